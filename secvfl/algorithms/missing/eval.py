"""Evaluation with missing feature blocks: the metrics of Valdeira et al. and the prediction combiners they need.

With missing blocks every *observed* party makes its own prediction for a test sample (LASER-VFL: ``h_(k,K_o)``;
Local: ``g_k(f_k)``; Ensemble, Combinatorial, Standard VFL, PlugVFL: one joint prediction that every observed party
receives). Predictions are therefore an (N, K) integer array, meaningful where the observation mask is True.

* Accuracy: mean over test samples of the mean over observed parties of ``1[prediction of k is right]``.
  Samples that no party observes cannot be predicted by anyone and are left out (the paper skips them too).
* F1: mean over parties of the binary F1 (``positive`` class) of party ``k``'s predictions on the test samples
  that ``k`` observes. A party that observes no test sample (it has left the federation) has no F1 and is left
  out of the mean. Zero true positives gives F1 = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from secvfl.errors import DataError

__all__ = ["MissingMetrics", "evaluate_predictions", "binary_f1", "majority_vote", "random_predictions"]


@dataclass(frozen=True)
class MissingMetrics:
    accuracy: float  # in [0, 1]
    f1: float | None  # in [0, 1]; None for multi-class labels (no positive class)
    f1_per_party: tuple[float | None, ...]
    accuracy_per_party: tuple[float | None, ...]
    n_evaluated: int  # samples with at least one observed party
    n_unpredictable: int  # samples no party observes

    def to_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "f1": self.f1,
            "f1_per_party": list(self.f1_per_party),
            "accuracy_per_party": list(self.accuracy_per_party),
            "n_evaluated": self.n_evaluated,
            "n_unpredictable": self.n_unpredictable,
        }


def binary_f1(pred: np.ndarray, y: np.ndarray, positive: int = 1) -> float:
    """F1 of the ``positive`` class; 0.0 when there is no true positive (also when it is undefined)."""
    p, t = pred == positive, y == positive
    tp = int(np.sum(p & t))
    if tp == 0:
        return 0.0
    fp, fn = int(np.sum(p & ~t)), int(np.sum(~p & t))
    return 2 * tp / (2 * tp + fp + fn)


def _check(predictions: np.ndarray, y: np.ndarray, observed: np.ndarray) -> None:
    if observed.ndim != 2 or observed.dtype != bool:
        raise DataError(f"the observation mask must be a boolean (N, K) array, got {observed.dtype} {observed.shape}")
    if predictions.shape != observed.shape:
        raise DataError(f"predictions {predictions.shape} must have the mask's shape {observed.shape} (one column per party)")
    if y.shape != (observed.shape[0],):
        raise DataError(f"labels {y.shape} must have one entry per sample ({observed.shape[0]})")


def evaluate_predictions(
    predictions: np.ndarray, y: np.ndarray, observed: np.ndarray, *, n_classes: int, positive: int = 1
) -> MissingMetrics:
    """Paper metrics from per-party predictions (N, K), labels (N,) and the test observation mask (N, K)."""
    predictions, y, observed = np.asarray(predictions), np.asarray(y), np.asarray(observed)
    _check(predictions, y, observed)
    n_obs = observed.sum(axis=1)
    usable = n_obs > 0
    correct = (predictions == y[:, None]) & observed
    per_sample = correct.sum(axis=1)[usable] / n_obs[usable]
    accuracy = float(per_sample.mean()) if usable.any() else float("nan")
    acc_party: list[float | None] = []
    f1_party: list[float | None] = []
    for k in range(observed.shape[1]):
        rows = observed[:, k]
        if not rows.any():
            acc_party.append(None)
            f1_party.append(None)
            continue
        acc_party.append(float(np.mean(predictions[rows, k] == y[rows])))
        f1_party.append(binary_f1(predictions[rows, k], y[rows], positive) if n_classes == 2 else None)
    scored = [f for f in f1_party if f is not None]
    f1 = float(np.mean(scored)) if (n_classes == 2 and scored) else None
    return MissingMetrics(
        accuracy=accuracy,
        f1=f1,
        f1_per_party=tuple(f1_party),
        accuracy_per_party=tuple(acc_party),
        n_evaluated=int(usable.sum()),
        n_unpredictable=int((~usable).sum()),
    )


def majority_vote(
    votes: np.ndarray, observed: np.ndarray, n_classes: int, rng: np.random.Generator
) -> np.ndarray:
    """Per-sample majority over observed parties' votes (N, K); ties broken uniformly at random.

    Returns (N,) labels; -1 for samples no party observes. Ties are broken by adding a random tie-breaker below
    one vote to each class count, which picks uniformly among the tied classes.
    """
    votes, observed = np.asarray(votes), np.asarray(observed)
    if votes.shape != observed.shape:
        raise DataError(f"votes {votes.shape} must have the mask's shape {observed.shape}")
    n = votes.shape[0]
    counts = np.zeros((n, n_classes), dtype=np.float64)
    rows, cols = np.nonzero(observed)
    np.add.at(counts, (rows, votes[rows, cols]), 1.0)
    # Counts are integers, so a tie-breaker in [0, 0.5) never overturns a strict majority.
    winner = np.argmax(counts + 0.5 * rng.random(counts.shape), axis=1)
    winner[~observed.any(axis=1)] = -1
    return winner


def random_predictions(n: int, n_classes: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform random labels: what a predictor that cannot run (a needed block is missing) outputs."""
    return rng.integers(0, n_classes, size=n)
