"""Heads the label party runs on what the feature parties send.

- :class:`ConcatHead` (Standard VFL / split NN): concatenates the embeddings, then an MLP.
- :class:`MeanHead` (VAFL-style): an MLP on the mean of the embeddings (all of the same width).
- :class:`SumHead` (FDML-style): the bottom models output logits; the head adds them (plus a bias).
Each takes either a list of per-party tensors or one already-aggregated tensor (sum/mean delivered by an
aggregation protocol), so encrypted or masked aggregation needs no change here.
"""

from __future__ import annotations

import torch
from torch import nn

from secvfl.models.bottoms import MLP

__all__ = ["ConcatHead", "MeanHead", "SumHead", "output_dim"]


def output_dim(n_classes: int) -> int:
    """Binary tasks use one logit (BCE); multi-class tasks one logit per class (softmax CE)."""
    return 1 if n_classes == 2 else n_classes


class ConcatHead(nn.Module):
    def __init__(self, in_dims: list[int], hidden: list[int], n_out: int) -> None:
        super().__init__()
        self.mlp = MLP(sum(in_dims), hidden, n_out)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.mlp(torch.cat(inputs, dim=1))


class MeanHead(nn.Module):
    def __init__(self, dim: int, hidden: list[int], n_out: int) -> None:
        super().__init__()
        self.mlp = MLP(dim, hidden, n_out)

    def forward(self, inputs: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        if isinstance(inputs, torch.Tensor):
            return self.mlp(inputs)
        return self.mlp(torch.stack(inputs).mean(dim=0))


class SumHead(nn.Module):
    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, inputs: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        if isinstance(inputs, torch.Tensor):
            return inputs + self.bias
        return torch.stack(inputs).sum(dim=0) + self.bias
