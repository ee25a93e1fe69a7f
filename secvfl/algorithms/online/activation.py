"""Which feature parties a round activates (the paper's Full / Random / Event add-ons).

Each party decides for itself, from what it alone knows: ``random:P`` draws from the party's own generator (state in
its checkpoint), ``event:GAMMA`` compares the mean of the party's own input features with GAMMA. The decision leaves
the party as one public bit in its embedding's meta (``active``): the label party needs it to know whom to send a
gradient. Under ``event`` that bit says whether the party's features averaged above GAMMA, which the event-driven
setting makes public by construction (the party reacts to the event); say so in a threat model that uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from secvfl.errors import ConfigError

__all__ = ["ActivationSpec", "parse_activation", "check_event_threshold", "Activation"]

_FORMS = "full, random:P with 0 < P <= 1, or event:GAMMA"


@dataclass(frozen=True)
class ActivationSpec:
    kind: str  # "full" | "random" | "event"
    value: float = 1.0  # P for random, GAMMA for event

    def __str__(self) -> str:
        return self.kind if self.kind == "full" else f"{self.kind}:{self.value:g}"


def parse_activation(text: str) -> ActivationSpec:
    """``full`` | ``random:P`` | ``event:GAMMA``; anything else is one clear line naming the accepted forms."""
    kind, sep, rest = str(text).strip().partition(":")
    kind = kind.lower()
    if kind == "full" and not sep:
        return ActivationSpec("full")
    if kind in ("random", "event") and sep:
        try:
            value = float(rest)
        except ValueError:
            value = math.nan
        if kind == "random" and 0 < value <= 1:
            return ActivationSpec("random", value)
        if kind == "event" and math.isfinite(value):
            return ActivationSpec("event", value)
    raise ConfigError(f"--activation must be {_FORMS}, got {text!r}")


def check_event_threshold(spec: ActivationSpec, row_means: list[np.ndarray]) -> None:
    """Refuse an ``event:GAMMA`` that is trivial on this data: every party above GAMMA in every training row (that
    is full activation) or none in any (no party would ever train). ``row_means``: per party, the mean of its
    features in each training row it holds (what :meth:`Activation.active` compares with GAMMA)."""
    if spec.kind != "event" or not row_means or not all(len(m) for m in row_means):
        return
    rates = [float(np.mean(m > spec.value)) for m in row_means]
    low, high = min(float(m.min()) for m in row_means), max(float(m.max()) for m in row_means)
    where = (f"choose GAMMA between {low:.3g} and {high:.3g}, where the parties' row means lie (event:0 activates a "
             "party in about half the rounds)")
    if all(r == 1.0 for r in rates):
        raise ConfigError(f"--activation {spec}: every party's mean feature is above {spec.value:g} in every training "
                          f"row, so every party is active in every round: that is --activation full; {where}")
    if all(r == 0.0 for r in rates):
        raise ConfigError(f"--activation {spec}: no party's mean feature is above {spec.value:g} in any training row, "
                          f"so no party would ever be activated and nothing would train; {where}")


class Activation:
    """One party's activation rule, with its own generator for ``random``."""

    def __init__(self, spec: ActivationSpec, seed: int, party_index: int) -> None:
        self.spec = spec
        self._rng = np.random.default_rng([seed, 0x0AC7, party_index])

    def active(self, x: np.ndarray) -> bool:
        if self.spec.kind == "full":
            return True
        if self.spec.kind == "random":
            return bool(self._rng.random() < self.spec.value)
        return bool(float(np.mean(x)) > self.spec.value)

    def state_dict(self) -> dict:
        return {"rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["rng"]
