import json
import pickle
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.errors import MessageError
from secvfl.messages import (
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_META_DEPTH,
    MAX_NAME_CHARS,
    WIRE_DTYPES,
    Message,
    decode,
    encode,
    header_size,
)

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


def _depth(value) -> int:
    """Lists/objects nested inside a meta value."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


json_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5))
meta_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
metas = st.dictionaries(st.text(max_size=5), meta_values.filter(lambda v: _depth(v) <= MAX_META_DEPTH), max_size=4)


def _tensor(dtype: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


@settings(max_examples=200)
@given(dtype=st.sampled_from(sorted(WIRE_DTYPES)), shape=shapes, seed=st.integers(0, 2**16),
       blob=st.binary(max_size=64), meta=metas)
def test_round_trip_every_dtype_and_shape(dtype, shape, seed, blob, meta):
    t = _tensor(WIRE_DTYPES[dtype], shape, seed)
    m = Message("embedding", "a", "b", 7, {"x": t}, {"c": blob}, meta)
    data = encode(m)
    back = decode(data)
    assert back.wire_size == len(data)
    assert back.tensors["x"].dtype == t.dtype and list(back.tensors["x"].shape) == shape
    assert torch.equal(back.tensors["x"], t)
    assert back.blobs == {"c": blob} and back.meta == meta and back.step == 7
    assert json.dumps(back.meta) == json.dumps(meta)  # same types too (True is not 1, 2.0 is not 2)
    # exact size: header + raw payload bytes, nothing else
    assert len(data) == header_size(m) + t.numel() * t.element_size() + len(blob)


def test_received_tensor_does_not_share_memory_with_sender():
    t = torch.ones(4, 3)
    back = decode(encode(Message("embedding", "a", "b", tensors={"x": t})))
    back.tensors["x"].add_(1)
    assert torch.equal(t, torch.ones(4, 3))


@given(cut=st.integers(0, 150))
def test_truncated_bytes_are_refused(cut):
    data = encode(Message("gradient", "a", "b", tensors={"g": torch.ones(3, 4)}))
    if cut >= len(data):
        return
    with pytest.raises(MessageError):
        decode(data[:cut])


def test_garbage_pickle_and_unknown_kind_are_refused():
    with pytest.raises(MessageError, match="magic"):
        decode(pickle.dumps({"x": 1}))
    with pytest.raises(MessageError, match="unknown message kind"):
        encode(Message("telepathy", "a", "b"))
    with pytest.raises(MessageError, match="trailing"):
        decode(encode(Message("control", "a", "b")) + b"x")
    with pytest.raises(MessageError, match="not plain JSON"):
        encode(Message("control", "a", "b", meta={"f": object()}))
    with pytest.raises(MessageError, match="no wire format"):
        encode(Message("control", "a", "b", tensors={"c": torch.ones(2, dtype=torch.complex64)}))


# -- strict decoding: one rule per test, on hand-built frames (issue 14) ---------------------------------------------
def _frame(header: bytes | str, payload: bytes = b"", *, hlen: int | None = None) -> bytes:
    header = header.encode("utf-8", "surrogatepass") if isinstance(header, str) else header
    return b"SVFL" + struct.pack("<BI", 1, len(header) if hlen is None else hlen) + header + payload


def _head(**changes) -> dict:
    head = {"kind": "embedding", "sender": "party0", "receiver": "label", "step": 3, "meta": {},
            "tensors": [["x", "float32", [2, 3]]], "blobs": []}
    head.update(changes)
    return head


def _wire(payload: bytes = bytes(24), **changes) -> bytes:
    """A frame with the standard library's compact JSON header (NaN/Infinity written as JSON cannot)."""
    return _frame(json.dumps(_head(**changes), separators=(",", ":"), allow_nan=True), payload)


def test_hand_built_frame_is_a_valid_message():
    # The frames below differ from this one only in the rule they break.
    data = _wire()
    m = decode(data)
    assert (m.kind, m.sender, m.receiver, m.step, m.meta) == ("embedding", "party0", "label", 3, {})
    assert torch.equal(m.tensor("x"), torch.zeros(2, 3))
    assert encode(m) == data


