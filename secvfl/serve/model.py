"""A trained run rebuilt in one party's process for serving: its own model, the run's network, nothing else.

Each serving process builds the run from the training settings the coordinator announces, exactly as a training
process does (``build_run(cfg, table, local=party)``: the same models, protocol layers and aggregation), on a
placeholder table of one row per split (serving reads its rows from the party's own table, not from the run's
splits), and keeps only its own party: a feature party's bottom model (split algorithms) or LASER-VFL party's
representation model and head, or the label party's head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from secvfl.config import TrainConfig
from secvfl.deploy.data import run_table
from secvfl.errors import UnsupportedError

__all__ = ["SERVABLE", "check_servable", "build_served_run", "own_party", "is_laser"]

SERVABLE = ("splitnn", "vafl", "fdml", "laser")


def check_servable(cfg: TrainConfig) -> None:
    if cfg.algo not in SERVABLE:
        raise UnsupportedError(f"secvfl serve serves {', '.join(SERVABLE)} so far; this run trained {cfg.algo}")


def is_laser(cfg: TrainConfig) -> bool:
    return cfg.algo == "laser"


def build_served_run(cfg: TrainConfig, widths: Sequence[int], n_classes: int, classes: Sequence[str] | None,
                     local: str) -> Any:
    """The run as party ``local``'s process builds it, on a placeholder table (see the module docstring)."""
    from secvfl.runner import build_run

    check_servable(cfg)
    cfg = replace(cfg, p_miss_train="0", p_miss_test="0")
    prepared = run_table(cfg.dataset, list(widths), (1, 1, 1), n_classes,
                         classes=list(classes) if classes is not None else None)
    return build_run(cfg, prepared, local=local)


def own_party(run: Any, name: str) -> Any:
    """The party object of ``name`` in its own process (a feature party, LASER-VFL party or the label party)."""
    from secvfl.handles import local_party

    handles = run.algorithm.handles()
    if name not in handles:
        raise UnsupportedError(f"{run.cfg.algo} has no party {name!r} (its parties: {sorted(handles)})")
    return local_party(handles[name])
