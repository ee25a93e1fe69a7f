"""How protocol layers are switched on from the command line and attached to a run.

A :class:`ProtocolPlugin` adds its flags to ``secvfl train`` (their values land in ``TrainConfig.options``) and,
given the resolved configuration and the algorithm's traits, returns a :class:`ProtocolSetup`: layers with their
position in the stack, an aggregation, hooks on the run's parties, and facts for ``summary.json``. Algorithms never
see plugins; they see only the network.

Stack positions (outbound order; inbound is the reverse): compression 10, differential privacy 20, secure channel 90
(outermost: it encrypts whatever the inner layers produced).
"""

from __future__ import annotations

import argparse
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocols.base import Aggregation, AlgorithmTraits, Layer
from secvfl.errors import UnsupportedError
from secvfl.registry import Registry

if TYPE_CHECKING:
    from secvfl.algorithms.base import Algorithm, RunContext
    from secvfl.config import TrainConfig

__all__ = ["ProtocolPlugin", "ProtocolSetup", "PROTOCOLS", "load_plugins", "configure_protocols", "PLUGIN_MODULES"]


@dataclass
class ProtocolSetup:
    layers: list[tuple[int, Layer]] = field(default_factory=list)
    aggregation: Aggregation | None = None
    # Called once with the built algorithm, e.g. to install a per-sample backward rule on the label party.
    attach: list[Callable[[Algorithm], None]] = field(default_factory=list)
    # Merged into summary.json at the end of the run (e.g. {"privacy": {...}}); callables are evaluated then.
    summary: dict[str, Any] | Callable[[], dict[str, Any]] = field(default_factory=dict)
    # Called at the end with the run directory (or None); may write files and return text to print.
    on_finish: list[Callable[[Path | None], str | None]] = field(default_factory=list)
    # Called with the finished run's summary (test metrics included) before it is written; may add entries to it
    # (e.g. differential privacy's warning when the model's utility collapsed).
    on_summary: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)
    # Called once before this process trains, with the run directory (or None) and the epochs already trained (a
    # resumed run's checkpoint), before anything in the run directory is written; may refuse to go on (differential
    # privacy: when finishing would spend more than the privacy budget, counting what interrupted processes released).
    on_start: list[Callable[[Path | None, int], None]] = field(default_factory=list)
    # Set when the training loss is computed from data that only its holder may read (label DP: the true labels): the
    # runner then hands each epoch's loss, (epoch, loss), to this keeper instead of writing or showing it anywhere
    # (metrics.jsonl, summary.json, curves.png, the log and the progress bar get null).
    private_loss: Callable[[int, float], None] | None = None


class ProtocolPlugin(ABC):
    name: str = "plugin"

    @abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this protocol's flags (with defaults that switch it off)."""

    @abstractmethod
    def configure(self, cfg: TrainConfig, traits: AlgorithmTraits, ctx: RunContext) -> ProtocolSetup | None:
        """What to add to the run, or None when the protocol is not requested. Raise UnsupportedError when invalid."""


PROTOCOLS: Registry[ProtocolPlugin] = Registry("protocol")

# Modules that register a plugin with PROTOCOLS.add(name, plugin) on import. One line per protocol.
PLUGIN_MODULES: list[str] = [
    "secvfl.algorithms.missing_flags",
    "protocols.dp.plugin",
    "protocols.secure_plugins",
    "protocols.compression",
    "secvfl.algorithms.saddle_train",
]
_loaded = False


def load_plugins() -> list[ProtocolPlugin]:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in PLUGIN_MODULES:
            importlib.import_module(module)
    return [PROTOCOLS.get(n) for n in PROTOCOLS.names()]


def configure_protocols(cfg: TrainConfig, traits: AlgorithmTraits, ctx: RunContext) -> list[ProtocolSetup]:
    setups = [s for p in load_plugins() if (s := p.configure(cfg, traits, ctx)) is not None]
    aggregations = [s.aggregation for s in setups if s.aggregation is not None]
    if len(aggregations) > 1:
        names = ", ".join(a.name for a in aggregations)
        raise UnsupportedError(f"only one secure aggregation can be used at a time, got {names}; choose one")
    return setups
