"""The per-message hot path (issue 19): faster encode/decode/network with the same bytes, the same refusals and the
same byte accounting.

``GOLDEN`` holds the SHA-256 of every corpus message as encoded by the code before the hot-path work (``git archive``
of commit 2d8a962 run on this file's ``corpus()``); the wire format must not move by one byte.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.errors import MessageError
from secvfl.messages import (
    KINDS,
    WIRE_DTYPES,
    Message,
    decode,
    encode,
    header_size,
    payload_size,
    register_kind,
)
from secvfl.transport import Network, Role

# Kinds the protocol layers and algorithm families register; registered by the ``protocol_kinds`` fixture for the
# test only (other tests compare the registry with the kinds their runs produce).
PROTOCOL_KINDS = ("ciphertext", "ciphertext-sum", "ckks-context", "masked", "masked-sum", "secagg-key", "psi-points",
                  "psi-reblinded", "handshake", "dual", "head")


@pytest.fixture
def protocol_kinds():
    added = set(PROTOCOL_KINDS) - KINDS
    for kind in added:
        register_kind(kind)
    yield
    KINDS.difference_update(added)


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(np.asarray(rng.random(shape) > 0.5))
    if dtype.is_floating_point:
        return torch.from_numpy(np.asarray(rng.standard_normal(shape) * 10)).to(dtype)
    low = 0 if dtype == torch.uint8 else -100
    return torch.from_numpy(np.asarray(rng.integers(low, 100, shape))).to(dtype)


def corpus() -> list[tuple[str, Message]]:
    """Messages shaped like the real ones of every kind, plus every dtype, odd shapes and odd meta."""
    f32 = torch.float32
    out: list[tuple[str, Message]] = [
        ("embedding-online", Message("embedding", "party0", "label", 1234, {"embedding": _values(f32, (1, 64), 1)})),
        ("embedding-batch", Message("embedding", "party3", "label", 7, {"embedding": _values(f32, (256, 64), 2)})),
        ("embedding-grad-tracked", Message("embedding", "party1", "label", 0,
                                           {"embedding": _values(f32, (4, 8), 3).requires_grad_(True)})),
        ("embedding-rows", Message("embedding", "party2", "label", 12, {"embedding": _values(f32, (3, 5), 4)},
                                   meta={"rows": ["train", 5, 9, 11], "eval": False})),
        ("embedding-noncontiguous", Message("embedding", "party0", "label", 3,
                                            {"embedding": _values(f32, (6, 4), 5).t()})),
        ("embedding-sliced", Message("embedding", "party0", "label", 3, {"embedding": _values(f32, (6, 4), 5)[::2]})),
        ("logits", Message("logits", "party1", "label", 99, {"logits": _values(torch.float64, (5, 10), 6)})),
        ("gradient-online", Message("gradient", "label", "party0", 1234, {"gradient": _values(f32, (1, 64), 7)})),
        ("gradient-batch", Message("gradient", "label", "party2", 2**40, {"gradient": _values(f32, (256, 64), 8)})),
        ("gradient-numpy-step", Message("gradient", "label", "party1", np.int64(17), {"gradient": _values(f32, (2, 3), 9)})),
        ("prediction", Message("prediction", "label", "party0", 5, {"prediction": _values(f32, (4, 2), 10)})),
        ("labels", Message("labels", "label", "party0", 5, {"labels": _values(torch.int64, (8,), 11)})),
        ("control-empty", Message("control", "coordinator", "party0")),
        ("control-meta", Message("control", "label", "party0", 2**63 - 1, meta={
            "epoch": 3, "lr": 0.01, "npf": np.float64(0.25), "name": "é\u2603\"q\\", "none": None, "flag": True,
            "nested": {"a": [1, 2.5, {"b": [None, "x"]}], "t": (1, 2)}, "": -(2**63)})),
        ("compression-like", Message("embedding", "party0", "label", 8,
                                     {"0\x1fvalues": _values(torch.float16, (40,), 12),
                                      "0\x1findex": _values(torch.int32, (40,), 13)},
                                     meta={"cmp": [["embedding", [8, 10], "float32", 3, "topk"]],
                                           "rows": {"s": "train", "range": [0, 8]}})),
        ("ciphertext", Message("ciphertext", "party0", "aggregator", 4, blobs={"c0": bytes(range(256)) * 3,
                                                                             "c1": bytearray(b"\x00\xff" * 10)},
                               meta={"layout": [[["embedding", [2, 3]]]], "scale": 2.0**40})),
        ("ciphertext-sum", Message("ciphertext-sum", "aggregator", "label", 4, blobs={"sum": memoryview(b"abc" * 7)})),
        ("ckks-context", Message("ckks-context", "label", "party1", 0, blobs={"context": b"ctx" * 50},
                                 meta={"poly_modulus_degree": 8192})),
        ("masked", Message("masked", "party2", "aggregator", 6, {"x": _values(torch.int64, (3, 4), 14)},
                           meta={"fixed_point": 16})),
        ("masked-sum", Message("masked-sum", "aggregator", "label", 6, {"x": _values(torch.int64, (3, 4), 15)})),
        ("secagg-key", Message("secagg-key", "party0", "party1", 0, blobs={"public_key": bytes(32)})),
        ("psi-points", Message("psi-points", "party0", "party1", 1, blobs={"points": b"\x01" * 64})),
        ("psi-reblinded", Message("psi-reblinded", "party1", "party0", 1, blobs={"points": b""})),
        ("handshake", Message("handshake", "party0", "label", 0, blobs={"share": b"k" * 32, "sig": b"s" * 64},
                              meta={"protocol": "secvfl-channel/1", "msg": "hello"})),
        ("sealed", Message("embedding", "party0", "label", 0, blobs={"sealed": b"\x07" * 100}, meta={"seq": 12})),
        ("dual", Message("dual", "label", "party4", 2, {"lambda": _values(f32, (16, 6), 16),
                                                         "residual": _values(f32, (16, 6), 17)})),
        ("head", Message("head", "label", "party4", 2, {"W": _values(f32, (10, 6), 18)})),
        ("size-one-dims", Message("embedding", "party0", "label", 3, {"embedding": _values(f32, (64, 1), 21).t()})),
        ("expanded", Message("embedding", "party0", "label", 3, {"embedding": _values(f32, (1, 4), 22).expand(3, 4)})),
        ("offset-view", Message("embedding", "party0", "label", 3, {"embedding": _values(f32, (5, 4), 23)[2:]})),
        ("bfloat16-transposed", Message("embedding", "p", "q", 3, {"x": _values(torch.bfloat16, (3, 5), 24).t()})),
        ("empty-bfloat16", Message("embedding", "p", "q", 3, {"x": torch.empty(0, 3, dtype=torch.bfloat16)})),
        ("empty-tensor", Message("embedding", "party0", "label", 1, {"embedding": torch.empty(0, 64)})),
        ("scalar-tensor", Message("control", "label", "party0", 1, {"loss": torch.tensor(0.5)})),
        ("tensors-and-blobs", Message("embedding", "party0", "label", 1, {"a": _values(f32, (2,), 19),
                                                                          "b": _values(torch.int8, (3, 1, 2), 20)},
                                      {"tag": b"t" * 16})),
    ]
    for i, (name, dtype) in enumerate(sorted(WIRE_DTYPES.items())):
        out.append((f"dtype-{name}", Message("embedding", "p", "q", i, {name: _values(dtype, (3, 2, 2), 100 + i)})))
    return out


GOLDEN: dict[str, str] = {
    "embedding-online": "79608b6f0419f9df4ab52aa51dd68a56eba8514e537336ed5808c90cbe547674",
    "embedding-batch": "f5dcc8dcead154e182d01b22ed970a0594331f3494719f294d247fa136aadc0c",
    "embedding-grad-tracked": "655d1df615110524f42070c87c8b3ecf772f833f2311289b7f21b66eb8299297",
    "embedding-rows": "9ae3853eae297dec4cdbc57672e62daf5decef42fe8c228da3b6f000d81f6bce",
    "embedding-noncontiguous": "15da2bf97852fdc4303766fbb37c93a0e413ff8ce15de2c85fe2d7e9cbd647d7",
    "embedding-sliced": "b641523e717f52e536ef8590f415ef762970e33e38bcdce1145d317984dabf73",
    "logits": "34e04b361815f1a8054996d3d06aae38223d8b8613e4333e853fc90b5c0153af",
    "gradient-online": "de88b41ee2f9f73372b1c2a7db450310f4841eb14762ad5e731957f02f3f4737",
    "gradient-batch": "6f5401197ef13149487677ada9d6d06549eef707c96fc4c8a511305e0ec88512",
    "gradient-numpy-step": "8c06d14eb5f46b9136eea8c80fd1f8d44213b3d937066eabf53172e67892d445",
    "prediction": "6e0ee0aae0b6499333c8feb33f73eed72fcbd7b93d3393b462ec0a56ba6f19a1",
    "labels": "3791adb47f3803f670d80791aadd8303275cdb9c0d0a9a7901b6ca39e9e32b19",
    "control-empty": "dd09f2fa8c7c657cacfb0766900e1f5319585cf080825e4d00fa9182e66e4412",
    "control-meta": "fd22f4d7801ee7f183062ab2bf09d90bdd7913a95fa6fa92c90c47895dd3b6c4",
    "compression-like": "59eddf96ccfa33229a2da7386e30288bdbbaba1132d1ce3f895bb038c8c2bedc",
    "ciphertext": "9dd9673b38d51435286c777ba1be277b9189041dc269c0961dd245013a8fdc03",
    "ciphertext-sum": "f5c397af94353a24e087929493137769e1f19b85d514e006c876993e967b4bbd",
    "ckks-context": "f27fdaf030f139ef54c79c40a68128af03c3ac2ce923424547b4704f6aeb37b6",
    "masked": "43681e0ec764fb023b1ddbeac38aac5c167b605a8d821dddd82794339ff9d93c",
    "masked-sum": "97e564017bda3321626d20fabfdbe5b098c29fafce6bee85e18bda56cd50a96a",
    "secagg-key": "9387933be159bbd5069e993b3aa20e2f3737386924ad493da2dc0058fa962709",
    "psi-points": "fca5f32ab9454f4601532cdab3eb95790f90415cf838c0de2b28282ce9313046",
    "psi-reblinded": "0b006789c007c7a1422269b964390e3151356f85969ae0d3e585a2e10a29bdcc",
    "handshake": "427cd08ca3030cf5ca9e2510195ff965d16c9c89ca2fcbd7a7f55fff39609b1b",
    "sealed": "612d75e2231dd053eb5e1fe1a9976a190dbfb6ab95f3fd7df965bf5f698b5428",
    "dual": "b2ab900fcfc5bc1c01837b1f22849155888b8b7db55293f96c9b3f453b36b093",
    "head": "889c74beb092d8eaa9982fcf0a6465f3f8f34f43abea71e18f7e7916ea33f0f0",
    "size-one-dims": "89f7c3c4874831735802dfe9e4e3ecdde20e3a0a13f8cf606df51714a16a1028",
    "expanded": "fc3f671f7c8321fdbf0cfbffb80450b71575388a16c20322fd14e9d9323936cc",
    "offset-view": "81d6b2849a7f07ff6f48d1a6a7e189ae38d2ab0910d878a27076210ba5aa4eec",
    "bfloat16-transposed": "dfbbef0dfb0ef5ee0b9dc063c90caad0ebef89c04be6720c1d3203058a9da7b3",
    "empty-bfloat16": "96486ba45aeb05bd295e078389d0ce1197e8722552cbb736c06433fc2a97596b",
    "empty-tensor": "1bebff8f60927ca6fe05e63bc16645fbb84460612a2f14180a913a466ecd660f",
    "scalar-tensor": "8d4ae8c30ab85cf8f6e52fe74f28602e691f9372f54b39e073d279f44c1392ee",
    "tensors-and-blobs": "1902aca13d5de53fc14215d960bcac1697d9230aeae769530bb9e99c6e3ae9bc",
    "dtype-bfloat16": "290608d6760bf6daeece79bcfa30432a4dbb82637004c585381a39dde15ed380",
    "dtype-bool": "f19880a1189b211e3363a985075944c28329cf260df7fb0842b102ceeb954133",
    "dtype-float16": "ce84b534f5188cbbdc3371e70b44716a183f2404b5ae45b343b35d9e868574b5",
    "dtype-float32": "f78ea177d51c71bbb0b754248e2c57ea9e689536b284a1cfcb1033b73b771ea7",
    "dtype-float64": "95955dc65f5f901db127bd6f580f3a109a945bc5095372437f4c025d0f5ff918",
    "dtype-int16": "7e7172edfe28f6b7d96bc21311dc1be539d1e7a0721966c40b545bee561703dc",
    "dtype-int32": "9432d5d17ac070735fc6a98c38b2b7aaeeb4c2bdf89ef806e8e99953c5f0c116",
    "dtype-int64": "6d5c0dfe009f3c511f92d0888193a3a13d228ded249d30751c1c7b310960f4f7",
    "dtype-int8": "75b86ada5e214f1c2d6630281a652f74948b5b4dad8b62d5cf448fdea0f6fd68",
    "dtype-uint8": "6f9b74aedd0198cab38b89b13c3d401f926491fd241d4c0081406616f55a85c7",
}


def test_corpus_bytes_are_those_of_the_old_encoder(protocol_kinds):
    digests = {name: hashlib.sha256(encode(m)).hexdigest() for name, m in corpus()}
    assert digests.keys() == GOLDEN.keys()
    changed = [name for name in GOLDEN if digests[name] != GOLDEN[name]]
    assert not changed, f"the wire format changed for {changed}"


def _reference_payload(m: Message) -> bytes:
    """Payload as the wire format defines it: each tensor's C-order bytes, then each blob, in order."""
    parts = [t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
             for t in m.tensors.values()]
    return b"".join(parts + [bytes(b) for b in m.blobs.values()])


