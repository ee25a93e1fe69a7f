"""Masked secure aggregation: exact cancellation, uniform-looking masked vectors, fixed-point bounds, dropouts."""

from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from protocols.secagg import KEY_KIND, MASKED_KIND, SUM_KIND, FixedPoint, MaskedAggregation, PartyDroppedError
from secvfl.errors import ProtocolError, UnsupportedError
from secvfl.messages import Message
from secvfl.transport import InProcessTransport, Network
from secvfl.transport.layers import AlgorithmTraits, Role, check_stack

LABEL = "label"


def feature_names(n: int) -> list[str]:
    return [f"f{i}" for i in range(n)]


def make_net(n: int, *, aggregator: bool = False, **kwargs) -> tuple[Network, MaskedAggregation]:
    roles = {LABEL: Role.LABEL, **{p: Role.FEATURE for p in feature_names(n)}}
    if aggregator:
        roles["agg"] = Role.AGGREGATOR
    agg = MaskedAggregation(**kwargs)
    return Network(roles, aggregation=agg), agg


def messages(values: list[torch.Tensor], kind: str = "embedding", step: int = 0) -> list[Message]:
    return [Message(kind, f"f{i}", LABEL, step, {kind: v}) for i, v in enumerate(values)]


def wire_sum(msgs: list[Message], name: str) -> np.ndarray:
    total = np.zeros(msgs[0].tensor(name).numel(), dtype=np.uint64)
    for m in msgs:
        total += m.tensor(name).numpy().reshape(-1).view(np.uint64)
    return total


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 6), rows=st.integers(1, 8), cols=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_masks_cancel_exactly_for_any_number_of_parties(n: int, rows: int, cols: int, seed: int) -> None:
    net, agg = make_net(n)
    view = net.record(LABEL)
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 10 for _ in range(n)]
    out = net.aggregate(messages(values, step=3), LABEL, "sum")
    masked = view.received_of(MASKED_KIND)
    assert len(masked) == n and {m.sender for m in masked} == set(feature_names(n))
    # The receiver's wire sum equals the sum of the plain encodings: every mask cancelled, bit for bit.
    encodings = np.zeros(rows * cols, dtype=np.uint64)
    for v in values:
        encodings += agg.codec.encode(v, n, "test")
    np.testing.assert_array_equal(wire_sum(masked, "embedding"), encodings)
    # ... while no single masked vector equals its party's encoding.
    for m, v in zip(sorted(masked, key=lambda m: m.sender), values, strict=True):
        assert not np.array_equal(m.tensor("embedding").numpy().reshape(-1).view(np.uint64),
                                  agg.codec.encode(v, n, "test"))
    assert out.kind == "embedding" and out.step == 3 and out.wire_size and out.wire_size > 0
    assert net.transport.pending() == 0


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 5),
    frac_bits=st.sampled_from([8, 16, 24, 32]),
    data=st.data(),
)
def test_decoded_sum_within_fixed_point_bound(n: int, frac_bits: int, data: st.DataObject) -> None:
    codec = FixedPoint(frac_bits)
    limit = min(codec.max_abs(n), 1e9)
    floats = st.floats(-limit, limit, allow_nan=False, allow_infinity=False)
    size = data.draw(st.integers(1, 12))
    values = [torch.tensor(data.draw(st.lists(floats, min_size=size, max_size=size)), dtype=torch.float64)
              for _ in range(n)]
    net, _ = make_net(n, frac_bits=frac_bits)
    exact = sum(v.numpy().astype(np.longdouble) for v in values)
    for op in ("sum", "mean"):
        out = net.aggregate(messages(values), LABEL, op).tensor("embedding").numpy()
        target = exact / n if op == "mean" else exact
        bound = codec.error_bound(n) / (n if op == "mean" else 1)
        # plus float64 rounding of the decoded value itself
        slack = bound + 4 * np.finfo(np.float64).eps * np.abs(target).astype(np.float64)
        assert np.all(np.abs(out - target.astype(np.float64)) <= slack)


