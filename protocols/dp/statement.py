"""The privacy statement: one paragraph in plain words that a run prints and writes to ``PRIVACY.md``.

It says what is protected, against whom, at which (epsilon, delta), under which accountant, how (clip, noise,
releases), what is *not* protected, and whether the noise came from the secure generator.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from protocols.dp.accounting import ACCOUNTANTS
from protocols.dp.alibi import LAPLACE_TAIL_MASS
from protocols.dp.config import LABEL_RELEASE_MECHANISMS, MECHANISM_WORDS, DPPlan
from protocols.dp.measured import measured_attacks
from protocols.dp.rr import rr_keep_probability

__all__ = [
    "privacy_summary",
    "privacy_statement",
    "privacy_markdown",
    "inference_bound",
    "inference_bound_words",
    "inference_markdown",
    "protection_words",
    "stream_markdown",
]

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
    released: dict[str, Any] | None = None,
    train_loss: str | None = None,
    what_it_means: bool = True,
) -> str:
    """One paragraph in plain words. ``released``: the mechanism's account of what it released (rr-prior's stages);
    ``train_loss``: where the label party keeps a training loss computed from the true labels (gradient mechanism);
    ``what_it_means``: end the guarantee with the attacker's bound ("What this means: ..."; PRIVACY.md gives it a
    section of its own instead)."""
    eps, delta = plan.epsilon, plan.delta
    algo = f" ({algorithm})" if algorithm else ""
    if plan.config.stream:
        text = f"Privacy guarantee{algo}: " + _stream_words(plan, n_classes or 2, released or {})
    elif plan.mechanism in LABEL_RELEASE_MECHANISMS:
        text = (
            f"Privacy guarantee{algo}: label differential privacy by {_RELEASE_NAMES[plan.mechanism]}, epsilon = "
            f"{_num(eps)} (pure DP, delta = 0). " + _release_words(plan, n_classes or 2, released or {})
            + " Training used only these released labels, so everything the feature parties saw and the trained "
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
    if plan.protects == "labels":
        if what_it_means:
            text += " " + inference_bound_words(plan, n_classes or 2)
        text += " " + _loss_words(plan, train_loss)
    if plan.config.auto_reason:
        text += (f" Mechanism chosen by --dp-mechanism auto (the default): {MECHANISM_WORDS[plan.mechanism]}, because "
                 f"{plan.config.auto_reason}.")
    if plan.notes:
        text += " Notes: " + "; ".join(plan.notes) + "."
    return text + " " + _rng_words(secure_rng, seed)


def _loss_words(plan: DPPlan, kept_at: str | None) -> str:
    if plan.mechanism in LABEL_RELEASE_MECHANISMS:
        return ("The training loss in metrics.jsonl and summary.json is computed from the released labels only "
                "(post-processing).")
    where = f" ({kept_at} in the run directory)" if kept_at else ""
    return ("The training loss is computed from the true labels, so it is no private release: the label party keeps it "
            f"to itself{where}, and metrics.jsonl, summary.json, curves.png and the log leave it out.")


_RELEASE_NAMES = {
    "rr": "randomized response",
    "rr-prior": "randomized response with a prior learned in two stages (Ghazi et al. 2021, LP-2ST)",
    "alibi": "ALIBI (Laplace noise on one-hot labels and Bayesian soft labels, Malek et al. 2021)",
}


def _release_words(plan: DPPlan, k: int, released: dict[str, Any]) -> str:
    eps = plan.epsilon
    keep = rr_keep_probability(eps, k)
    rr = (f"kept the true label with probability {keep:.4f} and otherwise reported one of the other {k - 1} "
          "class(es) uniformly at random")
    if plan.mechanism == "rr":
        return f"Before training, the label party replaced each training label once by randomized response: it {rr}."
    if plan.mechanism == "alibi":
        return (f"Before training, the label party added independent Laplace noise of scale {_num(2 / eps)} (= 2 / "
                f"epsilon: replacing a label moves its one-hot vector by 2 in L1) to each of the {k} coordinates of "
                "each training label's one-hot vector, once, and kept only the posterior distribution of the label "
                "given that noisy vector (uniform prior) as the sample's soft label. The Laplace draws come from the "
                f"same generator as all DP noise; its cut tails add below {k * LAPLACE_TAIL_MASS:.1e} per label to "
                "delta.")
    stages = released.get("stages", {})
    rows = (f" ({stages['stage1_rows']} and {stages['stage2_rows']} rows)" if "stage1_rows" in stages else "")
    mean_k = stages.get("stage2_mean_set_size")
    k_words = f" (on average {mean_k:.2f} classes here)" if mean_k is not None else ""
    start = stages.get("stage2_epoch", (plan.epochs + 1) // 2)
    return (
        f"The label party split the training rows at random, independently of the labels, into two parts{rows}. "
        f"Before training it replaced each part-1 label once by randomized response (it {rr}) and trained on those "
        f"alone for {start} epoch(s). Then the stage-1 model predicted a class distribution for every part-2 row -- a "
        "function of that row's features and of part 1's randomised labels only, never of a part-2 label -- and "
        "each part-2 label was replaced once by RRWithPrior with that prior: the reported class is drawn from the "
        f"classes most likely under the prior{k_words}, the true one with probability e^eps / (e^eps + k - 1) when "
        "it is among those k, and uniformly among them otherwise. Each label was released exactly once."
    )


def _stream_words(plan: DPPlan, k: int, released: dict[str, Any]) -> str:
    """Randomized response on a stream (protocols.dp.stream): what epsilon means per stream sample, and for a replay."""
    eps = _num(plan.epsilon)
    keep = rr_keep_probability(plan.epsilon, k)
    n = released.get("stream_labels_released")
    count = f" ({n:,} stream labels in this run)" if n is not None else ""
    draws = (f"; this run drew {n:,} samples from them, {n / plan.n_train:.2f} per row on average"
             if n is not None and plan.n_train else "")
    return (
        f"label differential privacy by randomized response on a stream, epsilon = {eps} per stream sample (pure DP, "
        f"delta = 0). As each (entity, label) event of the stream arrived, the label party replaced its label once by "
        f"randomized response: it kept the true label with probability {keep:.4f} and otherwise reported one of the "
        f"other {k - 1} class(es) uniformly at random{count}. Training used only these released labels: the round's "
        "gradients to the feature parties, the head's update and every later reuse of the label (DLR's window of past "
        "gradients, SLR's window of the last l labels) are post-processing, so for any two streams that differ in one "
        f"sample's label, every outcome is at most e^{eps} times more likely under one than under the other, whoever "
        "observes it. Every stream sample is a new individual whose label is released once, so by parallel "
        "composition over distinct samples this epsilon holds for each sample and does not grow with the length of "
        "the stream. For a dataset replayed as a stream (as `secvfl train` does), the unit of privacy is the stream "
        f"sample, not the source row: the replay draws copies of the same {plan.n_train:,} source rows (deformed, for "
        f"images{draws}), and a source row drawn r times has its label released r times, r * epsilon for that "
        "row; events from live sources (RoundJoin) are individuals. The prequential error is the label party's "
        "own score of its predictions against the true labels it holds: computed locally, it is no private release, "
        "so the error in metrics.jsonl, summary.json and online_error.png stays with the label party. Not protected: "
        "the features, which entities arrive and when, the number of samples and classes, and the labels from the "
        "label party itself, which holds them."
    )


def stream_markdown(plan: DPPlan) -> str:
    """PRIVACY.md's section on what epsilon means for a stream (online algorithms)."""
    eps = _num(plan.epsilon)
    return (
        "## What epsilon means on a stream\n\n"
        f"- **Per stream sample.** Each label is randomised once, when its event arrives; each stream sample is a new "
        f"individual, so every sample's label is epsilon = {eps}-DP (parallel composition over distinct samples) "
        "however long the stream runs. There is no budget that runs out over time, and none that grows.\n"
        "- **Post-processing.** The gradients sent to the feature parties, the head's updates and every reuse of a "
        "label in later rounds (DLR's gradient window, SLR's window of the last l labels) are computed from the "
        "randomised label only.\n"
        "- **A replayed dataset is not a stream of individuals.** `secvfl train` replays the training split as a "
        "stream: copies (deformed, for images) of the same source rows. The unit of privacy is then the stream sample: "
        f"a source row drawn r times has its label released r times, r * {eps} for that row (r grows with the "
        "number of samples; the average is the samples over the source rows). Events from live sources "
        "(`RoundJoin`, `OnlineVFL.train_live`) are individuals.\n"
        "- **The prequential error is not private.** The label party scores each prediction against the true label it "
        "holds (its own data, locally); the error curve it writes (metrics.jsonl, summary.json, online_error.png) is "
        "not covered by the guarantee. The training loss is computed from the randomised labels.\n"
        "- **After a crash.** A resumed run replays the block it was interrupted in: the same stream samples, whose "
        "labels are randomised again. With the secure generator that is a second release of those samples (the release "
        "ledger counts it, 2 epsilon, and the resume is refused unless `--dp-accept-epsilon` allows it); with "
        "`--dp-reproducible` on a CPU it redraws the same labels, no new release.\n"
    )


