"""What CKKS and masking share through protocols.base.SecureSumAggregation: the algorithms they serve, and the
refusals of a round's input before anything is encrypted, masked or sent."""

from __future__ import annotations

import math

import pytest
import torch

from protocols.base import SecureSumAggregation
from protocols.ckks import CKKSAggregation
from protocols.secagg import MaskedAggregation
from secvfl.errors import ProtocolError, UnsupportedError
from secvfl.messages import Message
from secvfl.transport.layers import AlgorithmTraits, Role
from secvfl.transport.network import Network

LABEL = "label"
FEATURES = ["p0", "p1", "p2"]

# aggregation factory, how its refusals name it, the flag that switches it on
PROTOCOLS = {
    "ckks": (lambda: CKKSAggregation("compact"), "CKKS aggregation", "--he ckks"),
    "mask": (lambda: MaskedAggregation(), "masked aggregation", "--secagg mask"),
}


def network(protocol: str) -> tuple[Network, SecureSumAggregation]:
    aggregation = PROTOCOLS[protocol][0]()
    roles = {LABEL: Role.LABEL, "agg": Role.AGGREGATOR, **{p: Role.FEATURE for p in FEATURES}}
    return Network(roles, aggregation=aggregation), aggregation


def embedding(sender: str, x: torch.Tensor, kind: str = "embedding", name: str = "embedding") -> Message:
    return Message(kind, sender, LABEL, 0, {name: x})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_serves_summing_algorithms_and_refuses_the_others_with_its_flag(protocol: str) -> None:
    _, aggregation = network(protocol)
    for ok in ("sum", "mean", "subset-mean"):
        assert aggregation.check(AlgorithmTraits("x", aggregation=ok)) == []
    broadcast = aggregation.check(AlgorithmTraits("eg", aggregation="broadcast"))
    assert len(broadcast) == 1 and f"so {PROTOCOLS[protocol][2]} would protect nothing" in broadcast[0]
    for other in ("concat", "none"):
        (reason,) = aggregation.check(AlgorithmTraits("splitnn", aggregation=other))
        assert "'splitnn'" in reason and "protect nothing" not in reason


BAD_ROUNDS = {
    # name: (messages, op, error type, what the refusal says after the protocol's name, or None: no name)
    "op": (lambda: [embedding(p, torch.ones(2)) for p in FEATURES[:2]], "max", UnsupportedError,
           "aggregation op must be 'sum' or 'mean', got 'max'"),
    "one party": (lambda: [embedding("p0", torch.ones(2))], "sum", UnsupportedError,
                  "{subject} needs at least 2 parties (got ['p0'])"),
    "no party": (lambda: [], "sum", UnsupportedError, "{subject} needs at least 2 parties (got [])"),
    "one party twice": (lambda: [embedding("p0", torch.ones(2))] * 2, "mean", ProtocolError,
                        "{subject} got two messages from one party: ['p0', 'p0']"),
    "two kinds": (lambda: [embedding("p0", torch.ones(2)), embedding("p1", torch.ones(2), kind="logits")], "sum",
                  ProtocolError, "{subject} mixes message kinds 'embedding' and 'logits'"),
    "two shapes": (lambda: [embedding("p0", torch.ones(2)), embedding("p1", torch.ones(3))], "sum", ProtocolError,
                   "p1's embedding tensors"),
    "two names": (lambda: [embedding("p0", torch.ones(2)), embedding("p1", torch.ones(2), name="other")], "sum",
                  ProtocolError, "every party must send the same names, shapes and dtypes"),
    "two dtypes": (lambda: [embedding("p0", torch.ones(2)), embedding("p1", torch.ones(2, dtype=torch.float64))],
                   "sum", ProtocolError, "do not match p0's"),
}


@pytest.mark.parametrize("case", BAD_ROUNDS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_round_that_cannot_be_summed_is_refused_before_anything_is_sent(protocol: str, case: str) -> None:
    net, _ = network(protocol)
    make, op, error, needle = BAD_ROUNDS[case]
    with pytest.raises(error) as info:
        net.aggregate(make(), LABEL, op)
    assert needle.format(subject=PROTOCOLS[protocol][1]) in str(info.value)
    assert net.stats.bytes_total == 0 and net.transport.pending() == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e30])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_values_a_sum_cannot_carry_are_refused_before_any_share_leaves_a_party(protocol: str, bad: float) -> None:
    net, _ = network(protocol)
    messages = [embedding("p0", torch.ones(4)), embedding("p1", torch.tensor([0.0, bad, 1.0, 2.0]))]
    with pytest.raises(ProtocolError, match="NaN or infinite" if not math.isfinite(bad) else "magnitude 1e\\+30"):
        net.aggregate(messages, LABEL, "sum")
    assert net.stats.messages_by_kind.get("ciphertext", 0) == 0 and net.stats.messages_by_kind.get("masked", 0) == 0
    # The same round with finite values in range goes through and sums exactly what was sent.
    good = [embedding("p0", torch.ones(4)), embedding("p1", torch.tensor([0.0, 3.0, 1.0, 2.0]))]
    out = net.aggregate(good, LABEL, "sum").tensor("embedding").double()
    assert out.tolist() == pytest.approx([1.0, 4.0, 2.0, 3.0], abs=1e-4)
