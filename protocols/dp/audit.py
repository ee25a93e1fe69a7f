"""Empirical privacy audits: run a mechanism many times on two neighbouring inputs and measure how well the best
test tells them apart; the result is a statistically valid *lower bound* on epsilon that must stay below the claim.

Label-DP gradient mechanism (:func:`audit_label_gradient`)
    A canary sample's label is 0 in one world and 1 in the other. Each trial trains a small head for ``releases``
    steps with the real :class:`LabelDPRule` code path on a batch that holds only the canary, so everything released
    (the row and the head update) is the canary's. The attacker is white-box: it knows the model, the features and
    the algorithm -- everything but the label and the noise -- so from the released updates it can recompute the
    noise-free releases ``v0`` (label 0) and ``v1`` (label 1) at every step and score the transcript with the
    optimal linear statistic ``S = sum_t <o_t - v0_t, (v1_t - v0_t) / |v1_t - v0_t|>``. Under label 0, ``S`` is
    pure noise; under label 1 it is shifted by ``sum_t |v1_t - v0_t| <= releases * Delta``. The canary's features
    are scaled so that its Jacobian is always clipped, the worst case the analysis allows.

Randomized response (:func:`audit_randomized_response`)
    Many draws of RR on label 0 vs label 1; the likelihood ratio of the output "0".

Lower bound: for every threshold, one-sided Clopper-Pearson bounds (confidence ``1 - alpha`` each) give
``TPR_low`` and ``FPR_high``; ``epsilon >= log((TPR_low - delta) / FPR_high)`` (and the same with the roles of
the worlds swapped). The maximum over thresholds is reported.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from scipy.stats import beta
from torch import nn

from protocols.dp.accounting import GaussianEvent, epsilon_of
from protocols.dp.label_dp import LabelDPBackward
from protocols.dp.rng import NoiseSource, SecureNoise
from protocols.dp.rr import randomized_response

__all__ = ["epsilon_lower_bound", "audit_label_gradient", "audit_randomized_response"]


def _cp_upper(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bounds for ``k`` successes out of ``n`` (vectorised)."""
    k = np.asarray(k)
    out = np.ones(k.shape)
    m = k < n
    out[m] = beta.ppf(1 - alpha, k[m] + 1, n - k[m])
    return out


