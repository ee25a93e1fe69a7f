"""``secvfl train --algo eg|gd|nesterov|admm|eg-mlp``: the saddle-point family behind the common trainer interface.

The linear methods (:mod:`secvfl.algorithms.saddle`, :mod:`secvfl.algorithms.saddle_baselines`) train a linear
model (logistic for 2 classes, softmax otherwise, or ``--saddle-loss squared``) on the run's standardised features,
full batch by default; one "epoch" is ``--saddle-iters`` iterations. ``eg-mlp`` (:mod:`secvfl.algorithms.
saddle_mlp`) trains MLP bottom models (``--hidden``) with stochastic EG, one epoch = one pass of ``--batch-size``
batches, ``--lr`` the step of the model parameters (plain EG steps, not Adam: use e.g. ``--lr 0.05``).

Flags (they join through the protocol-plugin mechanism, like the missing-feature flags, and add no layer):
``--saddle-mu`` (L2 regularisation, default 1e-3, or ``--weight-decay`` when given), ``--saddle-step
scaled|theory``, ``--saddle-step-mult``, ``--saddle-participation P``, ``--saddle-batch B`` (0: full batch),
``--saddle-iters``, ``--saddle-loss``, ``--admm-rho`` (in units of 1/N).

Evaluation: the feature parties send ``A_k x_k`` of the evaluated split to the label party (counted, like any
prediction traffic), which computes the metrics.
"""

from __future__ import annotations

import argparse
from typing import Any, ClassVar

import numpy as np
import torch

from protocols.base import AlgorithmTraits
from protocols.plugins import PROTOCOLS, ProtocolPlugin, ProtocolSetup
from secvfl.algorithms import ALGORITHMS
from secvfl.algorithms.base import Algorithm, ProgressFn, RunContext
from secvfl.algorithms.saddle import (
    BACKWARD_KIND,
    FORWARD_KIND,
    LABEL,
    ExtraGradient,
    LinearAlgorithm,
    LinearFeatureParty,
    LinearFederation,
    LinearLabelParty,
    StepSizes,
    make_loss,
    power_lambda_max,
)
from secvfl.algorithms.saddle_baselines import ADMM, GradientDescent, Nesterov, smoothness
from secvfl.errors import ConfigError, UnsupportedError
from secvfl.messages import Message
from secvfl.metrics import classification_metrics
from secvfl.transport.network import Network

__all__ = ["LinearSaddleTrainer", "SaddleMLPTrainer", "SaddleFlags", "SADDLE_ALGOS"]

SADDLE_ALGOS = ("eg", "gd", "nesterov", "admm", "eg-mlp")
_LINEAR = ("eg", "gd", "nesterov", "admm")


def _traits(name: str) -> AlgorithmTraits:
    return AlgorithmTraits(name, "sum", forward_kinds=(FORWARD_KIND,), backward_kinds=(BACKWARD_KIND,))


def _require_complete(ctx: RunContext, name: str) -> None:
    for split, mask in ctx.masks.items():
        if not np.all(mask):
            raise UnsupportedError(f"{name} needs every feature block of every row ({split} has missing blocks); "
                                   "use --p-miss-train 0 --p-miss-test 0")


def _loss_name(ctx: RunContext) -> str:
    name = ctx.config.option("saddle_loss") or "auto"
    if name == "auto":
        return "logistic" if ctx.data.n_classes == 2 else "softmax"
    return str(name)


