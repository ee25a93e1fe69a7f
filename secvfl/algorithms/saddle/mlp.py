"""Saddle-point VFL beyond linear models: MLP bottom models, per-sample ``z`` and ``lambda``, stochastic EG.

Feature party ``k`` runs a bottom model ``f_k(a_nk; theta_k)`` with C outputs; the model is ``sum_k f_k``. With the
per-sample variables ``z_n`` and ``lambda_n`` (scaled by N, so every quantity is O(1))::

    min_{theta, z} max_lambda  (1/N) sum_n [ loss(z_n, y_n) + <lambda_n, sum_k f_k(a_nk; theta_k) - z_n> ] + r(theta)

Each mini-batch ``B`` is one stochastic ExtraGradient iteration of two rounds (feature parties send
``f_k(A_kB; theta_k)``; the label party sends ``lambda_B``), updating ``theta`` with the batch estimate
``(1/b) sum_B J_k^T lambda_n`` and only the batch rows of ``z`` and ``lambda``. The problem is not convex-concave,
so there is no guarantee beyond stationarity; the point is that the same extensions (compression of both
directions, partial participation, noise) apply unchanged.

As in the linear family, the optimiser reaches a feature party only through its :class:`MLPFeatureHandle` (the
party keeps its own snapshots of ``theta``: ``theta^t`` and the half step) and holds the label party directly.

A row seen for the first time starts at ``z_n = sum_k f_k(a_nk)`` and ``lambda_n = grad loss(z_n)`` (the label
party computes both from what it received), i.e. on the saddle manifold of the current model, instead of at zero,
where the first updates would point the wrong way. Step sizes: ``1/curvature`` for ``z`` and ``curvature/2`` for
``lambda`` (the same block scaling as the linear case); ``theta`` is stepped by its party's optimizer, both EG steps
from ``theta^t``: ``sgd`` is plain EG with step ``lr``, ``adam``/``adamw`` ExtraAdam (Gidel et al., "A Variational
Inequality Perspective on Generative Adversarial Networks", ICLR 2019: the moments are updated at both steps), so
``secvfl train``'s shared defaults (adam, lr 1e-3) fit eg-mlp as they fit the other neural algorithms. Weight decay
is the ``r(theta)`` of the problem, inside the operator, so adam and adamw coincide here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from secvfl.algorithms.saddle.federation import BACKWARD_KIND, FORWARD_KIND, LABEL
from secvfl.algorithms.saddle.losses import Loss, make_loss
from secvfl.errors import ConfigError
from secvfl.handles import LocalHandle, request
from secvfl.messages import Message
from secvfl.parties import OPTIMIZERS, make_optimizer
from secvfl.transport.network import Network

__all__ = ["MLPFeatureParty", "MLPFeatureHandle", "MLPLabelParty", "SaddleMLP", "build_mlp_saddle"]

Params = dict[str, torch.Tensor]


class MLPFeatureParty:
    """A feature party with its own block (train/test rows) and bottom model; holds nothing else."""

    def __init__(self, name: str, blocks: dict[str, np.ndarray], model: nn.Module, *, weight_decay: float = 0.0,
                 dtype: torch.dtype = torch.float32, optimizer: str = "sgd", lr: float = 0.05) -> None:
        self.name = name
        self._x = {s: torch.as_tensor(np.asarray(b), dtype=dtype) for s, b in blocks.items()}
        self.model = model.to(dtype=dtype)
        self.weight_decay = float(weight_decay)
        self.dtype = dtype
        # weight decay is the r(theta) of the saddle problem, inside the operator, so not the optimizer's
        self.optimizer = make_optimizer(self.model.parameters(), optimizer, lr)
        self.snapshots: dict[str, Params] = {}  # this batch's theta^t and half step, by name

    def __repr__(self) -> str:
        return f"MLPFeatureParty({self.name!r})"

    def params(self) -> Params:
        return {k: v.detach() for k, v in self.model.named_parameters()}

    def output(self, split: str, rows: np.ndarray | None, params: Params | None = None) -> torch.Tensor:
        x = self._x[split] if rows is None else self._x[split][torch.as_tensor(rows)]
        with torch.no_grad():
            return functional_call(self.model, params or self.params(), (x,))

    def operator(self, rows: np.ndarray, lam: torch.Tensor, params: Params) -> Params:
        """``grad r(theta) + (1/b) J(theta)^T lambda_B`` at ``params`` (a vector-Jacobian product)."""
        x = self._x["train"][torch.as_tensor(rows)]
        p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        out = functional_call(self.model, p, (x,))
        grads = torch.autograd.grad(out, list(p.values()), grad_outputs=lam.to(out.dtype) / len(rows))
        return {k: g + self.weight_decay * p[k].detach() for k, g in zip(p, grads, strict=True)}

    def step_from(self, start: Params, rows: np.ndarray, lam: torch.Tensor, at: Params) -> Params:
        """One optimizer step from ``start`` along the operator evaluated at ``at`` (both EG steps start from
        theta^t); the model holds the result, which is returned as a copy."""
        grads = self.operator(rows, lam, at)
        self.load(start)
        for k, v in self.model.named_parameters():
            v.grad = grads[k]
        self.optimizer.step()
        return self.snapshot()

    def snapshot(self) -> Params:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def load(self, params: Params) -> None:
        with torch.no_grad():
            for k, v in self.model.named_parameters():
                v.copy_(params[k])

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class MLPFeatureHandle(LocalHandle):
    """A :class:`MLPFeatureParty`: requests name the party's snapshots of its parameters (``theta^t`` as "start",
    the half step as "half"); the party takes the label party's ``lambda`` from the network and steps itself."""

    _party: MLPFeatureParty

    @request
    def snapshot(self, name: str) -> None:
        """Keep the current parameters as ``name``."""
        self._party.snapshots[name] = self._party.snapshot()

    @request
    def send_output(self, step: int, meta: dict[str, Any], *, split: str, rows: np.ndarray,
                    params: str | None = None) -> None:
        """The model's output on rows ``rows`` of ``split`` (at the snapshot ``params``, else the current
        parameters), submitted to the aggregation for the label party."""
        p = self._party
        out = p.output(split, rows, p.snapshots[params] if params is not None else None)
        self._net.submit(Message(FORWARD_KIND, self.name, LABEL, step, {"value": out}, meta=meta))

    @request
    def step_from(self, *, at: str, rows: np.ndarray, into: str | None = None) -> None:
        """Take the ``lambda`` the label party sent and step from "start" along the operator at the snapshot
        ``at``; with ``into``, keep the result as that snapshot."""
        p = self._party
        lam = self._receive(BACKWARD_KIND, LABEL).tensor("value")
        result = p.step_from(p.snapshots["start"], rows, lam, at=p.snapshots[at])
        if into is not None:
            p.snapshots[into] = result


