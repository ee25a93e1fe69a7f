"""The missing-feature-block family: LASER-VFL and its baselines (``--algo laser``, ``local-missing``, ``svfl``,
``ensemble``, ``combinatorial``, ``plugvfl``).

Modules: ``laser`` (LASER-VFL, the family's method), ``subsets`` (its objective over subsets of parties and the task
sampling), ``baselines`` (the five baselines), ``base`` (what they share: pattern-grouped batches, scoring, the flat
optimiser), ``eval`` (the paper's metrics) and ``flags`` (``--class-balanced``, ``--p-drop``).
"""

from secvfl.algorithms.missing import baselines, laser  # noqa: F401 - registers the family's algorithms