def _cp_lower(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    k = np.asarray(k)
    out = np.zeros(k.shape)
    m = k > 0
    out[m] = beta.ppf(alpha, k[m], n - k[m] + 1)
    return out


def epsilon_lower_bound(
    scores0: np.ndarray, scores1: np.ndarray, delta: float = 0.0, alpha: float = 0.05
) -> dict[str, float]:
    """Largest epsilon certified (with confidence ``1 - 2 alpha``) by threshold tests on the two score samples.

    For every threshold ``t``, the tests "world 1 if score <= t" and "world 1 if score >= t", and their mirror
    images with the worlds' roles swapped, are each scored with Clopper-Pearson bounds.
    """
    s0, s1 = np.sort(np.asarray(scores0, float)), np.sort(np.asarray(scores1, float))
    n0, n1 = len(s0), len(s1)
    t = np.unique(np.concatenate([s0, s1]))
    below1, below0 = np.searchsorted(s1, t, "right"), np.searchsorted(s0, t, "right")
    above1, above0 = n1 - np.searchsorted(s1, t, "left"), n0 - np.searchsorted(s0, t, "left")
    best = {"epsilon_lower_bound": 0.0, "threshold": float("nan"), "tpr": float("nan"), "fpr": float("nan")}
    # (true positives, their n, false positives, their n) for the four tests
    for tp, n_tp, fp, n_fp in ((below1, n1, below0, n0), (above1, n1, above0, n0),
                               (n0 - below0, n0, n1 - below1, n1), (n0 - above0, n0, n1 - above1, n1)):
        lo, hi = _cp_lower(tp, n_tp, alpha) - delta, _cp_upper(fp, n_fp, alpha)
        with np.errstate(divide="ignore", invalid="ignore"):
            eps = np.where((lo > 0) & (hi > 0), np.log(np.maximum(lo, 1e-300) / hi), 0.0)
        i = int(np.argmax(eps))
        if eps[i] > best["epsilon_lower_bound"]:
            best = {"epsilon_lower_bound": float(eps[i]), "threshold": float(t[i]), "tpr": float(tp[i] / n_tp),
                    "fpr": float(fp[i] / n_fp)}
    return best


class _AuditHead(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _flat(step: Any) -> torch.Tensor:
    return torch.cat([step.input_grads[0].reshape(-1)] + [step.head_grads[n].reshape(-1) for n in step.head_grads])


def audit_label_gradient(
    *,
    epsilon: float = 3.0,
    delta: float = 1e-5,
    releases: int = 5,
    trials: int = 1000,
    clip: str = "residual",
    clip_norm: float = 1.0,
    dim: int = 8,
    lr: float = 0.05,
    noise: NoiseSource | None = None,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict[str, Any]:
    """White-box canary audit of the label-DP gradient mechanism (see the module docstring)."""
    from protocols.dp.accounting import calibrate_noise_multiplier

    sigma = calibrate_noise_multiplier(epsilon, delta, releases)
    noise = noise or SecureNoise()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, dim, generator=g, dtype=torch.float64) * 10.0  # large features: always clipped
    scores: dict[int, list[float]] = {0: [], 1: []}
    for world in (0, 1):
        for trial in range(trials):
            torch.manual_seed(seed * 1_000_003 + trial)  # the same initial model in both worlds
            head = _AuditHead(dim).double()
            opt = torch.optim.SGD(head.parameters(), lr=lr)
            kw = {"loss": "bce", "clip_norm": clip_norm, "noise": noise, "clip": clip}
            mech = LabelDPBackward(head, noise_multiplier=sigma, **kw)
            clean = LabelDPBackward(head, noise_multiplier=0.0, **kw)
            s = 0.0
            for _ in range(releases):
                o = _flat(mech([x], torch.tensor([world])))
                # the attacker's noise-free releases for both labels (it knows the model: updates are released)
                v0, v1 = (_flat(clean([x], torch.tensor([label]))) for label in (0, 1))
                d = v1 - v0
                # in label units: y + noise, noise std sigma when the canary's contribution is at the sensitivity
                s += float(torch.dot(o - v0, d) / torch.dot(d, d))
                mech.apply(mech.rule.last)
                opt.step()
            scores[world].append(s)
    s0, s1 = np.asarray(scores[0]), np.asarray(scores[1])
    bound = epsilon_lower_bound(-s0, -s1, delta=delta, alpha=alpha)
    return {
        "mechanism": f"label DP, gradient ({mech.mode} reduction, bce)",
        "claimed_epsilon": epsilon_of(GaussianEvent(sigma, releases), delta),
        "exact_gdp_epsilon": epsilon_of(GaussianEvent(sigma, releases), delta, "gdp"),
        "delta": delta,
        "releases": releases,
        "noise_multiplier": sigma,
        "trials_per_world": trials,
        "confidence": 1 - 2 * alpha,
        # separation of the two worlds' scores in noise standard deviations: the observed GDP mu, which the
        # analysis bounds by sqrt(releases) / sigma (equality when the canary always sits at the sensitivity)
        "canary_mu": float((s1.mean() - s0.mean()) / s0.std()),
        "analysed_mu": math.sqrt(releases) / sigma,
        "score_std_world0": float(s0.std()),
        "expected_score_std": sigma * math.sqrt(releases),
        **bound,
    }


def audit_randomized_response(
    *, epsilon: float = 3.0, n_classes: int = 2, draws: int = 200_000, noise: NoiseSource | None = None,
    alpha: float = 0.05,
) -> dict[str, Any]:
    """RR on label 0 vs label 1, ``draws`` times each; the best test is "output == 0"."""
    noise = noise or SecureNoise()
    out0 = randomized_response(np.zeros(draws, np.int64), n_classes, epsilon, noise)
    out1 = randomized_response(np.ones(draws, np.int64), n_classes, epsilon, noise)
    bound = epsilon_lower_bound((out0 != 0).astype(float), (out1 != 0).astype(float), delta=0.0, alpha=alpha)
    return {"mechanism": f"randomized response, {n_classes} classes", "claimed_epsilon": epsilon, "delta": 0.0,
            "draws_per_world": draws, "confidence": 1 - 2 * alpha, **bound}