class MLPLabelParty:
    """Labels, the loss, and the per-sample ``z`` and ``lambda`` (scaled by N) of the training rows."""

    def __init__(self, name: str, labels: dict[str, np.ndarray], loss: Loss, n_classes: int) -> None:
        self.name = name
        self.loss = loss
        self.n_classes = n_classes
        self._y = {s: np.asarray(v, dtype=np.int64) for s, v in labels.items()}
        self._t = {s: loss.targets(v, n_classes) for s, v in self._y.items()}
        n = len(self._y["train"])
        self.C = loss.outputs(n_classes)
        self.z = np.zeros((n, self.C))
        self.lam = np.zeros((n, self.C))
        self.seen = np.zeros(n, dtype=bool)

    def rows(self, split: str) -> int:
        return len(self._y[split])

    def labels(self, split: str) -> np.ndarray:
        return self._y[split]

    def row_grad(self, z: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Per-row gradient of ``loss`` (not divided by N)."""
        return self.loss.grad(z, self._t["train"][rows]) * len(rows)

    def batch_loss(self, s: np.ndarray, rows: np.ndarray) -> float:
        return self.loss.value(s, self._t["train"][rows])

    def accuracy(self, s: np.ndarray, split: str) -> float:
        return float(np.mean(self.loss.predict(s) == self._y[split]))

    def state_dict(self) -> dict:
        return {"z": torch.from_numpy(self.z.copy()), "lam": torch.from_numpy(self.lam.copy()),
                "seen": torch.from_numpy(self.seen.copy())}

    def load_state_dict(self, state: dict) -> None:
        self.z, self.lam, self.seen = state["z"].numpy().copy(), state["lam"].numpy().copy(), state["seen"].numpy().copy()


class SaddleMLP:
    """Stochastic ExtraGradient for MLP bottom models (``--algo eg-mlp``); see the module docstring."""

    method: ClassVar[str] = "eg-mlp"

    def __init__(self, net: Network, features: Sequence[MLPFeatureHandle], label: MLPLabelParty, *,
                 batch_size: int, z_step: float | None = None, lam_step: float | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32, optimizer: str = "sgd", lr: float = 0.05) -> None:
        self.net, self.feature_handles, self.label = net, list(features), label
        curv = label.loss.curvature()
        self.z_step = z_step if z_step is not None else 1.0 / curv
        self.lam_step = lam_step if lam_step is not None else 0.5 * curv
        self.batch_size = batch_size
        self.seed = seed
        self.dtype = dtype  # the parties' (and the wire's) dtype
        self.optimizer, self.lr = optimizer, lr
        self.step = 0

    # -- communication ----------------------------------------------------------------------------------------
    def _forward(self, rows: np.ndarray, split: str = "train", params: str | None = None) -> np.ndarray:
        """Every feature party's output on ``rows`` (at its snapshot ``params``): the sum the label party gets."""
        meta: dict[str, Any] = {"rows": [split, *map(int, rows)]}
        if split != "train":
            meta["eval"] = True  # prediction traffic (a compression layer sends it dense by default)
        for h in self.feature_handles:
            h.send_output(self.step, meta, split=split, rows=rows, params=params)
        senders = [h.name for h in self.feature_handles]
        return self.net.aggregate_submitted(LABEL, FORWARD_KIND, senders=senders).tensor("value").to(
            torch.float64).numpy()

    def _backward(self, lam: np.ndarray, names: Sequence[str], rows: np.ndarray, dtype: torch.dtype) -> None:
        t = torch.as_tensor(lam, dtype=dtype)
        meta = {"rows": ["train", *map(int, rows)]}
        self.net.send(*[Message(BACKWARD_KIND, LABEL, n, self.step, {"value": t}, meta=meta) for n in names])

    # -- training ---------------------------------------------------------------------------------------------
    def train_batch(self, rows: np.ndarray) -> float:
        lab = self.label
        parts = self.feature_handles
        names = [h.name for h in parts]
        for h in parts:
            h.snapshot("start")
        S = self._forward(rows, params="start")
        fresh = ~lab.seen[rows]
        if fresh.any():  # start unseen rows on the saddle manifold of the current model
            r = rows[fresh]
            lab.z[r] = S[fresh]
            lab.lam[r] = lab.row_grad(S[fresh], r)
            lab.seen[r] = True
        z, lam = lab.z[rows], lab.lam[rows]
        self._backward(lam, names, rows, self.dtype)
        self.step += 1
        for h in parts:
            h.step_from(at="start", into="half", rows=rows)
        zh = z - self.z_step * (lab.row_grad(z, rows) - lam)
        lh = lam + self.lam_step * (S - z)
        Sh = self._forward(rows, params="half")
        self._backward(lh, names, rows, self.dtype)
        self.step += 1
        for h in parts:
            h.step_from(at="half", rows=rows)
        lab.z[rows] = z - self.z_step * (lab.row_grad(zh, rows) - lh)
        lab.lam[rows] = lam + self.lam_step * (Sh - zh)
        return lab.batch_loss(S, rows)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        n = len(self.label.seen)
        order = np.random.default_rng([self.seed, epoch]).permutation(n)
        losses = [self.train_batch(np.sort(order[i : i + self.batch_size])) for i in range(0, n, self.batch_size)]
        return {"loss": float(np.mean(losses))}

    def predict_scores(self, split: str, eval_batch: int = 4096) -> np.ndarray:
        """Sum of the bottom outputs on ``split`` (the feature parties send them to the label party)."""
        n = self.label.rows(split)
        out = []
        for start in range(0, n, eval_batch):
            rows = np.arange(start, min(n, start + eval_batch))
            out.append(self._forward(rows, split))
            self.step += 1
        return np.concatenate(out) if out else np.zeros((0, self.label.C))

    def evaluate(self, split: str) -> dict[str, float]:
        s = self.predict_scores(split)
        return {"accuracy": self.label.accuracy(s, split), "loss": self.label.loss.value(s, self.label._t[split])}

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "optimizer": OPTIMIZERS[self.optimizer].__name__, "lr": self.lr,
                "z_step": self.z_step, "lambda_step": self.lam_step, "batch_size": self.batch_size}