def test_header_bytes_of_an_embedding_are_unchanged():
    # The wire format (and so byte accounting) is the one earlier versions wrote: B * D * 4 payload after this header.
    data = encode(Message("embedding", "party0", "label", 3, {"embedding": torch.ones(4, 2)}))
    header = b'{"kind":"embedding","sender":"party0","receiver":"label","step":3,"meta":{},' \
             b'"tensors":[["embedding","float32",[4,2]]],"blobs":[]}'
    assert data[:9] == b"SVFL\x01" + struct.pack("<I", len(header)) and data[9 : 9 + len(header)] == header
    assert len(data) == 9 + len(header) + 4 * 2 * 4


@pytest.mark.parametrize("step", [True, False, "7", 2.9, 2.0, -1, 2**63, None, [3]],
                         ids=["true", "false", "str", "float", "integral-float", "negative", "2^63", "null", "list"])
def test_step_of_the_wrong_type_or_range_is_refused_not_coerced(step):
    with pytest.raises(MessageError, match=r"\$\.step"):
        decode(_wire(step=step))


@pytest.mark.parametrize("token", ["Infinity", "-Infinity", "NaN", "1e400"])
def test_step_infinity_nan_or_out_of_range_float_is_refused(token):
    with pytest.raises(MessageError, match="step"):
        decode(_frame(json.dumps(_head(), separators=(",", ":")).replace('"step":3', f'"step":{token}'), bytes(24)))


def test_largest_step_is_accepted():
    assert decode(_wire(step=2**63 - 1)).step == 2**63 - 1


@pytest.mark.parametrize("shape", [[2, True], [2, 3.0], [2, "3"], [2, -3], [2, None], [[2], 3], 6],
                         ids=["bool", "float", "str", "negative", "null", "nested", "not-a-list"])
def test_dimensions_must_be_plain_non_negative_integers(shape):
    with pytest.raises(MessageError, match=r"\$\.tensors\[0\]\[2\]"):
        decode(_wire(tensors=[["x", "float32", shape]]))


def test_too_many_dimensions_are_refused():
    assert MAX_DIMS == 8
    decode(_wire(payload=bytes(4), tensors=[["x", "float32", [1] * 8]]))
    with pytest.raises(MessageError, match=r"\$\.tensors\[0\]\[2\].*length <= 8"):
        decode(_wire(payload=bytes(4), tensors=[["x", "float32", [1] * 9]]))


@pytest.mark.parametrize("shape", [[0, 2**31], [0, 2**63], [2**40]], ids=["2^31", "2^63", "2^40"])
def test_dimensions_of_2_31_or_more_are_refused(shape):
    with pytest.raises(MessageError, match=r"\$\.tensors\[0\]\[2\]\[\d\].*<= 2147483647"):
        decode(_wire(payload=b"", tensors=[["x", "float32", shape]]))


def test_empty_tensor_with_the_largest_dimension_is_accepted():
    m = decode(_wire(payload=b"", tensors=[["x", "float32", [0, 2**31 - 1]]]))
    assert tuple(m.tensor("x").shape) == (0, 2**31 - 1)


def test_shape_product_is_bounded_by_the_bytes_present():
    with pytest.raises(MessageError, match=r"tensor 'x' .* needs 4 \* \d+|needs \d+ bytes but 24 payload bytes"):
        decode(_wire(tensors=[["x", "float32", [2**31 - 1] * 8]]))
    with pytest.raises(MessageError, match="needs 28 bytes but 24"):
        decode(_wire(tensors=[["x", "float32", [7]]]))


def test_payload_must_match_the_header_exactly():
    with pytest.raises(MessageError, match="4 unexpected trailing bytes"):
        decode(_wire(payload=bytes(28)))
    with pytest.raises(MessageError, match="blob 'b' needs 10 bytes but 0"):
        decode(_wire(blobs=[["b", 10]]))


@pytest.mark.parametrize("dtype", ["complex64", "float", "", ["float32"], 5, None])
def test_unknown_dtype_is_refused(dtype):
    with pytest.raises(MessageError, match=r"\$\.tensors\[0\]\[1\]"):
        decode(_wire(tensors=[["x", dtype, [2, 3]]]))


@pytest.mark.parametrize("field, value, where", [
    ("tensors", 5, r"\$\.tensors"),
    ("tensors", [[["x"], "float32", [2, 3]]], r"\$\.tensors\[0\]\[0\]"),
    ("tensors", [["x", "float32"]], r"\$\.tensors\[0\]"),
    ("blobs", [{}], r"\$\.blobs\[0\]"),
    ("blobs", [["b", -1]], r"\$\.blobs\[0\]\[1\]"),
    ("blobs", [["b", 1.0]], r"\$\.blobs\[0\]\[1\]"),
    ("kind", ["embedding"], r"\$\.kind"),
    ("meta", [], r"\$\.meta"),
], ids=["tensors-int", "tensor-name-list", "tensor-spec-short", "blob-spec-object", "blob-negative", "blob-float",
        "kind-list", "meta-list"])
