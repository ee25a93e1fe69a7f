"""VIMSGD (Algorithm 1 of the paper): split learning with one linear head per party at the label party.

A round on batch B: each party sends ``h^k_B``; the label party takes one SGD step on every ``W_k`` and the bias
(eqs. 11-12) and sends each party ``dL/dh^k_B`` (eq. 13), which the party backpropagates into one SGD step with
momentum (eqs. 14-15). It is the split network of ``splitnn`` with a linear head kept per party, so it uses the
split algorithms' parties as they are, and every protocol that serves them serves it.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from secvfl.algorithms import ALGORITHMS
from secvfl.algorithms.base import LABEL_PARTY
from secvfl.algorithms.vim.base import (
    INDIVIDUAL_EMBEDDINGS,
    SGD_NEEDS_FEEDBACK,
    VIMAlgorithm,
    label_sgd,
    party_sgd,
)
from secvfl.algorithms.vim.handles import HeadsLabelHandle
from secvfl.algorithms.vim.model import PartyHeads
from secvfl.algorithms.vim.noise import NoisyFeatureHandle, NoisyFeatureParty
from secvfl.handles import FeatureHandle, LabelHandle
from secvfl.parties import LabelParty
from secvfl.transport.layers import AlgorithmTraits

__all__ = ["VIMSGD"]


@ALGORITHMS.register("vimsgd")
class VIMSGD(VIMAlgorithm):
    name = "vimsgd"
    traits = AlgorithmTraits("vimsgd", "concat", individual_outputs=INDIVIDUAL_EMBEDDINGS,
                             needs_error_feedback=SGD_NEEDS_FEEDBACK)

    def make_party(self, name: str, bottom: nn.Module, blocks: dict[str, np.ndarray],
                   observed: dict[str, np.ndarray]) -> FeatureHandle:
        ctx = self.ctx
        party = NoisyFeatureParty(name, blocks, bottom, party_sgd(bottom.parameters(), self.options, self.lr,
                                                                  self.beta, ctx.device),
                                  device=ctx.device, dtype=ctx.dtype, observed=observed)
        return NoisyFeatureHandle(party, self.net)

    def make_label(self, labels: dict[str, np.ndarray], n_classes: int) -> LabelHandle:
        heads = PartyHeads(self.ctx.partition.n_blocks, self.d_f, self.d_c).to(device=self.ctx.device,
                                                                              dtype=self.ctx.dtype)
        party = LabelParty(LABEL_PARTY, labels, heads, label_sgd(heads.parameters(), self.options, self.lr,
                                                                 self.beta, self.ctx.device),
                           n_classes, device=self.ctx.device, dtype=self.ctx.dtype)
        return HeadsLabelHandle(party, self.net)

    def round(self, ids: np.ndarray, present: list[str]) -> float:
        loss = self.label_handle.train_step(self.step, ids, present)
        for h in self.feature_handles:
            if h.name in present:
                h.backward(sender=LABEL_PARTY)
        return loss

    def party_importance(self) -> dict[str, float]:
        return dict(zip(self.names, self.label_handle.head_norms(), strict=True))