def build_mlp_saddle(
    net: Network, blocks: Sequence[dict[str, np.ndarray]], labels: dict[str, np.ndarray], n_classes: int, *,
    hidden: Sequence[int] = (64,), loss: str = "softmax", optimizer: str = "sgd", lr: float = 0.05,
    batch_size: int = 64, weight_decay: float = 0.0, seed: int = 0, dtype: torch.dtype = torch.float32,
) -> SaddleMLP:
    """Parties ``party0..`` with MLP bottoms (C outputs each) and the label party ``label`` on ``net``.

    ``optimizer`` steps theta: ``sgd`` is plain EG (a step of ``lr``; 0.05 suits standardised features), ``adam`` /
    ``adamw`` ExtraAdam (lr 1e-3, like the other neural algorithms).
    """
    from secvfl.models import MLP

    if not lr > 0:
        raise ConfigError(f"learning rate must be positive, got {lr}")
    loss_obj = make_loss(loss if n_classes > 2 or loss != "softmax" else "logistic")
    C = loss_obj.outputs(n_classes)
    torch.manual_seed(seed)
    feats = [MLPFeatureParty(f"party{k}", b, MLP(b["train"].shape[1], list(hidden), C), weight_decay=weight_decay,
                             dtype=dtype, optimizer=optimizer, lr=lr)
             for k, b in enumerate(blocks)]
    lab = MLPLabelParty(LABEL, labels, loss_obj, n_classes)
    return SaddleMLP(net, [MLPFeatureHandle(p, net) for p in feats], lab, batch_size=batch_size, seed=seed, dtype=dtype,
                     optimizer=optimizer, lr=lr)
