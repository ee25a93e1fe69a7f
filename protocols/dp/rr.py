"""Label DP by randomized response: each training label is randomised once, before training; the rest is
post-processing.

Threat model: anyone who sees anything derived from the training labels (feature parties, whoever receives the model)
learns about any one sample's true label no more than ``epsilon``-DP allows (pure DP, delta = 0) under the
neighbouring relation "one sample's label replaced". Each label is used once, so the guarantee is ``epsilon`` for
every sample by parallel composition; the features are not protected.

``K``-ary randomized response keeps the true label with probability ``e^eps / (e^eps + K - 1)`` and otherwise reports
each of the ``K - 1`` other labels with probability ``1 / (e^eps + K - 1)``; every output probability ratio between
two inputs is at most ``e^eps``.

Randomized response with a prior (Ghazi, Golowich, Kumar, Manurangsi & Zhang, "Deep Learning with Label Differential
Privacy", NeurIPS 2021, Alg. 2 ``RRWithPrior``): given a prior ``p`` over classes that does *not* depend on the sample's
own label (e.g. a model trained in an earlier stage on *other* samples' randomised labels), restrict the output to
the top-``k`` classes of the prior, ``k`` chosen to maximise ``P(output = true label) = sum_{top k} p * e^eps /
(e^eps + k - 1)``; randomised response over that set when the true label is in it, a uniform member otherwise. Output
probabilities are in ``{e^eps / (e^eps + k - 1), 1 / (e^eps + k - 1), 1 / k}``, whose ratios are <= ``e^eps``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from protocols.dp.rng import NoiseSource
from secvfl.errors import ConfigError, DataError

__all__ = [
    "rr_keep_probability",
    "rr_other_probability",
    "rr_transition_matrix",
    "randomized_response",
    "rr_with_prior_set_sizes",
    "rr_with_prior",
    "rr_with_prior_probabilities",
]


def _check_eps(epsilon: float) -> None:
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ConfigError(f"randomized response needs a finite epsilon > 0, got {epsilon}")


def class_indices(labels: np.ndarray | torch.Tensor, n_classes: int, what: str = "randomized response") -> np.ndarray:
    """``labels`` as an int64 array of class indices in [0, n_classes), checked for the mechanism ``what``."""
    y = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if y.ndim != 1:
        raise DataError(f"{what} needs a 1-D array of class indices, got shape {y.shape}")
    if n_classes < 2:
        raise ConfigError(f"{what} needs at least 2 classes, got {n_classes}")
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= n_classes):
        raise DataError(f"labels must be integers in [0, {n_classes}) for {what}")
    return y.astype(np.int64)


def rr_keep_probability(epsilon: float, n_classes: int) -> float:
    """Probability that ``K``-ary randomized response reports the true label."""
    _check_eps(epsilon)
    # e^eps / (e^eps + K - 1), written to stay finite for large epsilon
    return 1.0 / (1.0 + (n_classes - 1) * math.exp(-epsilon))


def rr_other_probability(epsilon: float, n_classes: int) -> float:
    """Probability of reporting one particular wrong label, ``1 / (e^eps + K - 1)`` (computed without cancellation)."""
    _check_eps(epsilon)
    return math.exp(-epsilon) / (1.0 + (n_classes - 1) * math.exp(-epsilon))


def rr_transition_matrix(epsilon: float, n_classes: int) -> np.ndarray:
    """``T[i, j] = P(report j | true label i)``; rows sum to 1 (for loss correction on randomised labels)."""
    keep = rr_keep_probability(epsilon, n_classes)
    other = rr_other_probability(epsilon, n_classes)
    t = np.full((n_classes, n_classes), other)
    np.fill_diagonal(t, keep)
    return t


def randomized_response(labels: np.ndarray | torch.Tensor, n_classes: int, epsilon: float, rng: NoiseSource) -> np.ndarray:
    """``K``-ary randomized response on each label independently (``epsilon``-label-DP per sample)."""
    y = class_indices(labels, n_classes)
    # Compare against the (small) flip probability, not 1 - keep: no cancellation for large epsilon.
    flip = (n_classes - 1) * rr_other_probability(epsilon, n_classes)
    u = rng.uniform(y.size)
    other = rng.integers(n_classes - 1, y.size)  # uniform over the K - 1 other labels ...
    other = other + (other >= y)  # ... skipping the true one
    return np.where(u < flip, other, y).astype(np.int64)


def rr_with_prior_set_sizes(priors: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: the prior's classes sorted by decreasing probability and the chosen set size ``k*``."""
    _check_eps(epsilon)
    p = np.asarray(priors, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] < 2:
        raise DataError(f"priors must have shape (samples, classes >= 2), got {p.shape}")
    if np.any(p < 0) or not np.allclose(p.sum(1), 1.0, atol=1e-6):
        raise DataError("each prior must be a probability vector (non-negative, summing to 1)")
    order = np.argsort(-p, axis=1, kind="stable")
    cum = np.cumsum(np.take_along_axis(p, order, axis=1), axis=1)
    k = np.arange(1, p.shape[1] + 1, dtype=np.float64)
    gain = cum / (1.0 + (k - 1.0) * math.exp(-epsilon))  # sum_{top k} p * e^eps / (e^eps + k - 1)
    return order, np.argmax(gain, axis=1) + 1


def rr_with_prior(
    labels: np.ndarray | torch.Tensor, priors: np.ndarray, epsilon: float, rng: NoiseSource
) -> np.ndarray:
    """RRWithPrior (Ghazi et al. 2021). ``priors[i]`` must not depend on sample ``i``'s own label."""
    p = np.asarray(priors, dtype=np.float64)
    y = class_indices(labels, p.shape[1] if p.ndim == 2 else 0)
    if p.shape[0] != y.size:
        raise DataError(f"{y.size} labels but {p.shape[0]} priors")
    order, k = rr_with_prior_set_sizes(p, epsilon)
    rank_of_y = np.argmax(order == y[:, None], axis=1)  # position of the true label in the sorted prior
    in_set = rank_of_y < k
    flip = (k - 1.0) * math.exp(-epsilon) / (1.0 + (k - 1.0) * math.exp(-epsilon))
    u = rng.uniform(y.size)
    # In the set, not kept: uniform over the k - 1 other members; not in the set: uniform over all k members.
    draw = rng.integers(np.where(in_set, np.maximum(k - 1, 1), k))
    rank = np.where(in_set, draw + (draw >= rank_of_y), draw)
    rank = np.where(in_set & ((u >= flip) | (k == 1)), rank_of_y, rank)
    return np.take_along_axis(order, rank[:, None], axis=1)[:, 0].astype(np.int64)


def rr_with_prior_probabilities(prior: np.ndarray, epsilon: float) -> np.ndarray:
    """Exact output distribution of RRWithPrior for one prior: ``P[y, o] = P(report o | true label y)``."""
    p = np.asarray(prior, dtype=np.float64).reshape(1, -1)
    order, ks = rr_with_prior_set_sizes(p, epsilon)
    k, top = int(ks[0]), order[0, : int(ks[0])]
    n = p.shape[1]
    keep = 1.0 / (1.0 + (k - 1.0) * math.exp(-epsilon))
    other = math.exp(-epsilon) / (1.0 + (k - 1.0) * math.exp(-epsilon))
    out = np.zeros((n, n))
    for y in range(n):
        if y in top:
            out[y, top] = other
            out[y, y] = keep
        else:
            out[y, top] = 1.0 / k
    return out
