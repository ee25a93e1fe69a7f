"""Parties. Each holds only its own data, model, optimiser and keys, and talks to others only through messages.

A party never receives another party's tensors directly: every tensor it is given arrives in a :class:`Message`
decoded from bytes by the transport and addressed to it, which :func:`require_wire` checks.

Nor does a party hold a reference to anything of another party's: not the other party, not the algorithm that
coordinates them all (nor its :class:`~secvfl.algorithms.base.RunContext`, whose dataset holds every party's
features and the labels), not the network or its protocol layers (which keep per-party state for every party).
Hooks that protocols install on a party (release rule, backward rule, tagger) run as that party and get its own
state plus public facts only (a :class:`~secvfl.algorithms.base.BatchSchedule`). ``tests/test_isolation.py`` walks
the object graph from every party, under every algorithm and protocol, to check this.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from secvfl.device import index_tensor, to_device
from secvfl.errors import ConfigError, PartyIsolationError
from secvfl.messages import Message, delivered

if TYPE_CHECKING:
    from secvfl.algorithms.base import BatchSchedule

__all__ = [
    "FeatureParty",
    "LabelParty",
    "BackwardRule",
    "standard_backward",
    "ReleaseRule",
    "PlainRelease",
    "task_loss",
    "make_optimizer",
    "optimizer_kernels",
    "require_wire",
    "trainable_parameters",
    "ProtocolHooks",
    "ReleasingParty",
    "LabelStream",
]


def require_wire(message: Message, receiver: str | None = None) -> Message:
    """Refuse a message that did not cross the transport (a party reading another party's objects), or, given the
    ``receiver`` using it, one addressed to another party.

    Crossing the transport is a mark only :func:`~secvfl.messages.decode` and the network set
    (:func:`~secvfl.messages.delivered`); a message built or copied in process lacks it, whatever its ``wire_size``.
    """
    if not delivered(message):
        raise PartyIsolationError(
            f"{message.kind} message from {message.sender} to {message.receiver} was handed over directly; "
            "parties may only use messages received through the network"
        )
    if receiver is not None and message.receiver != receiver:
        raise PartyIsolationError(
            f"{receiver} was handed a {message.kind} message addressed to {message.receiver}; a party may only use "
            "messages the network delivered to it"
        )
    return message


def task_loss(n_classes: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean batch loss: BCE on one logit for binary tasks, softmax cross-entropy otherwise."""
    if n_classes == 2:
        return lambda logits, y: nn.functional.binary_cross_entropy_with_logits(logits.squeeze(1), y.to(logits.dtype))
    return lambda logits, y: nn.functional.cross_entropy(logits, y)


def probabilities(logits: torch.Tensor, n_classes: int) -> torch.Tensor:
    if n_classes == 2:
        p1 = torch.sigmoid(logits.squeeze(1))
        return torch.stack([1 - p1, p1], dim=1)
    return torch.softmax(logits, dim=1)


OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def optimizer_kernels(device: torch.device | None) -> dict[str, Any]:
    """torch.optim options for parameters on ``device``: on CUDA the fused kernels (one launch updates every
    parameter, where the default launches several per parameter); elsewhere torch's defaults, so CPU runs are
    unchanged. The parameters must be on ``device`` when the optimiser is built."""
    return {"fused": True} if device is not None and device.type == "cuda" else {}


def make_optimizer(params: Any, name: str, lr: float, weight_decay: float = 0.0, *,
                   device: torch.device | None = None) -> torch.optim.Optimizer:
    """``name``'s optimiser; ``device``: where the parameters are (see :func:`optimizer_kernels`)."""
    try:
        cls = OPTIMIZERS[name]
    except KeyError:
        raise ConfigError(f"unknown optimiser {name!r}; choose one of {', '.join(OPTIMIZERS)}") from None
    return cls(params, lr=lr, weight_decay=weight_decay, **optimizer_kernels(device))


class BackwardRule(Protocol):
    """How the label party turns a batch into head gradients and gradients w.r.t. its inputs.

    Must set ``.grad`` on the head's parameters and on every input tensor, and return the batch loss. Protocol
    layers that change what the label party releases (label DP: per-sample clipping and noise) install their own.
    """

    def __call__(
        self,
        head: nn.Module,
        forward: Callable[[list[torch.Tensor]], torch.Tensor],
        inputs: list[torch.Tensor],
        labels: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        rows: np.ndarray | None = None,
    ) -> float | torch.Tensor:
        """``rows``: the batch's training row ids (the label party's own bookkeeping, e.g. for a posterior per row).
        The loss may come back as a one-element tensor: it is read after the step's gradients are sent, so that on
        a GPU reading it does not wait for the step (see :mod:`secvfl.device`)."""
        ...


def standard_backward(head, forward, inputs, labels, loss_fn, *, rows=None) -> torch.Tensor:  # noqa: ANN001 - see BackwardRule
    loss = loss_fn(forward(inputs), labels)
    loss.backward()
    return loss.detach()


class ReleaseRule(Protocol):
    """What a feature party releases of its model's output, and how a gradient for that release becomes gradients
    of its model's parameters.

    The counterpart of :class:`BackwardRule` on the feature side: protocol layers that change what a feature party
    releases (feature DP: clipped, noised rows and per-sample clipped, noised model gradients) install their own
    rule on the party instead of reaching into it. Used by :class:`FeatureParty` and LASER-VFL's parties.
    """

    def release(self, party: str, step: int, split: str, out: torch.Tensor, *, train: bool) -> torch.Tensor:
        """The tensor that leaves the party for its model output ``out`` (detached) on rows of ``split``."""
        ...

    def model_gradients(
        self, model: nn.Module, x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor
    ) -> list[torch.Tensor | None]:
        """Gradients of ``model``'s trainable parameters (in ``parameters()`` order; None for an unused one) for
        the batch ``x`` whose output ``out`` (with its graph) received the gradient ``grad``."""
        ...


_PARAMETERS: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Tensor, ...]] = weakref.WeakKeyDictionary()