def inference_bound(epsilon: float, n_classes: int, delta: float = 0.0) -> float:
    """The most often any attacker can guess one training label right, from a uniform prior over the classes.

    For each pair of labels the outcome's probability ratio is at most e^eps (plus delta), so the posterior of the
    true label is at most ``e^eps / (e^eps + K - 1)``; binary: ``e^eps / (1 + e^eps)``. With delta > 0 the bound
    grows by at most ``delta`` (a conservative, simple form).
    """
    k = max(int(n_classes), 2)
    return min(1.0, rr_keep_probability(epsilon, k) + delta)


def inference_bound_words(plan: DPPlan, n_classes: int) -> str:
    k = max(n_classes, 2)
    bound = inference_bound(plan.epsilon, k, plan.delta)
    formula = "e^eps / (1 + e^eps)" if k == 2 else f"e^eps / (e^eps + {k - 1})"
    plus = " + delta" if plan.delta else ""
    return (f"What this means: anyone, including whoever holds the trained model and every message, who knows "
            f"everything about the training set except one sample's label and starts from a uniform guess, names "
            f"that label correctly with probability at most {formula}{plus} = {bound:.3f} (chance: {1 / k:.3f}).")


# How much of the way from a blind guess to certainty the guarantee lets an attacker go (the bound's share of the gap
# between chance and 1), and the words for it. Binary labels: epsilon 0.5 -> 0.24 (strong), 1 -> 0.46 (moderate),
# 3 -> 0.91 (weak); ten classes: epsilon 1 -> 0.15, 3 -> 0.66.
_PROTECTION_WORDS = ((0.25, "strong"), (0.6, "moderate"), (1.01, "weak"))


