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
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from secvfl.algorithms.online.activation import Activation
from secvfl.algorithms.online.buffers import GradientWindow, split_views
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


def _is_layers(model: nn.Module, kinds: tuple[type, ...]) -> bool:
    """``model`` is exactly these layers in sequence, each Linear with a bias, every parameter trained (so the
    closed-form gradients below fill the flat parameter vector in its order)."""
    return (type(model) is nn.Sequential and len(model) == len(kinds)
            and all(type(m) is k for m, k in zip(model, kinds, strict=True))
            and all(m.bias is not None for m in model if type(m) is nn.Linear)
            and all(p.requires_grad for p in model.parameters()))


def _is_linear_relu(model: nn.Module) -> bool:
    return _is_layers(model, (nn.Linear, nn.ReLU))


def _linear_relu_grads(x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor, weight_grad: torch.Tensor,
                       bias_grad: torch.Tensor) -> torch.Tensor:
    """Gradients of <grad, relu(x W^T + b)> in W and b, written into ``weight_grad`` and ``bias_grad``: the
    operations autograd runs for these two layers (threshold_backward, then grad^T x and the row sum), without
    starting the autograd engine. Returns the gradient before the ReLU (for the gradient in x: it times W)."""
    g = torch.ops.aten.threshold_backward(grad, out, 0)  # autograd's ReLU backward; masked_fill takes ~6x longer
    torch.mm(g.t(), x, out=weight_grad)
    torch.sum(g, 0, out=bias_grad)
    return g


