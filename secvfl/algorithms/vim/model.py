"""VIM's models: one linear head ``W_k`` (``d_f x d_c``) per feature party and one bias, the prediction being
``sum_k h^k W_k + b``. VIMSGD and VIMADMM keep the heads at the label party (:class:`PartyHeads`); VIMADMM-J keeps
each party's head at that party, after its bottom model (:func:`local_model`)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PartyHeads", "local_model", "BOTTOM", "HEAD"]

# positions in the sequential model of a VIMADMM-J party (its bottom model, then its own linear head)
BOTTOM, HEAD = 0, 1


class PartyHeads(nn.Module):
    """``weights[k]`` is party k's head ``W_k`` (``d_f x d_c``); ``bias`` is shared (one per output)."""

    def __init__(self, parties: int, d_f: int, d_c: int) -> None:
        super().__init__()
        bound = 1.0 / d_f**0.5  # nn.Linear's initialisation of a d_f -> d_c layer
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.empty(d_f, d_c).uniform_(-bound, bound)) for _ in range(parties)])
        self.bias = nn.Parameter(torch.zeros(d_c))

    def party_logits(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``h^k W_k`` for every party (no bias)."""
        return [h @ w for h, w in zip(inputs, self.weights, strict=True)]

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(self.party_logits(inputs)).sum(dim=0) + self.bias

    def norms(self) -> list[float]:
        """``||W_k||_F`` per party: the paper's party importance."""
        return [float(torch.linalg.matrix_norm(w.detach())) for w in self.weights]


def local_model(bottom: nn.Module, d_f: int, d_c: int) -> nn.Sequential:
    """A VIMADMM-J party's model: its bottom model and its own head ``W_k`` (a linear layer; its bias is the party's
    share of the prediction's bias)."""
    return nn.Sequential(bottom, nn.Linear(d_f, d_c))
