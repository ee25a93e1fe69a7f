"""`local`: each feature party trains a model of its own (bottom + head) on its own block alone.

Label sharing, stated plainly: this baseline needs labels at every feature party, so at the start of training the
label party sends each feature party the labels of the training rows that party holds (one ``labels`` message per
party, counted in the byte accounting). No features, embeddings or gradients are exchanged afterwards. Evaluation:
each party predicts alone on the rows it holds; metrics are the mean over parties, per-party metrics alongside.
Use it as the floor every collaborative algorithm must beat, not where labels are sensitive.
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
from secvfl.messages import Message
from secvfl.metrics import classification_metrics
from secvfl.models import MLP, make_bottom, output_dim
from secvfl.parties import make_optimizer, probabilities, require_wire, task_loss
from secvfl.transport.layers import AlgorithmTraits
from secvfl.transport.network import Network

__all__ = ["Local", "LocalParty"]


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
        self._y[message.meta["split"]] = message.tensor("labels").to(self.device)

    def own_rows(self, split: str) -> np.ndarray:
        return np.flatnonzero(self._observed[split])

    def train_batch(self, ids: np.ndarray) -> float:
        idx = torch.as_tensor(ids, device=self.device)
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
        self._y = dict(state["labels"])


@ALGORITHMS.register("local")
class Local(Algorithm):
    name = "local"
    traits = AlgorithmTraits("local", "none", forward_kinds=(), backward_kinds=(), shares_labels=True)

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        cfg, data, part = ctx.config, ctx.data, ctx.partition
        n_out = output_dim(data.n_classes)
        self.local_parties: list[LocalParty] = []
        for k, name in enumerate(feature_party_names(part.n_blocks)):
            bottom = make_bottom(cfg.bottom, len(part.blocks[k]), cfg.embedding_dim, list(cfg.hidden), part.block_shapes[k])
            model = nn.Sequential(bottom, nn.ReLU(), MLP(cfg.embedding_dim, list(cfg.head_hidden), n_out))
            blocks = {s: part.take(getattr(data, f"X_{s}"), k) for s in ("train", "val", "test")}
            observed = {s: ctx.masks[s][:, k] for s in ("train", "val", "test")}
            self.local_parties.append(LocalParty(
                name, blocks, observed, model, data.n_classes,
                make_optimizer(model.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay), ctx.device, ctx.dtype,
            ))
        self._labels = {s: getattr(data, f"y_{s}") for s in ("train", "val", "test")}  # the label party's own
        self._shared = False

    def parties(self) -> dict[str, object]:
        return {p.name: p for p in self.local_parties}

    def _share_labels(self) -> None:
        # The label party sends each party the training labels (zeros where the party holds no row: it has no
        # use for them, and they are not revealed).
        for k, p in enumerate(self.local_parties):
            observed = self.ctx.masks["train"][:, k]
            y = torch.as_tensor(np.where(observed, self._labels["train"], 0), dtype=torch.int64)
            self.net.send(Message("labels", LABEL_PARTY, p.name, 0, {"labels": y}, meta={"split": "train"}))
            p.receive_labels(self.net.receive(p.name, kind="labels", sender=LABEL_PARTY))
        self._shared = True

    def batches_per_epoch(self) -> int:
        return max(-(-len(p.own_rows("train")) // self.cfg.batch_size) for p in self.local_parties)

    def train_epoch(self, epoch: int, progress: ProgressFn | None = None) -> dict[str, float]:
        if not self._shared:
            self._share_labels()
        iters = [batch_ids(p.own_rows("train"), self.cfg.batch_size, self.cfg.seed + k, epoch)
                 for k, p in enumerate(self.local_parties)]
        losses = []
        for _ in range(self.batches_per_epoch()):
            step_losses = [p.train_batch(ids) for p, it in zip(self.local_parties, iters, strict=True)
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
        for k, p in enumerate(self.local_parties):
            rows = self.ctx.masks[split][:, k]
            if rows.any():
                per_party.append(classification_metrics(y[rows], p.predict_proba(split)[rows]))
        keys = per_party[0].keys()
        out = {key: float(np.mean([m[key] for m in per_party])) for key in keys}
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "shared": self._shared}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._shared = bool(state.get("shared", False))
