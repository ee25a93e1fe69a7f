"""Rounds from live event sources: each feature party consumes its own (entity id, features) events and the label
party its (entity id, label) events; :class:`RoundJoin` forms rounds by entity id.

A round is ready when the label and every party's features for an entity have arrived, or when ``timeout`` has
passed since the entity's label arrived: the parties still missing are then *missing* for that round (they answer
with zeros and are passive, :mod:`.parties`). Features whose label never comes are dropped ``timeout`` after they
arrived. Memory is bounded whatever the stream's length: at most ``max_pending`` entities wait (the oldest is
dropped first, counted), and late events of an entity whose round has gone are dropped (counted); the set of
recently finished entities is bounded too. Time is whatever ``clock`` says (``time.monotonic`` by default; tests
pass a logical clock). Only entity ids cross parties here; features stay in the party's own feed
(:class:`~secvfl.algorithms.online.streams.Feed`), which :meth:`RoundJoin.deliver` fills for a ready round.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from secvfl.algorithms.online.streams import Feed
from secvfl.errors import ConfigError

__all__ = ["Round", "RoundJoin", "LABEL_SOURCE"]

LABEL_SOURCE = "label"


@dataclass
class Round:
    entity: Hashable
    label: Any
    features: dict[str, Any]  # party -> features; a missing party is absent
    missing: list[str]


@dataclass
class _Pending:
    first_seen: float
    label_at: float | None = None
    label: Any = None
    features: dict[str, Any] = field(default_factory=dict)


class RoundJoin:
    def __init__(self, parties: Iterable[str], *, timeout: float, max_pending: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.parties = list(parties)
        if not self.parties:
            raise ConfigError("a live round needs at least one feature party")
        if not timeout >= 0:
            raise ConfigError(f"the live-source timeout must be >= 0 seconds, got {timeout}")
        if max_pending < 1:
            raise ConfigError(f"max_pending must be at least 1, got {max_pending}")
        self.timeout, self.max_pending, self.clock = float(timeout), int(max_pending), clock
        self._pending: OrderedDict[Hashable, _Pending] = OrderedDict()
        self._done: OrderedDict[Hashable, None] = OrderedDict()  # recently finished ids: late events are dropped
        self.dropped = {"evicted": 0, "late": 0, "unlabelled": 0}

    def __len__(self) -> int:
        return len(self._pending)

    def offer(self, source: str, entity: Hashable, payload: Any) -> None:
        """An event from ``source`` (a feature party's name, or :data:`LABEL_SOURCE`)."""
        if source != LABEL_SOURCE and source not in self.parties:
            raise ConfigError(f"unknown live source {source!r}; sources are {[*self.parties, LABEL_SOURCE]}")
        if entity in self._done:
            self.dropped["late"] += 1
            return
        now = self.clock()
        slot = self._pending.get(entity)
        if slot is None:
            if len(self._pending) >= self.max_pending:
                self._pending.popitem(last=False)
                self.dropped["evicted"] += 1
            slot = self._pending[entity] = _Pending(now)
        if source == LABEL_SOURCE:
            slot.label, slot.label_at = payload, now
        else:
            slot.features[source] = payload

    def ready(self) -> Iterator[Round]:
        """Rounds that can run now, in the order their labels arrived (complete ones at once, others on timeout)."""
        now = self.clock()
        out = []
        for entity, slot in list(self._pending.items()):
            complete = slot.label_at is not None and len(slot.features) == len(self.parties)
            if complete or (slot.label_at is not None and now - slot.label_at >= self.timeout):
                out.append((slot.label_at, entity, slot))
            elif slot.label_at is None and now - slot.first_seen >= self.timeout:
                del self._pending[entity]
                self._finish(entity)
                self.dropped["unlabelled"] += 1
        for _, entity, slot in sorted(out, key=lambda t: t[0]):
            del self._pending[entity]
            self._finish(entity)
            missing = [p for p in self.parties if p not in slot.features]
            yield Round(entity, slot.label, dict(slot.features), missing)

    def _finish(self, entity: Hashable) -> None:
        self._done[entity] = None
        while len(self._done) > self.max_pending:
            self._done.popitem(last=False)

    def deliver(self, round_: Round, entity_id: int, feeds: dict[str, Feed], label_feed: Feed) -> None:
        """Put a ready round in the parties' feeds (None for a missing party), under the round's numeric id."""
        for p in self.parties:
            feeds[p].put(entity_id, round_.features.get(p))
        label_feed.put(entity_id, round_.label)
