"""Typed messages and their wire format.

Everything that crosses a party boundary is a :class:`Message`, serialised to bytes by :func:`encode` and read back
by :func:`decode` -- also when every party lives in one process, so byte counts are exact and the multi-host mode is
only a change of transport. Nothing is pickled: tensors travel as raw little-endian buffers described by an explicit
dtype/shape header, opaque payloads (ciphertexts, signatures) as ``blobs``.

Wire format (all integers little-endian)::

    b"SVFL" | version:u8 | header_len:u32 | header (UTF-8 JSON) | payload_0 | payload_1 | ...

The JSON header holds ``kind, sender, receiver, step, meta`` and, in order, one ``[name, dtype, shape]`` entry per
tensor and one ``[name, nbytes]`` entry per blob; payloads follow in the same order.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from secvfl.errors import MessageError

__all__ = [
    "Message",
    "encode",
    "decode",
    "header_size",
    "register_kind",
    "KINDS",
    "WIRE_DTYPES",
]

MAGIC = b"SVFL"
VERSION = 1
_PREFIX = struct.Struct("<4sBI")

# Message kinds known to the transport. Protocol layers register the kinds they introduce.
KINDS: set[str] = {
    "embedding",  # feature party -> label party: bottom-model outputs for a batch
    "logits",  # feature party -> label party: local logits (fdml-style sum aggregation)
    "gradient",  # label party -> feature party: d loss / d (embedding or logits)
    "prediction",  # label party -> feature party, when an algorithm needs predictions shared
    "labels",  # label party -> feature party, only where an algorithm says so (e.g. `local`)
    "control",  # small coordination messages (no tensors, or tiny ones)
}

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
_ITEMSIZE = {v: v.itemsize for v in WIRE_DTYPES.values()}
# One encoder for every header (json.dumps with options builds a new encoder per call).
_HEADER_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def register_kind(kind: str) -> str:
    """Declare a new message kind (used by protocol layers, e.g. ``"ciphertext"``)."""
    if not kind or not kind.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"message kind must be alphanumeric (with - or _), got {kind!r}")
    KINDS.add(kind)
    return kind


@dataclass(frozen=True)
class Message:
    """One typed message between two named parties.

    ``tensors`` hold numeric data (torch tensors, any supported dtype and shape); ``blobs`` hold opaque bytes such as
    serialised ciphertexts; ``meta`` holds small JSON-serialisable facts (batch size, compression spec, ...).
    ``wire_size`` is set by :func:`decode`: a message a party receives has crossed the transport.
    """

    kind: str
    sender: str
    receiver: str
    step: int = 0
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    blobs: Mapping[str, bytes] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    wire_size: int | None = field(default=None, compare=False)

    def replace(self, **changes: Any) -> Message:
        """A copy with some fields changed (``wire_size`` is reset: the copy has not crossed the wire)."""
        changes.setdefault("wire_size", None)
        return replace(self, **changes)

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise MessageError(
                f"{self.kind} message from {self.sender} to {self.receiver} has no tensor {name!r} "
                f"(it has {sorted(self.tensors)})"
            ) from None


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    # A byte view works for every dtype, bfloat16 and bool included, without a numpy dtype for it.
    return t.view(-1).view(torch.uint8).numpy().tobytes()


def _header(message: Message) -> bytes:
    tensors = []
    for name, t in message.tensors.items():
        if not isinstance(t, torch.Tensor):
            raise MessageError(f"tensor {name!r} of a {message.kind} message is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in _DTYPE_NAMES:
            raise MessageError(f"tensor {name!r} has dtype {t.dtype}, which has no wire format; use one of {sorted(WIRE_DTYPES)}")
        tensors.append([name, _DTYPE_NAMES[t.dtype], list(t.shape)])
    blobs = []
    for name, b in message.blobs.items():
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise MessageError(f"blob {name!r} of a {message.kind} message is a {type(b).__name__}, not bytes")
        blobs.append([name, len(b)])
    head = {
        "kind": message.kind,
        "sender": message.sender,
        "receiver": message.receiver,
        "step": int(message.step),
        "meta": dict(message.meta),
        "tensors": tensors,
        "blobs": blobs,
    }
    try:
        return _HEADER_JSON.encode(head).encode()
    except (TypeError, ValueError) as exc:
        raise MessageError(f"meta of a {message.kind} message is not plain JSON data: {exc}") from None


def header_size(message: Message) -> int:
    """Bytes of the message that are not tensor or blob payload (prefix + JSON header)."""
    return _PREFIX.size + len(_header(message))


def encode(message: Message) -> bytes:
    """Serialise a message to bytes (no pickle)."""
    if message.kind not in KINDS:
        raise MessageError(f"unknown message kind {message.kind!r}; known kinds: {sorted(KINDS)}")
    head = _header(message)
    parts = [_PREFIX.pack(MAGIC, VERSION, len(head)), head]
    parts.extend(_tensor_bytes(t) for t in message.tensors.values())
    parts.extend(bytes(b) for b in message.blobs.values())
    return b"".join(parts)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Read a message back from bytes; malformed or truncated input raises :class:`MessageError`."""
    data = memoryview(data)
    if len(data) < _PREFIX.size:
        raise MessageError(f"message truncated: {len(data)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise MessageError("not a secvfl message (bad magic bytes)")
    if version != VERSION:
        raise MessageError(f"message format version {version} is not supported (this secvfl reads version {VERSION})")
    off = _PREFIX.size
    if len(data) < off + hlen:
        raise MessageError("message truncated inside its header")
    try:
        head = json.loads(str(data[off : off + hlen], "utf-8"))
        kind, sender, receiver = head["kind"], head["sender"], head["receiver"]
        step, meta, tspecs, bspecs = int(head["step"]), head["meta"], head["tensors"], head["blobs"]
    except (ValueError, KeyError, TypeError) as exc:
        raise MessageError(f"message header is not valid: {exc}") from None
    if kind not in KINDS:
        raise MessageError(f"unknown message kind {kind!r}")
    off += hlen
    tensors: dict[str, torch.Tensor] = {}
    for spec in tspecs:
        try:
            name, dname, shape = spec
            dtype = WIRE_DTYPES[dname]
            shape = [int(s) for s in shape]
        except (ValueError, KeyError, TypeError):
            raise MessageError(f"bad tensor description in header: {spec!r}") from None
        if any(s < 0 for s in shape):
            raise MessageError(f"negative dimension in tensor {name!r}: {shape}")
        numel = math.prod(shape)
        nbytes = numel * _ITEMSIZE[dtype]
        if len(data) < off + nbytes:
            raise MessageError(f"message truncated inside tensor {name!r}")
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            # bytearray: a private, writable copy, so the receiver never shares memory with the sender.
            t = torch.frombuffer(bytearray(data[off : off + nbytes]), dtype=dtype).reshape(shape)
        tensors[name] = t
        off += nbytes
    blobs: dict[str, bytes] = {}
    for spec in bspecs:
        try:
            name, n = spec[0], int(spec[1])
        except (ValueError, TypeError, IndexError):
            raise MessageError(f"bad blob description in header: {spec!r}") from None
        if n < 0 or len(data) < off + n:
            raise MessageError(f"message truncated inside blob {name!r}")
        blobs[name] = bytes(data[off : off + n])
        off += n
    if off != len(data):
        raise MessageError(f"{len(data) - off} unexpected trailing bytes after the message")
    return Message(kind, sender, receiver, step, tensors, blobs, meta, wire_size=len(data))


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
