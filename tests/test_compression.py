"""Compression operators and the compression layer: specs, unbiasedness, top-k, quantisation bounds, wire bytes,
error feedback state, refusals, resume."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.compression import (
    CompressionLayer,
    compress_values,
    decompress_values,
    dequantize,
    index_dtype,
    pack_bits,
    pack_indices,
    packed_size,
    parse_spec,
    quantize,
    topk_indices,
    unpack_bits,
    unpack_indices,
)
from secvfl.errors import ConfigError, ProtocolError, UnsupportedError
from secvfl.messages import Message, encode, header_size
from secvfl.transport.layers import AlgorithmTraits, PlainAggregation, Role, check_stack
from secvfl.transport.network import Network

TRAITS = AlgorithmTraits("splitnn", "concat")
SUM_TRAITS = AlgorithmTraits("fdml", "sum", forward_kinds=("logits",))


def _roundtrip(x: torch.Tensor, spec_text: str, gen: torch.Generator) -> torch.Tensor:
    spec = parse_spec(spec_text)
    parts = compress_values(x, spec, gen)
    raw, scale = decompress_values(parts, spec, x.numel(), x.dtype)
    return raw * scale


# -- specs ------------------------------------------------------------------------------------------------------
def test_parse_spec_roundtrip_and_composition():
    s = parse_spec("topk:0.1+quant:8+ef")
    assert (s.sparsifier, s.ratio, s.codec, s.bits, s.feedback) == ("topk", 0.1, "quant", 8, "ef")
    assert str(s) == "topk:0.1+quant:8+ef"
    assert parse_spec("none") is None and parse_spec("") is None and parse_spec(None) is None
    assert parse_spec("randk:0.01+vr").unbiased
    assert not parse_spec("topk:0.5").unbiased


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("quant:0", "bits must be in 1..16"),
        ("quant:17", "bits must be in 1..16"),
        ("quant:x", "bit width"),
        ("topk:1.5", "ratio must be in (0, 1]"),
        ("topk:0", "ratio must be in (0, 1]"),
        ("randk:-0.1", "ratio must be in (0, 1]"),
        ("zip:3", "valid operators: topk:RATIO, randk:RATIO, quant:BITS"),
        ("quant:8+topk:0.1", "must come first"),
        ("topk:0.1+randk:0.1", "only one of topk/randk"),
        ("topk:0.1+vr", "needs an unbiased operator"),
        ("ef", "needs an operator"),
        ("topk:0.1+ef+vr", "at most one of ef"),
    ],
)
def test_parse_spec_errors_are_clear(text, needle):
    with pytest.raises(ConfigError, match=None) as err:
        parse_spec(text)
    assert needle in str(err.value)


# -- operators ----------------------------------------------------------------------------------------------------
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300, unique=True),
       st.floats(0.01, 1.0))
@settings(max_examples=60, deadline=None)
def test_topk_keeps_exactly_the_k_largest_magnitudes(values, ratio):
    x = torch.tensor(values, dtype=torch.float64)
    if len(set(np.abs(values))) != len(values):  # ties in magnitude make "the" top-k ambiguous
        return
    spec = parse_spec(f"topk:{ratio}")
    k = spec.kept(x.numel())
    assert k == min(x.numel(), max(1, math.ceil(ratio * x.numel() - 1e-9)))
    out = _roundtrip(x, f"topk:{ratio}", torch.Generator().manual_seed(0))
    kept = set(torch.nonzero(out).reshape(-1).tolist()) | {i for i in range(len(values)) if values[i] == 0 and False}
    expected = set(np.argsort(-np.abs(values), kind="stable")[:k].tolist())
    nonzero_expected = {i for i in expected if values[i] != 0}
    assert kept == nonzero_expected
    assert torch.equal(out[list(expected)], x[list(expected)])  # values are exact
    assert set(topk_indices(x, k).tolist()) == expected


@given(st.integers(1, 12), st.integers(1, 40), st.floats(0.01, 1.0), st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_rowwise_topk_keeps_the_k_largest_of_every_row(rows, width, ratio, seed):
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, width)))
    spec = parse_spec(f"topk:{ratio}")
    parts = compress_values(x.reshape(-1), spec, torch.Generator(), row_width=width)
    raw, _ = decompress_values(parts, spec, x.numel(), x.dtype, row_width=width)
    k = spec.kept(width)
    top = torch.topk(x.abs(), k, dim=1).indices
    assert torch.equal(raw.reshape(rows, width), torch.zeros_like(x).scatter(1, top, x.gather(1, top)))
    assert sum(v.numel() * v.element_size() for v in parts.values()) == packed_size(spec, x.numel(), x.dtype,
                                                                                    row_width=width)


@pytest.mark.parametrize("spec_text", ["randk:0.1", "randk:0.3", "quant:2", "quant:4", "randk:0.25+quant:3"])
def test_unbiased_operators_average_to_the_input(spec_text):
    torch.manual_seed(0)
    x = torch.randn(40, dtype=torch.float64) * torch.linspace(0.1, 3.0, 40, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    draws = 4000
    samples = torch.stack([_roundtrip(x, spec_text, gen) for _ in range(draws)])
    mean, sd = samples.mean(0), samples.std(0)
    # every coordinate's mean within 5 standard errors (and the operator is genuinely random)
    assert torch.all((mean - x).abs() <= 5 * sd / math.sqrt(draws) + 1e-12)
    assert sd.max() > 0
    # the variance bound omega holds on average
    spec = parse_spec(spec_text)
    err = ((samples - x) ** 2).sum(1).mean()
    assert err <= spec.omega(x.numel()) * float((x**2).sum()) * 1.1


def test_topk_is_biased_so_a_mean_test_would_fail():
    x = torch.tensor([3.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    mean = torch.stack([_roundtrip(x, "topk:0.25", gen) for _ in range(50)]).mean(0)
    assert not torch.allclose(mean, x)


@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=200), st.integers(1, 16))
@settings(max_examples=80, deadline=None)
def test_quantisation_round_trips_within_its_bound(values, bits):
    x = torch.tensor(values, dtype=torch.float64)
    packed, lohi = quantize(x, bits, torch.Generator().manual_seed(3))
    assert packed.dtype == torch.uint8 and packed.numel() == -(-x.numel() * bits // 8)
    back = dequantize(packed, lohi, bits, x.numel(), torch.float64)
    bound = float(x.max() - x.min()) / (2**bits - 1)
    assert torch.all((back - x).abs() <= bound * (1 + 1e-9) + 1e-12)
    assert float(back.min()) >= float(x.min()) - 1e-9 and float(back.max()) <= float(x.max()) + 1e-9


@given(st.integers(1, 16), st.integers(0, 300), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_pack_bits_round_trip(bits, n, seed):
    codes = torch.from_numpy(np.random.default_rng(seed).integers(0, 2**bits, n))
    packed = pack_bits(codes, bits)
    assert packed.numel() == -(-n * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@pytest.mark.parametrize(("n", "dtype"), [(1, torch.uint8), (256, torch.uint8), (257, torch.int16),
                                          (65536, torch.int16), (65537, torch.int32)])
def test_index_dtypes_fit_and_round_trip(n, dtype):
    assert index_dtype(n) == dtype
    idx = torch.tensor(sorted({0, n - 1, n // 2, max(0, n - 2)}))
    assert torch.equal(unpack_indices(pack_indices(idx, n), n), idx)


def test_out_of_range_index_is_refused():
    with pytest.raises(ProtocolError, match="outside"):
        unpack_indices(torch.tensor([7], dtype=torch.uint8), 5)


# -- wire bytes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec_text", ["topk:0.1", "randk:0.1", "quant:8", "quant:3", "topk:0.05+quant:4",
                                       "randk:0.2+fp16", "fp16", "topk:0.1+ef"])
@pytest.mark.parametrize("shape", [(64, 16), (300,), (70000,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wire_bytes_equal_the_packed_size(spec_text, shape, dtype):
    layer = CompressionLayer(spec_text, None)
    layer.check(TRAITS)
    x = torch.randn(shape, dtype=dtype)
    meta = {"persistent": True} if "ef" in spec_text else {}
    msg = Message("embedding", "a", "b", 0, {"embedding": x}, meta=meta)
    out = layer.outbound([msg], "a")[0]
    payload = len(encode(out)) - header_size(out)
    width = shape[-1] if len(shape) > 1 and not meta else 0  # a batch of rows: top-k acts per row
    assert payload == packed_size(parse_spec(spec_text), x.numel(), dtype, row_width=width)
    dense = x.numel() * x.element_size()
    if spec_text.startswith("topk:0.1") and x.numel() > 256:
        assert payload <= dense / 5  # 32-bit indices + float32 values: exactly 5x once n > 65536
    # and through a network the transport counts exactly the encoded message
    net = Network({"a": Role.FEATURE, "b": Role.LABEL}, layers=[CompressionLayer(spec_text, None)], traits=TRAITS)
    net.send(msg)
    got = net.receive("b", kind="embedding", sender="a")
    assert net.stats.bytes_total == len(encode(out))
    assert got.tensor("embedding").shape == x.shape and got.tensor("embedding").dtype == dtype


def test_uncompressed_kinds_and_integer_tensors_pass_through():
    layer = CompressionLayer("topk:0.1", None)
    layer.check(TRAITS)
    m = Message("gradient", "b", "a", 0, {"gradient": torch.randn(10)})
    assert layer.outbound([m], "b")[0] is m
    m2 = Message("embedding", "a", "b", 0, {"embedding": torch.randn(50), "ids": torch.arange(5)})
    out = layer.outbound([m2], "a")[0]
    assert torch.equal(out.tensors["ids"], torch.arange(5))


def test_non_finite_values_are_refused():
    layer = CompressionLayer("quant:8", None)
    layer.check(TRAITS)
    with pytest.raises(ProtocolError, match="non-finite"):
        layer.outbound([Message("embedding", "a", "b", 0, {"embedding": torch.tensor([1.0, float("nan")])})], "a")


# -- the layer: directions, refusals --------------------------------------------------------------------------------
def _net(fwd, bwd, traits=TRAITS, **kw):
    return Network({"a": Role.FEATURE, "b": Role.LABEL}, layers=[CompressionLayer(fwd, bwd, **kw)], traits=traits)


def test_directions_follow_the_traits():
    net = _net("topk:0.1", None)
    x = torch.randn(100)
    net.send(Message("embedding", "a", "b", 0, {"embedding": x}))
    got = net.receive("b").tensor("embedding")
    assert int((got != 0).sum()) == 10
    net.send(Message("gradient", "b", "a", 0, {"gradient": x}))
    assert torch.equal(net.receive("a").tensor("gradient"), x)


def _secure_aggregation(name: str):
    if name == "ckks":
        from protocols.ckks import CKKSAggregation

        return CKKSAggregation()
    from protocols.secagg import MaskedAggregation

    return MaskedAggregation()


@pytest.mark.parametrize("agg", ["ckks", "mask"])
def test_forward_compression_is_refused_under_secure_aggregation(agg):
    # the aggregation declares that it adds dense tensors only; check_stack refuses the pair, naming the fix
    with pytest.raises(UnsupportedError, match=rf"(?s)compress: forward compression \(topk:0.1\) cannot be combined "
                                               rf"with the {agg} aggregation.*--compress-backward"):
        check_stack([CompressionLayer("topk:0.1", None)], SUM_TRAITS, _secure_aggregation(agg))
    # backward compression stays valid: the label party's gradients are plaintext
    check_stack([CompressionLayer(None, "topk:0.1")], SUM_TRAITS, _secure_aggregation(agg))
    # what the layer declares: forward compression encodes the outputs, backward compression leaves them dense
    assert CompressionLayer("topk:0.1", None).encoded_outputs(SUM_TRAITS) is not None
    assert CompressionLayer(None, "topk:0.1").encoded_outputs(SUM_TRAITS) is None


def test_plain_aggregation_adds_compressed_outputs_and_specs_resolve():
    from protocols.compression import specs_from_options

    check_stack([CompressionLayer("topk:0.1", None)], SUM_TRAITS, PlainAggregation())  # no refusal
    f, b = specs_from_options("topk:0.1+ef", None, "quant:8")
    assert str(f) == "topk:0.1+ef" and str(b) == "quant:8"


# -- error feedback -------------------------------------------------------------------------------------------------
def test_ef21_converges_to_a_constant_message_and_states_agree():
    net = _net("topk:0.1+ef", None)
    x = torch.randn(200, dtype=torch.float64)
    for step in range(10):  # ten messages of 20 entries each cover all 200 coordinates of the residual
        net.send(Message("embedding", "a", "b", step, {"embedding": x}, meta={"persistent": True}))
        got = net.receive("b", kind="embedding").tensor("embedding")
    assert torch.allclose(got, x, atol=0, rtol=0)
    layer = net.layers[0]
    sender = layer._memory["a"]["b|embedding|embedding"]
    receiver = layer._memory["b"]["a|embedding|embedding"]
    assert torch.equal(sender, receiver)


def test_shifted_compression_tracks_a_constant_and_is_unbiased_each_step():
    net = _net("randk:0.25+vr", None)
    x = torch.randn(40, dtype=torch.float64)
    for step in range(300):
        net.send(Message("embedding", "a", "b", step, {"embedding": x}, meta={"persistent": True}))
        got = net.receive("b").tensor("embedding")
    h = net.layers[0]._memory["b"]["a|embedding|embedding"]
    assert torch.allclose(h, x, atol=1e-8)
    assert torch.allclose(got, x, atol=1e-6)


def test_error_feedback_needs_rows_or_a_persistent_message():
    net = _net(None, "topk:0.1+ef")
    with pytest.raises(ProtocolError, match="meta\\['rows'\\]"):
        net.send(Message("gradient", "b", "a", 0, {"gradient": torch.randn(20)}))


def test_per_batch_forward_outputs_are_compressed_without_memory():
    # no memory exists for rows at prediction time, so training outputs are compressed the same way (plain top-k)
    net = _net("topk:0.25+ef", None)
    x = torch.randn(4, 8, dtype=torch.float64)
    for _ in range(3):
        net.send(Message("embedding", "a", "b", 0, {"embedding": x}, meta={"rows": ["train", 0, 1, 2, 3]}))
        got = net.receive("b").tensor("embedding")
        assert int((got != 0).sum()) == 8
    top2 = torch.topk(x.abs(), 2, dim=1).indices
    assert torch.equal(got, torch.zeros_like(x).scatter(1, top2, x.gather(1, top2)))  # top-2 of every row
    assert not net.layers[0]._memory.get("a")
    # evaluation outputs of that link follow the same (memory-free) compression by default
    net.send(Message("embedding", "a", "b", 0, {"embedding": x}, meta={"rows": ["test", 0, 1, 2, 3], "eval": True}))
    assert int((net.receive("b").tensor("embedding") != 0).sum()) == 8


def test_gradient_of_a_topk_output_is_taken_through_the_selection():
    net = _net("topk:0.25", "topk:0.25")
    h = torch.randn(5, 8, dtype=torch.float64)
    net.send(Message("embedding", "a", "b", 0, {"embedding": h}))
    seen = net.receive("b").tensor("embedding")
    mask = seen != 0
    g = torch.randn(5, 8, dtype=torch.float64)  # dL/d(received), dense
    net.send(Message("gradient", "b", "a", 0, {"gradient": g}))
    back = net.receive("a").tensor("gradient")
    # dL/dh is zero where h never reached the loss; the top-2 of each masked row are exactly its support: lossless
    assert torch.equal(back, g * mask)
    # an evaluation output leaves no support behind, and a gradient without a matching batch passes unmasked
    net.send(Message("embedding", "a", "b", 1, {"embedding": h}, meta={"eval": True}))
    net.receive("b")
    layer = net.layers[0]
    assert not layer._support


def test_row_keyed_shift_keeps_memory_per_row():
    net = _net(None, "randk:0.5+vr")
    x = torch.randn(6, 4, dtype=torch.float64)
    rows_a, rows_b = [0, 1, 2], [3, 4, 5]
    for _ in range(200):  # alternate batches: each batch's memory only sees its own rows
        for rows in (rows_a, rows_b):
            net.send(Message("gradient", "b", "a", 0, {"gradient": x[rows]}, meta={"rows": ["train", *rows]}))
            got = net.receive("a")
    assert torch.allclose(got.tensor("gradient"), x[rows_b], atol=1e-6)
    assert got.meta["rows"] == {"s": "train", "range": [3, 6]}  # contiguous rows travel as a range
    table = net.layers[0]._memory["a"]["b|gradient|gradient|rows:train"]
    assert torch.allclose(table[:6], x, atol=1e-6)
    # scattered row ids travel packed (uint8 here) and are counted
    m = Message("gradient", "b", "a", 0, {"gradient": x[[0, 2, 5]]}, meta={"rows": ["train", 0, 2, 5]})
    out = net.layers[0].outbound([m], "b")[0]
    assert out.tensors["@rows"].dtype == torch.uint8 and out.meta["rows"] == {"s": "train", "ids": 256}
    assert torch.allclose(net.layers[0].inbound(out, "a").tensor("gradient"), x[[0, 2, 5]], atol=1e-6)


def test_scheduled_rows_are_resolved_from_the_public_batch_order():
    net = _net(None, "topk:0.5+ef")
    order = np.array([4, 1, 3, 0, 2, 5])
    net.layers[0].schedules["train"] = lambda epoch: np.roll(order, epoch)
    x = torch.randn(6, 3, dtype=torch.float64)
    total = torch.zeros(6, 3, dtype=torch.float64)
    for epoch in range(3):
        o = np.roll(order, epoch)
        for off in (0, 3):
            ids = o[off : off + 3]
            m = Message("gradient", "b", "a", 0, {"gradient": x[ids]},
                        meta={"rows": {"s": "train", "sched": [epoch, off, 3]}})
            net.send(m)
            got = net.receive("a")
            assert "@rows" not in got.tensors
            total[ids] += got.tensor("gradient")
    residual = net.layers[0]._memory["b"]["a|gradient|gradient|rows:train"][:6]
    assert torch.allclose(total + residual, 3 * x, atol=1e-12)  # per-row residuals keyed by the resolved ids
    with pytest.raises(ProtocolError, match="outside"):
        net.send(Message("gradient", "b", "a", 0, {"gradient": x[:3]},
                         meta={"rows": {"s": "train", "sched": [0, 5, 3]}}))


def test_per_row_gradients_carry_their_residual_and_lose_no_mass():
    net = _net(None, "topk:0.25+ef")
    rng = torch.Generator().manual_seed(0)
    sent_total = torch.zeros(4, 8, dtype=torch.float64)
    got_total = torch.zeros(4, 8, dtype=torch.float64)
    for step in range(12):
        g = torch.randn(4, 8, dtype=torch.float64, generator=rng)
        net.send(Message("gradient", "b", "a", step, {"gradient": g}, meta={"rows": ["train", 0, 1, 2, 3]}))
        got = net.receive("a").tensor("gradient")
        assert int((got != 0).sum()) == 8  # a quarter of 32 values per message
        sent_total += g
        got_total += got
    layer = net.layers[0]
    residual = layer._memory["b"]["a|gradient|gradient|rows:train"][:4]
    # what was received plus what the sender still owes equals everything sent
    assert torch.allclose(got_total + residual, sent_total, atol=1e-12)
    assert "a" not in layer._memory or not layer._memory["a"]  # the receiver keeps no state


def test_a_lost_message_desynchronises_and_is_detected():
    layer = CompressionLayer("topk:0.1+ef", None)
    layer.check(TRAITS)
    msgs = [layer.outbound([Message("embedding", "a", "b", i, {"embedding": torch.randn(30)},
                                    meta={"persistent": True})], "a")[0] for i in range(2)]
    with pytest.raises(ProtocolError, match="lost or reordered"):
        layer.inbound(msgs[1], "b")  # message 0 never arrived


def test_state_dict_resume_reproduces_the_same_wire_messages():
    def run(layer, start, stop):
        out = []
        for i in range(start, stop):
            x = torch.linspace(-1, 1, 50, dtype=torch.float64) * (i + 1)
            m = layer.outbound([Message("embedding", "a", "b", i, {"embedding": x}, meta={"persistent": True})], "a")[0]
            layer.inbound(m, "b")
            out.append(encode(m))
        return out

    spec = "randk:0.2+quant:4+ef"
    full = CompressionLayer(spec, None, seed=7)
    full.check(TRAITS)
    reference = run(full, 0, 6)
    first = CompressionLayer(spec, None, seed=7)
    first.check(TRAITS)
    run(first, 0, 3)
    state = first.state_dict()
    resumed = CompressionLayer(spec, None, seed=7)
    resumed.check(TRAITS)
    resumed.load_state_dict(state)
    assert run(resumed, 3, 6) == reference[3:]
    with pytest.raises(ConfigError, match="seed"):
        CompressionLayer(spec, None, seed=8).load_state_dict(state)


def test_describe_reports_the_compression_ratio():
    net = _net("topk:0.1", "quant:8")
    net.send(Message("embedding", "a", "b", 0, {"embedding": torch.randn(64, 16)}))
    net.receive("b")
    d = net.layers[0].describe()
    assert d["forward"] == "topk:0.1" and d["backward"] == "quant:8"
    assert d["forward_payload"]["ratio"] > 5


# -- through `secvfl train` ------------------------------------------------------------------------------------------
def _train(options, algo="splitnn"):
    from secvfl.config import TrainConfig
    from secvfl.runner import run_training

    cfg = TrainConfig(device="cpu", algo=algo, dataset="digits", parties=2, epochs=2, batch_size=64, lr=3e-3, options=options)
    return run_training(cfg, out=None, progress=False, log=lambda *_: None)


def test_splitnn_with_topk_ef_sends_far_fewer_bytes():
    plain = _train({})
    comp = _train({"compress": "topk:0.1+ef"})
    bk_plain = plain["comm"]["bytes_by_kind"]
    bk_comp = comp["comm"]["bytes_by_kind"]
    c = comp["compression"]
    assert c["forward"] == "topk:0.1+ef" and c["evaluation_messages_dense"] == 0
    # payload: 2 of 16 values per row (ceil(0.1 * 16)) + 1-byte in-row indices, against 16 float32 values
    assert c["forward_payload"]["ratio"] == pytest.approx(64 / 10)
    assert c["backward_payload"]["ratio"] == pytest.approx(64 / 10)
    # whole messages, JSON headers (~200 bytes at batch 64) included: >= 5x smaller in both directions
    assert bk_plain["embedding"] / bk_comp["embedding"] >= 5
    assert bk_plain["gradient"] / bk_comp["gradient"] >= 5
    dense_eval = _train({"compress": "topk:0.1+ef", "compress_eval": "dense"})
    assert dense_eval["compression"]["evaluation_messages_dense"] > 0
    assert bk_comp["embedding"] < dense_eval["comm"]["bytes_by_kind"]["embedding"] < bk_plain["embedding"]


def test_train_refuses_forward_compression_with_he():
    with pytest.raises(UnsupportedError, match="cannot be combined"):
        _train({"compress": "topk:0.1", "he": "ckks"}, algo="vafl")  # (fdml refuses a sparsifier on its logits anyway)


def test_training_gradients_name_their_rows_by_position_in_the_public_batch_order():
    """The compression layer tags through the parties' public ``tagger`` hook: during an epoch a gradient names its
    batch as (epoch, offset, length) in the shared-seed order; outside one, or for other rows, it lists the ids;
    evaluation outputs are marked."""
    from secvfl.algorithms.base import batch_ids
    from secvfl.config import TrainConfig
    from secvfl.runner import build_run

    cfg = TrainConfig(device="cpu", algo="splitnn", dataset="digits", parties=2, epochs=1, batch_size=64,
                      options={"compress": "topk:0.1+ef"})
    algo = build_run(cfg).algorithm
    tagger = algo.label_party.tagger
    batches = list(batch_ids(algo.train_rows(), cfg.batch_size, cfg.seed, 3))
    grad = Message("gradient", "label", "party0", 0, {"gradient": torch.zeros(len(batches[1]), 16)})
    algo.current_epoch = 3
    assert tagger.tag(grad, "train", batches[1], train=True).meta["rows"] == {"s": "train", "sched": [3, 64, 64]}
    assert tagger.tag(grad, "train", batches[1][::-1], train=True).meta["rows"][0] == "train"  # not a slice: listed
    algo.current_epoch = None
    assert tagger.tag(grad, "train", batches[1], train=True).meta["rows"] == ["train", *batches[1].tolist()]
    out = algo.feature_parties[0].forward(0, "test", np.arange(5), "label", train=False)
    assert out.meta["eval"] is True and "rows" not in out.meta
    algo.train_epoch(0)
    assert algo.current_epoch is None  # only set while an epoch trains
