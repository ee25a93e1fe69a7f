"""``secvfl train --algo eg|gd|nesterov|admm|eg-mlp``: the saddle-point family behind the common trainer interface.

The linear methods run the optimiser of ``secvfl reproduce saddle``, built by the same function
(:func:`secvfl.algorithms.saddle.methods.build_method`: same step sizes, same ``mu``), on parties built by the same
:func:`secvfl.algorithms.saddle.federation.build_federation`. The model is linear (logistic for 2 classes, softmax
otherwise, or ``--saddle-loss squared``) on the run's standardised features plus an intercept (a column of ones
held by the first feature party: centred features have no other way to express the class prior), full batch by
default; one "epoch" is ``--saddle-iters`` iterations (default 100). The logged training loss is the label party's mean loss
``l(sum_k A_k x_k)`` at the points it received during the epoch (the regulariser not included). ``eg-mlp``
(:mod:`secvfl.algorithms.saddle.mlp`) trains MLP bottom models (``--hidden``) with stochastic EG, one epoch = one
pass of ``--batch-size`` batches; ``--optimizer``/``--lr`` step the model parameters as for every neural algorithm
(default adam, 1e-3: ExtraAdam; ``--optimizer sgd --lr 0.05`` is plain EG).

Options (:class:`secvfl.algorithms.saddle.flags.SaddleOptions`, the family's ``options_type``):
``--saddle-mu`` (L2 regularisation, default 1e-3, or ``--weight-decay`` when given), ``--saddle-step
scaled|theory``, ``--saddle-step-mult``, ``--saddle-participation P``, ``--saddle-batch B`` (0: full batch),
``--saddle-iters``, ``--saddle-loss``, ``--admm-rho`` (in units of 1/N).

Bytes. A value costs ``s`` bytes on the wire (4 with ``--dtype float32``, the default; 8 with float64; the parties
compute in float64 either way). With ``K`` feature parties, ``B`` rows per iteration (``N``, the training rows, full
batch; ``--saddle-batch B`` otherwise) and ``C`` model outputs (1 for a binary task, the classes for softmax), one
communication round is ``K`` forward ``logits`` messages (``A_k x_k``, ``B x C``) and ``K`` backward ``gradient``
messages (``lambda``, or ``grad l`` for gd/nesterov, the residual for admm; ``B x C``), i.e. ``2 K B C s`` bytes
plus one header per message. EG needs two rounds per iteration, gd/nesterov/admm one::

    eg: 4 K B C s + headers per iteration        gd, nesterov, admm: 2 K B C s + headers per iteration

(with ``--saddle-participation`` only the participating parties' messages). Once per run (eg/gd/nesterov, not
repeated on resume): the power iteration for ``lambda_max``, at most 100 rounds of ``2 K`` ``control`` messages of
``N`` values. Each evaluation (validation after every epoch, test at the end): ``K`` ``logits`` messages of
``N_split x C`` values. a9a, 5 parties: N = 29305, C = 1, so one EG iteration is 2.34 MB plus 20 headers.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from secvfl.algorithms import ALGORITHMS
from secvfl.algorithms.base import Algorithm, ProgressFn, RunContext
from secvfl.algorithms.saddle.base import LinearAlgorithm
from secvfl.algorithms.saddle.federation import (
    BACKWARD_KIND,
    FORWARD_KIND,
    LABEL,
    build_federation,
    power_lambda_max,
)
from secvfl.algorithms.saddle.flags import SaddleOptions
from secvfl.algorithms.saddle.methods import build_method
from secvfl.errors import ConfigError, UnsupportedError
from secvfl.handles import LocalHandle, PartyHandle
from secvfl.metrics import classification_metrics
from secvfl.transport.layers import AlgorithmTraits
from secvfl.transport.network import Network

__all__ = ["LinearSaddleTrainer", "EGTrainer", "GDTrainer", "NesterovTrainer", "ADMMTrainer", "SaddleMLPTrainer"]


def _traits(name: str, *, persistent: bool = False, needs_error_feedback: str = "") -> AlgorithmTraits:
    return AlgorithmTraits(name, "sum", forward_kinds=(FORWARD_KIND,), backward_kinds=(BACKWARD_KIND,),
                           persistent_messages=persistent, needs_error_feedback=needs_error_feedback)


# eg-mlp's AlgorithmTraits.needs_error_feedback (`secvfl train --dataset breast_cancer --compress randk:0.1`)
_MLP_NEEDS_FEEDBACK = ("stochastic ExtraGradient steps on each per-sample output and dual as sent, and a sparsified "
                       "copy without memory (rand-k: n/k - 1 times its size in error) leaves it below the majority "
                       "class (randk:0.1: 0.55 test accuracy); its messages name no rows, so error feedback cannot "
                       "apply either: use a codec (quant:8, fp16)")


def _require_complete(ctx: RunContext, name: str) -> None:
    for split, mask in ctx.masks.items():
        if not np.all(mask):
            raise UnsupportedError(f"{name} needs every feature block of every row ({split} has missing blocks); "
                                   "use --p-miss-train 0 --p-miss-test 0")


def _loss_name(ctx: RunContext) -> str:
    return ctx.config.options_for(SaddleOptions).loss(ctx.data.n_classes)


class LinearSaddleTrainer(Algorithm):
    """A linear model trained by one of the saddle-family methods; subclasses set ``name``."""

    name: ClassVar[str] = "eg"
    # full-batch messages carry the same quantity every round (AlgorithmTraits.persistent_messages)
    traits: ClassVar[AlgorithmTraits] = _traits("eg", persistent=True)
    options_type = SaddleOptions
    uses_lambda_max: ClassVar[bool] = True  # its step sizes need lambda_max(A^T A) (ADMM's penalty does not)
    unused_settings = {
        "lr": "its step sizes come from the problem's smoothness; scale them with --saddle-step-mult",
        "optimizer": "--algo itself names the method (eg, gd, nesterov, admm)",
        "batch_size": "it trains on the full batch (eg: --saddle-batch B for stochastic mini-batches)",
        "hidden": "its model is linear, A_k x_k per party (--algo eg-mlp trains MLPs)",
        "embedding_dim": "its model is linear: each party sends its share of the logits (--algo eg-mlp trains MLPs)",
        "head_hidden": "the label party adds the parties' linear outputs, with no head",
        "bottom": "its model is linear, A_k x_k per party (--algo eg-mlp trains MLPs)",
        "eval_batch_size": "it evaluates the linear model in one pass",
    }

    def step_size(self) -> tuple[str, float] | None:
        return "--saddle-step-mult", self.options.saddle_step_mult or 1.0

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        _require_complete(ctx, self.name)
        cfg, data, part = ctx.config, ctx.data, ctx.partition
        self.options = cfg.options_for(SaddleOptions)
        mu = self.options.saddle_mu
        mu = mu if mu is not None else (cfg.weight_decay if cfg.weight_decay > 0 else 1e-3)
        # the run's features are standardised (centred), hence the intercept; see build_federation
        self.fed = build_federation(data.X_train, data.y_train, data.X_test, data.y_test, val=(data.X_val, data.y_val),
                                    blocks=part.blocks, loss=_loss_name(ctx), mu=mu, n_classes=data.n_classes,
                                    net=net, intercept=True, wire_dtype=ctx.dtype)
        self.iters = self.options.saddle_iters or 100
        share = self.options.saddle_participation
        if share is not None and share * self.iters * cfg.epochs < 1:  # a degenerate value, not a setting
            raise ConfigError(f"--saddle-participation {share:g}: a feature party would take part in "
                              f"{share * self.iters * cfg.epochs:.2g} of the run's {self.iters * cfg.epochs} "
                              "iterations on average, so the model would not train; raise it (1: every iteration)")
        self._method: LinearAlgorithm | None = None
        self._counters = {"t": 0, "round": 0, "avg_count": 0}

    @property
    def method(self) -> LinearAlgorithm:
        """The optimiser, built at first use. ``lambda_max`` (eg/gd/nesterov) comes from the power iteration, setup
        traffic counted in the run's bytes; the label party keeps it with its state, so a resumed run, which builds
        the optimiser after restoring the parties, neither repeats nor recounts that traffic."""
        if self._method is None:
            cfg, lab, o = self.cfg, self.fed.label, self.options
            if self.uses_lambda_max and "lambda_max" not in lab.vars:
                lab.vars["lambda_max"] = np.array(power_lambda_max(self.fed, seed=cfg.seed))
            self._method = build_method(
                self.fed, self.name, lam_max=float(lab.vars["lambda_max"]) if "lambda_max" in lab.vars else None,
                step=o.saddle_step or "scaled", multiplier=o.saddle_step_mult or 1.0,
                participation=o.saddle_participation or 1.0, batch_size=o.saddle_batch or None,
                admm_rho=o.admm_rho or 1.0, seed=cfg.seed)
            self._method.set_counters(self._counters)
        return self._method

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
        n = self.ctx.rows(split)
        if n == 0:
            return {}
        meta = {"rows": {"s": split, "range": [0, n]}, "eval": True}
        round_ = self.method.round
        for h in self.fed.feature_handles:
            h.send_output(round_, meta, split=split)
        senders = [h.name for h in self.fed.feature_handles]
        z = self.net.aggregate_submitted(LABEL, FORWARD_KIND, senders=senders).tensor("value").to(
            torch.float64).numpy()
        lab = self.fed.label
        return classification_metrics(lab.labels(split), lab.loss.proba(z))

    def handles(self) -> dict[str, PartyHandle]:
        # the label party's variables are the optimiser's own (it runs in the label party's process): held directly,
        # its state saved through a handle like every party's
        return {**{h.name: h for h in self.fed.feature_handles}, LABEL: LocalHandle(self.fed.label, self.net)}

    def state_dict(self) -> dict:
        counters = self._counters if self._method is None else {"avg_count": 0, **self._method.counters()}
        counters = {k: counters[k] for k in ("t", "round", "avg_count")}
        return {**super().state_dict(), **counters}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._counters = {k: int(state.get(k, 0)) for k in ("t", "round", "avg_count")}
        if self._method is not None:
            self._method.set_counters(self._counters)


@ALGORITHMS.register("eg")
class EGTrainer(LinearSaddleTrainer):
    """ExtraGradient on the saddle-point reformulation (Beznosikov et al.)."""

    name = "eg"
    traits = _traits("eg", persistent=True)


@ALGORITHMS.register("gd")
class GDTrainer(LinearSaddleTrainer):
    """Gradient descent on the minimisation form (baseline of the saddle-point family)."""

    name = "gd"
    traits = _traits("gd", persistent=True)


@ALGORITHMS.register("nesterov")
class NesterovTrainer(LinearSaddleTrainer):
    """Nesterov's accelerated gradient on the minimisation form."""

    name = "nesterov"
    traits = _traits("nesterov", persistent=True)


