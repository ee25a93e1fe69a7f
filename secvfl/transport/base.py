"""Transport interface: moves encoded messages (bytes) between named parties and counts every byte."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from secvfl.errors import MessageError, ProtocolError, UnsupportedError

__all__ = ["Transport", "CommStats", "PeerViolation", "peer_text"]

_SHOWN_CHARS = 300  # of a text a peer supplied, in an error or a log line


def peer_text(text: str | bytes, limit: int = _SHOWN_CHARS) -> str:
    """``text`` a peer supplied (an error it reports, a kind, a name), made safe for one line of a log or an error:
    control characters (newlines, ESC sequences that would move a terminal's cursor or fake log lines) escaped,
    invalid UTF-8 replaced, and at most ``limit`` characters (the rest counted, not shown)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "replace")
    shown = text[:limit]
    if not shown.isprintable():  # str.isprintable: False for C0/C1 controls, line and paragraph separators
        shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in shown)
    return shown + (f"... ({len(text) - limit} more characters)" if len(text) > limit else "")


class PeerViolation(ProtocolError, MessageError):
    """A peer sent what the protocol does not allow (too much, malformed, out of turn, non-finite values, a claim
    about another party): the run stops, naming that peer. Not a lost party: restarting the run does not help
    while that party's process misbehaves. (A MessageError too: code that refuses malformed messages catches it.)"""

    def __init__(self, party: str, problem: str) -> None:
        super().__init__(f"party {peer_text(party, 64)} broke the protocol: {problem}; the run stops (fix that "
                         "party's process, or leave it out of the federation, before resuming)")
        self.party = party
        self.problem = problem


@dataclass
class CommStats:
    """Exact communication counters, keyed by party and message kind.

    Bytes are the sizes of the encoded messages that crossed the transport (what a network would carry, before
    any TLS framing). ``payload_by_kind`` counts only their tensor and blob payloads (the network adds them: a
    transport sees bytes, not messages); the saddle-point experiments report it as "floats transmitted". It is
    checkpointed with the other counters but not part of :meth:`to_dict`.
    """

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_by_link: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def count(self, sender: str, receiver: str, kind: str, nbytes: int) -> None:
        self.bytes_sent[sender] += nbytes
        self.bytes_received[receiver] += nbytes
        self.messages_sent[sender] += 1
        self.bytes_by_kind[kind] += nbytes
        self.messages_by_kind[kind] += 1
        self.bytes_by_link[f"{sender}->{receiver}"] += nbytes

    def count_payload(self, kind: str, nbytes: int) -> None:
        self.payload_by_kind[kind] += nbytes

    def payload(self, kinds: Sequence[str] | None = None) -> int:
        """Payload bytes of the messages of ``kinds`` (all kinds when None)."""
        return sum(v for k, v in self.payload_by_kind.items() if kinds is None or k in kinds)

    @property
    def bytes_total(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def messages_total(self) -> int:
        return sum(self.messages_sent.values())

    def to_dict(self) -> dict:
        parties = sorted(set(self.bytes_sent) | set(self.bytes_received))
        return {
            "bytes_total": self.bytes_total,
            "messages_total": self.messages_total,
            "bytes_by_party": {
                p: {"sent": self.bytes_sent.get(p, 0), "received": self.bytes_received.get(p, 0)} for p in parties
            },
            "bytes_by_kind": dict(sorted(self.bytes_by_kind.items())),
            "messages_by_kind": dict(sorted(self.messages_by_kind.items())),
            "bytes_by_link": dict(sorted(self.bytes_by_link.items())),
        }

    def state_dict(self) -> dict:
        return {k: dict(getattr(self, k)) for k in self.__dataclass_fields__}

    def load_state_dict(self, state: dict) -> None:
        for k in self.__dataclass_fields__:
            d = defaultdict(int)
            d.update(state.get(k, {}))
            setattr(self, k, d)


class Transport(ABC):
    """Moves bytes between named parties. Implementations: in-process queues (``inprocess.py``, the default) and
    gRPC with mutual TLS between party processes (``grpc_link.py``, used by ``secvfl party`` and ``secvfl launch``)."""

    def __init__(self) -> None:
        self.stats = CommStats()

    @abstractmethod
    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        """Deliver ``data`` to ``receiver``'s inbox (counts it). A transport between processes may hold it until
        the sender's next wait for a message, or :meth:`flush`."""

    def flush(self) -> None:
        """Send what ``put`` holds now (the sender is about to do something long without waiting for messages)."""
        return None  # transports that deliver at put() hold nothing

    @abstractmethod
    def take(self, receiver: str, *, kind: str | None = None, sender: str | None = None) -> bytes:
        """Remove and return the oldest message for ``receiver`` matching ``kind``/``sender``."""

    @abstractmethod
    def pending(self, receiver: str | None = None) -> int:
        """Number of undelivered messages (for ``receiver``, or in total)."""

    def put_control(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        """Deliver deployment plumbing between party processes (requests, public set-up facts), counted apart from
        the run's messages: a run with every party in one process has none."""
        raise UnsupportedError("control messages travel only between parties in separate processes (secvfl.deploy)")