def test_structure_of_the_wrong_type_is_refused(field, value, where):
    with pytest.raises(MessageError, match=where):
        decode(_wire(**{field: value}))


def test_unknown_kind_is_refused():
    with pytest.raises(MessageError, match="unknown message kind 'telepathy'"):
        decode(_wire(kind="telepathy"))


@pytest.mark.parametrize("field", ["sender", "receiver"])
def test_party_names_are_non_empty_and_bounded(field):
    assert decode(_wire(**{field: "p" * MAX_NAME_CHARS})) is not None
    for bad in ("p" * (MAX_NAME_CHARS + 1), "", 7):
        with pytest.raises(MessageError, match=rf"\$\.{field}"):
            decode(_wire(**{field: bad}))


def test_missing_and_unknown_header_keys_are_refused():
    head = _head()
    del head["step"]
    with pytest.raises(MessageError, match="missing required field `step`"):
        decode(_frame(json.dumps(head, separators=(",", ":")), bytes(24)))
    with pytest.raises(MessageError, match="unknown field `extra`"):
        decode(_frame(json.dumps({**_head(), "extra": 1}, separators=(",", ":")), bytes(24)))


def _nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def test_meta_nesting_is_limited():
    assert decode(_wire(meta={"k": _nested(MAX_META_DEPTH)})).meta == {"k": _nested(MAX_META_DEPTH)}
    with pytest.raises(MessageError, match=r"\$\.meta\['k'\]\[0\]\[0\]\[0\]\[0\].*nested at most 4 deep"):
        decode(_wire(meta={"k": _nested(MAX_META_DEPTH + 1)}))


def test_meta_nested_100k_deep_is_a_message_error_not_a_recursion_error():
    deep = '{"ok":1,"k":' + "[" * 100_000 + "]" * 100_000 + "}"
    text = json.dumps(_head(), separators=(",", ":")).replace('"meta":{}', f'"meta":{deep}')
    # (too deep for msgspec to skip to the key's name: the message names meta and the limit)
    with pytest.raises(MessageError, match=r"\$\.meta.*nested at most 4 deep"):
        decode(_frame(text, bytes(24)))


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**4000, [10**4000] * 300],
                         ids=["2^63", "-2^63-1", "4000-digit", "list-of-4000-digit"])
def test_meta_integers_beyond_int64_are_refused(value):
    with pytest.raises(MessageError, match=r"\$\.meta\['n'\]"):
        decode(_wire(meta={"n": value}))


def test_meta_scalars_keep_their_types():
    meta = {"t": True, "i": 1, "f": 2.0, "z": -0.0, "s": "7", "n": None, "l": [1, 2.5, "x"], "d": {"a": [False]}}
    got = decode(_wire(meta=meta)).meta
    assert got == meta and [type(v) for v in got.values()] == [type(v) for v in meta.values()]


def test_meta_nan_and_over_long_keys_are_refused():
    with pytest.raises(MessageError, match="not valid JSON.*NaN"):
        decode(_wire(meta={"x": float("nan")}))
    with pytest.raises(MessageError, match=r"\$\.meta"):
        decode(_wire(meta={"k" * (MAX_NAME_CHARS + 1): 1}))


@pytest.mark.parametrize("rewrite", [
    lambda h: h.replace(b'"step":3', b'"step": 3'),
    lambda h: h.replace(b'"step":3', b'"step":3,"step":3'),
    lambda h: h.replace(b'"step":3', b'"step":03'),
    lambda h: h.replace(b'"party0"', b'"\\u0070arty0"'),
    lambda h: h.replace(b'"meta":{}', b'"meta":{"a":1,"a":2}'),
    lambda h: b'{"sender":"party0","kind":"embedding"' + h[h.index(b',"receiver"'):],
], ids=["whitespace", "duplicate-key", "leading-zero", "escape", "duplicate-meta-key", "key-order"])
def test_header_not_in_canonical_form_is_refused(rewrite):
    header = json.dumps(_head(), separators=(",", ":")).encode()
    with pytest.raises(MessageError):
        decode(_frame(rewrite(header), bytes(24)))


