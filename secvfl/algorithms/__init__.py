"""Training algorithms, found by name in :data:`ALGORITHMS`.

Modules listed in ``_MODULES`` register themselves on import; a new algorithm adds one line there.
"""

from __future__ import annotations

import importlib

from secvfl.algorithms.base import LABEL_PARTY, Algorithm, RunContext, batch_ids, feature_party_names
from secvfl.registry import Registry

__all__ = ["ALGORITHMS", "Algorithm", "RunContext", "batch_ids", "feature_party_names", "LABEL_PARTY", "get_algorithm"]

ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm")

# (registered name, module, class name): imported lazily so optional pieces do not slow down `secvfl --help`.
_BUILTIN = [
    ("splitnn", "secvfl.algorithms.split", "SplitNN"),
    ("vafl", "secvfl.algorithms.split", "VAFL"),
    ("fdml", "secvfl.algorithms.split", "FDML"),
    ("local", "secvfl.algorithms.local", "Local"),
]
# Modules that register further algorithms with @ALGORITHMS.register(name) when imported.
_MODULES: list[str] = ["secvfl.algorithms.laser", "secvfl.algorithms.missing_baselines", "secvfl.algorithms.saddle_train"]
_loaded = False


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name, module, cls in _BUILTIN:
        ALGORITHMS.add(name, getattr(importlib.import_module(module), cls))
    for module in _MODULES:
        importlib.import_module(module)


def get_algorithm(name: str) -> type[Algorithm]:
    _load()
    return ALGORITHMS.get(name)


def algorithm_names() -> list[str]:
    _load()
    return ALGORITHMS.names()