def test_float32_embeddings_keep_dtype_and_match_plain_sum() -> None:
    net, _ = make_net(4)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(256, 64, generator=gen) for _ in range(4)]
    out = net.aggregate(messages(values), LABEL, "sum").tensor("embedding")
    assert out.dtype == torch.float32 and out.shape == (256, 64)
    plain = torch.stack(values).double().sum(0)
    # fixed-point error (4 * 2^-25) plus the float32 cast of the result
    assert (out.double() - plain).abs().max() <= 4 * 2**-25 + plain.abs().max() * 2**-23


def _residue_pvalues(masked: np.ndarray) -> list[float]:
    """Chi-square uniformity p-values of the low byte and the high byte of the masked ring elements."""
    words = masked.view(np.uint64)
    out = []
    for shift in (0, 56):
        counts = np.bincount(((words >> np.uint64(shift)) & np.uint64(255)).astype(np.int64), minlength=256)
        out.append(stats.chisquare(counts).pvalue)
    return out


def test_each_masked_vector_alone_is_uniform_whatever_the_input() -> None:
    """A single masked vector is statistically independent of its input: its residues are uniform in Z/2^64
    for a constant zero input and for a huge constant input alike, and the two samples are indistinguishable."""
    shape = (64, 128)  # 8192 ring elements per party
    samples = {}
    for name, fill in (("zeros", 0.0), ("large", 1.0e6)):
        net, _ = make_net(3)
        view = net.record(LABEL)
        values = [torch.full(shape, fill, dtype=torch.float64) for _ in range(3)]
        net.aggregate(messages(values), LABEL, "sum")
        m = next(m for m in view.received_of(MASKED_KIND) if m.sender == "f1")
        words = m.tensor("embedding").numpy().reshape(-1)
        for p in _residue_pvalues(words):
            assert p > 1e-6, f"masked residues of a {name} input are not uniform (p={p:.2g})"
        samples[name] = (words.view(np.uint64) >> np.uint64(56)).astype(np.int64)
    # Without masks the encodings would be one constant each (a degenerate histogram, p ~ 0).
    table = np.stack([np.bincount(samples[k], minlength=256) for k in ("zeros", "large")])
    assert stats.chi2_contingency(table).pvalue > 1e-6


def test_masks_are_fresh_every_round() -> None:
    net, _ = make_net(2)
    view = net.record(LABEL)
    values = [torch.zeros(16, dtype=torch.float64), torch.zeros(16, dtype=torch.float64)]
    net.aggregate(messages(values, step=0), LABEL, "sum")
    net.aggregate(messages(values, step=0), LABEL, "sum")  # same step, same inputs: still new masks
    first, second = (m.tensor("embedding") for m in view.received_of(MASKED_KIND) if m.sender == "f0")
    assert not torch.equal(first, second)
    rounds = [m.meta["round"] for m in view.received_of(MASKED_KIND)]
    assert rounds == [0, 0, 1, 1]


def test_aggregator_sees_only_masked_vectors_and_receiver_only_the_sum() -> None:
    net, _ = make_net(3, aggregator=True)
    agg_view, label_view = net.record("agg"), net.record(LABEL)
    values = [torch.randn(8, 4, dtype=torch.float64) for _ in range(3)]
    out = net.aggregate(messages(values), LABEL, "mean")
    torch.testing.assert_close(out.tensor("embedding"), torch.stack(values).mean(0), atol=3 * 2**-25, rtol=0)
    assert [m.kind for m in agg_view.received] == [MASKED_KIND] * 3
    assert all(m.tensor("embedding").dtype == torch.int64 for m in agg_view.received)
    assert [m.kind for m in label_view.received] == [SUM_KIND]
    links = net.stats.to_dict()["bytes_by_link"]
    assert all(f"f{i}->{LABEL}" not in links for i in range(3))  # nothing goes to the receiver directly
    assert links["agg->label"] > 8 * 4 * 8


