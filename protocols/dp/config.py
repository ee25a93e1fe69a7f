"""DP options, their validation, and the plan (calibrated noise, reported epsilon) fixed before training starts.

``DPConfig`` is what the user asked for (``--epsilon``, ``--delta``, ``--noise-multiplier``, ``--dp-clip-norm``, ...);
:func:`plan_dp` checks it against the run (training-set size, epochs, batch size, loss) and returns a ``DPPlan``: the
noise multiplier to use and the epsilon it certifies. Every refusal is a :class:`ConfigError` naming the fix.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from protocols.dp.accounting import ACCOUNTANTS, GaussianEvent, calibrate_noise_multiplier, epsilon_of
from protocols.dp.label_dp import clip_mode_for
from protocols.dp.mechanisms import FEATURE_NEIGHBOURING, LABEL_NEIGHBOURING, release_sensitivity
from secvfl.errors import ConfigError, UnsupportedError

__all__ = [
    "DPConfig",
    "DPPlan",
    "plan_dp",
    "default_delta",
    "MECHANISMS",
    "MECHANISM_WORDS",
    "LABEL_RELEASE_MECHANISMS",
    "PROTECTS",
    "STREAM_UNIT",
]

MECHANISMS = ("gradient", "rr", "rr-prior", "alibi")
# Mechanisms that release each training label once, before it is used (pure epsilon-DP, no accountant, no noise
# multiplier); everything after the release is post-processing.
LABEL_RELEASE_MECHANISMS = ("rr", "rr-prior", "alibi")
PROTECTS = ("labels", "features")
STREAM_NEIGHBOURING = "replace-one-label: two streams are neighbours if they differ in the label of one stream sample"
# What one epsilon covers on a stream (summary.json's privacy.privacy_unit; protocols.dp.stream)
STREAM_UNIT = ("stream sample: each label randomised once, as it arrives; parallel composition over distinct samples, "
               "no growth with the stream's length")


MECHANISM_WORDS = {
    "gradient": "the gradient mechanism",
    "rr": "randomized response",
    "rr-prior": "randomized response with a prior",
    "alibi": "ALIBI",
}


# Larger multipliers overflow the accountants' floating point (alpha / (2 sigma^2) underflows to 0 long before).
MAX_NOISE_MULTIPLIER = 1e6


def default_delta(n_train: int) -> float:
    """``min(1e-5, 1 / (10 N))``: well below the 1/N at which releasing one whole record is (0, delta)-DP."""
    return min(1e-5, 1.0 / (10.0 * n_train))


@dataclass
class DPConfig:
    """What the user asked for. ``epsilon=None`` with ``noise_multiplier`` set means "report the epsilon"."""

    mechanism: str = "gradient"
    protects: str = "labels"
    epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    clip_norm: float = 1.0  # labels: joint per-sample clip C; features: embedding-row clip C_e
    gradient_clip_norm: float | None = None  # features: bottom-model per-sample gradient clip C_g (default C)
    clip: str = "auto"  # labels/gradient: auto (= residual) | residual | jacobian | gradient
    accountant: str = "rdp"
    reproducible: bool = False
    head_weight: float = 1.0
    stage1_fraction: float = 0.5  # rr-prior: share of the training rows randomised in stage 1 (Ghazi et al. 2021)
    auto_reason: str | None = None  # set when --dp-mechanism auto chose the mechanism: why
    # the labels arrive in a stream, each sample once (online algorithms): randomized response of each label as it
    # arrives, epsilon per stream sample (protocols.dp.stream)
    stream: bool = False


@dataclass
class DPPlan:
    """The calibrated mechanism for one run; ``to_summary`` is the ``privacy`` entry of summary.json."""

    config: DPConfig
    n_train: int
    epochs: int
    batch_size: int
    releases_per_sample: int
    delta: float
    noise_multiplier: float | None
    epsilon: float
    accountant: str
    clip_mode: str | None
    sensitivity: float | None
    neighbouring: str
    notes: list[str] = field(default_factory=list)
    loss: str = "bce"

    @property
    def clip_norm_unused(self) -> bool:
        return self.clip_mode == "residual" and self.config.protects == "labels" and self.loss in ("bce", "ce")

    @property
    def mechanism(self) -> str:
        return self.config.mechanism

    @property
    def protects(self) -> str:
        return self.config.protects

    def to_summary(self, *, secure_rng: bool) -> dict[str, Any]:
        c = self.config
        # (a stream has no batches; its neighbours differ in one stream sample's label)
        stream = {"privacy_unit": STREAM_UNIT, "neighbouring": STREAM_NEIGHBOURING, "batch_size": None} if c.stream else {}
        return {
            "mechanism": c.mechanism,
            "protects": c.protects,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "noise_multiplier": self.noise_multiplier,
            # residual mode on bce/ce needs no clipping (the residual is bounded by the loss itself)
            "clip_norm": None if c.mechanism != "gradient" or self.clip_norm_unused else c.clip_norm,
            "neighbouring": self.neighbouring,
            "secure_rng": bool(secure_rng),
            "clip_mode": self.clip_mode,
            "sensitivity": self.sensitivity,
            "gradient_clip_norm": (c.gradient_clip_norm or c.clip_norm) if c.protects == "features" else None,
            "releases_per_sample": self.releases_per_sample,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "n_train": self.n_train,
            "subsampling_amplification": False,
            "target_epsilon": c.epsilon,
            "auto_reason": c.auto_reason,
            "notes": list(self.notes),
            **stream,
        }

    def state(self) -> dict[str, Any]:
        return {**asdict(self), "config": asdict(self.config)}


def _positive_int(name: str, v: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    return v


def plan_dp(
    config: DPConfig,
    *,
    n_train: int,
    epochs: int,
    batch_size: int,
    loss: str = "bce",
    releases_per_epoch: int = 1,
) -> DPPlan:
    """Validate ``config`` for this run and calibrate (or account) the noise.

    ``releases_per_epoch``: how many times one sample's contribution is released per epoch (1 for an epoch that
    visits each sample once; an algorithm that revisits samples within an epoch must say so).
    """
    c = config
    n_train = _positive_int("the number of training samples", n_train)
    epochs = _positive_int("epochs", epochs)
    batch_size = _positive_int("batch size", batch_size)
    releases_per_epoch = _positive_int("releases per epoch", releases_per_epoch)
    if c.mechanism not in MECHANISMS:
        raise ConfigError(f"unknown --dp-mechanism {c.mechanism!r}; valid: {', '.join(MECHANISMS)}")
    if c.protects not in PROTECTS:
        raise ConfigError(f"unknown --dp-protect {c.protects!r}; valid: {', '.join(PROTECTS)}")
    if c.accountant not in ACCOUNTANTS:
        raise ConfigError(f"unknown --dp-accountant {c.accountant!r}; valid: {', '.join(sorted(ACCOUNTANTS))}")
    if c.epsilon is not None:
        if math.isnan(c.epsilon) or c.epsilon <= 0:
            raise ConfigError(f"--epsilon must be > 0, got {c.epsilon}; smaller epsilon = more privacy")
        if math.isinf(c.epsilon):
            raise ConfigError("--epsilon inf means no privacy; use --privacy none for a non-private run")
    if c.epsilon is None and c.noise_multiplier is None:
        raise ConfigError("--privacy dp needs --epsilon E (calibrates the noise) or --noise-multiplier S")
    if not 0 < c.head_weight < math.inf:
        raise ConfigError(f"--dp-head-weight must be a finite number > 0, got {c.head_weight}")
    if not c.clip_norm > 0 or not math.isfinite(c.clip_norm):
        raise ConfigError(f"--dp-clip-norm must be a finite number > 0, got {c.clip_norm}")
    if c.gradient_clip_norm is not None and not c.gradient_clip_norm > 0:
        raise ConfigError(f"the bottom-model gradient clip norm must be > 0, got {c.gradient_clip_norm}")
    if c.delta is not None and not (0 <= c.delta < 1):
        raise ConfigError(f"--delta must be in [0, 1), got {c.delta}")
    notes: list[str] = []

    if c.mechanism in LABEL_RELEASE_MECHANISMS:
        what = MECHANISM_WORDS[c.mechanism]
        if c.protects != "labels":
            raise UnsupportedError(f"{what} protects labels only; use --dp-mechanism gradient for features")
        if c.noise_multiplier is not None:
            raise UnsupportedError(f"--noise-multiplier has no meaning for {what} (it is calibrated by --epsilon alone)")
        if c.epsilon is None:
            raise ConfigError(f"{what} needs --epsilon")
        if c.mechanism == "rr-prior":
            if not 0 < c.stage1_fraction < 1:
                raise ConfigError(f"--dp-stage1-fraction must be strictly between 0 and 1, got {c.stage1_fraction}")
            if epochs < 2:
                raise ConfigError(f"{what} trains in two stages and needs --epochs >= 2 (got {epochs}); raise --epochs "
                                  "or use --dp-mechanism rr")
        if c.delta:
            notes.append(f"{what} is pure epsilon-DP: the requested delta {c.delta:g} is not needed (0)")
        return DPPlan(
            c, n_train, epochs, batch_size, 1, 0.0, None, float(c.epsilon),
            "pure",
            None, None, LABEL_NEIGHBOURING, notes,
        )

    delta = default_delta(n_train) if c.delta is None else float(c.delta)
    if delta <= 0:
        raise UnsupportedError("the Gaussian mechanism needs --delta > 0 (or use --dp-mechanism rr for pure DP)")
    if delta >= 1.0 / n_train:
        raise ConfigError(
            f"--delta {delta:g} is not below 1/N = {1.0 / n_train:g} (N = {n_train} training samples): such a delta "
            f"allows publishing a whole record; use --delta {default_delta(n_train):g} or smaller"
        )
    if batch_size > n_train:
        raise ConfigError(f"batch size {batch_size} exceeds the {n_train} training samples")

    if c.protects == "labels":
        mode = clip_mode_for(loss, c.clip)
        sensitivity = release_sensitivity(mode, "ce" if loss in ("ce", "cross_entropy", "softmax") else loss, c.clip_norm)
        per_epoch = releases_per_epoch
        neighbouring = LABEL_NEIGHBOURING
    else:
        mode, sensitivity, per_epoch, neighbouring = None, 2.0 * c.clip_norm, 2 * releases_per_epoch, FEATURE_NEIGHBOURING
    releases = per_epoch * epochs

    def event(s: float) -> GaussianEvent:
        return GaussianEvent(s, releases)

    if c.noise_multiplier is not None:
        if not 0 < c.noise_multiplier <= MAX_NOISE_MULTIPLIER:
            raise ConfigError(f"--noise-multiplier must be in (0, {MAX_NOISE_MULTIPLIER:g}], got {c.noise_multiplier} "
                              "(beyond that the noise drowns every signal and epsilon is 0 to any precision)")
        sigma = float(c.noise_multiplier)
        eps = epsilon_of(event(sigma), delta, c.accountant)
        if c.epsilon is not None and eps > c.epsilon:
            notes.append(
                f"--noise-multiplier {sigma:g} overrides --epsilon {c.epsilon:g}: the run spends epsilon {eps:.4g}, "
                "MORE than requested"
            )
    else:
        sigma = calibrate_noise_multiplier(float(c.epsilon), delta, event, accountant=c.accountant)
        eps = epsilon_of(event(sigma), delta, c.accountant)
    return DPPlan(
        c, n_train, epochs, batch_size, releases, delta, sigma, float(eps), c.accountant, mode, sensitivity,
        neighbouring, notes, "ce" if loss in ("ce", "cross_entropy", "softmax") else loss,
    )

