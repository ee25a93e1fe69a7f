"""Protocol layers: composable middleware on messages, under every algorithm.

An algorithm only sends "embeddings" and receives "gradients"; the configured stack of layers (compress, add noise,
encrypt, ...) transforms them on the way out (``outbound``, in stack order) and back (``inbound``, in reverse order),
like an onion. A layer acts on behalf of the party that sends or receives, and keeps that party's state apart from
every other party's (error-feedback residuals, keys, noise generators).

Collective operations whose *communication pattern* changes under a protocol (sum or mean of the feature parties'
outputs, which CKKS or masking route through an aggregator) go through an :class:`Aggregation` instead.

Every layer says up front whether it can serve an algorithm (:meth:`Layer.check` returns problems, empty if none),
so an invalid combination is refused before training with a message that says why.

These interfaces belong to the core (algorithms, the network and the protocols all need them); the layers and
aggregations themselves live in ``protocols/``, which imports this module, never the reverse.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from secvfl.errors import UnsupportedError
from secvfl.messages import Message

if TYPE_CHECKING:
    from secvfl.transport.network import Network

__all__ = ["Role", "AlgorithmTraits", "Topology", "Layer", "Aggregation", "PlainAggregation", "check_stack"]


class Role(str, Enum):  # noqa: UP042 - StrEnum would change str(role) in logs and saved configs
    LABEL = "label"  # holds labels and the head; computes the loss
    FEATURE = "feature"  # holds a feature block and a bottom model
    AGGREGATOR = "aggregator"  # holds no data and no secret key; adds what it is given (CKKS, masking)


@dataclass(frozen=True)
class AlgorithmTraits:
    """What an algorithm sends, so layers can decide whether (and to what) they apply."""

    name: str
    # How the receivers combine the parties' outputs: "concat" | "mean" | "sum" | "subset-mean" (through the network's
    # aggregation), "broadcast" (every receiver gets each party's output as its own message) or "none".
    aggregation: str
    forward_kinds: tuple[str, ...] = ("embedding",)
    backward_kinds: tuple[str, ...] = ("gradient",)
    gradient_based: bool = True
    shares_labels: bool = False  # the label party sends labels to feature parties (e.g. `local`)
    labels_at_every_party: bool = False  # every party holds the labels (LASER-VFL): no party to hide them from
    # The label party takes each training label from a stream as it arrives, one new sample per round (online
    # algorithms): there is no fixed training set, so a label mechanism can only act on each label as it comes.
    streamed_labels: bool = False
    # Each link carries the same quantity every round and the algorithm marks its messages itself (full-batch saddle
    # methods: meta "persistent", rows, eval), so layers need not tag the parties' messages for it.
    persistent_messages: bool = False
    # Why the receiver needs each party's output itself, not only their sum (e.g. to step that party's head): a secure
    # sum refuses the algorithm with this reason. Empty: the algorithm says nothing more than its ``aggregation``.
    individual_outputs: str = ""
    # Why a sparsifier without error feedback breaks the algorithm (it steps on every message as sent, so rand-k's
    # unbiased but n/k-fold noisier copy, or top-k's dropped entries, make it diverge or stall), and what to use
    # instead: a compression layer refuses topk/randk without +ef/+vr with this reason. Empty: accepted.
    needs_error_feedback: str = ""
    # Why the receiver needs every row of the parties' outputs exactly (per-batch outputs keep no error-feedback
    # memory): a compression layer refuses a sparsifier on the forward messages with this reason. Empty: accepted.
    exact_outputs: str = ""


@dataclass(frozen=True)
class Topology:
    """Who is who in a federation: party name -> role; ``local``: the one party this process acts for when the
    parties run in separate processes (secvfl.deploy), None when every party is in this process. (A coordinator
    may act for no party of the run: LASER-VFL's has no label party, so its ``local`` names none of ``roles``.)"""

    roles: Mapping[str, Role]
    local: str | None = None

    def parties(self, role: Role) -> list[str]:
        return [p for p, r in self.roles.items() if r == role]

    @property
    def label_party(self) -> str:
        labels = self.parties(Role.LABEL)
        if len(labels) != 1:
            raise UnsupportedError(f"this operation needs exactly one label party, found {labels}")
        return labels[0]

    @property
    def feature_parties(self) -> list[str]:
        return self.parties(Role.FEATURE)


class Layer:
    """One protocol layer. Subclasses override what they need; the defaults pass messages through unchanged (so
    nothing here is abstract: a layer that only observes, or only keeps state, is complete)."""

    name: ClassVar[str] = "layer"

    def check(self, traits: AlgorithmTraits) -> list[str]:
        """Problems that make this layer invalid for ``traits`` (empty list: valid)."""
        return []

    def bind(self, topology: Topology) -> None:
        """Called once when the network is built, before any message."""
        self.topology = topology

    def outbound(self, messages: list[Message], party: str) -> list[Message]:
        """Transform the messages ``party`` releases in one step (all of them together, e.g. for joint clipping)."""
        return messages

    def inbound(self, message: Message, party: str) -> Message:
        """Transform a message ``party`` received, undoing what the sender's layer did where needed."""
        return message

    def encoded_outputs(self, traits: AlgorithmTraits) -> tuple[str, str] | None:
        """``(what, why and the fix)`` when this layer turns the forward outputs (``traits.forward_kinds``) into
        something other than a dense tensor an aggregation could add (compression: sparse supports, packed codes);
        None when it leaves them dense. :func:`check_stack` refuses it under an aggregation that adds dense tensors
        only (``Aggregation.accepts_encoded``)."""
        return None

    def across_processes(self) -> str | None:
        """None when each party's process can run this layer on its own party's messages alone and the run gives
        what it gives in one process (secvfl.deploy); otherwise why not (the default: not verified)."""
        return "not yet verified with parties in separate processes"

    def describe(self) -> dict[str, Any]:
        """Facts for ``summary.json`` (parameters, privacy spent, ...)."""
        return {"layer": self.name}

    def start_epoch(self, net: Network, epoch: int) -> None:
        """Called by the runner before the first message of every epoch. Keys that a restarted process cannot
        have (and must not read back from a checkpoint) are renewed here, at each checkpoint boundary, so that an
        interrupted and resumed run sends exactly what an uninterrupted one sends."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def check_stack(layers: Sequence[Layer], traits: AlgorithmTraits, aggregation: Aggregation | None = None) -> None:
    """Refuse, with every reason at once, a stack that cannot serve the algorithm."""
    problems = [f"{layer.name}: {p}" for layer in layers for p in layer.check(traits)]
    if aggregation is not None:
        problems += [f"{aggregation.name}: {p}" for p in aggregation.check(traits)]
        if not aggregation.accepts_encoded and traits.aggregation != "none":
            outputs = "/".join(traits.forward_kinds)
            problems += [
                f"{layer.name}: {encoded[0]} cannot be combined with the {aggregation.name} aggregation, which "
                f"{aggregation.dense_inputs} each party's dense {outputs} and adds them: {encoded[1]}"
                for layer in layers if (encoded := layer.encoded_outputs(traits)) is not None
            ]
    if problems:
        raise UnsupportedError(f"protocols not valid for algorithm {traits.name!r}: " + "; ".join(problems))


class Aggregation(ABC):
    """How the sum or mean of several parties' tensors reaches one receiver."""

    name: ClassVar[str] = "aggregation"
    # Whether the receiver also learns each party's own tensors (plain: yes; secure aggregations: only the sum).
    reveals_individual_outputs: ClassVar[bool] = False
    # Whether it can add what a layer made of the outputs (sparse or packed forms, see Layer.encoded_outputs), or
    # needs each party's dense tensor, and what it does with that tensor (for the refusal: "CKKS-encrypts").
    accepts_encoded: ClassVar[bool] = True
    dense_inputs: ClassVar[str] = "adds"

    def check(self, traits: AlgorithmTraits) -> list[str]:
        return []

    def extra_roles(self) -> dict[str, Role]:
        """Parties this aggregation adds to the run's topology (CKKS: its aggregator); none by default."""
        return {}

    def bind(self, topology: Topology) -> None:
        self.topology = topology

    @abstractmethod
    def aggregate(self, net: Network, messages: Sequence[Message], receiver: str, op: str) -> Message:
        """Deliver ``op`` ("sum" or "mean") over ``messages``' tensors (name by name) to ``receiver``."""

    def describe(self) -> dict[str, Any]:
        return {"aggregation": self.name}

    # -- parties in separate processes (secvfl.deploy): each process runs only its own party's half of a round --
    across_processes: ClassVar[bool] = False  # whether it implements send_share and collect

    def send_share(self, net: Network, message: Message, senders: Sequence[str]) -> None:
        """The sender's half of a round, in the sender's process: ``message`` is its input, ``senders`` every
        contributor of the round (itself included)."""
        raise UnsupportedError(f"the {self.name} aggregation runs every party in one process so far")

    def collect(self, net: Network, receiver: str, kind: str, senders: Sequence[str], op: str) -> Message:
        """The receiver's half, in the receiver's process: the ``op`` of what ``senders`` sent, as :meth:`aggregate`
        would deliver it."""
        raise UnsupportedError(f"the {self.name} aggregation runs every party in one process so far")

    def start_epoch(self, net: Network, epoch: int) -> None:  # noqa: B027 - optional hook, like Layer's
        """Like :meth:`Layer.start_epoch`: renew per-epoch keys before the epoch's first round."""

    def state_dict(self) -> dict[str, Any]:
        """Public counters to checkpoint (never keys: :meth:`start_epoch` renews those)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook, like Layer's
        pass

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what it started (worker processes); called when its run ends or is refused."""


@dataclass
class PlainAggregation(Aggregation):
    """Every party sends its tensors to the receiver, which adds them up. No protection beyond the layers."""

    name: ClassVar[str] = "plain"
    reveals_individual_outputs: ClassVar[bool] = True
    topology: Topology | None = field(default=None, repr=False)

    def aggregate(self, net: Network, messages: Sequence[Message], receiver: str, op: str) -> Message:
        if op not in ("sum", "mean"):
            raise UnsupportedError(f"aggregation op must be 'sum' or 'mean', got {op!r}")
        for m in messages:
            net.send(m.replace(receiver=receiver))
        received = [net.receive(receiver, kind=m.kind, sender=m.sender) for m in messages]
        return sum_messages(received, receiver, op)

    across_processes: ClassVar[bool] = True

    def send_share(self, net: Network, message: Message, senders: Sequence[str]) -> None:
        net.send(message)

    def collect(self, net: Network, receiver: str, kind: str, senders: Sequence[str], op: str) -> Message:
        if op not in ("sum", "mean"):
            raise UnsupportedError(f"aggregation op must be 'sum' or 'mean', got {op!r}")
        return sum_messages([net.receive(receiver, kind=kind, sender=s) for s in senders], receiver, op)


def sum_messages(received: Sequence[Message], receiver: str, op: str) -> Message:
    names = list(received[0].tensors)
    total: dict[str, torch.Tensor] = {}
    for name in names:
        acc = received[0].tensor(name).clone()
        for m in received[1:]:
            acc += m.tensor(name)
        total[name] = acc / len(received) if op == "mean" else acc
    first = received[0]
    return Message(first.kind, "aggregate", receiver, first.step, total, {}, {"op": op, "parties": len(received)},
                   wire_size=sum(m.wire_size or 0 for m in received))
