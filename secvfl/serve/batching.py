"""Dynamic batching of scoring requests, with every wait and every queue bounded.

Client requests (each a list of entity ids) wait in one queue; a single worker thread takes the oldest, then waits
at most ``batch_wait_ms`` for more to fill a batch of at most ``max_batch_ids`` ids, scores the batch's distinct ids
in one round with the parties, and hands each request its rows. While a batch is being scored the queue fills by
itself, so under load batches grow without any wait. The window is used only once requests come concurrently (the
last batch held more than one request, or more are queued): a lone client's request is scored at once.

Bounds: a full queue (``max_queued_requests``) refuses a request at once (:class:`QueueFull`, HTTP 429 with the
reason); a request whose deadline passes while it waits is answered with :class:`DeadlineExceeded` without being
scored; a batch never holds more than ``max_batch_ids`` ids (a request is never split).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from secvfl.errors import SecvflError

__all__ = ["Batcher", "QueueFull", "DeadlineExceeded", "BatchStats"]


class QueueFull(SecvflError):
    """The queue of waiting requests is at its bound."""


class DeadlineExceeded(SecvflError):
    """A request's deadline passed before it was scored."""


@dataclass
class _Pending:
    ids: list[str]
    deadline: float  # time.monotonic()
    future: Future = field(default_factory=Future)


@dataclass
class BatchStats:
    batches: int = 0
    ids: int = 0
    requests: int = 0
    largest: int = 0
    score_seconds: float = 0.0  # time spent scoring batches with the parties (the rest of a request's time is
    # HTTP, TLS, JSON and waiting in the queue)

    def to_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "requests": self.requests, "ids": self.ids, "largest_batch_ids": self.largest,
                "mean_batch_ids": round(self.ids / self.batches, 2) if self.batches else 0.0,
                "score_seconds": round(self.score_seconds, 6)}


class Batcher:
    """``score(ids, seconds_left) -> result`` is called by one worker thread with a batch's distinct ids; each
    request's future gets ``(result, positions)`` -- the batch result and where its ids are in it."""

    def __init__(self, score: Callable[[list[str], float], Any], *, max_batch_ids: int, batch_wait_ms: float,
                 max_queued_requests: int, log: Callable[[str], None]) -> None:
        self._score = score
        self.max_batch_ids = max_batch_ids
        self.wait = batch_wait_ms / 1000.0
        self.max_queued = max_queued_requests
        self._queue: deque[_Pending] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._log = log
        self.stats = BatchStats()
        self._last_requests = 0  # requests in the last batch taken
        self._thread = threading.Thread(target=self._work, name="secvfl-serve-batcher", daemon=True)
        self._thread.start()

    def submit(self, ids: Sequence[str], deadline: float) -> Future:
        with self._cond:
            if self._closed:
                raise QueueFull("the server is stopping")
            if len(self._queue) >= self.max_queued:
                raise QueueFull(f"{len(self._queue)} requests are waiting, the most this server queues (--max-queue "
                                f"{self.max_queued}); retry later")
            item = _Pending(list(ids), deadline)
            self._queue.append(item)
            self._cond.notify()
        return item.future

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for item in self._queue:
                item.future.set_exception(QueueFull("the server is stopping"))
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _take_batch(self) -> list[_Pending] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            batch = [self._queue.popleft()]
            n = len(batch[0].ids)
            # Wait for more only once requests come concurrently: a lone client's request is scored at once.
            until = time.monotonic() + (self.wait if self._last_requests > 1 or self._queue else 0.0)
            while n < self.max_batch_ids:
                if self._queue:
                    if n + len(self._queue[0].ids) > self.max_batch_ids:
                        break
                    item = self._queue.popleft()
                    batch.append(item)
                    n += len(item.ids)
                    continue
                left = until - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._cond.wait(left)
            return batch

    def _work(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            now = time.monotonic()
            live = []
            for item in batch:
                if item.deadline <= now:
                    item.future.set_exception(DeadlineExceeded("the request's deadline passed while it waited in "
                                                               "the queue; retry, or ask for a longer deadline"))
                else:
                    live.append(item)
            if not live:
                continue
            distinct: dict[str, int] = {}
            for item in live:
                for i in item.ids:
                    distinct.setdefault(i, len(distinct))
            self._last_requests = len(batch)
            t0 = time.perf_counter()
            try:
                result = self._score(list(distinct), max(0.0, min(i.deadline for i in live) - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - each waiting request gets the failure, the worker goes on
                if not isinstance(exc, SecvflError):
                    import traceback

                    self._log("".join(traceback.format_exception(exc)).rstrip())
                for item in live:
                    item.future.set_exception(exc)
                continue
            self.stats.score_seconds += time.perf_counter() - t0
            self.stats.batches += 1
            self.stats.requests += len(live)
            self.stats.ids += len(distinct)
            self.stats.largest = max(self.stats.largest, len(distinct))
            for item in live:
                item.future.set_result((result, [distinct[i] for i in item.ids]))