def test_duplicate_tensor_or_blob_names_are_refused():
    with pytest.raises(MessageError, match="names tensor 'x' twice"):
        decode(_wire(payload=bytes(48), tensors=[["x", "float32", [2, 3]], ["x", "float32", [2, 3]]]))
    with pytest.raises(MessageError, match="names blob 'b' twice"):
        decode(_wire(blobs=[["b", 0], ["b", 0]]))


def test_header_size_is_bounded_before_reading_it():
    assert MAX_HEADER_BYTES == 4 << 20
    with pytest.raises(MessageError, match="over the 4194304-byte limit"):
        decode(_frame(b"{}", hlen=MAX_HEADER_BYTES + 1))
    with pytest.raises(MessageError, match="over the .* limit"):
        decode(_frame(b"{}", hlen=2**32 - 1))
    with pytest.raises(MessageError, match="truncated inside its header"):
        decode(_frame(b"{}", hlen=100))


def test_invalid_utf8_and_lone_surrogates_are_refused():
    with pytest.raises(MessageError, match="not valid JSON"):
        decode(_frame(json.dumps(_head(), separators=(",", ":")).encode().replace(b"party0", b"party\xff"),
                      bytes(24)))
    with pytest.raises(MessageError, match="not valid JSON"):
        decode(_frame(json.dumps(_head(), separators=(",", ":")).replace("party0", "\\ud800"), bytes(24)))


def test_bool_tensor_bytes_other_than_0_and_1_are_refused():
    ok = decode(_wire(payload=b"\x00\x01\x01", tensors=[["m", "bool", [3]]]))
    assert ok.tensor("m").tolist() == [False, True, True]
    with pytest.raises(MessageError, match="bool tensor 'm'"):
        decode(_wire(payload=b"\x00\x02\x01", tensors=[["m", "bool", [3]]]))


@pytest.mark.parametrize("data", [5, None, "SVFL", np.zeros((2, 2), dtype=np.float32)[:, :1]],
                         ids=["int", "none", "str", "strided"])
def test_decode_of_something_not_bytes_is_a_message_error(data):
    with pytest.raises(MessageError):
        decode(data)


# -- encode refuses what decode would refuse ----------------------------------------------------------------------
@pytest.mark.parametrize("meta, match", [
    ({"x": float("nan")}, r"meta\['x'\] is nan"),
    ({"x": [1.0, float("inf")]}, r"meta\['x'\]\[1\] is inf"),
    ({1: "a"}, "key 1, a int"),
    ({"x": 2**63}, r"\$\.meta\['x'\]"),
    ({"x": _nested(MAX_META_DEPTH + 1)}, "nested at most 4 deep"),
    ({"x": object()}, "not plain JSON"),
    ({"x": np.int64(3)}, "not plain JSON"),
], ids=["nan", "inf-in-list", "int-key", "int64-overflow", "too-deep", "object", "numpy-int"])
def test_encode_refuses_meta_the_receiver_would_refuse_or_change(meta, match):
    with pytest.raises(MessageError, match=match):
        encode(Message("control", "a", "b", meta=meta))


def test_encode_keeps_tuples_and_numpy_floats_as_json_arrays_and_numbers():
    back = decode(encode(Message("control", "a", "b", meta={"t": (1, 2), "f": np.float64(0.5)})))
    assert back.meta == {"t": [1, 2], "f": 0.5}


@pytest.mark.parametrize("step", [True, 2.9, 3.0, "7"])
def test_encode_refuses_a_step_that_is_not_an_integer(step):
    with pytest.raises(MessageError, match="step"):
        encode(Message("control", "a", "b", step=step))


def test_encode_accepts_numpy_integer_steps():
    assert decode(encode(Message("control", "a", "b", step=np.int64(4)))).step == 4


def test_encode_refuses_over_long_names():
    with pytest.raises(MessageError, match=r"\$\.sender"):
        encode(Message("control", "a" * (MAX_NAME_CHARS + 1), "b"))
    with pytest.raises(MessageError, match=r"\$\.tensors\[0\]\[0\]"):
        encode(Message("control", "a", "b", tensors={"": torch.ones(1)}))


def test_encode_refuses_a_header_over_the_limit():
    rows = ["train", *range(10**6, 10**6 + MAX_HEADER_BYTES // 8)]  # 8 bytes per id: just over the limit
    with pytest.raises(MessageError, match="over the 4194304-byte limit; send its meta"):
        encode(Message("gradient", "label", "party0", meta={"rows": rows}))
