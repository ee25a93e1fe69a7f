"""Fuzzing the two other parsers a peer's bytes reach: the gRPC transport's frame parser and the request codec.

Frames (``secvfl.transport.grpc_link``): real frames of every type (a hello with its nonce, a server's hello answer,
chunks of small and large messages, heartbeats, goodbyes, batch frames) are mutated (bytes flipped, cut, repeated,
header fields set to extreme values). For any mutation the parser raises ``MessageError``, or returns exactly what an
independent reading with ``struct`` finds in the bytes -- nothing truncated, nothing reinterpreted; a batch gives
back frames whose lengths add up to its payload.

Requests and answers (``secvfl.deploy.calls``): real requests and answers of the deployment (forward requests with
row ids, state digests, counters, predictor specs, tuples, dicts with tuple keys, non-finite floats) have their JSON
text mutated as bytes and as JSON (a node replaced by deep nesting, a huge number, a marker object with wrong
keys or types, a tensor reference that does not exist). For any mutation ``read_call``/``read_result`` raise
``MessageError``, or return plain data that encodes to a request equal to the one read.

The fast tests run a few hundred cases of each; the slow ones 10^4 seeded cases of each.
"""

from __future__ import annotations

import json
import math
import random
import struct

import numpy as np
import pytest
import torch

from secvfl.algorithms.missing.baselines import PredictorSpec
from secvfl.deploy.calls import WIRE_TYPES, call_message, read_call, read_result, result_message
from secvfl.errors import MessageError
from secvfl.messages import Message
from secvfl.transport import grpc_link as g

# -- frames -------------------------------------------------------------------------------------------------------
_HEADER = struct.Struct(">BBHQII")