class RecentRows:
    """The last ``length`` rows pushed, newest first, as one contiguous view (SLR's window of inputs or labels).

    The rows live in a buffer of 2 l rows: each push writes one row above the window, which slides up by one; when
    the window reaches the top, its newest l - 1 rows are copied back to the bottom half (once every l pushes). So
    the window is a tensor every round without a stack, a list or a copy, in the row order the model sees (newest
    first), which keeps the window's float sums those of a freshly stacked one."""

    def __init__(self, length: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.length = int(length)
        self._buffer = torch.zeros(2 * self.length, *row_shape, dtype=dtype)
        self._start = 2 * self.length  # the window is buffer[start : start + count]
        self._count = 0

    def push(self) -> torch.Tensor:
        """Make room for a new newest row (the oldest leaves a full window) and return it for the caller to write."""
        if self._start == 0:
            keep = min(self._count, self.length - 1)
            self._buffer[self.length + 1 : self.length + 1 + keep].copy_(self._buffer[:keep])
            self._start = self.length + 1
        self._start -= 1
        self._count = min(self._count + 1, self.length)
        return self._buffer[self._start]

    def window(self) -> torch.Tensor:
        return self._buffer[self._start : self._start + self._count]

    def clear(self) -> None:
        self._start, self._count = 2 * self.length, 0

    def __len__(self) -> int:
        return self._count


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
        # the parameters' values for the closed forms: views of the flat buffer (so every step shows in them), outside
        # autograd (so no graph is recorded, and no grad-mode switch is needed, when the layers run on them)
        self._values = tuple(p.detach() for p in self.params)
        size, shapes = self._flat.numel(), [p.shape for p in self.params]
        self.window = (GradientWindow(window.length, window.alpha, size, dtype=dtype, shapes=shapes)
                       if window.kind == "window" else None)
        self._direction = torch.empty(size, dtype=dtype)  # the step's direction, reused every round
        self._direction_parts = split_views(self._direction, shapes)  # ... shaped like the parameters

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

    def _step_window(self) -> None:  # (no grad mode needed: the flat buffer and the window are outside autograd)
        self._flat.add_(self.window.average(out=self._direction), alpha=-self.lr)


class OnlineFeatureParty(_OnlineParty):
    """Holds its bottom model, its feed of (entity, own columns) events, its activation rule and its window."""

    def __init__(self, name: str, feed: Feed, model: nn.Module, activation: Activation, window: WindowSpec, *,
                 lr: float, eval_blocks: dict[str, np.ndarray], observed: dict[str, np.ndarray] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model.to(dtype=dtype)
        super().__init__(name, feed, lr, window, self.model, dtype)
        self._in_dim, self._out_dim = self.model[0].in_features, self.model[0].out_features
        # one sample (OGD/DLR) or the window's rows (SLR) through Linear -> ReLU (the paper's party model): the
        # gradient in closed form. Starting the autograd engine costs several times this arithmetic, once per party
        # per round (`secvfl bench online`).
        self._closed_form = _is_linear_relu(self.model)
        self.activation = activation
        self._eval = {s: torch.as_tensor(b, dtype=dtype) for s, b in eval_blocks.items()}
        self._observed = {s: torch.as_tensor(m, dtype=dtype)[:, None] for s, m in (observed or {}).items()}
        # SLR: the window's inputs and whether the party held each (a row it did not hold is zeros, its flag 0)
        self._inputs = RecentRows(window.length, (self._in_dim,), dtype)
        self._held = RecentRows(window.length, (1,), dtype)
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
        if self.spec.kind == "static":
            self._remember(x)
            xs, held = self._inputs.window(), self._held.window()
            if self._closed_form:  # the layers' own operations, without the modules' call overhead
                out = torch.relu(nn.functional.linear(xs, *self._values)).mul_(held)
            else:
                with torch.set_grad_enabled(active):
                    out = self.model(xs) * held  # rows the party does not hold are zeros and get no gradient
        elif missing:  # zeros, as the windowed form would give; never active, so no graph
            xs, out = None, torch.zeros(1, self._out_dim, dtype=self.dtype)
        elif self._closed_form:  # as above: the layers' operations, no module call, no graph
            xs = torch.as_tensor(x[None], dtype=self.dtype)
            out = torch.relu(nn.functional.linear(xs, *self._values))
        else:
            xs = torch.as_tensor(x[None], dtype=self.dtype)
            with torch.set_grad_enabled(active):
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
        if self._closed_form and self.window is not None:  # straight into the window's new row, then the usual step
            _linear_relu_grads(xs, out, grad, *self.window.push_slot_parts())
            self._step_window()
        elif self._closed_form:  # SLR: the gradient of the window's rows is the step's direction
            _linear_relu_grads(xs, out, grad, *self._direction_parts)
            self._flat.add_(self._direction, alpha=-self.lr)
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
                "inputs": [x.clone() if h else None  # newest first; None: a round the party did not hold
                           for x, h in zip(self._inputs.window(), self._held.window().flatten().tolist(), strict=True)]}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.window is not None:
            self.window.load_state_dict(state["window"])
        self.activation.load_state_dict(state["activation"])
        self.rounds = dict(state["rounds"])  # compute seconds are measurements of this process, not state
        self._inputs.clear()
        self._held.clear()
        for v in reversed(state["inputs"]):  # oldest first, so that the newest ends first
            self._remember(None if v is None else v.numpy())

    def _remember(self, x: np.ndarray | None) -> None:
        """Push this round's input (None: not held) into SLR's window."""
        row, held = self._inputs.push(), self._held.push()
        if x is None:
            row.zero_()
            held.zero_()
        else:
            row.numpy()[...] = x  # numpy's cast to the party's dtype, as the stacked window had
            held.fill_(1.0)


class OnlineLabelParty(_OnlineParty):
    """Holds the head, its feed of (entity, label) events, its window and (SLR) the window's labels."""

    def __init__(self, name: str, feed: Feed, head: nn.Module, n_classes: int, window: WindowSpec, *, lr: float,
                 eval_labels: dict[str, np.ndarray], dtype: torch.dtype = torch.float32) -> None:
        self.head = head.to(dtype=dtype)
        super().__init__(name, feed, lr, window, self.head, dtype)
        self.n_classes = n_classes
        self._eval_labels = {s: np.asarray(v) for s, v in eval_labels.items()}
        self._labels = RecentRows(window.length, (), torch.int64)  # SLR: labels of the window, newest first
        self._label = torch.zeros(1, dtype=torch.int64)  # OGD/DLR: the round's label, the objective's one target
        # the paper's head (Linear -> ReLU -> Linear): the round's gradients in closed form (see
        # _closed_form_round); any other head goes through autograd
        self._closed_form = _is_layers(self.head, (nn.Linear, nn.ReLU, nn.Linear))
        # d objective / d log-probability of a target: -1/l for SLR's mean over the window, -1 for OGD/DLR's mean
        # over the round's one row; computed in the model's dtype, as autograd computes it
        divisor = self.spec.length if window.kind == "static" else 1
        self._target_grad = torch.ones((1, 1), dtype=dtype).div_(divisor).neg_()
        self._label_transform: Callable[[int, int], int] | None = None

    def install_label_transform(self, transform: Callable[[int, int], int]) -> None:
        """A protocol's hook (label DP on a stream): the party trains on ``transform(entity, label)`` instead of each
        label, called once per event as it is taken from the feed; it still scores its predictions against the label
        it holds (its own, local measurement)."""
        self._label_transform = transform

    def _take_label(self) -> tuple[int, int, int]:
        """The next event of the feed: (entity, the label to train on, the label as held, to score against)."""
        entity, y = self.feed.take()
        held = int(y)
        return entity, held if self._label_transform is None else int(self._label_transform(entity, held)), held

    def train_round(self, step: int, inputs: Sequence[Message], senders: Sequence[str], active: Sequence[str]
                    ) -> tuple[float, bool, list[Message]]:
        """Score the round's prediction (before any update), step the head, and build one gradient message per
        active sender. Returns (loss of this round's sample, whether the prediction was right, gradients)."""
        entity, y, held = self._take_label()
        for m in inputs:
            require_wire(m, self.name)
            if m.meta.get("entity") != entity:
                raise MessageError(f"{m.sender} sent an embedding of entity {m.meta.get('entity')} in the round of "
                                   f"entity {entity}; rounds are formed by entity id")
        xs = [m.tensor("embedding").to(dtype=self.dtype) for m in inputs]
        if not self.head.training:  # (a recursive call: not every round)
            self.head.train(True)
        if self.spec.kind == "static":
            self._labels.push().fill_(int(y))
        wanted = [s in active for s in senders]
        if self._closed_form:
            logits, loss, input_grads = self._closed_form_round(xs, int(y), wanted)
        else:
            logits, loss, input_grads = self._autograd_round(xs, int(y), wanted)
        correct = bool(int(logits[0].argmax()) == held)  # prequential: the logits of the head before its step
        out = [Message("gradient", self.name, s, step, {"gradient": g.detach()})
               for s, g in zip([s for s in senders if s in active], input_grads, strict=True)]
        return loss, correct, out

    def _autograd_round(self, xs: list[torch.Tensor], y: int, wanted: list[bool]
                        ) -> tuple[torch.Tensor, float, Sequence[torch.Tensor]]:
        """Step the head on the round's objective (SLR: the window's); returns the logits (before the step), the
        round's own loss, and the objective's gradients in the wanted inputs."""
        xs = [x.requires_grad_(True) for x in xs]
        logits = self.head(torch.cat(xs, dim=1))
        if self.spec.kind == "static":
            losses = nn.functional.cross_entropy(logits, self._labels.window(), reduction="none")
            objective = losses.sum() / self.spec.length
            loss = float(losses[0].detach())
        else:
            objective = nn.functional.cross_entropy(logits, torch.tensor([y]))
            loss = float(objective.detach())
        params = self.params
        grads = torch.autograd.grad(objective, [*params, *(x for x, w in zip(xs, wanted, strict=True) if w)],
                                    allow_unused=True)
        self._apply(grads[: len(params)])
        return logits.detach(), loss, grads[len(params):]

    def _closed_form_round(self, xs: list[torch.Tensor], y: int, wanted: list[bool]
                           ) -> tuple[torch.Tensor, float, list[torch.Tensor]]:
        """:meth:`_autograd_round` for a Linear -> ReLU -> Linear head, without the autograd engine: the same
        operations autograd runs for the round's objective (SLR: (1/l) sum of the window's cross-entropies; OGD/DLR:
        the cross-entropy of the round's one row, mean reduction), in the same order (log-softmax and NLL, then their
        backward, then each layer's), so the results are autograd's to the bit (the tests compare). Starting the
        engine costs more than this arithmetic at OGD/DLR's one row (`secvfl bench online`). Every tensor here is
        outside autograd (the parameters' values, the decoded embeddings), so no graph is recorded."""
        first_weight, first_bias, last_weight, last_bias = self._values
        z = torch.cat(xs, dim=1)
        hidden = torch.relu(nn.functional.linear(z, first_weight, first_bias))  # the modules' operations
        logits = nn.functional.linear(hidden, last_weight, last_bias)
        log_probs = torch.log_softmax(logits, 1)
        if self.window is None:  # SLR: the window's labels; the step's direction in the reused buffer
            targets, grads = self._labels.window(), self._direction_parts
        else:  # OGD/DLR: the round's label; the gradient straight into the window's new row
            targets, grads = self._label.fill_(y), self.window.push_slot_parts()
        # = cross_entropy(logits, targets); a mean over one row is that row's loss, bit for bit
        losses = nn.functional.nll_loss(log_probs, targets, reduction="none")
        grad_log_probs = torch.zeros_like(log_probs).scatter_(1, targets[:, None],
                                                              self._target_grad.expand(len(targets), 1))
        grad_logits = torch.ops.aten._log_softmax_backward_data(grad_log_probs, log_probs, 1, log_probs.dtype)
        torch.mm(grad_logits.t(), hidden, out=grads[2])
        torch.sum(grad_logits, 0, out=grads[3])
        grad_hidden = torch.mm(grad_logits, last_weight)
        grad_pre = _linear_relu_grads(z, hidden, grad_hidden, grads[0], grads[1])
        input_grads = []
        if any(wanted):  # (before the step: the gradient at the parameters that made the logits)
            grad_z = torch.mm(grad_pre, first_weight)
            offset = 0
            for x, w in zip(xs, wanted, strict=True):
                if w:
                    input_grads.append(grad_z.narrow(1, offset, x.shape[1]))
                offset += x.shape[1]
        if self.window is None:
            self._flat.add_(self._direction, alpha=-self.lr)
        else:
            self._step_window()
        return logits, float(losses[0]), input_grads

    @torch.no_grad()
    def predict(self, inputs: Sequence[Message]) -> torch.Tensor:
        xs = [require_wire(m, self.name).tensor("embedding").to(dtype=self.dtype) for m in inputs]
        self.head.eval()
        return torch.softmax(self.head(torch.cat(xs, dim=1)), dim=1)

    def labels(self, split: str) -> np.ndarray:
        return self._eval_labels[split]

    def state_dict(self) -> dict:
        return {"head": self.head.state_dict(), "window": None if self.window is None else self.window.state_dict(),
                "labels": self._labels.window().tolist()}  # newest first

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        if self.window is not None:
            self.window.load_state_dict(state["window"])
        self._labels.clear()
        for v in reversed(state["labels"]):  # oldest first, so that the newest ends first
            self._labels.push().fill_(int(v))
