"""Typed messages and their wire format.

Everything that crosses a party boundary is a :class:`Message`, serialised to bytes by :func:`encode` and read back
by :func:`decode` -- also when every party lives in one process, so byte counts are exact and the multi-host mode is
only a change of transport. Nothing is pickled: tensors travel as raw little-endian buffers described by an explicit
dtype/shape header, opaque payloads (ciphertexts, signatures) as ``blobs``.

Wire format (all integers little-endian)::

    b"SVFL" | version:u8 | header_len:u32 | header (UTF-8 JSON) | payload_0 | payload_1 | ...

The JSON header holds ``kind, sender, receiver, step, meta`` and, in order, one ``[name, dtype, shape]`` entry per
tensor and one ``[name, nbytes]`` entry per blob; payloads follow in the same order.

Strict decoding. :func:`decode` is the first code that touches another party's bytes, before any layer has
authenticated them, so it accepts exactly what :func:`encode` writes and raises :class:`MessageError` (naming the
field) for anything else, with work linear in the input:

* the header is at most :data:`MAX_HEADER_BYTES`, standard JSON (no NaN/Infinity, valid UTF-8), with exactly the
  seven keys above and exact types: ``step`` an integer in [0, 2^63) (``true``, ``"7"``, ``2.9`` or ``2.0`` are
  refused, not converted), names non-empty strings of at most :data:`MAX_NAME_CHARS` characters, ``kind`` a
  registered kind, dtypes from :data:`WIRE_DTYPES`, at most :data:`MAX_DIMS` integer dimensions each below 2^31;
* ``meta`` maps strings to JSON scalars (integers within int64, finite floats) and lists/objects of them nested at
  most :data:`MAX_META_DEPTH` deep;
* the header is in canonical form: re-encoding what was decoded gives the same bytes, so whitespace, escapes,
  number spellings, key order or duplicate keys that the encoder never writes are refused -- one message, one
  encoding, and nothing is silently reinterpreted;
* tensor and blob names are unique, and the payload sizes they declare add up to exactly the bytes present before
  anything is allocated (an empty tensor's other dimensions may not overflow its strides either); bool tensors
  hold only bytes 0 and 1.

:func:`encode` runs the same checks on what it writes, so a sender learns at once that a receiver would refuse it.

Why msgspec: the standard ``json`` module accepts NaN and Infinity, turns any digit string into an int in time
quadratic in its length (a header of 4000-digit integers cost seconds), recurses without bound on nesting and
returns untyped objects whose every field would need hand-written re-checks (``True`` is an int, ``2.9`` is not).
msgspec decodes JSON in C straight into the declared types below: it rejects wrong types (no bool-as-int, no
string-to-int, no float-to-int), checks the declared ranges and lengths while it parses (so a deep or huge value
stops at the first element past the limit), reports the path of the failing field, and is faster than ``json``.
It is maintained and ships wheels wherever torch does. safetensors (which validates a tensor section) was not
adopted: it has its own header and alignment, so it would change the payload layout that byte accounting relies
on (an embedding of B x D float32 costs B * D * 4 bytes plus its header), and checking [name, dtype, shape] entries
against the bytes present takes a few lines here.
"""

from __future__ import annotations

import math
import operator
import re
import struct
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, Union

import msgspec
import numpy as np
import torch

from secvfl.device import to_host
from secvfl.errors import MessageError

__all__ = [
    "Message",
    "encode",
    "encode_many",
    "decode",
    "delivered",
    "mark_delivered",
    "square_sums",
    "header_size",
    "payload_size",
    "encoded_payload_size",
    "register_kind",
    "KINDS",
    "WIRE_DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_NAME_CHARS",
    "MAX_DIMS",
    "MAX_META_DEPTH",
]

MAGIC = b"SVFL"
VERSION = 1
_PREFIX = struct.Struct("<4sBI")

