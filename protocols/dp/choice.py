"""``--dp-mechanism auto`` (the default): the label-DP mechanism with the best measured utility for the task.

The rule and the measurements behind it are in ``protocols/dp/README.md`` ("Which mechanism `auto` chooses");
every run's privacy statement says what ``auto`` chose and why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from protocols.dp.rr import rr_keep_probability

__all__ = ["choose_mechanism", "GRADIENT_ONLY_FLAGS", "RR_PRIOR_MIN_SIGNAL", "STREAM_REASON"]

# n_train * (RR's keep probability - 1/K): how many labels' worth of information plain randomized response leaves.
# rr-prior learns its prior from half of those in stage 1; below this it misled more than it helped (measured).
RR_PRIOR_MIN_SIGNAL = 500

# Why randomized response is the one label mechanism for a stream (each refusal in protocols.dp.plugin says more)
STREAM_REASON = ("the label party takes each label from a stream as it arrives, and randomized response of each label, "
                 "once, on arrival is the label mechanism that fits a stream (the others need a fixed training set)")

# Flags that only the gradient mechanism uses: a user who gives one asks for it.
GRADIENT_ONLY_FLAGS = ("--noise-multiplier", "--dp-clip", "--dp-clip-norm", "--dp-head-weight",
                       "--dp-denoise", "--dp-accountant")


def choose_mechanism(
    *,
    protects: str,
    n_classes: int,
    epochs: int,
    epsilon: float | None,
    n_train: int,
    gradient_flags: Sequence[str] = (),
    backward_pass: bool = True,
    streamed_labels: bool = False,
) -> tuple[str, str]:
    """``(mechanism, reason)`` for ``--dp-mechanism auto``; ``gradient_flags``: the gradient-only flags given;
    ``backward_pass``: the label party trains by a backward pass through its loss (``AlgorithmTraits.gradient_based``),
    which every mechanism but plain randomized response replaces or reweights; ``streamed_labels``: the label party
    takes each label from a stream as it arrives (``AlgorithmTraits.streamed_labels``)."""
    if protects == "features":
        return "gradient", "feature DP has one mechanism (clipped, noised embeddings and DP-SGD)"
    if gradient_flags:
        return "gradient", f"{', '.join(gradient_flags)} applies to the gradient mechanism only"
    if streamed_labels:
        return "rr", STREAM_REASON
    if not backward_pass:
        return "rr", ("the algorithm's label party sends no gradients, so only randomized response (labels replaced "
                      "once, before training) applies")
    if n_classes <= 2:
        return "rr", ("on binary tasks randomized response kept the most test AUC at equal epsilon (credit, a9a, "
                      "breast_cancer: BENCHMARKS.md)")
    if epochs < 2:
        return "rr", "randomized response with a prior trains in two stages (--epochs >= 2)"
    if epsilon is None or not math.isfinite(epsilon) or epsilon <= 0:
        return "rr", "randomized response needs only --epsilon"  # plan_dp refuses what is missing
    k = n_classes
    signal = n_train * (rr_keep_probability(epsilon, k) - 1.0 / k)
    if signal < RR_PRIOR_MIN_SIGNAL:
        return "rr", (f"with {n_train} training rows at epsilon {epsilon:g} randomized response leaves only about "
                      f"{signal:.0f} labels' worth of signal beyond chance, too little for a two-stage prior to help "
                      f"(below {RR_PRIOR_MIN_SIGNAL} plain randomized response measured better: digits, epsilon 1)")
    return "rr-prior", (f"on multi-class tasks with enough labels (here about {signal:.0f} labels' worth of signal "
                        "beyond chance) randomized response with a learned prior kept the most test accuracy at equal "
                        "epsilon (MNIST, epsilon 1: 0.878 against 0.812 for plain randomized response: "
                        "protocols/dp/README.md)")