def trainable_parameters(model: nn.Module) -> list[torch.Tensor]:
    """``[p for p in model.parameters() if p.requires_grad]``, for the training hot path.

    ``Module.parameters()`` walks the module tree (a generator per submodule) on every call, and every training
    step asks for the list at least once. The walk is done once per model; ``requires_grad`` is read on each call,
    so freezing a layer still counts. (A model whose layers are replaced after its first step would need a fresh
    walk; secvfl builds every model before training and never changes its structure.)
    """
    params = _PARAMETERS.get(model)
    if params is None:
        params = _PARAMETERS[model] = tuple(model.parameters())
    return [p for p in params if p.requires_grad]


class PlainRelease:
    """Release the output as computed; backpropagate the received gradient through it."""

    def release(self, party: str, step: int, split: str, out: torch.Tensor, *, train: bool) -> torch.Tensor:
        return out

    def model_gradients(
        self, model: nn.Module, x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor
    ) -> list[torch.Tensor | None]:
        return list(torch.autograd.grad(out, trainable_parameters(model), grad, allow_unused=True))


class MessageTagger(Protocol):
    """Adds public facts about a batch to the meta of a message a party sends: which rows it covers, whether it is
    an evaluation output. Protocol layers that keep per-row state (compression with error feedback) install one on
    the parties. The party knows these facts already; a tagger describes, it never changes the tensors."""

    def tag(self, message: Message, split: str, ids: np.ndarray, *, train: bool) -> Message: ...


class NoTags:
    """Send messages as built."""

    def tag(self, message: Message, split: str, ids: np.ndarray, *, train: bool) -> Message:
        return message


class ReleasingParty(Protocol):
    """A party whose model outputs leave it through a :class:`ReleaseRule` (feature parties, LASER-VFL's parties)."""

    name: str

    def install_release_rule(self, make: Callable[[nn.Module], ReleaseRule]) -> None:
        """Release through ``make(model)``, built from the model whose outputs this party releases."""
        ...


class LabelStream(Protocol):
    """A label party that takes each training label from a stream of (entity, label) events, once per event."""

    def install_label_transform(self, transform: Callable[[int, int], int]) -> None:
        """Train on ``transform(entity, label)`` instead of each label, applied once as its event is taken."""
        ...


