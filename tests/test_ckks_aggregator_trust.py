"""CKKS trusts its aggregator to forward the sum (issue 14, section 5): documented, and shown to be needed.

Nothing binds the ciphertext the label party decrypts to the parties that contributed (protocols/ckks.py, "Honest
aggregator"), so an aggregator that forwards one party's ciphertext under a correct-looking report makes the label
party decrypt that party's output without any error. This test pins that behaviour next to the statement, so that
neither changes without the other: if the sum is ever bound to its contributors, the lying aggregator below is
refused and this test must be turned into a refusal test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocols.ckks import SUM_KIND, CKKSAggregation
from secvfl.messages import Message
from secvfl.transport.layers import Role
from secvfl.transport.network import Network


class _ForwardsTheFirstCiphertext(CKKSAggregation):
    """An aggregator that deviates: it forwards the first party's ciphertexts as "the sum", with the report an honest
    aggregator would send (count and parties of the whole round)."""

    def add_messages(self, aggregator: str, received, to: str) -> Message:  # noqa: ANN001 - as in the base class
        first = received[0]
        return Message(SUM_KIND, aggregator, to, first.step, blobs=dict(first.blobs),
                       meta={**dict(first.meta), "count": len(received)})


def _round(aggregation: CKKSAggregation, xs: list[torch.Tensor]) -> torch.Tensor:
    roles = {"label": Role.LABEL, "agg": Role.AGGREGATOR, **{f"p{i}": Role.FEATURE for i in range(len(xs))}}
    net = Network(roles, aggregation=aggregation)
    msgs = [Message("embedding", f"p{i}", "label", 0, {"embedding": x}) for i, x in enumerate(xs)]
    return net.aggregate(msgs, "label", "sum").tensor("embedding").double()


def test_a_lying_aggregator_makes_the_label_party_decrypt_one_partys_output_as_the_threat_model_states():
    rng = np.random.default_rng(0)
    xs = [torch.as_tensor(rng.normal(size=(8, 4))) for _ in range(3)]
    exact = sum(x.double() for x in xs)
    bound = CKKSAggregation().params.error_bound(len(xs))

    honest = _round(CKKSAggregation(), xs)
    assert float((honest - exact).abs().max()) <= bound

    lied = _round(_ForwardsTheFirstCiphertext(), xs)  # no error: the label party cannot tell
    assert float((lied - xs[0].double()).abs().max()) <= bound  # it decrypted party p0's own output
    assert float((lied - exact).abs().max()) > 100 * bound


def test_the_threat_model_states_the_honest_aggregator_assumption():
    import protocols.ckks as ckks

    doc = " ".join(ckks.__doc__.split())
    assert "Honest aggregator (assumed, not enforced)" in doc
    assert "forwards one party's ciphertext" in doc
    assert "honest aggregator" in CKKSAggregation().describe()["trust"]


@pytest.mark.parametrize("count", [1, 2])
def test_an_aggregator_reporting_a_different_count_is_refused(count: int):
    """What the report check does catch: a faulty aggregator whose own report does not match the round."""
    from secvfl.errors import ProtocolError

    class _MiscountingAggregator(CKKSAggregation):
        def add_messages(self, aggregator: str, received, to: str) -> Message:  # noqa: ANN001
            out = super().add_messages(aggregator, received, to)
            return out.replace(meta={**out.meta, "count": count})

    xs = [torch.ones(2, 3) for _ in range(3)]
    with pytest.raises(ProtocolError, match="delivered a sum over"):
        _round(_MiscountingAggregator(), xs)
