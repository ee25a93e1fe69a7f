"""Party-handle requests as messages: what a coordinator asks of a party in another process, and the answer.

A request is a :class:`~secvfl.messages.Message` of kind ``party-call``: the method's name in ``meta``, its
arguments as JSON text in the ``args`` blob, and every array or tensor among them as one of the message's tensors
(referenced from the JSON by name). The answer is a ``party-result`` message built the same way. Only plain data
crosses: None, booleans, numbers, strings, lists, tuples, dicts, numpy arrays, torch tensors and the few frozen
dataclasses of :data:`WIRE_TYPES`; anything else is refused when encoding (never pickled), and decoding builds
nothing but those.

Decoding is strict and raises only :class:`~secvfl.errors.MessageError` (a peer's answer is untrusted input): the
JSON text at most :data:`MAX_JSON_BYTES`, nested at most :data:`MAX_DEPTH` deep (lists, tuples, dicts and dataclass
fields together), no NaN or Infinity literals, each marker object with exactly its own keys and value types,
tensors referenced by a name the message carries (each at most once), dictionary keys hashable, dataclasses built
only from their declared fields.
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

__all__ = ["CALL_KIND", "RESULT_KIND", "call_message", "read_call", "result_message", "read_result", "WIRE_TYPES",
           "MAX_DEPTH", "MAX_JSON_BYTES"]

MAX_DEPTH = 32  # nesting of a request's or an answer's value (the deepest real one: a dict of lists of pairs, 4)
MAX_JSON_BYTES = 64 << 20  # the JSON text of one request or answer (arrays travel beside it, as tensors)

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


class _Decoder:
    """Builds a value from the JSON of a request or answer, refusing anything the encoder would not write."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        self.tensors = tensors
        self.used: set[str] = set()
        self.where = where

    def fail(self, problem: str) -> MessageError:
        return MessageError(f"malformed {self.where}: {problem}")

    def tensor(self, name: Any) -> torch.Tensor:
        if not isinstance(name, str) or name not in self.tensors:
            raise self.fail(f"it references a tensor {str(name)[:40]!r} it does not carry")
        if name in self.used:
            raise self.fail(f"it references tensor {name!r} twice")
        self.used.add(name)
        return self.tensors[name]

    def marker(self, v: dict, key: str, kind: type | tuple[type, ...], extra: tuple[str, ...] = ()) -> Any:
        if set(v) != {key, *extra}:
            raise self.fail(f"a {key} object has the keys {sorted(map(str, v))[:6]}")
        value = v[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise self.fail(f"a {key} object holds a {type(value).__name__}")
        return value

    def value(self, v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self.fail(f"its values are nested more than {MAX_DEPTH} deep")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.value(x, depth + 1) for x in v]
        if not isinstance(v, dict):  # (json.loads builds nothing else)
            raise self.fail(f"a value of type {type(v).__name__}")
        if "__ndarray__" in v:
            t = self.tensor(self.marker(v, "__ndarray__", str))
            if t.dtype is torch.bfloat16:  # (numpy has none: the encoder never makes one)
                raise self.fail("an array of bfloat16")
            return t.numpy()
        if "__tensor__" in v:
            return self.tensor(self.marker(v, "__tensor__", str))
        if "__float__" in v:
            text = self.marker(v, "__float__", str)
            if text not in ("nan", "inf", "-inf"):  # the encoder writes only these (finite floats are plain JSON)
                raise self.fail(f"a __float__ object holds {text[:20]!r}")
            return float(text)
        if "__tuple__" in v:
            return tuple(self.value(x, depth + 1) for x in self.marker(v, "__tuple__", list))
        if "__dict__" in v:
            out = {}
            for pair in self.marker(v, "__dict__", list):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise self.fail("a __dict__ entry is not a [key, value] pair")
                key = _hashable(self.value(pair[0], depth + 1))
                try:
                    out[key] = self.value(pair[1], depth + 1)
                except TypeError:
                    raise self.fail("a __dict__ key is not hashable") from None
            return out
        if "__dataclass__" in v:
            name = self.marker(v, "__dataclass__", str, ("fields",))
            cls = WIRE_TYPES.get(name)
            if cls is None:
                raise self.fail(f"unknown type {name[:40]!r}")
            fields = v["fields"]
            declared = {f.name for f in dataclasses.fields(cls)}
            if not isinstance(fields, dict) or set(fields) != declared:
                raise self.fail(f"a {name} needs exactly the fields {sorted(declared)}")
            try:
                return cls(**{k: self.value(x, depth + 1) for k, x in fields.items()})
            except (TypeError, ValueError) as exc:
                raise self.fail(f"a {name} cannot be built from its fields ({exc})") from None
        raise self.fail(f"an object with the keys {sorted(map(str, v))[:6]}")


def _hashable(k: Any) -> Any:
    if isinstance(k, list):
        return tuple(_hashable(x) for x in k)
    return k


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON data")


_JSON = json.JSONDecoder(parse_constant=_refuse_constant)  # made once: json.loads with an option makes one a call


def _message(kind: str, sender: str, receiver: str, step: int, meta: dict[str, Any], payload: Any) -> Message:
    enc = _Encoder()
    text = json.dumps(enc.value(payload), separators=(",", ":")).encode()
    return Message(kind, sender, receiver, step, enc.tensors, {"args": text}, meta)


def _payload(message: Message) -> Any:
    where = f"{message.kind} message from {message.sender}"
    blob = message.blobs.get("args")
    if blob is None or set(message.blobs) != {"args"}:
        raise MessageError(f"malformed {where}: it carries the blobs {sorted(message.blobs)[:6]}, not just 'args'")
    if len(blob) > MAX_JSON_BYTES:
        raise MessageError(f"malformed {where}: {len(blob)} bytes of JSON (at most {MAX_JSON_BYTES})")
    try:
        text = _JSON.decode(blob.decode("utf-8"))
    except RecursionError:
        raise MessageError(f"malformed {where}: its values are nested more than {MAX_DEPTH} deep") from None
    except (ValueError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MessageError(f"malformed {where}: not JSON ({str(exc)[:120]})") from None
    decoder = _Decoder(dict(message.tensors), where)
    value = decoder.value(text, 0)
    if decoder.used != set(message.tensors):
        raise MessageError(f"malformed {where}: it carries tensors it does not reference")
    return value


def call_message(sender: str, receiver: str, call_id: int, method: str, args: tuple, kwargs: dict[str, Any], *,
                 reply: bool) -> Message:
    """The request ``receiver.method(*args, **kwargs)``; ``reply``: the caller waits for its result."""
    return _message(CALL_KIND, sender, receiver, call_id, {"method": method, "reply": reply},
                    {"args": list(args), "kwargs": kwargs})


def read_call(message: Message) -> tuple[str, list[Any], dict[str, Any], bool]:
    """(method, args, kwargs, reply) of a request; a malformed one raises :class:`MessageError`."""
    where = f"request from {message.sender}"
    method, reply = message.meta.get("method"), message.meta.get("reply")
    if set(message.meta) != {"method", "reply"} or not isinstance(method, str) or not isinstance(reply, bool):
        raise MessageError(f"malformed {where}: its meta must be a method name and a reply flag")
    body = _payload(message)
    if (not isinstance(body, dict) or set(body) != {"args", "kwargs"} or not isinstance(body["args"], list)
            or not isinstance(body["kwargs"], dict) or not all(isinstance(k, str) for k in body["kwargs"])):
        raise MessageError(f"malformed {where}: its body must hold args (a list) and kwargs (names to values)")
    return method, body["args"], body["kwargs"], reply


def result_message(sender: str, receiver: str, call_id: int, value: Any) -> Message:
    return _message(RESULT_KIND, sender, receiver, call_id, {}, value)


def read_result(message: Message) -> Any:
    """The value of an answer; a malformed one raises :class:`MessageError`."""
    if message.meta:
        raise MessageError(f"malformed {message.kind} message from {message.sender}: an answer has no meta")
    return _payload(message)
