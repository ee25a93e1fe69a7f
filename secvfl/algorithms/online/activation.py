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

__all__ = ["ActivationSpec", "parse_activation", "Activation"]

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