def test_key_agreement_is_counted_and_done_once() -> None:
    net, _ = make_net(4)
    values = [torch.ones(2, 2) for _ in range(4)]
    net.aggregate(messages(values), LABEL, "sum")
    kinds = net.stats.to_dict()["messages_by_kind"]
    assert kinds[KEY_KIND] == 4 * 3 and kinds[MASKED_KIND] == 4
    net.aggregate(messages(values), LABEL, "sum")
    kinds = net.stats.to_dict()["messages_by_kind"]
    assert kinds[KEY_KIND] == 12 and kinds[MASKED_KIND] == 8


def survivors_sum_tolerance(agg: MaskedAggregation, n_survivors: int) -> float:
    """Fixed-point rounding of each survivor's encoding (float64 inputs: no output cast)."""
    return agg.codec.error_bound(n_survivors) + 1e-12


@pytest.mark.parametrize("phase", ["masked", "keys"])
def test_a_dropped_party_fails_its_round_which_is_retried_without_it(
        phase: str, caplog: pytest.LogCaptureFixture) -> None:
    net, agg = make_net(4, drop_hook=lambda party, ph, rnd: ph == phase and party == "f2")
    label_view = net.record(LABEL)
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(5, 3, generator=gen, dtype=torch.float64) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="protocols.secagg"):
        out = net.aggregate(messages(values, step=7), LABEL, "sum")
    exact = values[0].numpy() + values[1].numpy() + values[3].numpy()  # float64 sum of the parties that delivered
    np.testing.assert_allclose(out.tensor("embedding").numpy(), exact, rtol=0, atol=survivors_sum_tolerance(agg, 3))
    assert out.meta["dropped"] == ["f2"] and out.meta["parties"] == 3
    assert out.meta["round"] == 1  # the failed round's number was never reused
    # The failed round delivered nothing but masked shares; the retry masked among the survivors only.
    assert label_view.received_of(SUM_KIND) == [] and out_of(label_view) == []
    retry = [m for m in label_view.received_of(MASKED_KIND) if m.meta["round"] == 1]
    assert sorted(m.sender for m in retry) == ["f0", "f1", "f3"] and retry[0].meta["parties"] == ["f0", "f1", "f3"]
    assert net.transport.pending() == 0  # nothing half-delivered waits anywhere
    assert agg.rounds_failed == 1 and agg.rounds_completed == 1 and agg.retried_rounds == 1
    assert agg.dropped == [{"step": 7, "round": 0, "party": "f2", "phase": phase}]
    assert agg.describe()["dropped"] == agg.dropped and agg.describe()["retried_rounds"] == 1
    if phase == "keys":  # all-or-nothing: nobody kept a seed with the party that never sent its key
        assert not any(st.has_seed("f2") for st in agg._parties.values())
        assert not any(agg._state("f2").has_seed(p) for p in feature_names(4))
    # A second drop is recorded but not logged again.
    net.aggregate(messages(values, step=8), LABEL, "mean")
    assert [d["step"] for d in agg.dropped] == [7, 8] and agg.retried_rounds == 2
    assert [r.getMessage() for r in caplog.records if r.name == "protocols.secagg"] == [
        f"masked aggregation: f2 did not deliver its {'key' if phase == 'keys' else 'masked tensor'} in round 0 "
        "(step 7); the round is retried without it (later drops are listed under secagg.dropped in summary.json)"
    ]


@pytest.mark.parametrize(("n", "dropped"), [(2, {"f1"}), (3, {"f0", "f2"})])
def test_fewer_than_two_parties_left_stop_the_aggregation(n: int, dropped: set[str]) -> None:
    net, agg = make_net(n, drop_hook=lambda party, ph, rnd: ph == "masked" and party in dropped)
    label_view = net.record(LABEL)
    with pytest.raises(PartyDroppedError, match="cannot go on.*a sum over one party would reveal its tensor") as info:
        net.aggregate(messages([torch.ones(3, dtype=torch.float64)] * n), LABEL, "sum")
    assert set(info.value.parties) == dropped
    assert out_of(label_view) == [] and label_view.received_of(SUM_KIND) == []
    assert agg.rounds_completed == 0 and {d["party"] for d in agg.dropped} == dropped
    assert net.transport.pending() == 0


