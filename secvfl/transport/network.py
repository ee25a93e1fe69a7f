"""The network a training run talks to: a transport, the protocol stack of layers, and an aggregation strategy.

Algorithms call :meth:`Network.send`, :meth:`Network.receive` and :meth:`Network.aggregate` and nothing else to move
data between parties. Every message is encoded to bytes and decoded again, so byte counts are exact and no party
ever holds a reference to another party's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from secvfl.errors import MessageError, TrainingDiverged
from secvfl.messages import Message, decode, encode, encode_many, encoded_payload_size, mark_delivered
from secvfl.transport.base import CommStats, PeerViolation, Transport, peer_text
from secvfl.transport.guard import ReceiveGuard, _finite
from secvfl.transport.inprocess import InProcessTransport
from secvfl.transport.layers import (
    Aggregation,
    AlgorithmTraits,
    Layer,
    PlainAggregation,
    Role,
    Topology,
    check_stack,
)

__all__ = ["Network", "Role", "View", "ReceivedCounts"]


class ReceivedCounts:
    """What the parties of a process received, counted as their senders count what they send (CommStats), but
    tallied per (sender, receiver, kind) on the receive path (one dictionary entry a message) and laid out as
    CommStats only when read: :meth:`stats`, or the CommStats methods below."""

    def __init__(self) -> None:
        self._tally: dict[tuple[str, str, str], list[int]] = {}
        self._loaded = CommStats()  # restored from a checkpoint

    def add(self, sender: str, receiver: str, kind: str, nbytes: int, payload: int) -> None:
        counts = self._tally.get((sender, receiver, kind))
        if counts is None:
            counts = self._tally[sender, receiver, kind] = [0, 0, 0]
        counts[0] += 1
        counts[1] += nbytes
        counts[2] += payload

    def stats(self) -> CommStats:
        out = CommStats()
        out.load_state_dict(self._loaded.state_dict())
        for (sender, receiver, kind), (messages, nbytes, payload) in self._tally.items():
            out.bytes_sent[sender] += nbytes
            out.bytes_received[receiver] += nbytes
            out.messages_sent[sender] += messages
            out.bytes_by_kind[kind] += nbytes
            out.messages_by_kind[kind] += messages
            out.bytes_by_link[f"{sender}->{receiver}"] += nbytes
            out.payload_by_kind[kind] += payload
        return out

    def state_dict(self) -> dict:
        return self.stats().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._tally = {}
        self._loaded.load_state_dict(state)

    def to_dict(self) -> dict:
        return self.stats().to_dict()


@dataclass
class View:
    """What one party saw: the messages it released (before its own layers) and received (after them).

    This is exactly the information an attacker controlling that party has about the other parties.
    """

    party: str
    sent: list[Message] = field(default_factory=list)
    received: list[Message] = field(default_factory=list)

    def received_of(self, kind: str) -> list[Message]:
        return [m for m in self.received if m.kind == kind]

    def sent_of(self, kind: str) -> list[Message]:
        return [m for m in self.sent if m.kind == kind]


class Network:
    def __init__(
        self,
        roles: Mapping[str, Role],
        *,
        transport: Transport | None = None,
        layers: Sequence[Layer] = (),
        aggregation: Aggregation | None = None,
        traits: AlgorithmTraits | None = None,
        local: str | None = None,
    ) -> None:
        self.topology = Topology(dict(roles), local)
        self.transport = transport or InProcessTransport()
        self.layers = list(layers)
        self.aggregation = aggregation or PlainAggregation()
        if traits is not None:
            check_stack(self.layers, traits, self.aggregation)
        for layer in self.layers:
            layer.bind(self.topology)
        self.aggregation.bind(self.topology)
        # Every message a party of this process receives is checked here (secvfl.transport.guard), after the
        # receiver's own layers: sender, step, rows, width, dtype, finiteness.
        self.guard = ReceiveGuard(traits.forward_kinds if traits else (), traits.backward_kinds if traits else ())
        # What this process's parties received, by sender and kind, counted at the receiver (a deployed run checks
        # it against what each sender says it sent: secvfl.deploy.remote.FederatedStats).
        self.received = ReceivedCounts()
        self.received_complete = True  # False after loading a checkpoint written before receivers counted
        self._views: dict[str, View] = {}
        # Inputs parties submitted to the aggregation, per (receiver, kind), until the receiver aggregates them.
        self._submitted: dict[tuple[str, str], list[Message]] = {}
        # The one party this process acts for when the parties run in separate processes (secvfl.deploy); None:
        # every party is here. Aggregations then run their halves (Aggregation.send_share and collect), layers
        # their own party's (topology.local).
        self.local: str | None = local
        # Called with the epoch by start_epoch: a coordinator passes the epoch on to parties in other processes.
        self.epoch_listeners: list[Callable[[int], None]] = []
        # name -> (save, load): the state of a party in another process that holds no handle (a CKKS aggregator),
        # saved by that party itself; what save() returns (a digest) goes into this network's checkpoint.
        self.remote_states: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}

    @property
    def stats(self) -> CommStats:
        return self.transport.stats

    def _known(self, party: str) -> None:
        if party not in self.topology.roles and party != "aggregate":
            raise MessageError(f"unknown party {party!r}; parties are {sorted(self.topology.roles)}")

    def _delivered_as_encoded(self) -> bool:
        """Whether every message goes from a party of this process to a party of this process as its sender encoded
        it: every party here, no layer, the plain in-process transport (a subclass may rewrite what it carries).
        The receiver's check of each message is then the sender's check of its own output (:meth:`send`)."""
        return self.local is None and not self.layers and type(self.transport) is InProcessTransport

    def send(self, *messages: Message) -> None:
        """Release messages from one sender in one step, through the sender's outbound layers."""
        if not messages:
            return
        sender = messages[0].sender
        if len(messages) > 1 and any(m.sender != sender for m in messages):
            raise MessageError("send() takes the messages of one sender; call it once per sender")
        self._known(sender)
        # What the party itself computed: its own divergence is its own to report, checked here (read after the one
        # wait below) -- unless the receiver is a party of this process that gets these very bytes and checks them
        # anyway (receive, own=True), which then says so with the same cause.
        check = not self._delivered_as_encoded()
        sums = self.guard.sums_to_send(messages) if check else None  # the GPU tensors' sums, on the device
        if check and self.layers:  # a protocol layer must not see them (it may read or keep them): checked now
            self.guard.check_sent(sums)
            self.guard.check_encoded(messages)
            check = False
        if sender in self._views:
            self._views[sender].sent.extend(messages)
        out = list(messages)
        for layer in self.layers:
            out = layer.outbound(out, sender)
        for m in out:
            self._known(m.receiver)
        # one wait for the GPU tensors of all of them (secvfl.device.to_host), not one per message
        if check:  # (no layer: ``out`` is ``messages``)
            squares: list[dict[str, float]] = []
            encoded = encode_many(out, squares)
            self.guard.check_sent(sums)  # before anything leaves
            self.guard.check_encoded(out, squares)  # the CPU tensors, from what the encoder read
        else:
            encoded = encode_many(out)
        for m, data in zip(out, encoded, strict=True):
            self.transport.put(m.sender, m.receiver, m.kind, data)
            self.stats.count_payload(m.kind, encoded_payload_size(data))

    def receive(self, receiver: str, *, kind: str | None = None, sender: str | None = None,
                timeout: float | None = None) -> Message:
        """Take the oldest matching message for ``receiver`` and pass it through the receiver's inbound layers.
        ``timeout``: the longest wait in seconds, for a transport between processes (default: the transport's own)."""
        if timeout is None:
            data = self.transport.take(receiver, kind=kind, sender=sender)
        else:
            data = self.transport.take(receiver, kind=kind, sender=sender, timeout=timeout)  # type: ignore[call-arg]
        try:
            wire = msg = decode(data)
        except MessageError as exc:  # the transport's label names who sent these bytes
            raise PeerViolation(sender or "?", f"it sent {receiver} bytes that are not a message ({exc})") from None
        for layer in reversed(self.layers):
            msg = layer.inbound(msg, receiver)
        # The transport routes by its own labels (the sender a peer's link is authenticated as); the message must
        # agree with what was asked for.
        if msg.receiver != receiver or (kind is not None and msg.kind != kind) or (sender is not None and msg.sender != sender):
            problem = (f"{receiver} asked for a {kind or 'any'} message from {sender or 'anyone'} but got a {msg.kind} "
                       f"message from {peer_text(msg.sender, 64)} to {peer_text(msg.receiver, 64)}; the message was "
                       "misrouted or relabelled")
            if sender is None:
                raise MessageError(problem)
            raise PeerViolation(sender, problem)
        # as its sender counted it (Network.send)
        self.received.add(msg.sender, receiver, wire.kind, len(data), encoded_payload_size(data))
        self.guard.check(msg, receiver, self._delivered_as_encoded(), as_read=msg is wire and not self.layers)
        # The receiver's layers act for the receiver (decompress, open a sealed envelope): what they return is what
        # the receiver got off the wire.
        msg = mark_delivered(msg)
        if receiver in self._views:
            self._views[receiver].received.append(msg)
        return msg

    def aggregate(self, messages: Sequence[Message], receiver: str, op: str = "sum") -> Message:
        """Sum or mean of several parties' tensors, delivered to ``receiver`` by the configured aggregation."""
        msg = self.aggregation.aggregate(self, messages, receiver, op)
        if msg.receiver != receiver:
            raise MessageError(f"the {self.aggregation.name} aggregation addressed the sum for {receiver} to "
                               f"{msg.receiver}")
        self._check_sum(msg, receiver, [m.sender for m in messages])
        # Built by the aggregation, for the receiver, from what it received through this network.
        return mark_delivered(msg)

    def _check_sum(self, total: Message, receiver: str, senders: Sequence[str]) -> None:
        """The guard's check of an aggregate (its inputs were checked one by one where they arrived in the clear;
        under encryption or masks only the sum can be): a violation names the parties summed."""
        try:
            self.guard.check(total, receiver)
        except PeerViolation as exc:
            who = ", ".join(senders) or total.sender
            if isinstance(self.aggregation, PlainAggregation) and not all(
                    _finite(t) for t in total.tensors.values() if t.is_floating_point() and t.numel()):
                # every input was checked, finite, as its sender sent it: the sum of finite values overflowed
                raise TrainingDiverged(
                    f"training stopped: the sum of {who}'s {total.kind} became non-finite at step {total.step}, "
                    f"though each was finite (an overflow). {self.guard.divergence_cause()}") from None
            raise PeerViolation(f"{who} (through the {self.aggregation.name} aggregation)", exc.problem) from None

    def submit(self, message: Message) -> None:
        """A party's input to the next aggregation for ``message.receiver`` (:meth:`aggregate_submitted`).

        Nothing travels yet: how inputs reach the receiver (in the clear, encrypted, masked) is the aggregation's
        business, and it needs every party's input of the round at once.
        """
        self._known(message.sender)
        self._known(message.receiver)
        if self.local is not None:  # the receiver is another process: the sender's half of the round runs now
            self.aggregation.send_share(self, message, self.topology.feature_parties)
            return
        self._submitted.setdefault((message.receiver, message.kind), []).append(message)

    def aggregate_submitted(self, receiver: str, kind: str, op: str = "sum", *, senders: Sequence[str] = ()
                            ) -> Message:
        """:meth:`aggregate` over the ``kind`` inputs submitted for ``receiver``, in the order they were submitted.

        ``senders``: the parties that submitted, in that order; needed when they are in other processes (their
        inputs then arrive as the plain aggregation's messages)."""
        if self.local is not None:
            if not senders:
                raise MessageError(f"aggregating {kind} across processes needs the senders' names")
            total = self.aggregation.collect(self, receiver, kind, senders, op)
            self._check_sum(total, receiver, senders)
            return mark_delivered(total)
        messages = self._submitted.pop((receiver, kind), [])
        if not messages:
            raise MessageError(f"no {kind} inputs were submitted for {receiver}; the protocol's order is broken")
        return self.aggregate(messages, receiver, op)

    def record(self, party: str) -> View:
        """Start recording ``party``'s view (for attacks and audits); returns the live view."""
        self._known(party)
        return self._views.setdefault(party, View(party))

    def describe(self) -> dict:
        return {
            "layers": [layer.describe() for layer in self.layers],
            "aggregation": self.aggregation.describe(),
        }

    def start_epoch(self, epoch: int) -> None:
        """Tell the aggregation and every layer that an epoch begins (they renew per-epoch keys). The listeners (the
        parties in other processes) are told first: renewing keys may take messages from them."""
        for listener in self.epoch_listeners:
            listener(epoch)
        self.aggregation.start_epoch(self, epoch)
        for layer in self.layers:
            layer.start_epoch(self, epoch)

    # -- deployment plumbing between party processes (secvfl.deploy), outside the run's counted messages --------
    def send_control(self, message: Message) -> None:
        """Send ``message`` (public set-up facts, e.g. a public key) to a party in another process as control
        traffic: counted in the transport's ``control_stats`` like the coordinator's requests, not with the run's
        messages, which stay the bytes of the in-process run (where such facts need no message). No layer touches
        it."""
        if self.local is None or message.sender != self.local:
            raise MessageError(f"control messages are sent by this process's own party ({self.local}), not "
                               f"{message.sender}")
        self._known(message.receiver)
        self.transport.put_control(message.sender, message.receiver, message.kind, encode(message))

    def receive_control(self, receiver: str, *, kind: str, sender: str) -> Message:
        """Take the ``kind`` control message of ``sender`` (see :meth:`send_control`)."""
        msg = decode(self.transport.take(receiver, kind=kind, sender=sender))
        if (msg.kind, msg.sender, msg.receiver) != (kind, sender, receiver):
            raise MessageError(f"{receiver} asked for a {kind} control message from {sender} but got a {msg.kind} "
                               f"message from {msg.sender} to {msg.receiver}")
        return msg

    def state_dict(self) -> dict:
        state = {"stats": self.stats.state_dict(), "layers": [layer.state_dict() for layer in self.layers],
                 "aggregation": self.aggregation.state_dict(), "received": self.received.state_dict()}
        if self.remote_states:
            state["remote"] = {name: save() for name, (save, _) in self.remote_states.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state["stats"])
        self.received.load_state_dict(state.get("received", {}))
        self.received_complete = "received" in state  # (a checkpoint from before receivers counted: incomplete)
        for layer, s in zip(self.layers, state["layers"], strict=True):
            layer.load_state_dict(s)
        self.aggregation.load_state_dict(state.get("aggregation", {}))
        for name, (_, load) in self.remote_states.items():
            load(state["remote"][name])
