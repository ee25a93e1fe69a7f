"""In-process transport: per-receiver inboxes of encoded bytes. The default (embedded) deployment."""

from __future__ import annotations

from collections import defaultdict, deque

from secvfl.errors import MessageError
from secvfl.transport.base import Transport

__all__ = ["InProcessTransport"]


class InProcessTransport(Transport):
    def __init__(self) -> None:
        super().__init__()
        self._inbox: dict[str, deque[tuple[str, str, bytes]]] = defaultdict(deque)

    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        if not isinstance(data, bytes):
            raise MessageError("the transport carries bytes only; encode the message first")
        self.stats.count(sender, receiver, kind, len(data))
        self._inbox[receiver].append((sender, kind, data))

    def take(self, receiver: str, *, kind: str | None = None, sender: str | None = None) -> bytes:
        box = self._inbox[receiver]
        for i, (s, k, data) in enumerate(box):
            if (kind is None or k == kind) and (sender is None or s == sender):
                del box[i]
                return data
        raise MessageError(
            f"no {kind or 'any'} message for {receiver} from {sender or 'anyone'} is waiting "
            f"({len(box)} other message(s) pending); the protocol's send/receive order is broken"
        )

    def pending(self, receiver: str | None = None) -> int:
        if receiver is not None:
            return len(self._inbox[receiver])
        return sum(len(b) for b in self._inbox.values())