# Limits of what decode accepts (encode refuses the same). The header bound leaves room for a meta list of ~500k
# row ids (the largest real headers name a batch's rows); one that size still parses in milliseconds
# (BENCHMARKS.md, "Wire format").
MAX_HEADER_BYTES = 4 << 20
MAX_NAME_CHARS = 256  # sender, receiver, tensor, blob names and meta keys
MAX_KIND_CHARS = 64
MAX_DIMS = 8
MAX_DIM = 2**31 - 1
MAX_ENTRIES = 4096  # tensors, and blobs, per message
MAX_META_DEPTH = 4  # lists/objects inside a meta value (CKKS layouts and compression headers use 3)
_MAX_INT64 = 2**63 - 1
_MAX_STRIDE = 2**62  # the largest product of dimensions (in bytes) a tensor's strides may reach

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
# The dtypes whose values' finiteness the codec reads off as it encodes or decodes (square_sums): a sum of squares,
# one BLAS dot product over the bytes in hand, is NaN or infinite if any value is; a receiver checks every float
# tensor it gets, and a torch reduction launched on a freshly woken thread costs several times this.
_SQUARED_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
# Wire dtype name -> (torch dtype, item size, numpy dtype or None for bfloat16, which numpy lacks, whether decode
# takes its sum of squares), for decode.
_WIRE_TYPES = {k: (v, v.itemsize, None if v is torch.bfloat16 else np.dtype(k),
                   v is not torch.bfloat16 and np.dtype(k) in _SQUARED_DTYPES) for k, v in WIRE_DTYPES.items()}

# The header's schema: msgspec checks these types, ranges and lengths while it parses.
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
_Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=_MAX_INT64)]
_MetaKey = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


def _meta_value_type(depth: int) -> Any:
    value: Any = Union[None, bool, _Int64, float, str]  # noqa: UP007 (a runtime type expression for msgspec)
    for _ in range(depth):  # spelled out level by level: the depth limit is part of the type
        value = Union[None, bool, _Int64, float, str, list[value], dict[_MetaKey, value]]  # noqa: UP007
    return value


_MetaValue = _meta_value_type(MAX_META_DEPTH)


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    # Field order is the wire's key order.
    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KIND_CHARS)]
    sender: _Name
    receiver: _Name
    step: Annotated[int, msgspec.Meta(ge=0, le=_MAX_INT64)]
    meta: dict[_MetaKey, _MetaValue]  # type: ignore[valid-type]
    tensors: Annotated[
        list[tuple[_Name, Literal[tuple(WIRE_DTYPES)],  # type: ignore[valid-type]
                   Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]], msgspec.Meta(max_length=MAX_DIMS)]]],
        msgspec.Meta(max_length=MAX_ENTRIES),
    ]
    blobs: Annotated[list[tuple[_Name, Annotated[int, msgspec.Meta(ge=0, le=_MAX_INT64)]]],
                     msgspec.Meta(max_length=MAX_ENTRIES)]


