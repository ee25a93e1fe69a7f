"""The base of the linear saddle-family methods: communication helpers and the run loop.

A method moves ``A_k x_k`` forward (aggregated, or individually where the label party needs each) and a dense vector
backward, always through the federation's network, and asks the feature parties for their steps through their
handles; :meth:`LinearAlgorithm.run` iterates, records a
:class:`~secvfl.algorithms.saddle.monitor.Trace` from the network's own counters and stops at a target, a budget or
divergence.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from secvfl.algorithms.saddle.federation import (
    BACKWARD_KIND,
    FORWARD_KIND,
    LABEL,
    LinearFeatureHandle,
    LinearFederation,
    received_array,
)
from secvfl.algorithms.saddle.monitor import Monitor, Trace
from secvfl.errors import UnsupportedError
from secvfl.messages import Message

__all__ = ["LinearAlgorithm"]

Array = np.ndarray


class LinearAlgorithm(ABC):
    """A federated first-order method on a :class:`LinearFederation`; subclasses implement :meth:`iterate`.

    Helpers move ``A_k x_k`` forward (aggregated, or individually where the label party needs each) and a dense
    vector backward, always through the network.
    """

    method: ClassVar[str] = "linear"
    persistent_messages: ClassVar[bool] = True  # each link carries the same quantity every round (error feedback)

    def __init__(self, fed: LinearFederation, *, seed: int = 0) -> None:
        self.fed = fed
        self.seed = seed
        self.t = 0  # iterations done
        self.round = 0  # communication rounds (message step numbers)
        self.last_sum: tuple[Array, Array | None] | None = None

    def counters(self) -> dict[str, int]:
        """The progress a checkpoint keeps besides the parties' state (a resumed run continues from it)."""
        return {"t": self.t, "round": self.round}

    def set_counters(self, counters: dict[str, int]) -> None:
        self.t, self.round = int(counters.get("t", 0)), int(counters.get("round", 0))

    # -- communication ----------------------------------------------------------------------------------------
    @staticmethod
    def meta(rows: Array | None) -> dict[str, Any]:
        """The public tags of a round's messages: full batch (the same quantity every round), or the batch's rows."""
        return {"persistent": True} if rows is None else {"rows": ["train", *map(int, rows)]}

    def send_forward(
        self, parts: Sequence[LinearFeatureHandle], *, point: str = "x", rows: Array | None = None,
        reuse_absent: bool = False,
    ) -> Array:
        """The feature parties ``parts`` send ``A_k`` times their point ``point``; returns what the label party gets:
        the sum."""
        if reuse_absent and not self.fed.individual_messages:
            raise UnsupportedError(
                "partial participation reuses each absent party's last A_k x_k, which the label party only "
                f"has with the plain aggregation, not {self.fed.net.aggregation.name}"
            )
        for h in parts:
            h.send_output(self.round, self.meta(rows), point=point, rows=rows, aggregated=not reuse_absent)
        return self.receive_forward([h.name for h in parts], rows=rows, reuse_absent=reuse_absent)

    def receive_forward(self, senders: Sequence[str], *, rows: Array | None = None, reuse_absent: bool = False
                        ) -> Array:
        """The label party takes the sum of what ``senders`` sent (their aggregate, or with ``reuse_absent`` each
        message, adding the last one of every absent party)."""
        net = self.fed.net
        if reuse_absent:  # the label party keeps each party's latest A_k x_k, so it needs them one by one
            for name in senders:
                # the label party keeps each party's last A_k x_k (reused while that party is absent)
                got = received_array(net.receive(LABEL, kind=FORWARD_KIND, sender=name).tensor("value"))
                self.fed.label.vars[f"last:{name}"] = got
            names = [h.name for h in self.fed.feature_handles]
            last = {n: self.fed.label.vars.get(f"last:{n}") for n in names}
            missing = [n for n, v in last.items() if v is None]
            if missing:
                raise UnsupportedError(f"no earlier message from {missing} to reuse")
            total = sum(last[n] for n in names)
        else:
            total = received_array(net.aggregate_submitted(LABEL, FORWARD_KIND, senders=senders).tensor(
                "value"))
        self.last_sum = (total, rows)  # the label party's latest sum (its training loss comes from it)
        return total

    def send_backward(self, value: Array, receivers: Sequence[str], *, rows: Array | None = None) -> None:
        """The label party sends ``value`` to each receiver (one message each); they take it with their next step."""
        t = self.fed.wire(value)
        self.fed.net.send(*[Message(BACKWARD_KIND, LABEL, r, self.round, {"value": t}, meta=self.meta(rows))
                            for r in receivers])

    # -- loop -------------------------------------------------------------------------------------------------
    @abstractmethod
    def iterate(self) -> None:
        """One iteration (its communication rounds included)."""

    def current(self) -> list[Array]:
        """The feature parties' weights, read in process by the experimenter's monitor (not part of the protocol)."""
        return [p.x for p in self.fed.features]

    def averaged(self) -> list[Array] | None:
        return None

    def run(
        self,
        monitor: Monitor,
        *,
        max_iters: int = 1000,
        target: float | None = None,
        eval_every: int = 10,
        max_floats: float | None = None,
        stop_on_target: bool = True,
        time_limit: float | None = None,
    ) -> Trace:
        trace = Trace(self.method, info=self.describe())
        stats = self.fed.stats
        base_payload, base_bytes = stats.payload(), stats.bytes_total
        base_msgs = stats.messages_total
        wall = 0.0
        f0 = None

        def record() -> dict[str, float]:
            row: dict[str, float] = {"iter": self.t, "floats": (stats.payload() - base_payload) / 8.0,
                                     "bytes": stats.bytes_total - base_bytes,
                                     "messages": stats.messages_total - base_msgs, "wall_s": wall}
            row.update(monitor.point(self.current()))
            avg = self.averaged()
            if avg is not None:
                row.update(monitor.point(avg, prefix="avg_"))
            trace.rows.append(row)
            return row

        row = record()
        f0 = row["objective"]
        status = "max_iters"
        while self.t < max_iters:
            start = time.perf_counter()
            self.iterate()
            wall += time.perf_counter() - start
            if self.t % eval_every == 0 or self.t == max_iters:
                row = record()
                f = row["objective"]
                if not math.isfinite(f) or f > 1e6 * max(1.0, abs(f0)):
                    status = "diverged"
                    break
                if stop_on_target and target is not None and row.get("subopt", math.inf) <= target:
                    status = "target"
                    break
                if max_floats is not None and row["floats"] >= max_floats:
                    status = "max_floats"
                    break
                if time_limit is not None and wall >= time_limit:
                    status = "time_limit"
                    break
        if trace.rows[-1]["iter"] != self.t:
            record()
        trace.info["status"] = status
        trace.info["wall_s"] = wall
        trace.info["bytes_by_kind"] = dict(stats.bytes_by_kind)
        return trace

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "protocols": self.fed.net.describe()}
