"""Shared machinery of the missing-feature-block algorithms (LASER-VFL and its baselines).

Setting (Valdeira et al.): K parties, party ``k`` holds feature block ``k`` of the samples it observes and the
labels. After entity alignment every party knows each sample's observation pattern (who holds it), so all parties
build the same :class:`~secvfl.data.pattern_sampler.PatternBatchSampler` from the public mask and the agreed seed
and walk through identical batches, each with one observed set ``K_o``, without exchanging indices.

Threat model: honest-but-curious parties. What a party sees of the others is exactly what crosses the network
(representations and gradients of the batch's observed parties, or predictions for a vote); a party never reads
another party's data, models or labels. Labels are held by every party (the paper's setting), so no label is sent.

Evaluation: every observed party predicts each test sample (see :mod:`secvfl.algorithms.missing.eval`); the run
harness, acting as the experimenter who holds the test labels, collects the predictions to score them. This is
outside the federation and sends nothing between parties.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from secvfl.algorithms.base import Algorithm, ProgressFn, RunContext, feature_party_names
from secvfl.algorithms.missing.eval import evaluate_predictions
from secvfl.algorithms.missing.flags import MissingOptions
from secvfl.data.pattern_sampler import PatternBatch, PatternBatchSampler, observed_parties, pattern_codes
from secvfl.errors import ConfigError
from secvfl.models import MLP, make_bottom, output_dim
from secvfl.transport.layers import Role
from secvfl.transport.network import Network

__all__ = ["MissingAlgorithm", "FlatOptimizer", "representation_model", "fusion_head", "SPLITS"]

SPLITS = ("train", "val", "test")


class FlatOptimizer:
    """A party's parameters in one flat buffer, updated with torch.optim's Adam/AdamW/SGD rule in a few
    whole-buffer operations.

    Why not ``torch.optim``: the models here are tiny (hundreds of weights), so its per-call, per-parameter Python
    work costs more than the arithmetic. The parameters are re-pointed into one contiguous buffer (the modules keep
    working unchanged) and each step is a constant number of tensor operations, however many models a party has.
    ``torch.optim.Adam`` in its place, ``foreach`` or not, makes every missing-block algorithm's epoch slower
    (measured when it was introduced, ``secvfl bench laser`` on credit: a LASER-VFL epoch 0.64 s against 1.06 s with
    ``torch.optim.Adam(foreach=True)``; the git history of BENCHMARKS.md has the table).

    Parameters come in groups (one per model) that step independently: a group that received no gradient this step
    is left alone -- no decay, no moment update, no step count -- exactly like ``torch.optim`` skips parameters
    whose ``.grad`` is None (Combinatorial trains only some predictors per batch). Update rules: ``torch.optim.Adam``
    (L2 weight decay added to the gradient), ``AdamW`` (decoupled decay), ``SGD`` (no momentum, as
    ``make_optimizer`` builds it); betas (0.9, 0.999), eps 1e-8.
    """

    def __init__(self, groups: list[list[nn.Parameter]], name: str, lr: float, weight_decay: float) -> None:
        if name not in ("adam", "adamw", "sgd"):
            raise ConfigError(f"unknown optimiser {name!r}; choose one of adam, adamw, sgd")
        self.name, self.lr, self.weight_decay = name, float(lr), float(weight_decay)
        self.betas, self.eps = (0.9, 0.999), 1e-8
        self.groups = [[p for p in g if p.requires_grad] for g in groups]
        params = [p for g in self.groups for p in g]
        self.sizes = [sum(p.numel() for p in g) for g in self.groups]
        self.flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
        offset = 0
        for p in params:  # the parameter now lives inside the flat buffer
            n = p.numel()
            p.data = self.flat[offset : offset + n].view_as(p)
            offset += n
        self.bounds = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.steps = torch.zeros(len(self.groups), dtype=torch.float64)
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self._sizes_t = torch.as_tensor(self.sizes, dtype=torch.int64)
        self._grads: dict[int, torch.Tensor] = {}
        self._uniform = True  # all groups have the same step count (true until some group skips a step)

    def set_grads(self, group: int, grads: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        """Gradients of group ``group``'s parameters, in their order; accumulated if set twice in one step."""
        g = torch.cat([x.reshape(-1) for x in grads]) if len(grads) > 1 else grads[0].reshape(-1)
        self._grads[group] = self._grads[group] + g if group in self._grads else g

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The full-buffer gradient (zeros for idle groups) and, if some group is idle, masks of active groups."""
        n = len(self.groups)
        if len(self._grads) == n:
            return torch.cat([self._grads[i] for i in range(n)]), None, None
        pieces, active = [], torch.zeros(n, dtype=torch.bool)
        for i in range(n):
            if i in self._grads:
                pieces.append(self._grads[i])
                active[i] = True
            else:
                pieces.append(self.flat.new_zeros(self.sizes[i]))
        elem = torch.repeat_interleave(active, self._sizes_t)
        return torch.cat(pieces), active, elem

    def step(self) -> None:
        if not self._grads:
            return
        g, active, elem = self._gather()
        self._grads = {}
        p = self.flat
        if self.name == "sgd":
            if self.weight_decay:
                g = g.add(p, alpha=self.weight_decay) if elem is None else g.add(p * elem, alpha=self.weight_decay)
            p.add_(g, alpha=-self.lr)
            return
        b1, b2 = self.betas
        if active is None:
            self.steps += 1
        else:
            self.steps[active] += 1
            self._uniform = False
        if self._uniform:  # every group has taken every step: scalar bias corrections
            t: torch.Tensor | float = float(self.steps[0])
        else:
            t = torch.repeat_interleave(self.steps, self._sizes_t).to(p.dtype)
        if self.name == "adamw":
            decay = 1 - self.lr * self.weight_decay
            p.mul_(decay if elem is None else torch.where(elem, decay, 1.0))
        elif self.weight_decay:
            g = g.add(p, alpha=self.weight_decay)
        m, v = self.exp_avg, self.exp_avg_sq
        if elem is None:
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
        else:
            m.copy_(torch.where(elem, m.lerp(g, 1 - b1), m))
            v.copy_(torch.where(elem, v * b2 + (1 - b2) * g * g, v))
        if isinstance(t, float):
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / (1 - b1**t))
            return
        denom = (v / (1 - b2**t)).sqrt_().add_(self.eps)
        update = m / (1 - b1**t) / denom
        p.sub_(update * self.lr if elem is None else torch.where(elem, update * self.lr, 0.0))

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sizes": list(self.sizes), "steps": self.steps.clone(),
                "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name or list(state["sizes"]) != self.sizes:
            raise ConfigError("optimiser state does not match this party's optimiser (different --optimizer or model)")
        self.steps.copy_(state["steps"])
        self._uniform = bool((self.steps == self.steps[0]).all()) if len(self.steps) else True
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])


def representation_model(ctx: RunContext, k: int) -> nn.Module:
    """``f_k``: the configured bottom model on block ``k``, output width ``--embedding-dim``."""
    cfg, part = ctx.config, ctx.partition
    return make_bottom(cfg.bottom, len(part.blocks[k]), cfg.embedding_dim, list(cfg.hidden), part.block_shapes[k],
                       channels=part.channels)


def fusion_head(ctx: RunContext, in_dim: int) -> nn.Module:
    """``g_k``: an MLP (``--head-hidden``, empty for a linear head) from ``in_dim`` to the logits."""
    return MLP(in_dim, list(ctx.config.head_hidden), output_dim(ctx.data.n_classes))


class MissingAlgorithm(Algorithm):
    """Base of the algorithms trained on pattern-grouped batches and scored with the paper's metrics."""

    # Which batches an algorithm trains on; None: every batch.
    min_observed: ClassVar[int] = 1
    options_type = MissingOptions

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        self.K = ctx.partition.n_blocks
        self.names = feature_party_names(self.K)
        self.departed: set[int] = set()  # blocks of parties that left the federation (see depart)
        self.n_classes = ctx.data.n_classes
        self.sampler = PatternBatchSampler(
            ctx.masks["train"], self.cfg.batch_size, seed=self.cfg.seed, labels=ctx.data.y_train,
            class_balanced=self.cfg.options_for(MissingOptions).class_balanced,
        )
        # The experimenter's copy of the labels, for scoring only (parties hold their own copies).
        self._labels = {s: np.asarray(getattr(ctx.data, f"y_{s}")) for s in SPLITS}

    @classmethod
    def party_roles(cls, k: int) -> dict[str, Role]:
        # Every party holds features, labels and a head: all are label parties. Protocols that assume a single
        # label party are refused by the topology with a clear message.
        return {p: Role.LABEL for p in feature_party_names(k)}

    # -- training ---------------------------------------------------------------------------------------------
    def trains_on(self, observed: tuple[int, ...]) -> bool:
        """Whether a batch with this observed set is used (Standard VFL: only complete ones; PlugVFL: active)."""
        return True

    def epoch_batches(self, epoch: int) -> list[PatternBatch]:
        return [b for b in self.sampler.epoch(epoch) if self.trains_on(b.observed)]

    def batches_per_epoch(self) -> int:
        return max(1, len(self.epoch_batches(0)))

    @abstractmethod
    def train_batch(self, batch: PatternBatch) -> float:
        """One optimisation step on one batch; returns its loss."""

    def train_epoch(self, epoch: int, progress: ProgressFn | None = None) -> dict[str, float]:
        losses = []
        for batch in self.epoch_batches(epoch):
            loss = self.train_batch(batch)
            losses.append(loss)
            self.step += 1
            if progress is not None:
                progress(loss)
        return {"loss": float(np.mean(losses)) if losses else float("nan"), "batches": float(len(losses))}

    # -- prediction and scoring -------------------------------------------------------------------------------
    @abstractmethod
    def predict_group(self, split: str, ids: np.ndarray, observed: tuple[int, ...]) -> dict[int, np.ndarray]:
        """Predicted labels of every observed party for rows ``ids`` that share the observed set ``observed``."""

    def predict_parties(self, split: str, mask: np.ndarray | None = None) -> np.ndarray:
        """(N, K) predicted labels, -1 where a party does not observe the row. ``mask`` defaults to the run's."""
        mask = self.ctx.masks[split] if mask is None else np.asarray(mask, dtype=bool)
        n = self.ctx.rows(split)
        if mask.shape != (n, self.K):
            raise ConfigError(f"an observation mask for {split} must have shape ({n}, {self.K}), got {mask.shape}")
        out = np.full((n, self.K), -1, dtype=np.int64)
        codes = pattern_codes(mask)
        chunk = self.cfg.eval_batch_size
        for code in np.unique(codes):
            if code == 0:
                continue  # nobody holds these rows: nobody can predict them
            observed = observed_parties(int(code), self.K)
            rows = np.flatnonzero(codes == code)
            for s in range(0, len(rows), chunk):
                ids = rows[s : s + chunk]
                for k, pred in self.predict_group(split, ids, observed).items():
                    out[ids, k] = pred
        return out

    def score(self, split: str, mask: np.ndarray | None = None) -> dict[str, float]:
        """The paper's metrics on ``split``: ``accuracy`` (mean over rows of the mean over observed parties of a
        correct prediction) and, for binary labels, ``f1_positive`` (F1 of class 1 per party on the rows it observes,
        averaged over parties). Named like the other algorithms' positive-class F1; their ``f1`` is macro F1."""
        mask = self.ctx.masks[split] if mask is None else np.asarray(mask, dtype=bool)
        if self.departed:  # a party that left predicts nothing: its block is missing in every row
            mask = mask.copy()
            mask[:, sorted(self.departed)] = False
        if self.ctx.rows(split) == 0:
            return {}
        preds = self.predict_parties(split, mask)
        m = evaluate_predictions(preds, self._labels[split], mask, n_classes=self.n_classes)
        out = {"accuracy": m.accuracy}
        if m.f1 is not None:
            out["f1_positive"] = m.f1
        out["unpredictable_rows"] = float(m.n_unpredictable)
        return out

    def evaluate(self, split: str) -> dict[str, float]:
        return self.score(split)

    def depart(self, name: str) -> bool:
        """Party ``name`` has left: score without its block from now on. False if no party would be left."""
        k = self.names.index(name)
        if len(self.departed | {k}) >= self.K:
            return False
        self.departed.add(k)
        return True
