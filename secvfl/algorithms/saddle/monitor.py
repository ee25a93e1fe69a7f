"""The experimenter's instruments: objective, suboptimality and accuracy (:class:`Monitor`) and curves (:class:`Trace`).

Monitoring is not part of the protocol: the :class:`Monitor` reads party state directly and nothing it computes is
sent or counted, as a deployment would evaluate once at the end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from secvfl.algorithms.saddle.federation import LinearFederation

__all__ = ["Monitor", "Trace"]

Array = np.ndarray


@dataclass
class Monitor:
    """The experimenter's view: objective and accuracy from the parties' current (or averaged) weights.

    It reads party state directly; nothing it computes is sent over the network or counted.
    """

    fed: LinearFederation
    f_star: float | None = None

    def objective(self, xs: Sequence[Array]) -> tuple[float, Array]:
        z = sum(p.output(x) for p, x in zip(self.fed.features, xs, strict=True))
        f = self.fed.label.loss_value(z) + sum(p.reg_value(x) for p, x in zip(self.fed.features, xs, strict=True))
        return float(f), z

    def test_accuracy(self, xs: Sequence[Array]) -> float:
        z = sum(p.output(x, split="test") for p, x in zip(self.fed.features, xs, strict=True))
        return self.fed.label.accuracy(z, "test")

    def point(self, xs: Sequence[Array], prefix: str = "") -> dict[str, float]:
        f, z = self.objective(xs)
        out = {f"{prefix}objective": f, f"{prefix}train_accuracy": self.fed.label.accuracy(z, "train"),
               f"{prefix}test_accuracy": self.test_accuracy(xs)}
        if self.f_star is not None:
            out[f"{prefix}subopt"] = (f - self.f_star) / abs(self.f_star) if self.f_star else f
        return out


@dataclass
class Trace:
    """One run's curve: a row per evaluation (iteration, floats and bytes so far, objective, accuracies)."""

    method: str
    rows: list[dict[str, float]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def first(self, key: str, below: float) -> dict[str, float] | None:
        """The first row where ``key`` <= ``below`` (e.g. the floats needed to reach a suboptimality)."""
        for r in self.rows:
            v = r.get(key)
            if v is not None and math.isfinite(v) and v <= below:
                return r
        return None

    def last(self) -> dict[str, float]:
        return self.rows[-1] if self.rows else {}

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "info": self.info, "rows": self.rows}
