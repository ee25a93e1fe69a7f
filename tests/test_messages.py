import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.errors import MessageError
from secvfl.messages import WIRE_DTYPES, Message, decode, encode, header_size

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


def _tensor(dtype: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


@settings(max_examples=200)
@given(dtype=st.sampled_from(sorted(WIRE_DTYPES)), shape=shapes, seed=st.integers(0, 2**16),
       blob=st.binary(max_size=64), meta=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5)))
def test_round_trip_every_dtype_and_shape(dtype, shape, seed, blob, meta):
    t = _tensor(WIRE_DTYPES[dtype], shape, seed)
    m = Message("embedding", "a", "b", 7, {"x": t}, {"c": blob}, meta)
    data = encode(m)
    back = decode(data)
    assert back.wire_size == len(data)
    assert back.tensors["x"].dtype == t.dtype and list(back.tensors["x"].shape) == shape
    assert torch.equal(back.tensors["x"], t)
    assert back.blobs == {"c": blob} and back.meta == meta and back.step == 7
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
