"""The options of the saddle-point family (``--saddle-*``, ``--admm-rho``): one typed :class:`SaddleOptions`
(:mod:`secvfl.options`) that eg, gd, nesterov, admm and eg-mlp declare as their ``options_type``; the trainers read it
with ``cfg.options_for(SaddleOptions)``. Each field says which of the family's algorithms it applies to; given for
another algorithm, it is refused before anything is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from secvfl.algorithms.saddle.methods import LINEAR_METHODS
from secvfl.options import Options, option

__all__ = ["SaddleOptions"]


@dataclass(frozen=True)
class SaddleOptions(Options):
    """None: not given (the trainers then use the defaults the help texts state)."""

    title = "saddle-point family (eg, gd, nesterov, admm, eg-mlp)"

    saddle_mu: float | None = option(
        None, "eg/gd/nesterov/admm: L2 regularisation mu (default --weight-decay if set, else 1e-3)",
        check=(lambda v: 0 <= v < math.inf, "a finite number >= 0"), algos=LINEAR_METHODS)
    saddle_step: Literal["scaled", "theory"] | None = option(
        None, "eg: block step sizes (scaled, default) or the single theory step "
              "1/2 min{1, 1/sqrt(lambda_max), 1/L_r, 1/L_l}", algos=("eg",))
    saddle_step_mult: float | None = option(
        None, "eg/gd/nesterov: multiply the step sizes (tuning; default 1). Compressed EG with +vr or a ratio below "
              "0.1 may need less: secvfl reproduce saddle picks it by short pilot runs (a9a: 1 for randk:0.1+ef, 0.2 "
              "for randk:0.01+vr)",
        check=(lambda v: 0 < v < math.inf, "a finite number > 0"), algos=("eg", "gd", "nesterov"))
    saddle_participation: float | None = option(
        None, "eg: probability that a feature party takes part in an iteration (default 1)",
        check=(lambda v: 0 < v <= 1, "in (0, 1]"), algos=("eg",))
    saddle_batch: int | None = option(
        None, "eg: rows per iteration for stochastic mini-batch EG (default: full batch)",
        check=(lambda v: v >= 0, "an integer >= 0 (0: full batch)"), algos=("eg",))
    saddle_iters: int | None = option(
        None, "eg/gd/nesterov/admm: iterations per epoch (default 100; these linear methods use the saddle flags, not "
              "--lr/--optimizer/--batch-size)", check=(lambda v: v >= 1, "an integer >= 1"), algos=LINEAR_METHODS)
    saddle_loss: Literal["auto", "logistic", "softmax", "squared"] | None = option(
        None, "saddle family: loss (default auto: logistic for 2 classes, softmax otherwise); the linear model has an "
              "intercept")
    admm_rho: float | None = option(
        None, "admm: penalty rho in units of 1/N (default 1)",
        check=(lambda v: 0 < v < math.inf, "a finite number > 0"), algos=("admm",))

    def loss(self, n_classes: int) -> str:
        """The loss: ``--saddle-loss``, or for auto logistic on 2 classes and softmax otherwise."""
        name = self.saddle_loss or "auto"
        if name == "auto":
            return "logistic" if n_classes == 2 else "softmax"
        return name