def out_of(view) -> list[Message]:
    """Messages a receiver got that are not masked shares (an unmasked value would show up here)."""
    return [m for m in view.received if m.kind not in (MASKED_KIND, SUM_KIND)]


def test_party_refuses_to_reuse_a_round() -> None:
    net, agg = make_net(2)
    net.aggregate(messages([torch.ones(3), torch.ones(3)]), LABEL, "sum")
    agg._next_round = 0  # a coordinator that tries to replay round 0
    with pytest.raises(ProtocolError, match="reusing a round's masks"):
        net.aggregate(messages([torch.ones(3), torch.ones(3)]), LABEL, "sum")


def test_values_that_could_overflow_are_refused_before_sending() -> None:
    net, agg = make_net(2, frac_bits=24)
    limit = agg.codec.max_abs(2)
    with pytest.raises(ProtocolError, match="above the fixed-point limit"):
        net.aggregate(messages([torch.ones(3, dtype=torch.float64), torch.full((3,), 2 * limit,
                                                                               dtype=torch.float64)]), LABEL, "sum")
    with pytest.raises(ProtocolError, match="NaN or infinite"):
        net.aggregate(messages([torch.ones(3), torch.tensor([1.0, float("nan"), 0.0])]), LABEL, "sum")
    assert net.stats.bytes_total == 0  # refused before any key or share was sent
    # exactly at the limit the sum is still right (a wrap-around would be off by about 2^(64-f))
    values = [torch.full((3,), limit, dtype=torch.float64), torch.full((3,), limit, dtype=torch.float64)]
    out = net.aggregate(messages(values), LABEL, "sum")
    np.testing.assert_allclose(out.tensor("embedding").numpy(), 2 * limit, rtol=0, atol=agg.codec.error_bound(2))


def test_bad_inputs_are_refused_with_clear_errors() -> None:
    net, _ = make_net(3)
    with pytest.raises(UnsupportedError, match="at least 2 parties"):
        net.aggregate(messages([torch.ones(2)]), LABEL, "sum")
    with pytest.raises(UnsupportedError, match="'sum' or 'mean'"):
        net.aggregate(messages([torch.ones(2), torch.ones(2)]), LABEL, "max")
    with pytest.raises(ProtocolError, match="do not match"):
        net.aggregate(messages([torch.ones(2), torch.ones(3)]), LABEL, "sum")
    with pytest.raises(ProtocolError, match="floating-point"):
        net.aggregate(messages([torch.ones(2, dtype=torch.int64)] * 2), LABEL, "sum")
    with pytest.raises(UnsupportedError, match="frac_bits"):
        MaskedAggregation(frac_bits=60)


def test_check_refuses_concat_algorithms() -> None:
    agg = MaskedAggregation()
    for ok in ("sum", "mean", "subset-mean"):
        assert agg.check(AlgorithmTraits("x", aggregation=ok)) == []
    with pytest.raises(UnsupportedError, match="only delivers sums or means.*'splitnn'.*'concat'"):
        check_stack([], AlgorithmTraits("splitnn", aggregation="concat"), agg)


def test_result_does_not_depend_on_the_keys() -> None:
    """Fresh random keys every run, yet the decoded result is bit-identical: runs stay reproducible."""
    values = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    outs = [make_net(3)[0].aggregate(messages(values), LABEL, "sum").tensor("embedding") for _ in range(2)]
    assert torch.equal(outs[0], outs[1])


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


class CorruptingTransport(InProcessTransport):
    """Rewrites every masked share ``victim`` sends while ``armed`` (default: flips its last byte)."""

    def __init__(self, victim: str, corrupt=flip_last_byte) -> None:  # noqa: ANN001
        super().__init__()
        self.victim, self.corrupt, self.armed = victim, corrupt, False

    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        if self.armed and sender == self.victim and kind == MASKED_KIND:
            data = self.corrupt(data)
        super().put(sender, receiver, kind, data)