class LinearSaddleTrainer(Algorithm):
    """A linear model trained by one of the saddle-family methods; subclasses set ``name``."""

    name: ClassVar[str] = "eg"
    traits: ClassVar[AlgorithmTraits] = _traits("eg")
    persistent_messages: ClassVar[bool] = True  # full-batch messages carry the same quantity every round

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        _require_complete(ctx, self.name)
        cfg, data, part = ctx.config, ctx.data, ctx.partition
        mu = cfg.option("saddle_mu")
        mu = float(mu) if mu is not None else (cfg.weight_decay if cfg.weight_decay > 0 else 1e-3)
        loss = make_loss(_loss_name(ctx))
        n_out = loss.outputs(data.n_classes)
        splits = {s: np.asarray(getattr(data, f"X_{s}"), dtype=np.float64) for s in ("train", "val", "test")}
        features = [
            LinearFeatureParty(f"party{k}", {s: part.take(X, k) for s, X in splits.items()}, n_out, mu)
            for k in range(part.n_blocks)
        ]
        labels = {s: np.asarray(getattr(data, f"y_{s}")) for s in ("train", "val", "test")}
        label = LinearLabelParty(LABEL, labels, loss, data.n_classes)
        self.fed = LinearFederation(net, features, label, mu)
        self.iters = int(cfg.option("saddle_iters") or 100)
        self.method = self._make(cfg)

    def _make(self, cfg: Any) -> LinearAlgorithm:
        fed = self.fed
        mult = float(cfg.option("saddle_step_mult") or 1.0)
        if self.name == "admm":
            return ADMM(fed, rho=float(cfg.option("admm_rho") or 1.0) / fed.n, seed=cfg.seed)
        lam_max = power_lambda_max(fed, seed=cfg.seed)  # setup traffic, counted in the run's bytes
        if self.name == "gd":
            return GradientDescent(fed, smoothness(fed, lam_max), step_multiplier=mult, seed=cfg.seed)
        if self.name == "nesterov":
            return Nesterov(fed, smoothness(fed, lam_max), step_multiplier=mult, seed=cfg.seed)
        L_l = fed.label.smoothness
        if (cfg.option("saddle_step") or "scaled") == "theory":
            steps = StepSizes.theory(lam_max, fed.mu, L_l).scale(mult)
        else:
            steps = StepSizes.scaled(lam_max, fed.mu, L_l, mult)
        batch = int(cfg.option("saddle_batch") or 0) or None
        return ExtraGradient(fed, steps, participation=float(cfg.option("saddle_participation") or 1.0),
                             batch_size=batch, seed=cfg.seed)

    def batches_per_epoch(self) -> int:
        return self.iters

    def train_epoch(self, epoch: int, progress: ProgressFn | None = None) -> dict[str, float]:
        losses = []
        for _ in range(self.iters):
            self.method.iterate()
            last = self.method.last_sum
            loss = self.fed.label.loss_value(last[0], rows=last[1]) if last is not None else float("nan")
            losses.append(loss)
            if progress is not None:
                progress(loss)
        self.step = self.method.round
        return {"loss": float(np.mean(losses))}

    def evaluate(self, split: str) -> dict[str, float]:
        if self.ctx.rows(split) == 0:
            return {}
        n = self.fed.features[0].rows(split)
        meta = {"rows": {"s": split, "range": [0, n]}, "eval": True}
        msgs = [Message(FORWARD_KIND, p.name, LABEL, self.method.round, {"value": torch.from_numpy(p.output(split=split))},
                        meta=meta) for p in self.fed.features]
        z = self.net.aggregate(msgs, LABEL, "sum").tensor("value").numpy().astype(np.float64)
        lab = self.fed.label
        return classification_metrics(lab.labels(split), lab.loss.proba(z))

    def parties(self) -> dict[str, object]:
        return {**{p.name: p for p in self.fed.features}, LABEL: self.fed.label}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "t": self.method.t, "round": self.method.round,
                "avg_count": getattr(self.method, "_avg_count", 0)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.method.t = int(state.get("t", 0))
        self.method.round = int(state.get("round", 0))
        if hasattr(self.method, "_avg_count"):
            self.method._avg_count = int(state.get("avg_count", 0))


@ALGORITHMS.register("eg")
class EGTrainer(LinearSaddleTrainer):
    """ExtraGradient on the saddle-point reformulation (Beznosikov et al.)."""

    name = "eg"
    traits = _traits("eg")


@ALGORITHMS.register("gd")
class GDTrainer(LinearSaddleTrainer):
    """Gradient descent on the minimisation form (baseline of the saddle-point family)."""

    name = "gd"
    traits = _traits("gd")


@ALGORITHMS.register("nesterov")
class NesterovTrainer(LinearSaddleTrainer):
    """Nesterov's accelerated gradient on the minimisation form."""

    name = "nesterov"
    traits = _traits("nesterov")


@ALGORITHMS.register("admm")
class ADMMTrainer(LinearSaddleTrainer):
    """ADMM for the sharing problem (Boyd et al., Section 7.3)."""

    name = "admm"
    traits = _traits("admm")


