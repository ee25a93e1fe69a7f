"""The end-of-run check of a DP run: did the model's utility collapse to chance, and what to change if it did.

Near chance means: test AUC below :data:`AUC_FLOOR` (binary tasks), or, when there is no AUC, test accuracy less than
:data:`ACCURACY_MARGIN` above the majority-class rate of the test split (what predicting one class everywhere
scores), or -- whatever the AUC -- a macro F1 less than :data:`ACCURACY_MARGIN` above what predicting the majority
class everywhere scores: a model that predicts one class for (nearly) every row is useless as a classifier even when
its scores still rank the rows a little (feature DP on credit: AUC 0.64, every test row predicted negative). A DP run
that ends there did not fail: it trained a useless model, and says so with the likely reason.
"""

from __future__ import annotations

import math

import numpy as np

from protocols.dp.config import DPPlan
from protocols.dp.rr import rr_keep_probability

__all__ = ["utility_collapse", "chance_accuracy", "chance_f1", "AUC_FLOOR", "ACCURACY_MARGIN"]

AUC_FLOOR = 0.55
ACCURACY_MARGIN = 0.05


def chance_accuracy(labels: np.ndarray) -> float:
    """Accuracy of always predicting the most frequent class of ``labels``."""
    y = np.asarray(labels)
    return float(np.bincount(y.astype(np.int64)).max() / y.size) if y.size else math.nan


def chance_f1(labels: np.ndarray) -> float:
    """Macro F1 of always predicting the most frequent class of ``labels`` (scikit-learn's macro average over the
    classes present): that class scores ``2p / (1 + p)`` (``p`` its share, precision ``p``, recall 1), every other 0."""
    y = np.asarray(labels).astype(np.int64)
    if not y.size:
        return math.nan
    counts = np.bincount(y)
    p = counts.max() / y.size
    return float(2 * p / (1 + p) / np.count_nonzero(counts))


def _reason(plan: DPPlan, n_classes: int) -> str:
    eps, n = plan.epsilon, plan.n_train
    if plan.protects == "features":
        return (f"feature DP adds Gaussian noise of {plan.noise_multiplier:.3g} times the sensitivity to every "
                f"embedding row and bottom-model gradient ({plan.releases_per_sample} releases per sample), which "
                "drowns the features")
    if plan.mechanism == "gradient":
        return (f"the gradient mechanism adds noise of {plan.noise_multiplier:.3g} times the label's sensitivity in "
                f"every step ({plan.releases_per_sample} releases per sample at epsilon {eps:.3g}), so the head and "
                f"bottom models mostly learn noise" + (" (it degrades fastest with many classes)" if n_classes > 2 else ""))
    k = max(n_classes, 2)
    keep = rr_keep_probability(eps, k)
    rows = "the stream samples seen" if plan.config.stream else f"{n} training rows"
    return (f"at epsilon {eps:.3g} with {k} classes a released label is the true one with probability about "
            f"{keep:.2f} (chance {1 / k:.2f}), too little signal for {rows}")


def _advice(plan: DPPlan) -> str:
    if plan.protects == "features":
        return "raise --epsilon, train fewer --epochs or use larger batches, or protect fewer parties (--dp-parties)"
    if plan.mechanism == "gradient":
        return ("use --dp-mechanism auto (randomized response or its prior variant release each label once), or raise "
                "--epsilon, or train fewer --epochs")
    if plan.config.stream:  # randomized response is the one mechanism for a stream
        return ("raise --epsilon, or learn from a longer stream (--samples, --epochs: epsilon stays per stream sample, "
                "though a replayed source row drawn more often has its label released more often)")
    return "raise --epsilon, train on more rows, or try another --dp-mechanism (rr, rr-prior, alibi)"


def utility_collapse(test: dict[str, float], chance: float, plan: DPPlan, n_classes: int, *,
                     majority_f1: float | None = None) -> str | None:
    """One warning line if the test metrics are near chance, else None. ``chance``: the test split's majority-class
    rate (:func:`chance_accuracy`); ``majority_f1``: the macro F1 of always predicting that class (:func:`chance_f1`;
    None: not checked)."""
    auc = test.get("auc", math.nan)
    if math.isfinite(auc) and auc < AUC_FLOOR:
        what = f"test AUC {auc:.3f} is below {AUC_FLOOR} (chance is 0.5)"
    elif not math.isfinite(auc) and "accuracy" in test and math.isfinite(chance) and \
            test["accuracy"] < chance + ACCURACY_MARGIN:
        what = (f"test accuracy {test['accuracy']:.3f} is within {ACCURACY_MARGIN:.2f} of chance (always predicting "
                f"the majority class scores {chance:.3f})")
    elif majority_f1 is not None and math.isfinite(majority_f1) and "f1" in test and \
            test["f1"] < majority_f1 + ACCURACY_MARGIN:
        positive = f", F1 of the positive class {test['f1_positive']:.3f}" if "f1_positive" in test else ""
        ranks = f"; test AUC {auc:.3f}" if math.isfinite(auc) else ""
        what = (f"the model predicts one class for (nearly) every test row: macro F1 {test['f1']:.3f}{positive}, "
                f"within {ACCURACY_MARGIN:.2f} of what always predicting the majority class scores "
                f"({majority_f1:.3f}){ranks}")
    else:
        return None
    return (f"WARNING: utility collapsed under differential privacy: {what}. Likely reason: {_reason(plan, n_classes)}. "
            f"What to change: {_advice(plan)}.")
