"""The privacy statement: one paragraph in plain words that a run prints and writes to ``PRIVACY.md``.

It says what is protected, against whom, at which (epsilon, delta), under which accountant, how (clip, noise,
releases), what is *not* protected, and whether the noise came from the secure generator.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from protocols.dp.accounting import ACCOUNTANTS
from protocols.dp.config import DPPlan
from protocols.dp.rr import rr_keep_probability

__all__ = ["privacy_summary", "privacy_statement", "privacy_markdown"]

_CLIP_WORDS = {
    "bce": "by clipping the label-independent Jacobian of the logit (binary cross-entropy), so a changed label moves "
    "it by at most the clip norm",
    "softmax": "by clipping the centred, label-independent Jacobian rows of the logits (softmax cross-entropy), so a "
    "changed label moves it by at most the clip norm",
    "gradient": "by clipping its loss gradient, so a changed label moves it by at most twice the clip norm",
}


def _num(x: float) -> str:
    return f"{x:.3g}" if x < 1e-3 else f"{x:.4g}"


def privacy_summary(plan: DPPlan, *, secure_rng: bool) -> dict[str, Any]:
    """The ``privacy`` entry of ``summary.json``."""
    return plan.to_summary(secure_rng=secure_rng)


_RESIDUAL_WORDS = {
    "bce": "the derivative of its loss with respect to its logit, sigmoid(z) - y, which a changed label moves by "
    "exactly 1",
    "ce": "the derivative of its loss with respect to its logits, softmax(z) - onehot(y), which a changed label "
    "moves by sqrt(2)",
}


def _how_words(plan: DPPlan) -> str:
    sigma, sens = _num(plan.noise_multiplier or 0), _num(plan.sensitivity or 0)
    if plan.clip_mode == "residual":
        what = _RESIDUAL_WORDS.get(plan.loss, f"the derivative of its loss with respect to its logits, clipped to "
                                              f"L2 norm {_num(plan.config.clip_norm)} (so a changed label moves it "
                                              f"by at most twice that)")
        return (
            "In every step, the only quantity that depends on a sample's label -- " + what + " -- was perturbed with "
            f"Gaussian noise of {sigma} times that sensitivity ({sens}), and the gradients sent to the feature "
            "parties as well as the head's update were computed from the noisy values only, so they are "
            "post-processing."
        )
    return (
        "In every step, each sample's joint contribution (its gradient row across all feature parties together "
        f"with its effect on the head) was bounded {_CLIP_WORDS[plan.clip_mode or 'gradient']} "
        f"({_num(plan.config.clip_norm)}), giving an L2 sensitivity of {sens}, and Gaussian noise of {sigma} times "
        "that sensitivity was added."
    )


def _accountant_words(plan: DPPlan) -> str:
    if plan.accountant == "pure":
        return "a single pure-DP mechanism per label (no composition needed)"
    return ACCOUNTANTS[plan.accountant].description


def _rng_words(secure_rng: bool, seed: int | None) -> str:
    if secure_rng:
        return "The noise came from a cryptographically secure generator (AES-256-CTR keyed from the operating system)."
    seed_txt = f" {seed}" if seed is not None else ""
    return (
        "WARNING: the noise came from the seeded generator (--dp-reproducible, seed" + seed_txt + "); the guarantee "
        "holds only against someone who does not know the seed, so do not use this run's outputs in production."
    )


def privacy_statement(
    plan: DPPlan,
    *,
    secure_rng: bool,
    seed: int | None = None,
    algorithm: str | None = None,
    protected_parties: Sequence[str] | None = None,
    n_classes: int | None = None,
) -> str:
    """One paragraph in plain words."""
    eps, delta = plan.epsilon, plan.delta
    algo = f" ({algorithm})" if algorithm else ""
    if plan.mechanism == "rr":
        k = n_classes or 2
        keep = rr_keep_probability(eps, k)
        text = (
            f"Privacy guarantee{algo}: label differential privacy by randomized response, epsilon = {_num(eps)} "
            f"(pure DP, delta = 0). Before training, the label party replaced each training label once by randomized "
            f"response: it kept the true label with probability {keep:.4f} and otherwise reported one of the other "
            f"{k - 1} class(es) uniformly at random"
            + (", restricted to the most likely classes under a prior learned in an earlier stage from other samples "
               "(Ghazi et al. 2021)" if plan.config.rr_prior else "")
            + ". Training used only these randomized labels, so everything the feature parties saw and the trained "
            f"model are post-processing: for any two training sets that differ in one sample's label, every outcome "
            f"is at most e^{_num(eps)} times more likely under one than under the other, whoever observes it. "
            "Not protected: the features, which samples are in the training set and in each batch, the number of "
            "samples and classes, and the labels from the label party itself, which holds them."
        )
    elif plan.protects == "labels":
        text = (
            f"Privacy guarantee{algo}: label differential privacy with epsilon = {_num(eps)} and delta = {_num(delta)}, "
            f"computed with {_accountant_words(plan)}. It protects each training sample's label from the feature "
            "parties, even if they all collude: for any two training sets that differ only in one sample's label, "
            "everything the label party sent them (the cut-layer gradients) and every update of its head, hence the "
            f"trained model, are ({_num(eps)}, {_num(delta)})-indistinguishable. " + _how_words(plan) + " "
            f"Each sample was released {plan.releases_per_sample} times "
            f"({plan.epochs} epochs); no amplification by subsampling is claimed, because the feature parties know "
            "which samples are in each batch. Not protected: the features, batch membership, the number of samples "
            "and classes, and the labels from the label party itself, which holds them."
        )
    else:
        who = ", ".join(protected_parties) if protected_parties else "each feature party"
        gclip = plan.config.gradient_clip_norm or plan.config.clip_norm
        text = (
            f"Privacy guarantee{algo}: feature differential privacy with epsilon = {_num(eps)} and delta = "
            f"{_num(delta)}, computed with {_accountant_words(plan)}. It protects each training row of the features "
            f"held by {who} from every other party (the label party and the other feature parties, even colluding): "
            "for any two training sets that differ only in that party's row for one sample, everything the party "
            f"sent and every update of its bottom model are ({_num(eps)}, {_num(delta)})-indistinguishable. Each "
            f"released embedding row was clipped to L2 norm {_num(plan.config.clip_norm)} and each per-sample "
            f"bottom-model gradient to {_num(gclip)}, and Gaussian noise of {_num(plan.noise_multiplier or 0)} times "
            f"the replace-one sensitivity (twice the clip norm) was added to both; each sample was released "
            f"{plan.releases_per_sample} times ({plan.epochs} epochs, two releases each), with no amplification by "
            "subsampling claimed. Not protected: labels, batch membership, the number of samples, and the other "
            "parties' features."
        )
    if plan.notes:
        text += " Notes: " + "; ".join(plan.notes) + "."
    return text + " " + _rng_words(secure_rng, seed)


def privacy_markdown(plan: DPPlan, *, secure_rng: bool, seed: int | None = None, **kw: Any) -> str:
    """``PRIVACY.md``: the statement plus the machine-readable parameters."""
    summary = privacy_summary(plan, secure_rng=secure_rng)
    return (
        "# Privacy statement\n\n"
        + privacy_statement(plan, secure_rng=secure_rng, seed=seed, **kw)
        + "\n\n## Parameters\n\n```json\n"
        + json.dumps(summary, indent=2)
        + "\n```\n"
    )
