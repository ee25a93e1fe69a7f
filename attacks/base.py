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

from secvfl.errors import UnsupportedError
from secvfl.registry import Registry
from secvfl.transport.layers import AlgorithmTraits

__all__ = ["Attack", "AttackResult", "RunOutline", "ATTACKS", "LABEL_INFERENCE", "FEATURE_RECONSTRUCTION"]

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


@dataclass(frozen=True)
class RunOutline:
    """What is known of a training run before it trains: enough for an attack to say whether it can serve it."""

    algo: str
    traits: AlgorithmTraits
    # One bottom model per feature party, a head at the label party and one gradient message per party and training
    # batch (splitnn, vafl, fdml): the shape the harness records, pairs with batch ids and rebuilds white-box.
    split_model: bool
    dataset: str  # as a person reads it (a file name, not a path)
    n_classes: int
    feature_parties: tuple[str, ...]
    linear: bool = False  # every bottom model and the head are one linear layer
    image_parties: bool = False  # every party holds an image region (h, w)


class Attack(ABC):
    """One attack. Subclasses set ``name``, ``family``, ``metric`` and ``threat_model`` and implement ``run``.

    ``run`` takes the attacker's observations and knowledge as keyword arguments (each attack documents its own) and
    the ground truth used only for scoring. What an attack needs of a training run is declared (``reads``,
    ``binary_only``) and checked by :meth:`check` before any training.
    """

    name: ClassVar[str] = "attack"
    family: ClassVar[str] = LABEL_INFERENCE
    metric: ClassVar[str] = "accuracy"
    threat_model: ClassVar[str] = ""
    #: What the attack reads of a split model (see :class:`RunOutline`), for the reason a run is refused.
    reads: ClassVar[str] = "it reads the gradient its party receives for every training batch"
    #: The attack scores a positive class against the rest, so it needs a binary task.
    binary_only: ClassVar[bool] = False

    @classmethod
    def check(cls, run: RunOutline, **options: Any) -> None:
        """Raise :class:`UnsupportedError` (why, and what to use instead) if this attack cannot serve ``run`` with
        these attack ``options``; subclasses add their own needs after calling this."""
        if not run.split_model:
            raise UnsupportedError(
                f"--attack {cls.name} needs a split model ({cls.reads}) and {run.algo} is not one; use --algo "
                "splitnn, vafl or fdml"
            )
        if cls.binary_only and run.n_classes != 2:
            raise UnsupportedError(
                f"--attack {cls.name} needs a binary task and {run.dataset} has {run.n_classes} classes; use --attack "
                "direction (it clusters the gradients of several classes) or --attack direct with --algo fdml"
            )

    @abstractmethod
    def run(self, **inputs: Any) -> AttackResult:
        """Run the attack on the attacker's inputs and score it against the ground truth."""

    def result(self, ap: float, chance: float, **details: Any) -> AttackResult:
        return AttackResult(self.name, self.threat_model, float(ap), self.metric, float(chance), dict(details))


#: Every attack by command-line name (``secvfl attack label-inference --attack NAME``).
ATTACKS: Registry[type[Attack]] = Registry("attack")
