"""The parties of an online run: a feature party answers each round with an embedding of its own sample, a label
party predicts, scores that prediction before any update (prequential), and sends gradients to active parties only.

Update rules (Wang et al., Algorithm 1 and Appendix C):

- ``window`` (OGD: l = 1; DLR: l, alpha): every party steps with (1/W) sum_i alpha^i of its last l gradients
  (:class:`~secvfl.algorithms.online.buffers.GradientWindow`). The label party's gradient v_m = d f^t / d h_m is sent
  unscaled; the feature party enqueues v_m * dh_m/dw_m and applies the window's weights itself (eq. 5), so 1/W is
  applied once. A passive party enqueues zeros and does not step.
- ``static`` (SLR): each party keeps its last l inputs, re-evaluates their embeddings at its current parameters and
  sends all of them every round; the label party keeps the matching labels and steps on (1/l) sum of the window's
  losses at the current parameters, and sends each active party the gradients of that mean for every embedding of
  the window (so a round costs about l times the bytes of OGD, both ways).

A party missing a round's sample (a live source that timed out, a block missing from a replayed row) answers with an
embedding of zeros marked ``missing``; it is passive for the round. Each party measures its own compute seconds,
split by whether it was active.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from secvfl.algorithms.online.activation import Activation
from secvfl.algorithms.online.buffers import GradientWindow
from secvfl.algorithms.online.streams import Feed
from secvfl.errors import MessageError
from secvfl.messages import Message
from secvfl.parties import PartyIsolationError, require_wire

__all__ = ["OnlineFeatureParty", "OnlineLabelParty", "WindowSpec", "bottom_model", "head_model"]


class WindowSpec:
    """How a party combines past rounds: ``kind`` "window" (OGD/DLR) or "static" (SLR), length l, alpha."""

    def __init__(self, kind: str, length: int, alpha: float = 1.0) -> None:
        if kind not in ("window", "static"):
            raise ValueError(f"unknown window kind {kind!r}")
        self.kind, self.length, self.alpha = kind, int(length), float(alpha)


def bottom_model(in_dim: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(in_dim, width), nn.ReLU())


def head_model(in_dim: int, hidden: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, n_out))


def _is_linear_relu(model: nn.Module) -> bool:
    return (type(model) is nn.Sequential and len(model) == 2 and type(model[0]) is nn.Linear
            and type(model[1]) is nn.ReLU)


def _linear_relu_grads(x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor, flat: torch.Tensor) -> None:
    """Gradients of <grad, relu(x W^T + b)> in W and b, written into ``flat`` (W's then b's, the parameter order):
    the operations autograd runs for these two layers (threshold_backward, then grad^T x and the row sum), without
    starting the autograd engine."""
    g = grad.masked_fill(out <= 0, 0.0)
    n_weight = g.shape[1] * x.shape[1]
    torch.mm(g.t(), x, out=flat[:n_weight].view(g.shape[1], x.shape[1]))
    torch.sum(g, 0, out=flat[n_weight:])


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _dense(grads: Sequence[torch.Tensor | None], params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)]


def _flatten_parameters(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """Re-point the parameters into one contiguous buffer (as FlatOptimizer does) and return it: a step is then one
    tensor operation instead of one per parameter, and the modules work unchanged."""
    flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset : offset + n].view_as(p)
        offset += n
    return flat


class _OnlineParty:
    def __init__(self, name: str, feed: Feed, lr: float, window: WindowSpec, model: nn.Module, dtype: torch.dtype
                 ) -> None:
        self.name = name
        self.feed = feed
        self.lr = float(lr)
        self.spec = window
        self.dtype = dtype
        self.params = _params(model)
        self._flat = _flatten_parameters(self.params)
        size = self._flat.numel()
        self.window = GradientWindow(window.length, window.alpha, size, dtype=dtype) if window.kind == "window" else None
        self._direction = torch.empty(size, dtype=dtype)  # the step's direction, reused every round

    def __repr__(self) -> str:  # never print data or keys
        return f"{type(self).__name__}({self.name!r})"

    @torch.no_grad()
    def _apply(self, grads: Sequence[torch.Tensor | None] | None) -> None:
        """Enqueue this round's gradient (None: passive, zeros) and step; SLR steps on the window's mean directly."""
        if grads is None:
            if self.window is not None:
                self.window.push(None)
            return
        parts = _dense(grads, self.params)
        if self.window is not None:
            self.window.push_parts(parts)
            self._step_window()
        else:
            self._flat.add_(torch.cat([g.reshape(-1) for g in parts], out=self._direction), alpha=-self.lr)

    @torch.no_grad()
    def _step_window(self) -> None:
        self._flat.add_(self.window.average(out=self._direction), alpha=-self.lr)


class OnlineFeatureParty(_OnlineParty):
    """Holds its bottom model, its feed of (entity, own columns) events, its activation rule and its window."""

    def __init__(self, name: str, feed: Feed, model: nn.Module, activation: Activation, window: WindowSpec, *,
                 lr: float, eval_blocks: dict[str, np.ndarray], observed: dict[str, np.ndarray] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model.to(dtype=dtype)
        super().__init__(name, feed, lr, window, self.model, dtype)
        self._in_dim, self._out_dim = self.model[0].in_features, self.model[0].out_features
        # one sample through Linear -> ReLU (the paper's party model): the gradient in closed form. Starting the
        # autograd engine costs several times this arithmetic, once per party per round (`secvfl bench online`).
        self._closed_form = window.kind == "window" and _is_linear_relu(self.model)
        self.activation = activation
        self._eval = {s: torch.as_tensor(b, dtype=dtype) for s, b in eval_blocks.items()}
        self._observed = {s: torch.as_tensor(m, dtype=dtype)[:, None] for s, m in (observed or {}).items()}
        self._inputs: deque[tuple[np.ndarray | None]] = deque(maxlen=window.length)  # SLR: the window's inputs
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seconds = {"active": 0.0, "passive": 0.0}
        self.rounds = {"active": 0, "passive": 0, "missing": 0}
        self._active = False

    def forward(self, step: int, receiver: str) -> Message:
        """This round's embedding of the next event in the feed (its window of embeddings under SLR)."""
        t0 = time.perf_counter()
        entity, x = self.feed.take()
        missing = x is None
        self._active = active = (not missing) and self.activation.active(x)
        dim = self._in_dim
        if self.spec.kind == "static":
            self._inputs.appendleft((x,))
            rows = [np.zeros(dim, np.float32) if v is None else v for (v,) in self._inputs]
            held = torch.tensor([[0.0 if v is None else 1.0] for (v,) in self._inputs], dtype=self.dtype)
            xs = torch.as_tensor(np.stack(rows), dtype=self.dtype)
            with torch.set_grad_enabled(active):
                out = self.model(xs) * held  # rows the party does not hold are zeros and get no gradient
        elif missing:  # zeros, as the windowed form would give; never active, so no graph
            xs, out = None, torch.zeros(1, self._out_dim, dtype=self.dtype)
        else:
            xs = torch.as_tensor(x[None], dtype=self.dtype)
            with torch.set_grad_enabled(active and not self._closed_form):
                out = self.model(xs)
        self._pending = (xs, out) if active else None
        key = "active" if active else "passive"
        self.rounds["missing" if missing else key] += 1
        message = Message("embedding", self.name, receiver, step, {"embedding": out.detach()},
                          meta={"entity": int(entity), "active": bool(active), "missing": bool(missing)})
        self.seconds[key] += time.perf_counter() - t0
        return message

    def backward(self, message: Message | None) -> None:
        """Active: apply the gradient the label party sent for this round's embedding(s). Passive (None): enqueue
        zeros (DLR) and keep the parameters."""
        t0 = time.perf_counter()
        if message is None:
            if self._active:
                raise PartyIsolationError(f"{self.name} was active but got no gradient for the round")
            self._apply(None)
            self.seconds["passive"] += time.perf_counter() - t0
            return
        require_wire(message, self.name)
        if self._pending is None:
            raise PartyIsolationError(f"{self.name} received a gradient for a round it was not active in")
        xs, out = self._pending
        self._pending = None
        grad = message.tensor("gradient").to(dtype=out.dtype)
        if grad.shape != out.shape:
            raise PartyIsolationError(f"{self.name}: gradient of shape {tuple(grad.shape)} for output {tuple(out.shape)}")
        if self._closed_form:  # straight into the window's new row, then the usual step
            _linear_relu_grads(xs, out, grad, self.window.push_slot())
            self._step_window()
        else:
            self._apply(torch.autograd.grad(out, self.params, grad, allow_unused=True))
        self.seconds["active"] += time.perf_counter() - t0

    @torch.no_grad()
    def forward_eval(self, step: int, split: str, ids: np.ndarray, receiver: str) -> Message:
        idx = torch.as_tensor(ids)
        self.model.eval()
        out = self.model(self._eval[split][idx])
        if split in self._observed:
            out = out * self._observed[split][idx]
        return Message("embedding", self.name, receiver, step, {"embedding": out}, meta={"eval": True})

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "window": None if self.window is None else self.window.state_dict(),
                "activation": self.activation.state_dict(), "rounds": dict(self.rounds),
                "inputs": [None if v is None else torch.from_numpy(np.array(v)) for (v,) in self._inputs]}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.window is not None:
            self.window.load_state_dict(state["window"])
        self.activation.load_state_dict(state["activation"])
        self.rounds = dict(state["rounds"])  # compute seconds are measurements of this process, not state
        self._inputs.clear()
        self._inputs.extend((None if v is None else v.numpy(),) for v in state["inputs"])


