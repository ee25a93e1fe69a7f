"""Differential privacy for what crosses party boundaries.

- :mod:`protocols.dp.accounting`: events, composition, ``get_epsilon(delta)``, noise calibration (Opacus RDP/PRV, exact GDP).
- :mod:`protocols.dp.rng`: the AES-256-CTR noise source (secure, or seeded for ``--dp-reproducible``).
- :mod:`protocols.dp.mechanisms`: per-sample joint clipping and the label-sensitivity reductions.
- :mod:`protocols.dp.label_dp`: the label-DP gradient mechanism (privatised backward of the label party).
- :mod:`protocols.dp.rr`: randomized response (K classes, with a prior).
- :mod:`protocols.dp.staged`: randomized response with a prior learned in two stages (LP-2ST, ``rr-prior``).
- :mod:`protocols.dp.alibi`: ALIBI (Laplace noise on one-hot labels, Bayesian soft labels).
- :mod:`protocols.dp.targets`: the label party's loss on released labels (rr-prior, alibi).
- :mod:`protocols.dp.choice`: what ``--dp-mechanism auto`` chooses; :mod:`protocols.dp.collapse`: the end-of-run
  utility check; :mod:`protocols.dp.measured`: attacks measured against each mechanism (quoted in PRIVACY.md).
- :mod:`protocols.dp.feature_dp`: feature DP (clipped, noised embedding rows + DP-SGD bottom model).
- :mod:`protocols.dp.denoise`: Bayesian soft labels from the noisy releases (post-processing).
- :mod:`protocols.dp.config`: option validation and the calibrated plan; :mod:`protocols.dp.statement`: the text.
- :mod:`protocols.dp.ledger`: each releasing party's durable record of its releases, so that releases repeated after
  a crash are charged; :mod:`protocols.dp.private`: files only one party reads (the true-label training loss).
- :mod:`protocols.dp.plugin`: ``--privacy dp`` flags, the ``dp`` protocol layer, attachment to a run.
- :mod:`protocols.dp.audit`: empirical epsilon lower bounds (canary audits).

Threat models, neighbouring relations and measured results: ``protocols/dp/README.md``.
"""

from __future__ import annotations

from protocols.dp.accounting import (
    ACCOUNTANTS,
    ComposedEvent,
    GaussianEvent,
    PureDPEvent,
    SampledGaussianEvent,
    calibrate_noise_multiplier,
    compose,
    epsilon_of,
    make_accountant,
)
from protocols.dp.alibi import alibi_posterior, alibi_soft_labels
from protocols.dp.choice import choose_mechanism
from protocols.dp.collapse import utility_collapse
from protocols.dp.config import DPConfig, DPPlan, default_delta, plan_dp
from protocols.dp.denoise import LabelPosterior
from protocols.dp.feature_dp import FeatureDP
from protocols.dp.label_dp import LabelDPBackward, LabelDPRule, LabelDPStep
from protocols.dp.mechanisms import clip_jointly, joint_norms
from protocols.dp.rng import NoiseSource, SecureNoise, SeededNoise, make_noise_source
from protocols.dp.rr import randomized_response, rr_keep_probability, rr_transition_matrix, rr_with_prior
from protocols.dp.staged import TwoStageRR
from protocols.dp.statement import inference_bound, privacy_markdown, privacy_statement, privacy_summary
from protocols.dp.targets import TargetBackward

__all__ = [
    "ACCOUNTANTS",
    "ComposedEvent",
    "GaussianEvent",
    "PureDPEvent",
    "SampledGaussianEvent",
    "calibrate_noise_multiplier",
    "compose",
    "epsilon_of",
    "make_accountant",
    "DPConfig",
    "DPPlan",
    "default_delta",
    "plan_dp",
    "FeatureDP",
    "LabelDPBackward",
    "LabelDPRule",
    "LabelDPStep",
    "LabelPosterior",
    "clip_jointly",
    "joint_norms",
    "NoiseSource",
    "SecureNoise",
    "SeededNoise",
    "make_noise_source",
    "randomized_response",
    "rr_keep_probability",
    "rr_transition_matrix",
    "rr_with_prior",
    "TwoStageRR",
    "alibi_posterior",
    "alibi_soft_labels",
    "TargetBackward",
    "choose_mechanism",
    "utility_collapse",
    "inference_bound",
    "privacy_markdown",
    "privacy_statement",
    "privacy_summary",
]
