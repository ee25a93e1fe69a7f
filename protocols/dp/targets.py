"""Training on released labels: the label party's backward rule for the label-release mechanisms.

Randomized response with a prior (:mod:`protocols.dp.staged`) and ALIBI (:mod:`protocols.dp.alibi`) release each
training label once, before it is used. The label party then trains on what was released only: its training labels
are replaced by a ``(samples, classes)`` float tensor of *targets*, and a row of zeros marks a label that has not
been released yet (the second stage of randomized response with a prior), which takes no part in the loss.
Everything the label party sends after that is post-processing of the released values and of the features.

Two kinds of targets:
    ``soft``        a distribution over the classes (ALIBI's posterior); loss ``-sum_y t_y log p(y | x)``.
    ``likelihood``  ``t_y = P(reported label | true label y)`` for a randomised label (a public function of epsilon,
                    the reported label and, for RRWithPrior, the prior); loss ``-log sum_y t_y p(y | x)``, the
                    likelihood of the report under the model (forward correction, Patrini et al. 2017).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from secvfl.errors import ProtocolError

__all__ = ["TargetBackward", "log_probabilities"]


def log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Log class probabilities of the model's outputs: one logit (binary, sigmoid) or one per class (softmax)."""
    if logits.shape[1] == 1:
        z = logits[:, 0]
        return torch.stack([nn.functional.logsigmoid(-z), nn.functional.logsigmoid(z)], dim=1)
    return nn.functional.log_softmax(logits, dim=1)


class TargetBackward:
    """The loss on released targets (``likelihood``: forward-corrected, else soft), averaged over released rows.

    A :class:`secvfl.parties.BackwardRule`; ``labels`` are the rows of the installed targets. The DP layer refuses a
    gradient message that did not go through it (``pending_release``), like the gradient mechanism's rule.
    """

    def __init__(self, likelihood: bool = False) -> None:
        self.likelihood = likelihood
        self.pending_release = False
        self.steps = 0
        self.rows_trained = 0

    def __call__(
        self,
        head: nn.Module,
        forward: Callable[[list[torch.Tensor]], torch.Tensor],
        inputs: list[torch.Tensor],
        labels: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        rows: Any = None,
    ) -> float:
        if labels.ndim != 2 or not labels.is_floating_point():
            raise ProtocolError("label DP: the label party's training labels are not the released targets; refusing")
        logp = log_probabilities(forward(inputs))
        targets = labels.to(logp.dtype)
        if self.likelihood:
            released_rows = targets.sum(dim=1, keepdim=True) > 0
            log_lik = torch.log(torch.where(released_rows, targets, torch.ones_like(targets)))
            per_row = -torch.logsumexp(logp + log_lik, dim=1) * released_rows[:, 0]
        else:
            per_row = -(targets * logp).sum(dim=1)
        released = targets.sum(dim=1) > 0
        n = int(released.sum())
        loss = per_row.sum() / max(n, 1)  # unreleased rows contribute exact zeros (their gradient rows are zero)
        loss.backward()
        self.pending_release = True
        self.steps += 1
        self.rows_trained += n
        return float(loss.detach())

    def describe(self) -> dict[str, Any]:
        return {"steps": self.steps, "rows_trained": self.rows_trained}
