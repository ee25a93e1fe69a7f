"""Evaluation metrics, computed by whoever owns the labels."""

from __future__ import annotations

import numpy as np
from sklearn.metrics import f1_score, roc_auc_score

__all__ = ["classification_metrics"]


def classification_metrics(y_true: np.ndarray, proba: np.ndarray) -> dict[str, float]:
    """accuracy, macro F1 and (binary tasks) ROC AUC of the positive class."""
    y_true = np.asarray(y_true)
    if len(y_true) == 0:
        return {}
    pred = proba.argmax(axis=1)
    out = {
        "accuracy": float((pred == y_true).mean()),
        "f1": float(f1_score(y_true, pred, average="macro", zero_division=0)),
    }
    if proba.shape[1] == 2:
        out["f1_positive"] = float(f1_score(y_true, pred, average="binary", zero_division=0))
        out["auc"] = float(roc_auc_score(y_true, proba[:, 1])) if len(np.unique(y_true)) == 2 else float("nan")
    return out