def test_corpus_payload_and_accounting_match_the_definition(protocol_kinds):
    for name, m in corpus():
        data = encode(m)
        (hlen,) = struct.unpack_from("<I", data, 5)
        assert data[9 + hlen :] == _reference_payload(m), name
        assert len(data) == header_size(m) + payload_size(m) == 9 + hlen + len(_reference_payload(m)), name


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(sorted(WIRE_DTYPES)), shape=st.lists(st.integers(0, 4), min_size=0, max_size=4),
       seed=st.integers(0, 2**16), perm_seed=st.integers(0, 100), grad=st.booleans(), step=st.integers(0, 2**63 - 1))
def test_any_layout_encodes_its_c_order_bytes_and_decodes_to_an_equal_private_tensor(
        dtype, shape, seed, perm_seed, grad, step):
    t = _values(WIRE_DTYPES[dtype], tuple(shape), seed)
    if len(shape) > 1:  # a permuted (non-contiguous) view: the wire carries the logical C-order values
        order = list(np.random.default_rng(perm_seed).permutation(len(shape)))
        t = t.permute(*order)
    if grad and t.is_floating_point():
        t.requires_grad_(True)
    m = Message("embedding", "a", "b", step, {"x": t})
    data = encode(m)
    assert data.endswith(_reference_payload(m))
    back = decode(data).tensor("x")
    assert back.dtype == t.dtype and back.shape == t.shape and not back.requires_grad
    assert torch.equal(back, t.detach())
    assert back.is_contiguous()


