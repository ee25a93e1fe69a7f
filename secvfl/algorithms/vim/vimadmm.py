"""VIMADMM (Algorithm 2 of the paper): ADMM with model splitting; the label party holds the heads ``W_k``.

A round on batch B (every arrow is a message through the network)::

    party k  --embedding h^k_B (B x d_f)-------------------------->  label party
             label party: z_B (eq. 6), lambda_B (eq. 7), one SGD step of every W_k and b (eq. 8), s^k_B (eq. 9;
             --vim-residual round-start: with the heads W^t)
    label    --dual {dual: lambda_B, residual: s^k_B} (2 x B x d_c)->  party k
    label    --head {weight: W_k} (d_f x d_c)---------------------->  party k
             party k: --vim-local-steps SGD steps on eq. 10 on the same batch

so per round and party ``B d_f 4`` bytes up and ``2 B d_c 4 + d_f d_c 4`` down (float32), plus one header per message.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from secvfl.algorithms import ALGORITHMS
from secvfl.algorithms.base import LABEL_PARTY
from secvfl.algorithms.vim.base import (
    ADMM_NEEDS_FEEDBACK,
    INDIVIDUAL_EMBEDDINGS,
    VIMAlgorithm,
    label_sgd,
    party_sgd,
)
from secvfl.algorithms.vim.handles import ADMMFeatureHandle, ADMMLabelHandle
from secvfl.algorithms.vim.model import PartyHeads
from secvfl.algorithms.vim.parties import DUAL_KIND, HEAD_KIND, ADMMFeatureParty, ADMMLabelParty
from secvfl.handles import FeatureHandle, LabelHandle
from secvfl.transport.layers import AlgorithmTraits

__all__ = ["VIMADMM"]


@ALGORITHMS.register("vimadmm")
class VIMADMM(VIMAlgorithm):
    name = "vimadmm"
    # gradient_based=False: it sends duals and residuals, no gradients, so the gradient DP mechanism has nothing to do
    traits = AlgorithmTraits("vimadmm", "concat", backward_kinds=(DUAL_KIND, HEAD_KIND), gradient_based=False,
                             individual_outputs=INDIVIDUAL_EMBEDDINGS, needs_error_feedback=ADMM_NEEDS_FEEDBACK)

    def make_party(self, name: str, bottom: nn.Module, blocks: dict[str, np.ndarray],
                   observed: dict[str, np.ndarray]) -> FeatureHandle:
        ctx, o = self.ctx, self.options
        party = ADMMFeatureParty(name, blocks, bottom,
                                 party_sgd(bottom.parameters(), o, self.lr, self.beta, ctx.device),
                                 rho=o.rho_for(self.name), local_steps=o.vim_local_steps,
                                 prox=o.prox_for(self.name, self.ctx.partition.n_blocks), joint=False, algo=self.name,
                                 device=ctx.device, dtype=ctx.dtype, observed=observed)
        return ADMMFeatureHandle(party, self.net)

    def make_label(self, labels: dict[str, np.ndarray], n_classes: int) -> LabelHandle:
        o = self.options
        heads = PartyHeads(self.ctx.partition.n_blocks, self.d_f, self.d_c).to(device=self.ctx.device,
                                                                              dtype=self.ctx.dtype)
        party = ADMMLabelParty(LABEL_PARTY, labels, heads,
                               label_sgd(heads.parameters(), o, self.lr, self.beta, self.ctx.device),
                               n_classes,
                               outputs=self.d_c, rho=o.rho_for(self.name), tol=o.vim_z_tol, algo=self.name,
                               device=self.ctx.device, dtype=self.ctx.dtype, residual=o.vim_residual)
        return ADMMLabelHandle(party, self.net)

    def round(self, ids: np.ndarray, present: list[str]) -> float:
        loss = self.label_handle.admm_step(self.step, ids, present)
        for h in self.feature_handles:
            if h.name in present:
                h.local_update(sender=LABEL_PARTY)
        return loss

    def party_importance(self) -> dict[str, float]:
        return dict(zip(self.names, self.label_handle.head_norms(), strict=True))
