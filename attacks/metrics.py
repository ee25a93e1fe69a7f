"""Metrics for attacks: ROC AUC per batch, matched clustering accuracy, reconstruction error, and DCS."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import roc_auc_score

from secvfl.errors import DataError

__all__ = [
    "roc_auc",
    "AucSummary",
    "per_batch_auc",
    "accuracy",
    "majority_rate",
    "best_label_matching",
    "feature_mse",
    "random_guess_mse",
    "dcs",
    "randomized_response_ceiling",
]


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC of ``scores`` for binary ``labels`` (1 = positive); NaN when only one class is present."""
    scores, labels = np.asarray(scores, dtype=np.float64).reshape(-1), np.asarray(labels).reshape(-1)
    if scores.shape != labels.shape:
        raise DataError(f"{scores.shape[0]} scores for {labels.shape[0]} labels")
    classes = np.unique(labels)
    if not np.isin(classes, (0, 1)).all():
        raise DataError(f"ROC AUC needs binary labels 0/1, got classes {classes.tolist()}")
    if len(classes) < 2:
        return float("nan")
    return float(roc_auc_score(labels, scores))


@dataclass
class AucSummary:
    """Per-batch AUCs and their summary (Li et al. 2022 report the mean and a high quantile of |AUC - 0.5|)."""

    aucs: list[float] = field(default_factory=list)
    skipped: int = 0  # batches with a single class among the scored rows (AUC undefined)

    @property
    def mean(self) -> float:
        return float(np.mean(self.aucs)) if self.aucs else float("nan")

    @property
    def p95_abs_deviation(self) -> float:
        return float(np.percentile(np.abs(np.asarray(self.aucs) - 0.5), 95)) if self.aucs else float("nan")

    def as_dict(self) -> dict:
        return {
            "mean_auc": self.mean,
            "p95_abs_auc_minus_half": self.p95_abs_deviation,
            "min_auc": float(np.min(self.aucs)) if self.aucs else None,
            "max_auc": float(np.max(self.aucs)) if self.aucs else None,
            "batches": len(self.aucs),
            "batches_skipped_single_class": self.skipped,
        }


def per_batch_auc(scores: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> AucSummary:
    """AUC of each batch's scores against that batch's labels; single-class batches are counted as skipped."""
    if len(scores) != len(labels):
        raise DataError(f"{len(scores)} score batches for {len(labels)} label batches")
    out = AucSummary()
    for s, y in zip(scores, labels, strict=True):
        auc = roc_auc(s, y)
        if math.isnan(auc):
            out.skipped += 1
        else:
            out.aucs.append(auc)
    return out


def accuracy(predicted: np.ndarray, labels: np.ndarray) -> float:
    predicted, labels = np.asarray(predicted).reshape(-1), np.asarray(labels).reshape(-1)
    if predicted.shape != labels.shape:
        raise DataError(f"{predicted.shape[0]} predictions for {labels.shape[0]} labels")
    if predicted.size == 0:
        raise DataError("no rows to score")
    return float(np.mean(predicted == labels))


def majority_rate(labels: np.ndarray) -> float:
    """Accuracy of always guessing the most frequent class: the chance level for label-inference accuracy."""
    labels = np.asarray(labels).reshape(-1)
    if labels.size == 0:
        raise DataError("no labels")
    return float(np.bincount(labels.astype(np.int64)).max() / labels.size)


def best_label_matching(clusters: np.ndarray, labels: np.ndarray, n_clusters: int, n_classes: int,
                        prior: np.ndarray | None = None) -> np.ndarray:
    """Cluster -> class map that agrees with the most known labels (Hungarian method).

    ``clusters`` and ``labels`` are the cluster index and the known class of the labelled rows. ``prior`` (shape
    ``(n_clusters, n_classes)``, optional) is added to the agreement counts, e.g. a small similarity bonus that breaks
    ties when few labels are known. Returns ``mapping`` with ``mapping[cluster] = class``; when there are more
    clusters than classes, unmatched clusters get their best-agreeing class.
    """
    clusters, labels = np.asarray(clusters, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    score = np.zeros((n_clusters, n_classes))
    np.add.at(score, (clusters, labels), 1.0)
    if prior is not None:
        score = score + prior
    rows, cols = linear_sum_assignment(score, maximize=True)
    mapping = score.argmax(axis=1)
    mapping[rows] = cols
    return mapping


def feature_mse(reconstructed: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Mean squared error per feature (column), both in the same [0, 1] scaling."""
    reconstructed, truth = np.asarray(reconstructed, np.float64), np.asarray(truth, np.float64)
    if reconstructed.shape != truth.shape:
        raise DataError(f"reconstruction has shape {reconstructed.shape}, truth {truth.shape}")
    return ((reconstructed - truth) ** 2).mean(axis=0)


def random_guess_mse(truth: np.ndarray) -> np.ndarray:
    """Expected per-feature MSE of guessing each value uniformly at random in [0, 1].

    E[(U - x)^2] = x^2 - x + 1/3 for U ~ Uniform(0, 1); exact, so the baseline carries no sampling noise.
    """
    truth = np.asarray(truth, np.float64)
    return (truth**2 - truth + 1.0 / 3.0).mean(axis=0)


def dcs(ap: float, mp: float, *, ap_star: float, mp_star: float, beta: float = 0.5) -> float:
    """Defence capability score (VFLAIR, Zou et al. ICLR 2024), with one-sided distances.

    DCS = 1 / (1 + sqrt((1 - beta) * d_AP^2 + beta * d_MP^2)) where d_AP = max(0, AP - AP*) is how far the attack
    gets above the chance level AP* and d_MP = max(0, MP* - MP) is the main-task performance lost against the
    undefended run MP*. An attack below chance or a main task above MP* costs nothing. 1 is a perfect defence.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    values = (ap, mp, ap_star, mp_star)
    if not all(math.isfinite(float(v)) for v in values):
        raise DataError(f"DCS needs finite AP, MP, AP*, MP*; got {values}")
    d_ap = max(0.0, float(ap) - float(ap_star))
    d_mp = max(0.0, float(mp_star) - float(mp))
    return 1.0 / (1.0 + math.sqrt((1.0 - beta) * d_ap**2 + beta * d_mp**2))


def randomized_response_ceiling(epsilon: float, n_classes: int = 2) -> float:
    """Probability that epsilon-randomized response reports the true label: e^eps / (e^eps + K - 1).

    Gradients computed on randomized labels reveal those labels, so an attack's accuracy (and, for K = 2, its ROC
    AUC: (TPR + TNR) / 2) cannot be pushed below this by the mechanism itself.
    """
    if epsilon < 0 or n_classes < 2:
        raise ValueError(f"need epsilon >= 0 and n_classes >= 2, got {epsilon}, {n_classes}")
    e = math.exp(epsilon)
    return e / (e + n_classes - 1)