@ALGORITHMS.register("eg-mlp")
class SaddleMLPTrainer(Algorithm):
    """Stochastic ExtraGradient with MLP bottom models and per-sample z, lambda (non-convex extension)."""

    name = "eg-mlp"
    traits = _traits("eg-mlp")

    def __init__(self, ctx: RunContext, net: Network) -> None:
        from secvfl.algorithms.saddle_mlp import build_mlp_saddle

        super().__init__(ctx, net)
        _require_complete(ctx, self.name)
        cfg, data, part = ctx.config, ctx.data, ctx.partition
        blocks = [{s: part.take(getattr(data, f"X_{s}"), k) for s in ("train", "val", "test")}
                  for k in range(part.n_blocks)]
        labels = {s: np.asarray(getattr(data, f"y_{s}")) for s in ("train", "val", "test")}
        self.algo = build_mlp_saddle(net, blocks, labels, data.n_classes, hidden=cfg.hidden, loss=_loss_name(ctx),
                                     lr=cfg.lr, batch_size=cfg.batch_size, weight_decay=cfg.weight_decay, seed=cfg.seed)

    def batches_per_epoch(self) -> int:
        return -(-self.ctx.rows("train") // self.cfg.batch_size)

    def train_epoch(self, epoch: int, progress: ProgressFn | None = None) -> dict[str, float]:
        out = self.algo.train_epoch(epoch)
        if progress is not None:
            for _ in range(self.batches_per_epoch()):
                progress(out["loss"])
        self.step = self.algo.step
        return out

    def evaluate(self, split: str) -> dict[str, float]:
        if self.ctx.rows(split) == 0:
            return {}
        s = self.algo.predict_scores(split)
        lab = self.algo.label
        return classification_metrics(lab._y[split], lab.loss.proba(s))

    def parties(self) -> dict[str, object]:
        return {**{p.name: p for p in self.algo.features}, LABEL: self.algo.label}


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
                            help="eg/gd/nesterov: multiply the step sizes (tuning)")
        parser.add_argument("--saddle-participation", type=float, default=None,
                            help="eg: probability that a feature party takes part in an iteration (default 1)")
        parser.add_argument("--saddle-batch", type=int, default=None,
                            help="eg: rows per iteration for stochastic mini-batch EG (default: full batch)")
        parser.add_argument("--saddle-iters", type=int, default=None,
                            help="eg/gd/nesterov/admm: iterations per epoch (default 100)")
        parser.add_argument("--saddle-loss", choices=("auto", "logistic", "softmax", "squared"), default=None,
                            help="saddle family: loss (auto: logistic for 2 classes, softmax otherwise)")
        parser.add_argument("--admm-rho", type=float, default=None, help="admm: penalty rho in units of 1/N (default 1)")

    def configure(self, cfg: Any, traits: AlgorithmTraits, ctx: Any) -> ProtocolSetup | None:
        given = [f for f in ("saddle_mu", "saddle_step", "saddle_step_mult", "saddle_participation", "saddle_batch",
                             "saddle_iters", "saddle_loss", "admm_rho") if cfg.option(f) is not None]
        if given and traits.name not in SADDLE_ALGOS:
            flags = ", ".join("--" + g.replace("_", "-") for g in given)
            raise UnsupportedError(f"{flags}: only for --algo {'/'.join(SADDLE_ALGOS)}, not {traits.name}")
        checks = {"saddle_mu": lambda v: v >= 0, "saddle_step_mult": lambda v: v > 0,
                  "saddle_participation": lambda v: 0 < v <= 1, "saddle_batch": lambda v: v >= 0,
                  "saddle_iters": lambda v: v >= 1, "admm_rho": lambda v: v > 0}
        for key, ok in checks.items():
            v = cfg.option(key)
            if v is not None and not ok(v):
                raise ConfigError(f"--{key.replace('_', '-')} has an invalid value {v}")
        if cfg.option("admm_rho") is not None and traits.name != "admm":
            raise UnsupportedError("--admm-rho applies to --algo admm only")
        eg_only = [f for f in ("saddle_step", "saddle_participation", "saddle_batch") if cfg.option(f) is not None]
        if eg_only and traits.name != "eg":
            raise UnsupportedError(f"--{eg_only[0].replace('_', '-')} applies to --algo eg only")
        return None


if "saddle" not in PROTOCOLS:
    PROTOCOLS.add("saddle", SaddleFlags())
