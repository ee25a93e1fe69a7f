"""The attack interface: every attack states its threat model and returns an :class:`AttackResult`.

An attack is written against what its attacker actually holds -- a :class:`~secvfl.transport.network.View` of the
messages its party sent and received, plus that party's own objects (features, bottom model, batch ids, the few
labels it may know). Ground truth (the victim's labels or features) enters only to *score* the attack, never to run it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from secvfl.registry import Registry

__all__ = ["Attack", "AttackResult", "ATTACKS", "LABEL_INFERENCE", "FEATURE_RECONSTRUCTION"]

LABEL_INFERENCE = "label-inference"
FEATURE_RECONSTRUCTION = "feature-reconstruction"


@dataclass
class AttackResult:
    """How well an attack did.

    ``ap`` (attack performance) is oriented so that larger means more leakage; ``chance`` is what an attacker without
    the observed messages would score on the same metric (0.5 for AUC, the majority-class rate for accuracy,
    ``1 - MSE`` of a uniform random guess for reconstruction). ``details`` holds JSON-serialisable extras.
    """

    attack: str
    threat_model: str
    ap: float
    metric: str
    chance: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def advantage(self) -> float:
        """AP above chance (negative when the attack does worse than guessing)."""
        return self.ap - self.chance

    def summary(self, mp: float | None = None, mp_star: float | None = None, beta: float = 0.5) -> dict[str, Any]:
        """The ``summary.json`` record: attack, threat model, AP, MP, chance and (when MP and MP* are known) DCS."""
        from attacks.metrics import dcs  # local import: metrics imports nothing from here, keep it that way

        out: dict[str, Any] = {
            "attack": self.attack,
            "threat_model": self.threat_model,
            "metric": self.metric,
            "AP": _finite_or_none(self.ap),
            "MP": _finite_or_none(mp),
            "MP_star": _finite_or_none(mp_star),
            "chance": _finite_or_none(self.chance),
            "DCS": None,
            "details": self.details,
        }
        if mp is not None and mp_star is not None:
            out["DCS"] = dcs(self.ap, mp, ap_star=self.chance, mp_star=mp_star, beta=beta)
        return out


def _finite_or_none(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


class Attack(ABC):
    """One attack. Subclasses set ``name``, ``family``, ``metric`` and ``threat_model`` and implement ``run``.

    ``run`` takes the attacker's observations and knowledge as keyword arguments (each attack documents its own) and
    the ground truth used only for scoring.
    """

    name: ClassVar[str] = "attack"
    family: ClassVar[str] = LABEL_INFERENCE
    metric: ClassVar[str] = "accuracy"
    threat_model: ClassVar[str] = ""

    @abstractmethod
    def run(self, **inputs: Any) -> AttackResult:
        """Run the attack on the attacker's inputs and score it against the ground truth."""

    def result(self, ap: float, chance: float, **details: Any) -> AttackResult:
        return AttackResult(self.name, self.threat_model, float(ap), self.metric, float(chance), dict(details))


#: Every attack by command-line name (``secvfl attack label-inference --attack NAME``).
ATTACKS: Registry[type[Attack]] = Registry("attack")
