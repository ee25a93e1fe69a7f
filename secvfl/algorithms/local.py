"""`local`: each feature party trains a model of its own (bottom + head) on its own block alone.

Label sharing, stated plainly: this baseline needs labels at every feature party, so at the start of training the
label party sends each feature party the labels of the training rows that party holds (one ``labels`` message per
party, counted in the byte accounting). No features, embeddings or gradients are exchanged afterwards. Evaluation:
each party predicts alone on the rows it holds; the run harness, acting as the experimenter who holds the labels,
collects the predictions to score them (metrics are the mean over parties), as for the missing-feature-block
baselines: outside the federation, nothing is sent. Use it as the floor every collaborative algorithm must beat, not
where labels are sensitive.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from secvfl.algorithms import ALGORITHMS
from secvfl.algorithms.base import (
    LABEL_PARTY,
    Algorithm,
    ProgressFn,
    RunContext,
    batch_ids,
    feature_party_names,
)
from secvfl.device import index_tensor, to_device
from secvfl.handles import LocalHandle, PartyHandle, request
from secvfl.messages import Message
from secvfl.metrics import classification_metrics
from secvfl.models import MLP, make_bottom, output_dim
from secvfl.parties import make_optimizer, probabilities, require_wire, task_loss
from secvfl.transport.layers import AlgorithmTraits
from secvfl.transport.network import Network

__all__ = ["Local", "LocalParty", "LocalPartyHandle"]


class LocalParty:
    """A feature party with a complete model of its own; labels arrive once, as a message."""

    def __init__(self, name: str, blocks: dict[str, np.ndarray], observed: dict[str, np.ndarray], model: nn.Module,
                 n_classes: int, optimizer: torch.optim.Optimizer, device: torch.device, dtype: torch.dtype) -> None:
        self.name, self.device = name, device
        self._x = {s: torch.as_tensor(b, dtype=dtype, device=device) for s, b in blocks.items()}
        self._observed = {s: np.array(m, dtype=bool) for s, m in observed.items()}  # copies, not views of the masks
        self.model = model.to(device=device, dtype=dtype)
        self.optimizer = optimizer
        self.n_classes = n_classes
        self.loss_fn = task_loss(n_classes)
        self._y: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"LocalParty({self.name!r})"

    def receive_labels(self, message: Message) -> None:
        require_wire(message, self.name)
        self._y[message.meta["split"]] = to_device(message.tensor("labels"), self.device)

    def own_rows(self, split: str) -> np.ndarray:
        return np.flatnonzero(self._observed[split])

    def train_batch(self, ids: np.ndarray) -> float:
        idx = index_tensor(ids, self.device)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(self._x["train"][idx]), self._y["train"][idx])
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    @torch.no_grad()
    def predict_proba(self, split: str) -> np.ndarray:
        self.model.eval()
        return probabilities(self.model(self._x[split]), self.n_classes).cpu().numpy()

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "labels": dict(self._y)}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._y = {split: y.to(self.device) for split, y in state["labels"].items()}  # (a checkpoint loads on the CPU)


class LocalPartyHandle(LocalHandle):
    """A :class:`LocalParty`: takes its labels from the network once, then trains and predicts alone."""

    _party: LocalParty

    @request
    def receive_labels(self, *, sender: str) -> None:
        self._party.receive_labels(self._receive("labels", sender))

    @request
    def train_batch(self, ids: np.ndarray) -> float:
        """One optimiser step on the party's training rows ``ids``; returns the batch loss."""
        return self._party.train_batch(ids)

    @request
    def predict(self, split: str) -> np.ndarray:
        """Class probabilities on every row of ``split``, for the experimenter to score (see the module docstring)."""
        return self._party.predict_proba(split)


@ALGORITHMS.register("local")
class Local(Algorithm):
    name = "local"
    traits = AlgorithmTraits("local", "none", forward_kinds=(), backward_kinds=(), shares_labels=True)

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        cfg, data, part = ctx.config, ctx.data, ctx.partition
        n_out = output_dim(data.n_classes)
        self.local_handles: list[LocalPartyHandle] = []
        for k, name in enumerate(feature_party_names(part.n_blocks)):
            bottom = make_bottom(cfg.bottom, len(part.blocks[k]), cfg.embedding_dim, list(cfg.hidden), part.block_shapes[k],
                                 channels=part.channels)
            model = nn.Sequential(bottom, nn.ReLU(), MLP(cfg.embedding_dim, list(cfg.head_hidden), n_out))
            model = model.to(device=ctx.device, dtype=ctx.dtype)  # before its optimiser (fused kernels on CUDA)
            blocks = {s: part.take(getattr(data, f"X_{s}"), k) for s in ("train", "val", "test")}
            observed = {s: ctx.masks[s][:, k] for s in ("train", "val", "test")}
            self.local_handles.append(LocalPartyHandle(LocalParty(
                name, blocks, observed, model, data.n_classes,
                make_optimizer(model.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay, device=ctx.device),
                ctx.device, ctx.dtype,
            ), net))
        self._labels = {s: getattr(data, f"y_{s}") for s in ("train", "val", "test")}  # the label party's own
        self._shared = False

    def handles(self) -> dict[str, PartyHandle]:
        return {h.name: h for h in self.local_handles}

    def _own_rows(self, k: int) -> np.ndarray:
        # the training rows party k holds: the public alignment pattern, which the party itself holds as well
        return np.flatnonzero(self.ctx.masks["train"][:, k])

    def _share_labels(self) -> None:
        # The label party sends each party the training labels (zeros where the party holds no row: it has no
        # use for them, and they are not revealed).
        for k, h in enumerate(self.local_handles):
            observed = self.ctx.masks["train"][:, k]
            y = torch.as_tensor(np.where(observed, self._labels["train"], 0), dtype=torch.int64)
            self.net.send(Message("labels", LABEL_PARTY, h.name, 0, {"labels": y}, meta={"split": "train"}))
            h.receive_labels(sender=LABEL_PARTY)
        self._shared = True

    def batches_per_epoch(self) -> int:
        return max(-(-len(self._own_rows(k)) // self.cfg.batch_size) for k in range(len(self.local_handles)))

    def train_epoch(self, epoch: int, progress: ProgressFn | None = None) -> dict[str, float]:
        if not self._shared:
            self._share_labels()
        iters = [batch_ids(self._own_rows(k), self.cfg.batch_size, self.cfg.seed + k, epoch)
                 for k in range(len(self.local_handles))]
        losses = []
        for _ in range(self.batches_per_epoch()):
            step_losses = [h.train_batch(ids) for h, it in zip(self.local_handles, iters, strict=True)
                           if (ids := next(it, None)) is not None]
            losses.append(float(np.mean(step_losses)))
            self.step += 1
            if progress is not None:
                progress(losses[-1])
        return {"loss": float(np.mean(losses))}

    def evaluate(self, split: str) -> dict[str, float]:
        y = self._labels[split]
        if len(y) == 0:
            return {}
        per_party = []
        for k, h in enumerate(self.local_handles):
            rows = self.ctx.masks[split][:, k]
            if rows.any():
                per_party.append(classification_metrics(y[rows], h.predict(split)[rows]))
        keys = per_party[0].keys()
        out = {key: float(np.mean([m[key] for m in per_party])) for key in keys}
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "shared": self._shared}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._shared = bool(state.get("shared", False))