class OnlineLabelParty(_OnlineParty):
    """Holds the head, its feed of (entity, label) events, its window and (SLR) the window's labels."""

    def __init__(self, name: str, feed: Feed, head: nn.Module, n_classes: int, window: WindowSpec, *, lr: float,
                 eval_labels: dict[str, np.ndarray], dtype: torch.dtype = torch.float32) -> None:
        self.head = head.to(dtype=dtype)
        super().__init__(name, feed, lr, window, self.head, dtype)
        self.n_classes = n_classes
        self._eval_labels = {s: np.asarray(v) for s, v in eval_labels.items()}
        self._labels: deque[int] = deque(maxlen=window.length)  # SLR: labels of the window, newest first

    def train_round(self, step: int, inputs: Sequence[Message], senders: Sequence[str], active: Sequence[str]
                    ) -> tuple[float, bool, list[Message]]:
        """Score the round's prediction (before any update), step the head, and build one gradient message per
        active sender. Returns (loss of this round's sample, whether the prediction was right, gradients)."""
        entity, y = self.feed.take()
        for m in inputs:
            require_wire(m, self.name)
            if m.meta.get("entity") != entity:
                raise MessageError(f"{m.sender} sent an embedding of entity {m.meta.get('entity')} in the round of "
                                   f"entity {entity}; rounds are formed by entity id")
        xs = [m.tensor("embedding").to(dtype=self.dtype).requires_grad_(True) for m in inputs]
        if not self.head.training:  # (a recursive call: not every round)
            self.head.train(True)
        logits = self.head(torch.cat(xs, dim=1))
        correct = bool(int(logits[0].argmax()) == int(y))  # prequential: scored before the update below
        if self.spec.kind == "static":
            self._labels.appendleft(int(y))
            targets = torch.tensor(list(self._labels))
            losses = nn.functional.cross_entropy(logits, targets, reduction="none")
            objective = losses.sum() / self.spec.length
            loss = float(losses[0].detach())
        else:
            objective = nn.functional.cross_entropy(logits, torch.tensor([int(y)]))
            loss = float(objective.detach())
        params = self.params
        wanted = [x for x, s in zip(xs, senders, strict=True) if s in active]
        grads = torch.autograd.grad(objective, [*params, *wanted], allow_unused=True)
        self._apply(grads[: len(params)])
        out = [Message("gradient", self.name, s, step, {"gradient": g.detach()})
               for s, g in zip([s for s in senders if s in active], grads[len(params):], strict=True)]
        return loss, correct, out

    @torch.no_grad()
    def predict(self, inputs: Sequence[Message]) -> torch.Tensor:
        xs = [require_wire(m, self.name).tensor("embedding").to(dtype=self.dtype) for m in inputs]
        self.head.eval()
        return torch.softmax(self.head(torch.cat(xs, dim=1)), dim=1)

    def labels(self, split: str) -> np.ndarray:
        return self._eval_labels[split]

    def state_dict(self) -> dict:
        return {"head": self.head.state_dict(), "window": None if self.window is None else self.window.state_dict(),
                "labels": list(self._labels)}

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        if self.window is not None:
            self.window.load_state_dict(state["window"])
        self._labels.clear()
        self._labels.extend(int(v) for v in state["labels"])
