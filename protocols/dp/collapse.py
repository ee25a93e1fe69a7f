"""The end-of-run check of a DP run: did the model's utility collapse to chance, and what to change if it did.

Near chance means: test AUC below :data:`AUC_FLOOR` (binary tasks), or, when there is no AUC, test accuracy less than
:data:`ACCURACY_MARGIN` above the majority-class rate of the test split (what predicting one class everywhere
scores). A DP run that ends there did not fail: it trained a useless model, and says so with the likely reason.
"""

from __future__ import annotations

import math

import numpy as np

from protocols.dp.config import DPPlan
from protocols.dp.rr import rr_keep_probability

__all__ = ["utility_collapse", "chance_accuracy", "AUC_FLOOR", "ACCURACY_MARGIN"]

AUC_FLOOR = 0.55
ACCURACY_MARGIN = 0.05


def chance_accuracy(labels: np.ndarray) -> float:
    """Accuracy of always predicting the most frequent class of ``labels``."""
    y = np.asarray(labels)
    return float(np.bincount(y.astype(np.int64)).max() / y.size) if y.size else math.nan


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


def utility_collapse(test: dict[str, float], chance: float, plan: DPPlan, n_classes: int) -> str | None:
    """One warning line if the test metrics are near chance, else None."""
    if "auc" in test and math.isfinite(test["auc"]):
        if test["auc"] >= AUC_FLOOR:
            return None
        what = f"test AUC {test['auc']:.3f} is below {AUC_FLOOR} (chance is 0.5)"
    elif "accuracy" in test and math.isfinite(chance):
        if test["accuracy"] >= chance + ACCURACY_MARGIN:
            return None
        what = (f"test accuracy {test['accuracy']:.3f} is within {ACCURACY_MARGIN:.2f} of chance (always predicting "
                f"the majority class scores {chance:.3f})")
    else:
        return None
    return (f"WARNING: utility collapsed under differential privacy: {what}. Likely reason: {_reason(plan, n_classes)}. "
            f"What to change: {_advice(plan)}.")
