"""Training algorithms, found by name in :data:`ALGORITHMS`.

Each family in :data:`FAMILIES` (a module, or a package under ``secvfl/algorithms/``) registers its algorithms with
``@ALGORITHMS.register(name)`` when imported; a new family is one package and one line there.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from secvfl.algorithms.base import LABEL_PARTY, Algorithm, RunContext, batch_ids, feature_party_names
from secvfl.registry import Registry

__all__ = ["ALGORITHMS", "FAMILIES", "Algorithm", "RunContext", "batch_ids", "feature_party_names", "LABEL_PARTY",
           "get_algorithm", "algorithm_names", "settings_for"]

ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm")

# Imported lazily, at the first look-up, so optional pieces do not slow down `secvfl --help`.
FAMILIES: list[str] = [
    "secvfl.algorithms.split",  # splitnn, vafl, fdml
    "secvfl.algorithms.local",  # local
    "secvfl.algorithms.missing",  # laser and its baselines
    "secvfl.algorithms.saddle",  # eg, gd, nesterov, admm, eg-mlp
    "secvfl.algorithms.online",  # ogd, slr, dlr (one stream sample per round)
    "secvfl.algorithms.vim",  # vimsgd, vimadmm, vimadmm-j
]
_loaded = False


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for family in FAMILIES:
        importlib.import_module(family)


def get_algorithm(name: str) -> type[Algorithm]:
    _load()
    return ALGORITHMS.get(name)


def algorithm_names() -> list[str]:
    _load()
    return ALGORITHMS.names()


def settings_for(algo: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` (TrainConfig fields) without those ``algo`` does not read (``Algorithm.unused_settings``, which
    TrainConfig refuses): for code that builds several algorithms from one set of settings (sweeps, tests)."""
    unused = get_algorithm(algo).unused_settings
    return {k: v for k, v in settings.items() if k not in unused}