def protection_words(plan: DPPlan, n_classes: int) -> str:
    """A plain-words reading of the guarantee for one person, jargon explained (PRIVACY.md, "What this means")."""
    k = max(int(n_classes), 2)
    eps, delta = plan.epsilon, plan.delta
    chance = 1 / k
    bound = inference_bound(eps, k, delta)
    share = (bound - chance) / (1 - chance)
    grade = next(word for limit, word in _PROTECTION_WORDS if share < limit)
    what = "label (the answer the model learns to predict, e.g. whether a customer defaulted)"
    if plan.protects != "labels":
        what = "row of features (the values a feature party holds about them)"
        question = ("whether a person's row is one value or another, for any two values (say, a high or a low "
                    "balance)")
    elif k == 2:
        question = "a person's label"
    else:
        question = f"a person's label, one of {k} classes"
    delta_words = (f" Delta = {_num(delta)} is a small probability with which the guarantee may fail outright; it "
                   "should be well below one over the number of people in the data." if delta else "")
    return (
        f"Each person's {what} is what is protected. Imagine an attacker who knows everything about the training "
        f"data except {question}, and who sees everything this run released: the messages the other parties received "
        f"and the trained model. Guessing blindly, they would be right with probability {chance:.3f}. "
        f"Differential privacy with epsilon = {_num(eps)} limits how much the run can improve that guess: they are "
        f"right with probability at most {bound:.3f}. Epsilon measures how much one person's data can change what "
        "the run releases: at most a factor e^epsilon in the probability of any outcome, so smaller is more private."
        f"{delta_words}\n\nFor one person that is **{grade} protection**: the guarantee allows an attacker to go "
        f"{share:.0%} of the way from a blind guess to certainty. "
        + {"strong": "The run's outputs say little about any one person's data.",
           "moderate": "An attacker learns something about each person, far from certainty.",
           "weak": (f"An attacker may be nearly sure of {question}; the protection is that they can never be "
                    "certain, and that every person has it. Use a smaller epsilon (1 or less) where single "
                    "individuals must stay hidden, at a cost in accuracy.")}[grade]
    )


