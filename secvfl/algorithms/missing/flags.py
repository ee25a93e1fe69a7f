"""The options of the missing-feature-block family (laser, local-missing, svfl, ensemble, combinatorial, plugvfl):
``--class-balanced`` and ``--p-drop``, one typed :class:`MissingOptions` (:mod:`secvfl.options`) that every
algorithm of the family declares as its ``options_type``; read with ``cfg.options_for(MissingOptions)``. Given for an
algorithm outside the family (or ``--p-drop`` for another than plugvfl), they are refused before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from secvfl.options import Options, option

__all__ = ["MissingOptions"]


@dataclass(frozen=True)
class MissingOptions(Options):
    title = "missing feature blocks (laser and its baselines)"

    class_balanced: bool = option(False, "missing-feature algorithms: class-balanced batches (equal draws per class "
                                         "per epoch) for imbalanced labels")
    p_drop: float = option(0.05, "plugvfl: probability of dropping each passive party's representation per batch",
                           check=(lambda p: 0.0 <= p < 1.0, "in [0, 1)"), algos=("plugvfl",))