_PREFIX = struct.Struct("<4sBI")  # the wire format's b"SVFL" | version | header length


def edit_header(change):  # noqa: ANN001, ANN201
    """A corruption that decodes the JSON header, lets ``change`` edit it in place and re-frames the message."""

    def corrupt(data: bytes) -> bytes:
        magic, version, hlen = _PREFIX.unpack_from(data)
        head = json.loads(data[_PREFIX.size : _PREFIX.size + hlen])
        change(head)
        raw = json.dumps(head).encode()
        return _PREFIX.pack(magic, version, len(raw)) + raw + data[_PREFIX.size + hlen :]

    return corrupt


MALFORMED_SHARES = {
    "truncated": lambda data: data[:-8],
    "not-a-message": lambda data: b"\x00" * len(data),
    "meta-is-a-list": edit_header(lambda h: h.update(meta=[h["meta"]])),
    "tensors-is-a-number": edit_header(lambda h: h.update(tensors=5)),  # once a TypeError inside decode
    "float64-payload": edit_header(lambda h: h["tensors"][0].__setitem__(1, "float64")),  # same bytes, other dtype
    "future-round": edit_header(lambda h: h["meta"].update(round=h["meta"]["round"] + 100)),
    "other-parties": edit_header(lambda h: h["meta"].update(parties=h["meta"]["parties"][:2])),
}


@pytest.mark.parametrize("fault", sorted(MALFORMED_SHARES))
def test_a_malformed_share_counts_as_a_drop_and_the_round_is_retried(fault: str) -> None:
    transport = CorruptingTransport("f1", MALFORMED_SHARES[fault])
    agg = MaskedAggregation()
    net = Network({LABEL: Role.LABEL, **{p: Role.FEATURE for p in feature_names(3)}}, transport=transport,
                  aggregation=agg)
    gen = torch.Generator().manual_seed(2)
    values = [torch.randn(4, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    net.aggregate(messages(values), LABEL, "sum")  # keys agreed; round 0 clean
    transport.armed = True
    out = net.aggregate(messages(values, step=1), LABEL, "sum")
    np.testing.assert_allclose(out.tensor("embedding").numpy(), values[0].numpy() + values[2].numpy(), rtol=0,
                               atol=survivors_sum_tolerance(agg, 2))
    assert out.meta["dropped"] == ["f1"] and out.meta["round"] == 2
    assert agg.dropped == [{"step": 1, "round": 1, "party": "f1", "phase": "masked"}]
    assert transport.pending() == 0


def test_runs_under_the_secure_channel_and_a_tampered_share_is_retried_without_its_sender() -> None:
    from protocols.channel import ChannelCredentials, IdentityKey, PinnedKeys, SecureChannelLayer

    names = [LABEL, *feature_names(3)]
    ids = {p: IdentityKey.generate() for p in names}
    pins = PinnedKeys({p: k.public_key for p, k in ids.items()})
    layer = SecureChannelLayer({p: ChannelCredentials(ids[p], pins) for p in names})
    transport = CorruptingTransport("f1")
    net = Network({LABEL: Role.LABEL, **{p: Role.FEATURE for p in feature_names(3)}}, transport=transport,
                  layers=[layer], aggregation=MaskedAggregation())
    layer.establish(net)
    values = [torch.randn(4, 4, dtype=torch.float64) for _ in range(3)]
    out = net.aggregate(messages(values), LABEL, "sum")
    torch.testing.assert_close(out.tensor("embedding"), sum(values), atol=3 * 2**-25, rtol=0)
    assert layer.opened == 3 * 2 + 3  # sealed key exchange (6) and masked shares (3)
    transport.armed = True
    out = net.aggregate(messages(values), LABEL, "sum")
    assert layer.rejected == 1 and transport.pending() == 0  # the channel refused the share: f1 dropped
    assert out.meta["dropped"] == ["f1"] and [d["party"] for d in net.aggregation.dropped] == ["f1"]
    torch.testing.assert_close(out.tensor("embedding"), values[0] + values[2], atol=3 * 2**-25, rtol=0)
