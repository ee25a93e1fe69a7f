"""What a party process received and has not taken yet, indexed for O(1) takes and counted per sender.

A peer fills this buffer; it is bounded per peer (:class:`ReceiveLimits`) and taking a message never scans the
buffer: messages are kept in one queue per (sender, kind), so ``take(kind=..., sender=...)`` pops the head of one
queue whatever else is waiting (a peer that floods one kind cannot slow the take of another). A take that leaves
the sender or the kind open compares the heads of the non-empty queues: at most one per (peer, registered kind).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from secvfl.errors import ConfigError

__all__ = ["Inbox", "ReceiveLimits", "ENTRY_COST"]

# Bytes a buffered message is charged on top of its data (the queue entry, the bytes object's header): a flood of
# empty messages fills the byte budget too.
ENTRY_COST = 256
_MIB = 1 << 20


@dataclass(frozen=True)
class ReceiveLimits:
    """What one peer may make this party hold, and how it may connect. Every limit is per peer except
    ``connections`` (incoming connections to this party's server, peers and strangers together).

    ``max_message_bytes``: the largest message accepted (a message declaring more chunks than fit is refused at its
    first chunk, before anything is buffered). ``max_buffered_bytes`` / ``max_buffered_messages``: received and not
    yet taken (a message being assembled counts); when a peer reaches either, its stream is not read until the
    party takes some of it (HTTP/2 flow control then holds the sender), and a party that waits for that peer while
    its buffer is full of messages it did not ask for stops the run naming it. ``streams_per_peer``: concurrent
    streams a peer may hold open to this party (one is used; a reconnect briefly needs two).
    ``handshake_seconds``: time a new connection has for its TLS handshake, and a new stream for its first frame.
    """

    max_message_bytes: int = 64 * _MIB
    max_buffered_bytes: int = 160 * _MIB
    max_buffered_messages: int = 16384
    streams_per_peer: int = 2
    connections: int = 64
    handshake_seconds: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_buffered_bytes", "max_buffered_messages", "streams_per_peer",
                     "connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"receive limit {name} must be a positive integer, got {value!r}")
        if not self.handshake_seconds > 0:
            raise ConfigError(f"receive limit handshake_seconds must be positive, got {self.handshake_seconds!r}")
        if self.max_buffered_bytes < 2 * self.max_message_bytes:
            # a peer's buffer must hold a message being assembled beside one not yet taken, or a legitimate
            # sender could stall its receiver
            raise ConfigError(f"the receive buffer per peer ({self.max_buffered_bytes / _MIB:g} MiB) must hold at "
                              f"least two of the largest messages ({self.max_message_bytes / _MIB:g} MiB each)")

    def describe(self) -> dict[str, float]:
        """The limits as a user sets them (federation file ``[limits]``)."""
        return {"max_message_mib": round(self.max_message_bytes / _MIB, 3),
                "buffer_mib": round(self.max_buffered_bytes / _MIB, 3),
                "buffered_messages": self.max_buffered_messages, "streams_per_peer": self.streams_per_peer,
                "connections": self.connections, "handshake_seconds": self.handshake_seconds}


class Inbox:
    """Received messages not yet taken: one FIFO queue per (sender, kind), and per-sender byte and message counts.

    Not thread-safe: the transport holds its lock around every call."""

    def __init__(self) -> None:
        self._queues: dict[tuple[str, str], deque[tuple[int, bytes]]] = {}
        self._kinds: dict[str, set[str]] = {}  # sender -> kinds with a non-empty queue
        self._order = 0
        self.bytes: dict[str, int] = {}
        self.messages: dict[str, int] = {}
        self.total = 0

    def add(self, sender: str, kind: str, data: bytes) -> None:
        queue = self._queues.get((sender, kind))
        if queue is None:  # (queues are kept once made: at most one per peer and registered kind)
            queue = self._queues[sender, kind] = deque()
        if not queue:
            kinds = self._kinds.get(sender)
            if kinds is None:
                kinds = self._kinds[sender] = set()
            kinds.add(kind)
        self._order += 1
        queue.append((self._order, data))
        self.bytes[sender] = self.bytes.get(sender, 0) + len(data) + ENTRY_COST
        self.messages[sender] = self.messages.get(sender, 0) + 1
        self.total += 1

    def _oldest(self, sender: str | None, kind: str | None) -> tuple[str, str] | None:
        """The (sender, kind) whose queue holds the oldest message matching the filters."""
        if sender is not None and kind is not None:
            queue = self._queues.get((sender, kind))
            return (sender, kind) if queue else None
        best, best_order = None, 0
        senders = [sender] if sender is not None else list(self._kinds)
        for s in senders:
            for k in self._kinds.get(s, ()):
                if kind is not None and k != kind:
                    continue
                order = self._queues[s, k][0][0]
                if best is None or order < best_order:
                    best, best_order = (s, k), order
        return best

    def pop(self, sender: str | None = None, kind: str | None = None) -> tuple[str, str, bytes] | None:
        """Remove and return the oldest message matching the filters as (sender, kind, data); None if none."""
        if sender is not None and kind is not None:  # the common case: one queue's head
            queue = self._queues.get((sender, kind))
            if not queue:
                return None
        else:
            key = self._oldest(sender, kind)
            if key is None:
                return None
            sender, kind = key
            queue = self._queues[key]
        _, data = queue.popleft()
        if not queue:
            kinds = self._kinds[sender]
            kinds.discard(kind)
            if not kinds:
                del self._kinds[sender]
        self.bytes[sender] -= len(data) + ENTRY_COST
        self.messages[sender] -= 1
        self.total -= 1
        return sender, kind, data

    def peek(self) -> tuple[str, str] | None:
        """(sender, kind) of the oldest message, left in place."""
        return self._oldest(None, None)

    def holds(self, sender: str, kind: str | None) -> bool:
        if kind is None:
            return sender in self._kinds
        return bool(self._queues.get((sender, kind)))

    def drop(self, sender: str) -> int:
        """Discard everything ``sender`` sent (a peer that broke the protocol); returns how many messages."""
        dropped = 0
        for kind in list(self._kinds.pop(sender, ())):
            queue = self._queues[sender, kind]
            dropped += len(queue)
            queue.clear()
        self.total -= dropped
        self.bytes[sender] = 0
        self.messages[sender] = 0
        return dropped
