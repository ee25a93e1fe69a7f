"""Party-handle requests as messages: what a coordinator asks of a party in another process, and the answer.

A request is a :class:`~secvfl.messages.Message` of kind ``party-call``: the method's name in ``meta``, its
arguments as JSON text in the ``args`` blob, and every array or tensor among them as one of the message's tensors
(referenced from the JSON by name). The answer is a ``party-result`` message built the same way. Only plain data
crosses: None, booleans, numbers, strings, lists, tuples, dicts, numpy arrays, torch tensors and the few frozen
dataclasses of :data:`WIRE_TYPES`; anything else is refused when encoding (never pickled), and decoding builds
nothing but those.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import torch

from secvfl.errors import MessageError
from secvfl.messages import Message, register_kind

__all__ = ["CALL_KIND", "RESULT_KIND", "call_message", "read_call", "result_message", "read_result", "WIRE_TYPES"]

CALL_KIND = register_kind("party-call")
RESULT_KIND = register_kind("party-result")


def _wire_types() -> dict[str, type]:
    from secvfl.algorithms.missing.baselines import PredictorSpec

    return {"PredictorSpec": PredictorSpec}


WIRE_TYPES = _wire_types()


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def _tensor(self, t: torch.Tensor, tag: str) -> dict[str, str]:
        name = f"t{len(self.tensors)}"
        self.tensors[name] = t.detach().cpu().contiguous()
        return {tag: name}

    def value(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, np.integer)):
            return int(v)
        if isinstance(v, (float, np.floating)):
            f = float(v)
            return f if math.isfinite(f) else {"__float__": repr(f)}
        if isinstance(v, np.ndarray):
            if v.dtype == object:
                raise MessageError("a request carries no object arrays")
            return self._tensor(torch.from_numpy(np.ascontiguousarray(v)), "__ndarray__")
        if isinstance(v, torch.Tensor):
            return self._tensor(v, "__tensor__")
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, tuple):
            return {"__tuple__": [self.value(x) for x in v]}
        if isinstance(v, dict):
            return {"__dict__": [[self.value(k), self.value(x)] for k, x in v.items()]}
        name = type(v).__name__
        if dataclasses.is_dataclass(v) and WIRE_TYPES.get(name) is type(v):
            return {"__dataclass__": name,
                    "fields": {f.name: self.value(getattr(v, f.name)) for f in dataclasses.fields(v)}}
        raise MessageError(f"a {name} cannot cross a party boundary in a request (plain data only)")


def _decode(v: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(v, list):
        return [_decode(x, tensors) for x in v]
    if not isinstance(v, dict):
        return v
    if "__ndarray__" in v:
        return tensors[v["__ndarray__"]].numpy()
    if "__tensor__" in v:
        return tensors[v["__tensor__"]]
    if "__float__" in v:
        return float(v["__float__"])
    if "__tuple__" in v:
        return tuple(_decode(x, tensors) for x in v["__tuple__"])
    if "__dict__" in v:
        return {_hashable(_decode(k, tensors)): _decode(x, tensors) for k, x in v["__dict__"]}
    if "__dataclass__" in v:
        cls = WIRE_TYPES.get(v["__dataclass__"])
        if cls is None:
            raise MessageError(f"unknown type {v['__dataclass__']!r} in a request")
        return cls(**{k: _decode(x, tensors) for k, x in v["fields"].items()})
    raise MessageError(f"malformed request value {sorted(v)}")


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def _message(kind: str, sender: str, receiver: str, step: int, meta: dict[str, Any], payload: Any) -> Message:
    enc = _Encoder()
    text = json.dumps(enc.value(payload), separators=(",", ":")).encode()
    return Message(kind, sender, receiver, step, enc.tensors, {"args": text}, meta)


def _payload(message: Message) -> Any:
    try:
        return _decode(json.loads(message.blobs["args"]), dict(message.tensors))
    except (KeyError, ValueError, TypeError) as exc:
        raise MessageError(f"malformed {message.kind} message from {message.sender}: {exc}") from None


def call_message(sender: str, receiver: str, call_id: int, method: str, args: tuple, kwargs: dict[str, Any], *,
                 reply: bool) -> Message:
    """The request ``receiver.method(*args, **kwargs)``; ``reply``: the caller waits for its result."""
    return _message(CALL_KIND, sender, receiver, call_id, {"method": method, "reply": reply},
                    {"args": list(args), "kwargs": kwargs})


def read_call(message: Message) -> tuple[str, list[Any], dict[str, Any], bool]:
    body = _payload(message)
    return str(message.meta["method"]), body["args"], body["kwargs"], bool(message.meta["reply"])


def result_message(sender: str, receiver: str, call_id: int, value: Any) -> Message:
    return _message(RESULT_KIND, sender, receiver, call_id, {}, value)


def read_result(message: Message) -> Any:
    return _payload(message)