@dataclass(frozen=True)
class ProtocolHooks:
    """The public hook points an algorithm offers protocols (``Algorithm.protocol_hooks()``); what it lacks is None or
    empty, and a protocol that needs it refuses the algorithm. Protocols install rules on these parties through their
    hooks (``backward_rule``, ``use_training_labels``, ``tagger``, ``install_release_rule``), never by replacing a
    party's methods or writing its private state.

    ``label``: the one label party (its backward rule, training labels, tagger); ``feature_parties``: the feature
    parties (tagger, release rule); ``releasing``: every party whose outputs a release rule governs, by name (default:
    the feature parties); ``schedule``: the public batch order; ``predict``: the run's class probabilities on a split's
    rows (e.g. rr-prior's second stage needs them on the training rows); ``label_stream``: a label party that takes
    each label from a stream as it arrives (online algorithms; ``install_label_transform``).
    """

    label: LabelParty | None = None
    feature_parties: tuple[FeatureParty, ...] = ()
    releasing: Mapping[str, ReleasingParty] | None = None
    schedule: BatchSchedule | None = None
    predict: Callable[[str], np.ndarray] | None = None
    label_stream: LabelStream | None = None

    def releasing_parties(self) -> Mapping[str, ReleasingParty]:
        return self.releasing if self.releasing is not None else {fp.name: fp for fp in self.feature_parties}


class _Party:
    def __init__(self, name: str, device: torch.device, dtype: torch.dtype) -> None:
        self.name = name
        self.device = device
        self.dtype = dtype

    def __repr__(self) -> str:  # never print data or keys
        return f"{type(self).__name__}({self.name!r})"


