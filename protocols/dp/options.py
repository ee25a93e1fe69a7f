"""``--privacy dp`` and its flags: the typed options of the DP plugin (:mod:`secvfl.options`).

Every DP flag defaults to None ("not given"), except ``--privacy`` and the ``--dp-reproducible`` switch: a flag that
has no effect under the chosen mechanism is refused rather than ignored (:meth:`DPOptions.inapplicable`), and so is
any DP flag without ``--privacy dp`` (:meth:`DPOptions.problems`). :meth:`DPOptions.config` is the
:class:`~protocols.dp.config.DPConfig` they ask for, with the defaults the help texts state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from protocols.dp.choice import GRADIENT_ONLY_FLAGS
from protocols.dp.config import LABEL_RELEASE_MECHANISMS, MAX_NOISE_MULTIPLIER, MECHANISM_WORDS, DPConfig
from secvfl.options import Options, option, option_fields, option_values

__all__ = ["DPOptions"]

_FINITE_POSITIVE = (lambda v: 0 < v < math.inf, "a finite number > 0")


@dataclass(frozen=True)
class DPOptions(Options):
    privacy: Literal["none", "dp"] = option(
        "none", "dp: differential privacy for what crosses party boundaries (see --dp-protect)")
    epsilon: float | None = option(
        None, "privacy budget; calibrates the noise for the configured epochs before training",
        check=(lambda v: v > 0, "> 0 (smaller epsilon = more privacy)"))
    delta: float | None = option(
        None, "DP delta (default min(1e-5, 1/(10 N)); must be below 1/N)", check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    noise_multiplier: float | None = option(
        None, "noise std / sensitivity; overrides --epsilon and reports the epsilon it spends",
        check=(lambda v: 0 < v <= MAX_NOISE_MULTIPLIER,
               f"in (0, {MAX_NOISE_MULTIPLIER:g}] (beyond that the noise drowns every signal and epsilon is 0 to any "
               "precision)"))
    dp_protect: Literal["labels", "features"] | None = option(
        None, "labels (default): each label, from the feature parties; features: each feature row of the protected "
              "parties, from everyone else")
    dp_mechanism: Literal["auto", "gradient", "rr", "rr-prior", "alibi"] | None = option(
        None, "auto (default): the best measured for the task (binary: rr; multi-class: rr-prior, or rr when there are "
              "too few labels for a learned prior); gradient: noised label gradients; rr: randomized response on the "
              "labels before training; rr-prior: randomized response with a prior learned in two stages (Ghazi et "
              "al.); alibi: Laplace noise on one-hot labels, trained on the posterior (Malek et al.); rr, rr-prior and "
              "alibi are pure epsilon-DP")
    dp_stage1_fraction: float | None = option(
        None, "rr-prior: share of the training rows randomised in stage 1 (default 0.5)",
        check=(lambda v: 0 < v < 1, "strictly between 0 and 1"))
    dp_clip_norm: float | None = option(
        None, "per-sample joint L2 clip norm C (labels) or embedding-row clip (features); default 1",
        check=_FINITE_POSITIVE)
    dp_grad_clip_norm: float | None = option(
        None, "features: per-sample bottom-model gradient clip (default: --dp-clip-norm)", check=_FINITE_POSITIVE)
    dp_clip: Literal["auto", "jacobian", "gradient"] | None = option(
        None, "labels: clip the logit Jacobian (auto/jacobian, sensitivity C) or the loss gradient (sensitivity 2C)")
    dp_accountant: Literal["rdp", "prv", "gdp"] | None = option(
        None, "rdp (default, Opacus), prv (Opacus PRV, tighter) or gdp (exact for these releases)")
    dp_reproducible: bool = option(
        False, "seeded noise instead of the secure generator (debugging only; the summary says so)")
    dp_head_weight: float | None = option(
        None, "labels/gradient: weight of the head's part in the joint clipping (default 1)", check=_FINITE_POSITIVE)
    dp_denoise: Literal["none", "posterior"] | None = option(
        None, "labels/gradient (residual): train on Bayesian soft labels combining all of a sample's noisy releases so "
              "far (post-processing, no privacy cost)")
    dp_parties: str | None = option(
        None, "features: comma-separated feature parties that protect their rows (default: all)")
    dp_accept_epsilon: float | None = option(
        None, "finish a run whose releases were repeated after a crash (see the release ledger) even though that "
              "spends more than planned, up to epsilon E (default: refuse); may be given with --resume",
        metavar="E", check=_FINITE_POSITIVE)

    def given(self) -> list[str]:
        """The flags of the DP parameters given (``--privacy`` itself not counted)."""
        values = option_values(self)
        return [f.flag for f in option_fields(DPOptions)[1:] if values[f.name] not in (None, False)]

    def problems(self) -> list[str]:
        if self.privacy != "dp" and self.given():
            return [f"{', '.join(self.given())} only take effect with --privacy dp; add it or drop them"]
        return []

    def gradient_flags(self) -> list[str]:
        """The given flags that only the gradient mechanism uses (``--dp-mechanism auto`` then chooses it)."""
        values = option_values(self)
        return [f.flag for f in option_fields(DPOptions) if f.flag in GRADIENT_ONLY_FLAGS and values[f.name] is not None]

    def config(self) -> DPConfig:
        """The :class:`DPConfig` these options ask for (flags not given take their defaults)."""
        return DPConfig(
            mechanism=self.dp_mechanism or "auto",
            protects=self.dp_protect or "labels",
            epsilon=self.epsilon,
            delta=self.delta,
            noise_multiplier=self.noise_multiplier,
            clip_norm=self.dp_clip_norm if self.dp_clip_norm is not None else 1.0,
            gradient_clip_norm=self.dp_grad_clip_norm,
            clip=self.dp_clip or "auto",
            accountant=self.dp_accountant or "rdp",
            reproducible=self.dp_reproducible,
            head_weight=self.dp_head_weight if self.dp_head_weight is not None else 1.0,
            stage1_fraction=self.dp_stage1_fraction if self.dp_stage1_fraction is not None else 0.5,
        )

    def inapplicable(self, config: DPConfig) -> list[str]:
        """Flags the chosen mechanism (``config``, ``auto`` resolved) would silently ignore: they are refused, so
        nobody believes they applied."""
        problems = []
        labels_gradient = config.protects == "labels" and config.mechanism == "gradient"
        if self.dp_denoise == "posterior" and not (labels_gradient and config.clip in ("auto", "residual")):
            problems.append("--dp-denoise posterior works with --dp-protect labels --dp-mechanism gradient --dp-clip "
                            "residual only")
        if self.dp_grad_clip_norm is not None and config.protects != "features":
            problems.append("--dp-grad-clip-norm applies to --dp-protect features only")
        if self.dp_clip is not None and not labels_gradient:
            problems.append("--dp-clip applies to --dp-protect labels --dp-mechanism gradient only")
        if self.dp_head_weight is not None and not labels_gradient:
            problems.append("--dp-head-weight applies to --dp-protect labels --dp-mechanism gradient only")
        if config.mechanism in LABEL_RELEASE_MECHANISMS and (self.dp_clip_norm is not None
                                                             or self.dp_accountant is not None):
            problems.append(f"{MECHANISM_WORDS[config.mechanism]} has no clip norm and needs no accountant (it is "
                            "pure epsilon-DP); drop --dp-clip-norm/--dp-accountant")
        if self.dp_stage1_fraction is not None and config.mechanism != "rr-prior":
            problems.append("--dp-stage1-fraction applies to --dp-mechanism rr-prior only")
        if self.dp_parties and config.protects != "features":
            problems.append("--dp-parties applies to --dp-protect features only")
        return problems
