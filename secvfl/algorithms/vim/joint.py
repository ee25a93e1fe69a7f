"""VIMADMM-J (Algorithm 3 of the paper): ADMM without model splitting; each party holds its own head ``W_k``.

A round on batch B::

    party k  --logits o^k_B = h^k_B W_k (B x d_c), through the aggregation----->  label party gets sum_k o^k_B only
             label party: z_B (eq. 16), lambda_B (eq. 17)
    label    --dual {dual: lambda_B, residual: z_B - sum_k o^k_B} (2 x B x d_c)-->  every party (the same values)
             party k: s^k = residual + o^k (eq. 18); --vim-local-steps steps, each one SGD step on W_k (eq. 19)
             then one on its bottom model (eq. 20)

The label party never needs an individual party's logits (``s^k = (z - sum_i o^i) + o^k``), so the sum can come from a
secure aggregation: under ``--he ckks`` or ``--secagg mask`` it sees only the sum.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from secvfl.algorithms import ALGORITHMS
from secvfl.algorithms.base import LABEL_PARTY
from secvfl.algorithms.vim.base import ADMM_EXACT_LOGITS, ADMM_NEEDS_FEEDBACK, VIMAlgorithm, party_sgd
from secvfl.algorithms.vim.handles import ADMMFeatureHandle, ADMMLabelHandle
from secvfl.algorithms.vim.model import BOTTOM, HEAD, local_model
from secvfl.algorithms.vim.parties import DUAL_KIND, ADMMFeatureParty, ADMMLabelParty
from secvfl.handles import FeatureHandle, LabelHandle
from secvfl.transport.layers import AlgorithmTraits

__all__ = ["VIMADMMJoint"]


@ALGORITHMS.register("vimadmm-j")
class VIMADMMJoint(VIMAlgorithm):
    name = "vimadmm-j"
    aggregated = True
    traits = AlgorithmTraits("vimadmm-j", "sum", forward_kinds=("logits",), backward_kinds=(DUAL_KIND,),
                             gradient_based=False, needs_error_feedback=ADMM_NEEDS_FEEDBACK,
                             exact_outputs=ADMM_EXACT_LOGITS)

    def make_party(self, name: str, bottom: nn.Module, blocks: dict[str, np.ndarray],
                   observed: dict[str, np.ndarray]) -> FeatureHandle:
        ctx, o = self.ctx, self.options
        model = local_model(bottom, self.d_f, self.d_c).to(device=ctx.device, dtype=ctx.dtype)
        party = ADMMFeatureParty(name, blocks, model,
                                 party_sgd(model[BOTTOM].parameters(), o, self.lr, self.beta, ctx.device),
                                 head_optimizer=party_sgd(model[HEAD].parameters(), o, self.lr, self.beta, ctx.device),
                                 rho=o.rho_for(self.name), local_steps=o.vim_local_steps,
                                 prox=o.prox_for(self.name, self.ctx.partition.n_blocks), joint=True, algo=self.name,
                                 device=ctx.device, dtype=ctx.dtype, observed=observed)
        return ADMMFeatureHandle(party, self.net)

    def make_label(self, labels: dict[str, np.ndarray], n_classes: int) -> LabelHandle:
        o = self.options
        party = ADMMLabelParty(LABEL_PARTY, labels, nn.Identity(), None, n_classes, outputs=self.d_c,
                               rho=o.rho_for(self.name), tol=o.vim_z_tol, algo=self.name, device=self.ctx.device,
                               dtype=self.ctx.dtype, input_kind="logits")
        return ADMMLabelHandle(party, self.net)

    def round(self, ids: np.ndarray, present: list[str]) -> float:
        loss = self.label_handle.admm_step(self.step, ids, present)
        for h in self.feature_handles:
            if h.name in present:  # a party a secure aggregation left out of the round's sum gets nothing for it
                h.local_update(sender=LABEL_PARTY)
        return loss

    def party_importance(self) -> dict[str, float]:
        return {h.name: h.head_norm() for h in self.feature_handles}