def inference_markdown(plan: DPPlan, n_classes: int) -> str:
    """PRIVACY.md's sections "What this means" (plain words) and "What an attacker can still infer": the bound and the
    attacks measured against this mechanism."""
    k = max(n_classes, 2)
    lines = ["## What this means", "", protection_words(plan, k), "", "## What an attacker can still infer", ""]
    bound = inference_bound(plan.epsilon, k, plan.delta)
    formula = "e^eps / (1 + e^eps)" if k == 2 else f"e^eps / (e^eps + {k - 1})"
    lines.append(f"The most often any attacker names one training label correctly, from a uniform guess: "
                 f"{formula}{' + delta' if plan.delta else ''} = {bound:.3f} (chance: {1 / k:.3f}).")
    if k == 2:
        lines[-1] += (" The same number bounds the ROC AUC of any label-inference attack on a training label "
                      "(the area under the best ROC curve epsilon-DP allows).")
    rows = measured_attacks(plan.mechanism)
    name = MECHANISM_WORDS[plan.mechanism]
    if not rows:
        lines += ["", f"No label-inference attack has been measured against {name} yet; the bound above holds for "
                      "every attacker."]
    else:
        lines += ["", f"Measured label-inference attacks against {name} (a feature party attacks the gradients it "
                      "receives; chance is AUC 0.5, or accuracy 1/K):", "",
                  "| epsilon | classes | attack | measured | bound at that epsilon | setting |", "|---|---|---|---|---|---|"]
        for r in rows:
            e = r["epsilon"]
            bound = f"{inference_bound(e, r['classes']):.3f}" if e is not None else "-"
            lines.append(f"| {_num(e) if e is not None else 'inf'} | {r['classes']} | {r['attack']} | {r['metric']} "
                         f"{r['value']:.3f} | {bound} | {r['setting']} |")
        if plan.mechanism == "rr":
            lines += ["", "The feature parties' gradients are computed from the randomised labels, so an attack can "
                          "recover those (on a binary task the measured AUC comes close to the bound); what it cannot "
                          "learn is which randomised labels differ from the true ones, and that is what the bound "
                          "limits."]
    return "\n".join(lines) + "\n"


def privacy_markdown(plan: DPPlan, *, secure_rng: bool, seed: int | None = None, **kw: Any) -> str:
    """``PRIVACY.md``: the statement, what an attacker can still infer, and the machine-readable parameters."""
    summary = privacy_summary(plan, secure_rng=secure_rng)
    if plan.protects == "labels":
        infer = "\n" + inference_markdown(plan, kw.get("n_classes") or 2)
    else:
        infer = "\n## What this means\n\n" + protection_words(plan, 2) + "\n"
    if plan.config.stream:
        infer += "\n" + stream_markdown(plan)
    return (
        "# Privacy statement\n\n"
        + privacy_statement(plan, secure_rng=secure_rng, seed=seed, what_it_means=False, **kw)
        + "\n" + infer
        + "\n## Parameters\n\n```json\n"
        + json.dumps(summary, indent=2)
        + "\n```\n"
    )
