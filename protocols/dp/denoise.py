"""Post-processing of the label-DP residual releases: Bayesian soft labels.

In ``residual`` mode the label party releases, for each sample of a batch, ``r~ = r + N(0, s^2 I)`` with
``r = sigmoid(z) - y`` (BCE) or ``softmax(z) - onehot(y)`` (CE). Since ``z`` is label-independent, every release is an
observation of the label, ``o = sigmoid(z) - r~ = y + noise`` (resp. ``softmax(z) - r~ = onehot(y) + noise``), with
known Gaussian noise. Combining all of a sample's observations so far gives the posterior of its label; training on
the posterior mean (a soft label) instead of on the latest single observation uses all the information already
paid for. This is pure post-processing of released values (plus the public noise scale), so it costs no privacy.

Posterior (independent Gaussian observations, prior ``pi``):
    BCE: ``logit P(y = 1 | o_1..o_t) = logit(pi) + sum_j (2 o_j - 1) / (2 s^2)``
    CE:  ``P(y = k | o_1..o_t) = softmax_k(log pi_k + sum_j o_jk / s^2)``
The prior ``pi`` is estimated from the observations themselves (their mean is an unbiased estimate of the class
frequencies), so it is post-processing too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from secvfl.errors import ConfigError

__all__ = ["LabelPosterior"]


class LabelPosterior:
    """Per-sample sufficient statistics of the noisy label observations, and the soft labels they imply."""

    def __init__(self, n_rows: int, n_out: int, obs_std: float) -> None:
        if n_rows < 1 or n_out < 1:
            raise ConfigError(f"label posterior needs rows and outputs, got {n_rows} x {n_out}")
        if not obs_std > 0:
            raise ConfigError(f"label posterior needs a positive observation noise, got {obs_std}")
        self.n_out = n_out
        self.obs_std = float(obs_std)
        self.sums = torch.zeros(n_rows, n_out, dtype=torch.float64)  # sum of observations per sample
        self.counts = torch.zeros(n_rows, dtype=torch.float64)
        self.total = torch.zeros(n_out, dtype=torch.float64)  # sum of all observations (for the prior)
        self.n_obs = 0

    def _ids(self, ids: np.ndarray | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.sums.shape[0]):
            raise ConfigError("label posterior: row id out of range")
        return t

    def update(self, ids: np.ndarray | torch.Tensor, observations: torch.Tensor) -> None:
        """Add one noisy observation (B, n_out) for each row in ``ids`` (rows of one batch are distinct)."""
        t = self._ids(ids)
        obs = observations.detach().to(torch.float64).reshape(len(t), self.n_out)
        self.sums[t] += obs
        self.counts[t] += 1
        self.total += obs.sum(0)
        self.n_obs += len(t)

    def prior(self) -> torch.Tensor:
        if self.n_out == 1:
            p = (self.total / max(self.n_obs, 1)).clamp(0.01, 0.99)
            return p
        p = (self.total / max(self.n_obs, 1)).clamp_min(1e-3)
        return p / p.sum()

    def soft_labels(self, ids: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Posterior mean of each row's label encoding: P(y = 1) (BCE, shape (B, 1)) or P(y = k) (CE, (B, K))."""
        t = self._ids(ids)
        var = self.obs_std**2
        pi = self.prior()
        if self.n_out == 1:
            llr = (2 * self.sums[t] - self.counts[t, None]) / (2 * var)
            return torch.sigmoid(torch.log(pi / (1 - pi)) + llr)
        return torch.softmax(torch.log(pi) + self.sums[t] / var, dim=1)

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums.clone(), "counts": self.counts.clone(), "total": self.total.clone(),
                "n_obs": self.n_obs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sums = torch.as_tensor(state["sums"], dtype=torch.float64).clone()
        self.counts = torch.as_tensor(state["counts"], dtype=torch.float64).clone()
        self.total = torch.as_tensor(state["total"], dtype=torch.float64).clone()
        self.n_obs = int(state["n_obs"])
