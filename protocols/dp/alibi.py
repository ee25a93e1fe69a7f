"""Label DP by ALIBI (Malek, Mironov, Prasad, Shilov & Tramer, "Antipodes of Label Differential Privacy: PATE and
ALIBI", NeurIPS 2021): Laplace noise on each one-hot label, once, and training on the Bayesian posterior.

Threat model: as randomized response (:mod:`protocols.dp.rr`). Anyone who sees anything derived from the training
labels (feature parties, whoever receives the model) learns about one sample's true label no more than pure
``epsilon``-DP allows, under "one sample's label replaced". Each label is released once; the features are not
protected.

Mechanism: the label party adds independent ``Laplace(0, 2 / epsilon)`` noise to every coordinate of each training
label's one-hot vector ``e_y`` (replacing a label moves ``e_y`` by exactly 2 in L1, so this is the Laplace mechanism
with sensitivity 2: ``epsilon``-DP). It then keeps only the posterior of the label given the noisy vector ``o``,
with a uniform prior (post-processing)::

    P(y = k | o)  proportional to  exp(-||o - e_k||_1 / b) = exp(-(|o_k - 1| - |o_k|) / b) * (a factor common to all k)

and trains on that distribution as a soft label. Binary tasks use two coordinates (one-hot over the two classes).

Noise: Laplace draws come from the same AES-256-CTR generator as every other DP noise (:mod:`protocols.dp.rng`) by
inversion of its 53-bit uniforms, ``x = -b sign(u - 1/2) ln(1 - 2|u - 1/2|)``, in float64. Known deviation: the tails
are cut at ``53 ln 2 ~= 36.7`` noise scales (the most extreme uniform), so each draw differs from the exact Laplace
distribution by a total variation below ``2^-53 ~= 1.1e-16``; an auditor adds ``K`` times that per label to delta.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from protocols.dp.rng import NoiseSource
from protocols.dp.rr import class_indices
from secvfl.errors import ConfigError, DataError

__all__ = ["alibi_noise_scale", "laplace", "alibi_posterior", "alibi_soft_labels", "LAPLACE_TAIL_MASS"]

# Per-draw total variation to the exact Laplace distribution caused by the cut tails (see the module notes).
LAPLACE_TAIL_MASS = 2.0**-53


def alibi_noise_scale(epsilon: float) -> float:
    """Laplace scale ``b = 2 / epsilon``: the one-hot label has L1 sensitivity 2 under replace-one-label."""
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ConfigError(f"ALIBI needs a finite epsilon > 0, got {epsilon}")
    return 2.0 / epsilon


def laplace(rng: NoiseSource, n: int, scale: float) -> np.ndarray:
    """``n`` float64 draws of ``Laplace(0, scale)`` by inversion of the generator's uniforms."""
    if not scale > 0:
        raise ConfigError(f"Laplace scale must be > 0, got {scale}")
    centred = rng.uniform(n) - 0.5  # in (-1/2, 1/2), never 0 (the grid is offset by half a step)
    return -scale * np.sign(centred) * np.log1p(-2.0 * np.abs(centred))


def alibi_posterior(noisy: np.ndarray, epsilon: float, prior: np.ndarray | None = None) -> np.ndarray:
    """``P(y = k | o)`` for noisy one-hot vectors ``o`` (rows), Laplace scale ``2 / epsilon``; rows sum to 1."""
    o = np.asarray(noisy, dtype=np.float64)
    if o.ndim != 2 or o.shape[1] < 2:
        raise DataError(f"ALIBI needs noisy one-hot rows of shape (samples, classes >= 2), got {o.shape}")
    b = alibi_noise_scale(epsilon)
    log_like = -(np.abs(o - 1.0) - np.abs(o)) / b
    if prior is not None:
        p = np.asarray(prior, dtype=np.float64)
        if p.shape != (o.shape[1],) or np.any(p < 0) or not math.isclose(float(p.sum()), 1.0, abs_tol=1e-6):
            raise DataError(f"the ALIBI prior must be one probability vector over {o.shape[1]} classes")
        with np.errstate(divide="ignore"):
            log_like = log_like + np.log(p)
    log_like -= log_like.max(axis=1, keepdims=True)
    post = np.exp(log_like)
    return post / post.sum(axis=1, keepdims=True)


def alibi_soft_labels(
    labels: np.ndarray | torch.Tensor, n_classes: int, epsilon: float, rng: NoiseSource
) -> np.ndarray:
    """Release each label once through the Laplace mechanism and return the posteriors (samples, classes)."""
    y = class_indices(labels, n_classes, "ALIBI")
    noisy = np.eye(n_classes)[y]
    noisy += laplace(rng, noisy.size, alibi_noise_scale(epsilon)).reshape(noisy.shape)
    return alibi_posterior(noisy, epsilon)
