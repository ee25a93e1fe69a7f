"""Missing feature blocks: which parties observe each sample.

A mask is a boolean array (n_samples, K): True where party k holds sample n's block. Missingness is MCAR, either
with one probability ``p_miss`` per block or with per-block probabilities (e.g. drawn from Beta(2, 2)).
"""

from __future__ import annotations

import numpy as np

from secvfl.errors import DataError

__all__ = ["draw_masks", "block_miss_probabilities", "drop_unobserved", "parse_p_miss"]


def parse_p_miss(p_miss: float | str) -> float | tuple[float, float]:
    """A probability in [0, 1), or the (A, B) of ``"beta:A,B"``; DataError naming the fix otherwise."""
    if isinstance(p_miss, bool) or not isinstance(p_miss, (str, int, float, np.floating, np.integer)):
        raise DataError(f"p_miss must be a number in [0, 1) or 'beta:A,B', got {p_miss!r}")
    if isinstance(p_miss, str) and p_miss.strip().startswith("beta:"):
        try:
            a, b = (float(v) for v in p_miss.strip()[5:].split(","))
        except ValueError:
            raise DataError(f"bad Beta spec {p_miss!r}; write beta:A,B, e.g. beta:2,2") from None
        if not (0 < a < np.inf and 0 < b < np.inf):
            raise DataError(f"Beta parameters must be positive and finite, got {a}, {b} (e.g. beta:2,2)")
        return a, b
    try:
        p = float(p_miss)
    except ValueError:
        raise DataError(f"p_miss must be a number in [0, 1) or 'beta:A,B', got {p_miss!r}") from None
    if not 0.0 <= p < 1.0:  # also refuses nan
        raise DataError(f"p_miss must be in [0, 1), got {p_miss}")
    return p


def block_miss_probabilities(k: int, p_miss: float | str, rng: np.random.Generator) -> np.ndarray:
    """Per-block missing probabilities: a number in [0, 1) for all blocks, or ``"beta:A,B"`` drawn per block."""
    spec = parse_p_miss(p_miss)
    if isinstance(spec, tuple):
        return np.minimum(rng.beta(*spec, size=k), 0.999)
    return np.full(k, spec)


def draw_masks(n: int, k: int, p_miss: float | str | np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Observed-block mask (n, k): each block missing independently with its probability."""
    probs = np.asarray(p_miss) if isinstance(p_miss, np.ndarray) else block_miss_probabilities(k, p_miss, rng)
    if probs.shape != (k,) or (probs < 0).any() or (probs >= 1).any():
        raise DataError(f"per-block missing probabilities must be {k} numbers in [0, 1), got {probs}")
    return rng.random((n, k)) >= probs


def drop_unobserved(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """Indices of samples with at least one observed block, and how many were dropped."""
    keep = np.flatnonzero(mask.any(axis=1))
    return keep, int(len(mask) - len(keep))