def test_decoded_tensors_are_private_writable_copies():
    sent = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    data = encode(Message("gradient", "label", "party0", 3, {"gradient": sent}))
    first, second = decode(data).tensor("gradient"), decode(data).tensor("gradient")
    first.mul_(-1.0)  # a receiver updating what it got in place
    assert torch.equal(second, sent) and torch.equal(decode(data).tensor("gradient"), sent)
    assert data == encode(Message("gradient", "label", "party0", 3, {"gradient": sent}))
    storages = {x.untyped_storage().data_ptr() for x in (sent, first, second)}
    assert len(storages) == 3


def test_network_counts_payload_and_wire_bytes_of_what_it_sends(protocol_kinds):
    messages = [m.replace(sender="party0", receiver="label") for _, m in corpus()]
    net = Network({"party0": Role.FEATURE, "label": Role.LABEL})
    for m in messages:
        net.send(m)
    for m in messages:
        got = net.receive("label", kind=m.kind, sender="party0")
        assert got.wire_size == len(encode(m))
    expected_payload: dict[str, int] = {}
    for m in messages:
        expected_payload[m.kind] = expected_payload.get(m.kind, 0) + len(_reference_payload(m))
    assert dict(net.stats.payload_by_kind) == expected_payload
    assert net.stats.bytes_total == sum(len(encode(m)) for m in messages)


def test_a_refused_message_is_refused_by_encode_and_never_counted():
    net = Network({"party0": Role.FEATURE, "label": Role.LABEL})
    with pytest.raises(MessageError, match="not plain JSON data|JSON has no NaN"):
        net.send(Message("embedding", "party0", "label", 1, {"x": torch.ones(2)}, meta={"bad": float("nan")}))
    with pytest.raises(MessageError, match="no wire format"):
        net.send(Message("embedding", "party0", "label", 1, {"x": torch.ones(2, dtype=torch.complex64)}))
    assert net.stats.bytes_total == 0 and net.stats.payload() == 0 and net.transport.pending() == 0
