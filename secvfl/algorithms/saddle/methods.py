"""One builder for the linear saddle-family methods, shared by ``secvfl train --algo eg|gd|nesterov|admm`` and
``secvfl reproduce saddle``: both run the same optimiser with the same constants, by construction.

* ``eg``: :class:`~secvfl.algorithms.saddle.extragradient.ExtraGradient` with the block steps
  ``StepSizes.scaled`` (or the single ``StepSizes.theory`` step), times ``multiplier``;
* ``gd``, ``nesterov``: step ``multiplier / L`` with ``L = mu + L_l lambda_max(A^T A)``;
* ``admm``: penalty ``rho = admm_rho / N``.

``lambda_max`` comes from the power iteration over the federation's network (its traffic counted there) unless the
caller already has it. :func:`tune_multiplier` picks a step multiplier (or ADMM's penalty) by short pilot runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from secvfl.algorithms.saddle.base import LinearAlgorithm
from secvfl.algorithms.saddle.baselines import ADMM, GradientDescent, Nesterov, smoothness
from secvfl.algorithms.saddle.extragradient import ExtraGradient, StepSizes
from secvfl.algorithms.saddle.federation import LinearFederation, power_lambda_max
from secvfl.algorithms.saddle.monitor import Monitor
from secvfl.errors import ConfigError

__all__ = ["LINEAR_METHODS", "build_method", "tune_multiplier"]

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


def tune_multiplier(
    make: Callable[[float], LinearAlgorithm],
    *,
    f_star: float | None = None,
    grid: Sequence[float] = (4.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.05),
    pilot_iters: int = 200,
) -> tuple[float, list[dict[str, float]]]:
    """Run ``make(m)`` for ``pilot_iters`` iterations per multiplier ``m``; return the best ``m`` and the pilots.

    The best multiplier has the lowest objective at the end of its pilot (diverged pilots lose). ``make`` must
    build each pilot on a fresh federation (new network, new layer state), so pilots do not share memory.
    """
    results = []
    for m in grid:
        algo = make(m)
        tr0 = algo.fed.stats.payload()
        trace = algo.run(Monitor(algo.fed, f_star), max_iters=pilot_iters, eval_every=pilot_iters, target=None)
        f = trace.last().get("objective", math.inf)
        if trace.info.get("status") == "diverged" or not math.isfinite(f):
            f = math.inf
        results.append({"multiplier": m, "objective": f, "floats": (algo.fed.stats.payload() - tr0) / 8.0})
    best = min(results, key=lambda r: (r["objective"], -r["multiplier"]))
    return float(best["multiplier"]), results
