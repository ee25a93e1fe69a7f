"""One builder for the linear saddle-family methods, shared by ``secvfl train --algo eg|gd|nesterov|admm`` and
``secvfl reproduce saddle``: both run the same optimiser with the same constants, by construction.

* ``eg``: :class:`~secvfl.algorithms.saddle.ExtraGradient` with the block steps ``StepSizes.scaled`` (or the single
  ``StepSizes.theory`` step), times ``multiplier``;
* ``gd``, ``nesterov``: step ``multiplier / L`` with ``L = mu + L_l lambda_max(A^T A)``;
* ``admm``: penalty ``rho = admm_rho / N``.

``lambda_max`` comes from the power iteration over the federation's network (its traffic counted there) unless the
caller already has it.
"""

from __future__ import annotations

from secvfl.algorithms.saddle import (
    ExtraGradient,
    LinearAlgorithm,
    LinearFederation,
    StepSizes,
    power_lambda_max,
)
from secvfl.algorithms.saddle_baselines import ADMM, GradientDescent, Nesterov, smoothness
from secvfl.errors import ConfigError

__all__ = ["LINEAR_METHODS", "build_method"]

LINEAR_METHODS = ("eg", "gd", "nesterov", "admm")


def build_method(
    fed: LinearFederation,
    kind: str,
    *,
    lam_max: float | None = None,
    step: str = "scaled",
    multiplier: float = 1.0,
    participation: float = 1.0,
    batch_size: int | None = None,
    admm_rho: float = 1.0,
    seed: int = 0,
) -> LinearAlgorithm:
    """The ``kind`` method on ``fed``; ``participation`` and ``batch_size`` are EG's, ``admm_rho`` (units of 1/N) ADMM's."""
    if kind not in LINEAR_METHODS:
        raise ConfigError(f"unknown linear saddle-family method {kind!r}; choose one of {', '.join(LINEAR_METHODS)}")
    if kind == "admm":
        return ADMM(fed, rho=admm_rho / fed.n, seed=seed)
    if lam_max is None:
        lam_max = power_lambda_max(fed, seed=seed)
    if kind == "gd":
        return GradientDescent(fed, smoothness(fed, lam_max), step_multiplier=multiplier, seed=seed)
    if kind == "nesterov":
        return Nesterov(fed, smoothness(fed, lam_max), step_multiplier=multiplier, seed=seed)
    L_l = fed.label.smoothness
    if step == "theory":
        steps = StepSizes.theory(lam_max, fed.mu, L_l).scale(multiplier)
    elif step == "scaled":
        steps = StepSizes.scaled(lam_max, fed.mu, L_l, multiplier)
    else:
        raise ConfigError(f"unknown EG step rule {step!r}; choose scaled or theory")
    return ExtraGradient(fed, steps, participation=participation, batch_size=batch_size, seed=seed)
