"""``secvfl train`` flags of the saddle-point family (``--saddle-*``, ``--admm-rho``); the trainers read them.

They join the command line through the protocol-plugin mechanism (an entry point of group ``secvfl.protocols``, like
the missing-feature flags) but add no protocol layer: ``configure`` only validates them. Values land in
``TrainConfig.options``.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from secvfl.algorithms.saddle.methods import LINEAR_METHODS
from secvfl.errors import ConfigError, UnsupportedError
from secvfl.plugins import ProtocolPlugin, ProtocolSetup
from secvfl.transport.layers import AlgorithmTraits

__all__ = ["SaddleFlags", "SADDLE_ALGOS"]

SADDLE_ALGOS = (*LINEAR_METHODS, "eg-mlp")


class SaddleFlags(ProtocolPlugin):
    """``secvfl train`` flags of the saddle-point family; validated here, read by the trainers."""

    name = "saddle"

    def add_arguments(self, parser: argparse.ArgumentParser | Any) -> None:
        parser.add_argument("--saddle-mu", type=float, default=None,
                            help="eg/gd/nesterov/admm: L2 regularisation mu (default --weight-decay if set, else 1e-3)")
        parser.add_argument("--saddle-step", choices=("scaled", "theory"), default=None,
                            help="eg: block step sizes (scaled, default) or the single theory step "
                                 "1/2 min{1, 1/sqrt(lambda_max), 1/L_r, 1/L_l}")
        parser.add_argument("--saddle-step-mult", type=float, default=None,
                            help="eg/gd/nesterov: multiply the step sizes (tuning; default 1)")
        parser.add_argument("--saddle-participation", type=float, default=None,
                            help="eg: probability that a feature party takes part in an iteration (default 1)")
        parser.add_argument("--saddle-batch", type=int, default=None,
                            help="eg: rows per iteration for stochastic mini-batch EG (default: full batch)")
        parser.add_argument("--saddle-iters", type=int, default=None,
                            help="eg/gd/nesterov/admm: iterations per epoch (default 100; these linear methods use "
                                 "the saddle flags, not --lr/--optimizer/--batch-size)")
        parser.add_argument("--saddle-loss", choices=("auto", "logistic", "softmax", "squared"), default=None,
                            help="saddle family: loss (default auto: logistic for 2 classes, softmax otherwise); "
                                 "the linear model has an intercept")
        parser.add_argument("--admm-rho", type=float, default=None, help="admm: penalty rho in units of 1/N (default 1)")

    def configure(self, cfg: Any, traits: AlgorithmTraits, ctx: Any) -> ProtocolSetup | None:
        given = [f for f in ("saddle_mu", "saddle_step", "saddle_step_mult", "saddle_participation", "saddle_batch",
                             "saddle_iters", "saddle_loss", "admm_rho") if cfg.option(f) is not None]
        if given and traits.name not in SADDLE_ALGOS:
            flags = ", ".join("--" + g.replace("_", "-") for g in given)
            raise UnsupportedError(f"{flags}: only for --algo {'/'.join(SADDLE_ALGOS)}, not {traits.name}")
        checks = {"saddle_mu": (lambda v: 0 <= v < math.inf, "a finite number >= 0"),
                  "saddle_step_mult": (lambda v: 0 < v < math.inf, "a finite number > 0"),
                  "saddle_participation": (lambda v: 0 < v <= 1, "in (0, 1]"),
                  "saddle_batch": (lambda v: v >= 0, "an integer >= 0 (0: full batch)"),
                  "saddle_iters": (lambda v: v >= 1, "an integer >= 1"),
                  "admm_rho": (lambda v: 0 < v < math.inf, "a finite number > 0")}
        for key, (ok, what) in checks.items():
            v = cfg.option(key)
            if v is not None and not ok(v):
                raise ConfigError(f"--{key.replace('_', '-')} must be {what}, got {v}")
        if cfg.option("admm_rho") is not None and traits.name != "admm":
            raise UnsupportedError("--admm-rho applies to --algo admm only")
        eg_only = [f for f in ("saddle_step", "saddle_participation", "saddle_batch") if cfg.option(f) is not None]
        if eg_only and traits.name != "eg":
            raise UnsupportedError(f"--{eg_only[0].replace('_', '-')} applies to --algo eg only")
        return None