class FeatureParty(_Party):
    """Holds one feature block (per split), a bottom model and its optimiser."""

    def __init__(
        self,
        name: str,
        blocks: dict[str, np.ndarray],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        output_kind: str = "embedding",
        observed: dict[str, np.ndarray] | None = None,
    ) -> None:
        super().__init__(name, device, dtype)
        self._x = {s: torch.as_tensor(b, dtype=dtype).to(device) for s, b in blocks.items()}
        # Which of the aligned rows this party actually holds (missing blocks); its output is zero elsewhere.
        self._observed = {
            s: torch.as_tensor(m, dtype=dtype, device=device)[:, None]
            for s, m in (observed or {}).items() if not np.all(m)
        }
        self.model = model.to(device=device, dtype=dtype)
        self.optimizer = optimizer
        self.output_kind = output_kind
        self.release_rule: ReleaseRule = PlainRelease()
        self.tagger: MessageTagger = NoTags()
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def rows(self, split: str) -> int:
        return int(self._x[split].shape[0])

    def install_release_rule(self, make: Callable[[nn.Module], ReleaseRule]) -> None:
        """A protocol's hook (:class:`ReleasingParty`): release the bottom model's outputs through ``make(model)``."""
        self.release_rule = make(self.model)

    def forward(self, step: int, split: str, ids: np.ndarray, receiver: str, *, train: bool = True) -> Message:
        """Compute the bottom-model output on rows ``ids`` and wrap what the release rule lets out for ``receiver``."""
        idx = index_tensor(ids, self.device)
        x = self._x[split][idx]
        if self.model.training is not train:  # Module.train() walks every submodule: only when the mode changes
            self.model.train(train)
        with torch.set_grad_enabled(train):
            out = self.model(x)
            if split in self._observed:  # in-graph, so rows it does not hold get no gradient either
                out = out * self._observed[split][idx]
        released = self.release_rule.release(self.name, step, split, out.detach(), train=train)
        if train:
            held = self._observed[split][idx] if split in self._observed else None
            self._pending = (x, out, held)
        message = Message(self.output_kind, self.name, receiver, step, {self.output_kind: released})
        return self.tagger.tag(message, split, ids, train=train)

    def backward(self, message: Message) -> None:
        """Apply the received gradient w.r.t. the last training output and take an optimiser step."""
        require_wire(message, self.name)
        if self._pending is None:
            raise PartyIsolationError(f"{self.name} received a gradient without a pending forward pass")
        x, out, held = self._pending
        grad = to_device(message.tensor("gradient"), self.device, out.dtype)
        if grad.shape != out.shape:
            raise PartyIsolationError(f"{self.name}: gradient of shape {tuple(grad.shape)} for output {tuple(out.shape)}")
        if held is not None:  # rows the party does not hold never train its model, whatever the rule
            grad = grad * held
        grads = self.release_rule.model_gradients(self.model, x, out, grad)
        self._pending = None
        params = trainable_parameters(self.model)
        if len(grads) != len(params):
            raise PartyIsolationError(f"{self.name}: release rule returned {len(grads)} gradients for {len(params)} parameters")
        for p, g in zip(params, grads, strict=True):
            p.grad = g if g is None or g.dtype is p.dtype else g.to(p.dtype)
        self.optimizer.step()

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class LabelParty(_Party):
    """Holds the labels, the head and its optimiser; computes the loss and the gradients it sends back.

    ``aggregated=True``: the head receives one tensor (sum or mean delivered by the aggregation protocol) and
    every feature party gets the gradient w.r.t. that aggregate (scaled by ``1/K`` for a mean).
    """

    def __init__(
        self,
        name: str,
        labels: dict[str, np.ndarray],
        head: nn.Module,
        optimizer: torch.optim.Optimizer,
        n_classes: int,
        *,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        input_kind: str = "embedding",
    ) -> None:
        super().__init__(name, device, dtype)
        self._y = {s: torch.as_tensor(v, dtype=torch.long).to(device) for s, v in labels.items()}
        self.head = head.to(device=device, dtype=dtype)
        self.optimizer = optimizer
        self.n_classes = n_classes
        self.loss_fn = task_loss(n_classes)
        self.input_kind = input_kind
        self.backward_rule: BackwardRule = standard_backward
        self.tagger: MessageTagger = NoTags()

    def labels(self, split: str, ids: np.ndarray | None = None) -> torch.Tensor:
        """The label party's own labels (used for its own loss and evaluation, never sent unless an algorithm says so)."""
        y = self._y[split]
        return y if ids is None else y[index_tensor(ids, self.device)]

    def use_training_labels(self, labels: np.ndarray | torch.Tensor) -> None:
        """A protocol's hook: train on ``labels`` (one per training row) from now on, e.g. label DP's released labels
        (integer classes) or targets (float rows, in the party's dtype); ``labels("train")`` returns them. Validation
        and test labels stay."""
        values = torch.as_tensor(labels)
        dtype = self.dtype if values.is_floating_point() else torch.long
        if values.shape[0] != self._y["train"].shape[0]:
            raise PartyIsolationError(f"{self.name}: {values.shape[0]} training labels for "
                                      f"{self._y['train'].shape[0]} training rows")
        self._y["train"] = torch.as_tensor(labels, dtype=dtype, device=self.device)

    def _inputs(self, inputs: Sequence[Message]) -> list[torch.Tensor]:
        return [
            to_device(require_wire(m, self.name).tensor(self.input_kind), self.device, self.dtype).requires_grad_(True)
            for m in inputs
        ]

    def _forward(self, xs: list[torch.Tensor], aggregated: bool, scale: torch.Tensor | None) -> torch.Tensor:
        if aggregated:
            z = xs[0] if scale is None else xs[0] * scale
            return self.head(z)
        return self.head(xs)

    def train_step(
        self,
        step: int,
        ids: np.ndarray,
        inputs: Sequence[Message],
        senders: Sequence[str],
        *,
        aggregated: bool = False,
        input_scale: torch.Tensor | None = None,
    ) -> tuple[float | torch.Tensor, list[Message]]:
        """One optimiser step of the head; returns the loss (a float or a one-element tensor: read it after sending
        the messages) and one gradient message per sender.

        ``input_scale`` (per-row factors, e.g. 1/number of observed parties) turns an aggregated sum into a mean.
        """
        xs = self._inputs(inputs)
        y = self.labels("train", ids)
        if not self.head.training:  # Module.train() walks every submodule: only when the mode changes
            self.head.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.backward_rule(self.head, lambda t: self._forward(t, aggregated, input_scale), xs, y, self.loss_fn,
                                  rows=np.asarray(ids))
        self.optimizer.step()
        if aggregated:
            grads = [xs[0].grad] * len(senders)
        else:
            grads = [x.grad for x in xs]
        msgs = [
            self.tagger.tag(Message("gradient", self.name, s, step, {"gradient": g.detach()}), "train", ids, train=True)
            for s, g in zip(senders, grads, strict=True)
        ]
        return loss, msgs

    @torch.no_grad()
    def predict(
        self, inputs: Sequence[Message], *, aggregated: bool = False, input_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Class probabilities (n, C) for the rows the inputs describe."""
        self.head.eval()
        xs = [to_device(require_wire(m, self.name).tensor(self.input_kind), self.device, self.dtype) for m in inputs]
        return probabilities(self._forward(xs, aggregated, input_scale), self.n_classes)

    def state_dict(self) -> dict:
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