def _float_subclass(obj: Any) -> float:
    if isinstance(obj, float):  # numpy.float64 and other float subclasses: the same number
        return float(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON data")


_ENCODER = msgspec.json.Encoder(enc_hook=_float_subclass)
_DECODER = msgspec.json.Decoder(_Header)
_META_HINT = (f"(meta values are null, booleans, int64 integers, finite floats, strings, and lists/objects of them "
              f"nested at most {MAX_META_DEPTH} deep)")


def register_kind(kind: str) -> str:
    """Declare a new message kind (used by protocol layers, e.g. ``"ciphertext"``)."""
    if not kind or not kind.replace("_", "").replace("-", "").isalnum() or len(kind) > MAX_KIND_CHARS:
        raise ValueError(f"message kind must be alphanumeric (with - or _), at most {MAX_KIND_CHARS} characters, "
                         f"got {kind!r}")
    KINDS.add(kind)
    return kind


@dataclass(frozen=True)
class Message:
    """One typed message between two named parties.

    ``tensors`` hold numeric data (torch tensors, any supported dtype and shape); ``blobs`` hold opaque bytes such as
    serialised ciphertexts; ``meta`` holds small JSON-serialisable facts (batch size, compression spec, ...).
    ``wire_size`` is set by :func:`decode` (the bytes it was read from); whether a message crossed the transport is
    a separate mark only :func:`decode` and the network set (:func:`delivered`).
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


def _tensor_bytes(t: torch.Tensor) -> bytes | np.ndarray:
    """The tensor's raw bytes in C order, as a buffer :func:`encode` joins without another copy."""
    t = t.contiguous()
    if t.dtype is torch.bfloat16:  # numpy has no bfloat16: a byte view of the same memory
        if t.numel() == 0:  # (an empty view may have stride 0, which a dtype view refuses)
            return b""
        t = t.detach().view(-1).view(torch.uint8)
    return t.numpy(force=True)  # detached (encode copied device tensors to the host before)


def _header(message: Message) -> bytes:
    tensors = []
    for name, t in message.tensors.items():
        if not isinstance(t, torch.Tensor):
            raise MessageError(f"tensor {name!r} of a {message.kind} message is a {type(t).__name__}, not a torch.Tensor")
        dname = _DTYPE_NAMES.get(t.dtype)
        if dname is None:
            raise MessageError(f"tensor {name!r} has dtype {t.dtype}, which has no wire format; use one of {sorted(WIRE_DTYPES)}")
        tensors.append((name, dname, t.shape))  # a torch.Size is a tuple: msgspec writes it as the list it is
    blobs = []
    for name, b in message.blobs.items():
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise MessageError(f"blob {name!r} of a {message.kind} message is a {type(b).__name__}, not bytes")
        blobs.append((name, len(b)))
    if isinstance(message.step, bool):
        raise MessageError(f"step of a {message.kind} message is {message.step!r}, not an integer")
    try:
        step = operator.index(message.step)  # ints and numpy integers; a float step is a bug, not rounded
    except TypeError:
        raise MessageError(f"step of a {message.kind} message is {message.step!r}, not an integer") from None
    meta = dict(message.meta)
    try:
        data = _ENCODER.encode(_Header(message.kind, message.sender, message.receiver, step, meta, tensors, blobs))
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise MessageError(f"the header of a {message.kind} message is not plain JSON data: {exc}") from None
    if len(data) > MAX_HEADER_BYTES:
        raise MessageError(f"the header of a {message.kind} message is {len(data)} bytes, over the "
                           f"{MAX_HEADER_BYTES}-byte limit; send its meta (e.g. row ids) in smaller messages")
    # The receiver's checks, on the sender's side: what would be refused there is refused here, with the reason.
    checked = _parse_header(data, canonical=False)
    if checked.meta != meta:
        problem = _meta_difference(meta, checked.meta, "meta")
        if problem is not None:  # (None: only tuples that arrive as lists)
            raise MessageError(f"{problem}, in a {message.kind} message; meta must be plain JSON data")
    return data


def _meta_difference(sent: Any, got: Any, path: str) -> str | None:
    """Where ``sent`` (the sender's meta) differs from ``got`` (what the receiver decodes); tuples arrive as lists."""
    if isinstance(sent, Mapping):
        for key, value in sent.items():
            if not isinstance(key, str):
                return f"{path} has the key {key!r}, a {type(key).__name__} (JSON keys are strings)"
            if not isinstance(got, dict) or key not in got:
                return f"{path}[{key!r}] does not survive the wire"
            problem = _meta_difference(value, got[key], f"{path}[{key!r}]")
            if problem is not None:
                return problem
        return None
    if isinstance(sent, (list, tuple)) and isinstance(got, list) and len(sent) == len(got):
        for i, (a, b) in enumerate(zip(sent, got, strict=True)):
            problem = _meta_difference(a, b, f"{path}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(sent, float) and not math.isfinite(sent):
        return f"{path} is {sent} (JSON has no NaN or Infinity)"
    same_type = type(sent) is type(got) or (isinstance(sent, float) and type(got) is float)  # numpy floats: fine
    if not same_type or sent != got:
        return f"{path} = {sent!r:.80} would arrive as {got!r:.80}"
    return None


def _parse_header(raw: bytes | memoryview, *, canonical: bool) -> _Header:
    try:
        head = _DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        raise MessageError(_validation_problem(raw, exc)) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise MessageError(f"message header is not valid JSON: {exc}{_near(raw, exc)}") from None
    if head.kind not in KINDS:
        raise MessageError(f"unknown message kind {head.kind!r}")
    for what, entries in (("tensor", head.tensors), ("blob", head.blobs)):
        if len(entries) > 1 and len({e[0] for e in entries}) != len(entries):
            names = [e[0] for e in entries]
            dup = next(n for n in names if names.count(n) > 1)
            raise MessageError(f"message header names {what} {dup!r} twice")
    if canonical and _ENCODER.encode(head) != raw:
        raise MessageError("message header is not in the canonical form secvfl's encoder writes (whitespace, "
                           "escapes, number spelling, key order or duplicate keys differ); re-encode it with encode()")
    return head


def _near(raw: bytes | memoryview, exc: Exception) -> str:
    """The header text around the byte msgspec names, so the error shows which field is malformed."""
    if isinstance(exc, UnicodeDecodeError):  # its position is within one string, not the header
        try:
            bytes(raw).decode("utf-8")
            return ""
        except UnicodeDecodeError as whole:
            at = whole.start
    else:
        found = re.search(r"\(byte (\d+)\)", str(exc))
        if found is None:
            return ""
        at = int(found.group(1))
    return f", near {bytes(raw[max(0, at - 32) : at + 16]).decode('utf-8', 'replace')!r}"


class _MetaEntries(msgspec.Struct):
    meta: dict[str, msgspec.Raw]


def _validation_problem(raw: bytes | memoryview, exc: msgspec.ValidationError) -> str:
    """One line naming the header field msgspec refused (for meta, the key too: msgspec writes ``[...]``)."""
    problem, _, path = str(exc).partition(" - at `")
    path = path.rstrip("`")
    if not path:
        return f"message header: {problem}"
    if not path.startswith("$.meta"):
        return f"message header field {path}: {problem}"
    try:  # error path only: find the meta key whose value fails
        for key, value in msgspec.json.decode(raw, type=_MetaEntries).meta.items():
            try:
                msgspec.json.decode(value, type=_MetaValue)
            except msgspec.ValidationError as inner:
                path = f"$.meta[{key!r}]" + str(inner).partition(" - at `$")[2].rstrip("`")
                break
    except (ValueError, RecursionError):
        pass
    return f"message header field {path}: {problem} {_META_HINT}"


def header_size(message: Message) -> int:
    """Bytes of the message that are not tensor or blob payload (prefix + JSON header)."""
    return _PREFIX.size + len(_header(message))


def payload_size(message: Message) -> int:
    """Bytes of the message's tensor and blob payloads: its encoded size minus :func:`header_size`."""
    tensors = sum(t.numel() * _ITEMSIZE[t.dtype] for t in message.tensors.values())
    return tensors + sum(len(b) for b in message.blobs.values())


def encoded_payload_size(data: bytes) -> int:
    """:func:`payload_size` of the message ``data`` encodes (read from its prefix, without decoding it)."""
    return len(data) - _PREFIX.size - _PREFIX.unpack_from(data)[2]


def _checked_header(message: Message) -> bytes:
    if message.kind not in KINDS:
        raise MessageError(f"unknown message kind {message.kind!r}; known kinds: {sorted(KINDS)}")
    return _header(message)


def _join(message: Message, head: bytes, tensors: list[torch.Tensor], sums: dict[str, float] | None = None
          ) -> bytes:
    parts = [_PREFIX.pack(MAGIC, VERSION, len(head)), head]
    if sums is None:
        parts.extend(_tensor_bytes(t) for t in tensors)
    else:
        for name, t in zip(message.tensors, tensors, strict=True):
            values = _tensor_bytes(t)
            if getattr(values, "dtype", None) in _SQUARED_DTYPES:  # (an empty bfloat16 tensor's bytes are b"")
                sums[name] = _square_sum(values)
            parts.append(values)
    parts.extend(bytes(b) for b in message.blobs.values())
    return b"".join(parts)


# A non-finite or overflowing sum is the answer, not a fault (the receiver names the sender); numpy's warning about
# it would reach the party's log beside that line. A filter costs nothing per message, unlike np.errstate.
warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered in dot", RuntimeWarning, r"secvfl\.messages")


def _square_sum(values: np.ndarray) -> float:
    flat = values.reshape(-1)
    return float(flat.dot(flat))


def square_sums(message: Message) -> Mapping[str, float]:
    """The sums of squares of the float32 and float64 tensors of a message :func:`decode` read, by name, computed
    as it read them (empty for a message it did not read). A sum is NaN or infinite if a value is, or if the values
    are so large that their squares overflow: an infinite sum needs the exact check."""
    return getattr(message, "_square_sums", _NO_SUMS)


_NO_SUMS: Mapping[str, float] = {}


def encode(message: Message) -> bytes:
    """Serialise a message to bytes (no pickle); a message :func:`decode` would refuse raises :class:`MessageError`.

    Tensors on a GPU are copied to the host with one wait for the whole message (:func:`secvfl.device.to_host`)."""
    head = _checked_header(message)
    return _join(message, head, to_host(list(message.tensors.values())))


def encode_many(messages: Sequence[Message], sums: list[dict[str, float]] | None = None) -> list[bytes]:
    """:func:`encode` each message, with one wait for the GPU tensors of all of them (a party sending one message
    per peer in a step waits once). Nothing is encoded if one of them would be refused. ``sums``: a list that gets,
    per message, the sums of squares of its float32 and float64 tensors by name (see :func:`square_sums`), read
    off the bytes as they are encoded."""
    heads = [_checked_header(m) for m in messages]
    hosts = iter(to_host([t for m in messages for t in m.tensors.values()]))
    if sums is None:
        return [_join(m, head, [next(hosts) for _ in m.tensors]) for m, head in zip(messages, heads, strict=True)]
    out = []
    for m, head in zip(messages, heads, strict=True):
        sums.append({})
        out.append(_join(m, head, [next(hosts) for _ in m.tensors], sums[-1]))
    return out


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Read a message back from bytes; anything :func:`encode` would not have written raises :class:`MessageError`."""
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise MessageError(f"a message is a contiguous bytes object, not {type(data).__name__}") from None
    n = len(view)
    if n < _PREFIX.size:
        raise MessageError(f"message truncated: {n} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, hlen = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise MessageError("not a secvfl message (bad magic bytes)")
    if version != VERSION:
        raise MessageError(f"message format version {version} is not supported (this secvfl reads version {VERSION})")
    if hlen > MAX_HEADER_BYTES:
        raise MessageError(f"message header of {hlen} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    off = _PREFIX.size
    if n < off + hlen:
        raise MessageError(f"message truncated inside its header ({n - off} of {hlen} header bytes present)")
    head = _parse_header(view[off : off + hlen], canonical=True)
    off += hlen
    # Every declared size is checked against the bytes actually present before anything is allocated.
    left = n - off
    layout = []
    for name, dname, shape in head.tensors:
        dtype, itemsize, np_dtype, squared = _WIRE_TYPES[dname]
        nbytes = math.prod(shape) * itemsize  # at most 8 dims below 2^31: exact and cheap
        if nbytes == 0 and math.prod(d or 1 for d in shape) * itemsize > _MAX_STRIDE:
            # an empty tensor whose other dimensions' product overflows the strides torch would compute
            raise MessageError(f"tensor {name!r} ({dname} {shape}) has dimensions whose product overflows")
        if nbytes > left:
            raise MessageError(f"tensor {name!r} ({dname} {shape}) needs {nbytes} bytes but {left} payload bytes "
                               f"are left (message truncated or shape wrong)")
        left -= nbytes
        layout.append((name, dtype, np_dtype, squared, shape, nbytes))
    for name, nbytes in head.blobs:
        if nbytes > left:
            raise MessageError(f"blob {name!r} needs {nbytes} bytes but {left} payload bytes are left (message truncated)")
        left -= nbytes
    if left:
        raise MessageError(f"{left} unexpected trailing bytes after the message")
    tensors: dict[str, torch.Tensor] = {}
    sums: dict[str, float] = {}
    for name, dtype, np_dtype, squared, shape, nbytes in layout:
        if nbytes == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            # bytearray: a private, writable copy, so the receiver never shares memory with the sender. (A tensor
            # over ``data`` itself would save this one copy, but ``data`` is an immutable bytes object that others
            # may hold -- a second decode of it, a transcript -- and torch has no read-only tensors: a receiver's
            # in-place update would write into all of them.)
            buf = bytearray(view[off : off + nbytes])
            if dtype is torch.bool and buf.translate(None, b"\x00\x01"):
                raise MessageError(f"bool tensor {name!r} holds bytes other than 0 and 1")
            if np_dtype is None:  # bfloat16
                t = torch.frombuffer(buf, dtype=dtype).reshape(shape)
            else:  # the same tensor over the same bytes, in half the time of frombuffer + reshape
                values = np.ndarray(shape, np_dtype, buf)
                if squared:
                    sums[name] = _square_sum(values)
                t = torch.from_numpy(values)
        tensors[name] = t
        off += nbytes
    blobs: dict[str, bytes] = {}
    for name, nbytes in head.blobs:
        blobs[name] = bytes(view[off : off + nbytes])
        off += nbytes
    message = Message(head.kind, head.sender, head.receiver, head.step, tensors, blobs, head.meta, wire_size=n)
    if sums:
        object.__setattr__(message, "_square_sums", sums)
    return mark_delivered(message)


_DELIVERED = object()  # the mark of a message read from bytes (or delivered by a Network); see mark_delivered


def mark_delivered(message: Message) -> Message:
    """Mark ``message`` as having crossed the transport (returns it).

    :func:`decode` marks every message it reads, and the network marks what it hands a party after the receiver's
    own layers (and the result of an aggregation it runs for the receiver). Nothing else should call this: the
    constructor and :meth:`Message.replace` never mark, so a message built or copied in process -- whatever its
    ``wire_size`` says -- is refused by :func:`secvfl.parties.require_wire`.
    """
    object.__setattr__(message, "_delivered", _DELIVERED)
    return message


def delivered(message: Message) -> bool:
    """Whether ``message`` was read from bytes by :func:`decode` or delivered by a network (see :func:`mark_delivered`)."""
    return getattr(message, "_delivered", None) is _DELIVERED


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