def _frame_corpus() -> list[bytes]:
    rng = np.random.default_rng(0)
    data = [g._frame("embedding", g._DATA, 7, 0, 1, rng.bytes(300)),
            g._frame("party-call", g._DATA, 8, 0, 3, rng.bytes(g.CHUNK_BYTES // 64)),
            g._frame("gradient", g._DATA, 9, 2, 3, b""),
            g._frame("label", g._HELLO, payload=rng.bytes(g._NONCE_BYTES)),
            g._frame("label", g._HELLO, payload=g._hello_answer(rng.bytes(400), rng.bytes(72))),
            g._frame("", g._HEARTBEAT), g._frame("", g._GOODBYE),
            g._frame("ckks-context", g._DATA, 1, 0, 1, rng.bytes(1000))]
    return [*data, g._batch(data[:3]), g._batch([data[0], data[5], data[0]])]


def _reference_parse(frame: bytes) -> tuple | None:
    """What the bytes say, read with struct and a strict UTF-8 decode (None: a frame the parser must refuse)."""
    if len(frame) < _HEADER.size:
        return None
    version, ftype, n, seq, index, count = _HEADER.unpack_from(frame)
    end = _HEADER.size + n
    if version != g._VERSION or ftype > g._BATCH or end > len(frame) or count == 0 or index >= count:
        return None
    try:
        kind = frame[_HEADER.size:end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return ftype, kind, seq, index, count, frame[end:]


def _reference_unbatch(payload: bytes, count: int) -> list[bytes] | None:
    frames, at = [], 0
    for _ in range(count):
        if at + 4 > len(payload):
            return None
        n = int.from_bytes(payload[at:at + 4], "big")
        if at + 4 + n > len(payload):
            return None
        frames.append(payload[at + 4:at + 4 + n])
        at += 4 + n
    return frames if at == len(payload) else None


def _mutate_frame(frame: bytes, rng: random.Random) -> bytes:
    b = bytearray(frame)
    how = rng.randrange(7)
    if how == 0 and b:  # flip bytes
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif how == 1:  # cut
        del b[rng.randrange(len(b) + 1):]
    elif how == 2:  # extend
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    elif how == 3:  # a header field set to an extreme value
        field, size = rng.choice([(0, 1), (1, 1), (2, 2), (4, 8), (12, 4), (16, 4)])
        value = rng.choice([0, 1, 2**(8 * size) - 1, 2**(8 * size - 1), rng.randrange(2**(8 * size))])
        b[field:field + size] = value.to_bytes(size, "big")
    elif how == 4 and len(b) > _HEADER.size:  # invalid UTF-8 in the kind
        b[_HEADER.size] = rng.choice([0x80, 0xC0, 0xFF, 0xED])
    elif how == 5:  # a length inside a batch payload
        at = rng.randrange(len(b) + 1)
        b[at:at + 4] = rng.choice([0, 3, 2**31, 2**32 - 1]).to_bytes(4, "big")
    else:  # a slice repeated
        i = rng.randrange(len(b) + 1)
        b[i:i] = b[i:i + rng.randint(1, 30)]
    return bytes(b)


def _check_frame(frame: bytes) -> None:
    want = _reference_parse(frame)
    try:
        got = g._parse(frame)
    except MessageError:
        assert want is None, f"refused a valid frame {frame[:40]!r}"
        return
    assert want is not None, f"accepted an invalid frame {frame[:40]!r}"
    assert got[:5] == want[:5] and bytes(got[5]) == want[5]
    if got[0] == g._BATCH:
        expect = _reference_unbatch(want[5], want[4])
        try:
            inner = [bytes(f) for f in g._unbatch(got[5], got[4])]
        except MessageError:
            assert expect is None
            return
        assert inner == expect
        for f in inner:
            _check_frame(f)
    if got[0] == g._HELLO and len(got[5]) >= 4:
        try:
            cert, signature = g._read_hello_answer(got[5])
        except MessageError:
            assert int.from_bytes(bytes(got[5][:4]), "big") > len(got[5]) - 4
            return
        assert g._hello_answer(cert, signature) == bytes(got[5])


def _fuzz_frames(cases: int, seed: int) -> None:
    rng = random.Random(seed)
    corpus = _frame_corpus()
    for i in range(cases):
        original = corpus[i % len(corpus)]
        frame = original
        for _ in range(rng.randint(1, 3)):
            frame = _mutate_frame(frame, rng)
        _check_frame(frame)


def test_real_frames_parse_to_what_they_say() -> None:
    for frame in _frame_corpus():
        _check_frame(frame)
        assert _reference_parse(frame) is not None


def test_mutated_frames_parse_exactly_or_raise_message_error() -> None:
    _fuzz_frames(600, seed=1)


@pytest.mark.slow
def test_ten_thousand_mutated_frames_parse_exactly_or_raise_message_error() -> None:
    _fuzz_frames(10_000, seed=0)


# -- requests and answers -----------------------------------------------------------------------------------------
def _call_corpus() -> list[Message]:
    ids = np.array([5, 1, 9, 2], dtype=np.int64)
    return [
        call_message("label", "party0", 3, "forward", (4, "train", ids), {"to": "label", "train": True}, reply=False),
        call_message("label", "party1", 4, "train_heads", (4, ids, (0, 1), ["party0", "party1"]), {}, reply=True),
        call_message("label", "party0", 5, "__load__", ({"party": "party0", "state_sha256": "ab" * 32},), {},
                     reply=True),
        call_message("label", "party0", 6, "holder_step",
                     (1, ids, [(PredictorSpec(members=(0, 1), holder=1), [0, 1])], ["party0"], ["party1"]), {},
                     reply=True),
        result_message("party0", "label", 7, {"sent": {"bytes_sent": {"party0": 10}}, "received": {}}),
        result_message("party0", "label", 8, {"cpu_seconds": 1.25}),
        result_message("party1", "label", 9, np.full((3, 2), 0.5)),
        result_message("party1", "label", 10, {(1, 2): [float("nan"), float("inf"), -0.0], "x": (None, True)}),
        result_message("party1", "label", 11, {"__party_lost__": "party0", "reason": "its stream ended"}),
        result_message("party1", "label", 12, torch.arange(6, dtype=torch.float32).reshape(2, 3)),
    ]


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


_JSON_SWAPS = ["null", "true", "1e400", "-0", "12345678901234567890123", '"\\ud800"', _deep(100_000), _deep(40),
               '{"__tensor__":"t99"}', '{"__ndarray__":7}', '{"__float__":"1.5"}', '{"__tuple__":{}}',
               '{"__dict__":[[[1],2]]}', '{"__dict__":[1]}', '{"__dataclass__":"PredictorSpec","fields":[0,1]}',
               '{"__dataclass__":"PredictorSpec","fields":{"members":[0],"holder":0,"x":1}}',
               '{"__dataclass__":"Path","fields":{}}', '{"__tensor__":"t0","extra":1}', '{"a":NaN}', "Infinity",
               '{"__dict__":[[{"__dict__":[]},1]]}']


def _mutate_call(message: Message, rng: random.Random) -> Message:
    text = message.blobs["args"]
    how = rng.randrange(5)
    if how == 0:  # bytes flipped, cut or repeated
        b = bytearray(text)
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(3)
            if op == 0 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op == 1:
                del b[rng.randrange(len(b) + 1):]
            else:
                i = rng.randrange(len(b) + 1)
                b[i:i] = b[i:i + rng.randint(1, 20)]
        return message.replace(blobs={"args": bytes(b)})
    if how == 1:  # one JSON value replaced by a hostile one
        spans = [(i, j) for i in range(len(text)) for j in (i + 1,) if text[i:j] in b"0123456789[{n"]
        i, _ = rng.choice(spans)
        end = i + 1
        while end < len(text) and text[end:end + 1] not in b",]}":
            end += 1
        return message.replace(blobs={"args": text[:i] + rng.choice(_JSON_SWAPS).encode() + text[end:]})
    if how == 2:  # the meta
        meta = dict(message.meta)
        meta[rng.choice(["method", "reply", "extra"])] = rng.choice([7, None, "x", True, [1]])
        return message.replace(meta=meta)
    if how == 3:  # tensors removed, added or of another dtype
        tensors = dict(message.tensors)
        if tensors and rng.random() < 0.5:
            name = rng.choice(sorted(tensors))
            tensors[name] = rng.choice([torch.zeros(2, dtype=torch.bfloat16), tensors[name].to(torch.int8)]) \
                if rng.random() < 0.5 else tensors.pop(name)
        else:
            tensors[f"t{len(tensors) + rng.randrange(2)}"] = torch.ones(1)
        return message.replace(tensors=tensors)
    blobs = dict(message.blobs)
    blobs[rng.choice(["args", "extra"])] = rng.choice([b"", b"{}", b"\xff\xfe", b"[" * 5000])
    return message.replace(blobs=blobs)


_PLAIN = (type(None), bool, int, float, str, np.ndarray, torch.Tensor, *WIRE_TYPES.values())


def _plain(value, depth: int = 0) -> bool:  # noqa: ANN001
    if depth > 40:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return isinstance(value, _PLAIN)


def _same(a, b) -> bool:  # noqa: ANN001
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, np.ndarray):  # the same bytes (NaN included)
        return type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return (type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return type(b) is dict and len(a) == len(b) and all(k in b and _same(v, b[k]) for k, v in a.items())
    return type(a) is type(b) and a == b


def _check_call(message: Message) -> None:
    try:
        if message.kind == "party-call":
            method, args, kwargs, reply = read_call(message)
            value = {"args": args, "kwargs": kwargs}
            again = read_call(call_message("label", "party0", 1, method, tuple(args), kwargs, reply=reply))
            assert _same({"args": again[1], "kwargs": again[2]}, value)
        else:
            value = read_result(message)
            assert _same(read_result(result_message("party0", "label", 1, value)), value)
    except MessageError:
        return
    assert _plain(value)


def _fuzz_calls(cases: int, seed: int) -> None:
    rng = random.Random(seed)
    corpus = _call_corpus()
    for i in range(cases):
        _check_call(_mutate_call(corpus[i % len(corpus)], rng))


def test_real_requests_and_answers_read_back() -> None:
    for message in _call_corpus():
        _check_call(message)


def test_a_hostile_answer_raises_message_error_only() -> None:
    deep = result_message("party1", "label", 1, None).replace(blobs={"args": _deep(100_000).encode()})
    with pytest.raises(MessageError, match="nested more than 32 deep"):
        read_result(deep)
    fields = json.dumps({"__dataclass__": "PredictorSpec", "fields": [[0, 1], 1]}).encode()
    with pytest.raises(MessageError, match="a PredictorSpec needs exactly the fields"):
        read_result(result_message("party1", "label", 1, None).replace(blobs={"args": fields}))


def test_mutated_requests_and_answers_read_back_or_raise_message_error() -> None:
    _fuzz_calls(600, seed=1)


@pytest.mark.slow
def test_ten_thousand_mutated_requests_and_answers_read_back_or_raise_message_error() -> None:
    _fuzz_calls(10_000, seed=0)