@ALGORITHMS.register("admm")
class ADMMTrainer(LinearSaddleTrainer):
    """ADMM for the sharing problem (Boyd et al., Section 7.3)."""

    name = "admm"
    traits = _traits("admm", persistent=True)
    uses_lambda_max = False
    unused_settings = {**LinearSaddleTrainer.unused_settings,
                       "lr": "its steps follow from its penalty --admm-rho",
                       "batch_size": "it trains on the full batch"}

    def step_size(self) -> tuple[str, float] | None:
        return None  # its steps are exact minimisations under the penalty --admm-rho


@ALGORITHMS.register("eg-mlp")
class SaddleMLPTrainer(Algorithm):
    """Stochastic ExtraGradient with MLP bottom models and per-sample z, lambda (non-convex extension)."""

    name = "eg-mlp"
    traits = _traits("eg-mlp", needs_error_feedback=_MLP_NEEDS_FEEDBACK)
    options_type = SaddleOptions
    unused_settings = {
        "embedding_dim": "each party's MLP outputs its share of the logits, one value per class",
        "head_hidden": "the label party adds the parties' outputs, with no head",
        "bottom": "each party's model is an MLP of widths --hidden",
    }

    def __init__(self, ctx: RunContext, net: Network) -> None:
        from secvfl.algorithms.saddle.mlp import build_mlp_saddle

        super().__init__(ctx, net)
        _require_complete(ctx, self.name)
        cfg, data, part = ctx.config, ctx.data, ctx.partition
        blocks = [{s: part.take(getattr(data, f"X_{s}"), k) for s in ("train", "val", "test")}
                  for k in range(part.n_blocks)]
        labels = {s: np.asarray(getattr(data, f"y_{s}")) for s in ("train", "val", "test")}
        self.algo = build_mlp_saddle(net, blocks, labels, data.n_classes, hidden=cfg.hidden, loss=_loss_name(ctx),
                                     optimizer=cfg.optimizer, lr=cfg.lr, batch_size=cfg.batch_size,
                                     weight_decay=cfg.weight_decay, seed=cfg.seed, dtype=ctx.dtype)

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
        s = self.algo.predict_scores(split, self.cfg.eval_batch_size)
        lab = self.algo.label
        return classification_metrics(lab.labels(split), lab.loss.proba(s))

    def handles(self) -> dict[str, PartyHandle]:
        return {**{h.name: h for h in self.algo.feature_handles}, LABEL: LocalHandle(self.algo.label, self.net)}

    def state_dict(self) -> dict:
        # the message step counter (evaluations advance it too): a resumed run's headers, hence bytes, match
        return {**super().state_dict(), "message_step": self.algo.step}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.algo.step = int(state.get("message_step", self.step))
