"""How protocol layers are switched on from the command line and attached to a run.

A :class:`ProtocolPlugin` adds its flags to ``secvfl train`` (their values land in ``TrainConfig.options``) and,
given the resolved configuration and the algorithm's traits, returns a :class:`ProtocolSetup`: layers with their
position in the stack, an aggregation, hooks on the run's parties, and facts for ``summary.json``. Algorithms never
see plugins; they see only the network.

Discovery. Plugins are the entry points of the group ``secvfl.protocols`` (``[project.entry-points."secvfl.protocols"]``
in pyproject.toml: ``name = "module:PluginClass"``), as pytest and Flower find theirs: the core never imports a
protocol, and a package installed beside secvfl adds its plugins the same way. The registry name is the entry
point's; plugins are taken in name order, so the flags in ``secvfl train --help``, the order in which plugins
configure a run and the order of layers at the same stack position are the same in every process. A plugin whose
module cannot be imported (a dependency is not installed) is left out and remembered: a run that switches on an
option no loaded plugin takes (a saved run's config.toml, a TOML file, library options) is refused in one line that
names it and, when a plugin could not be loaded, why -- it never trains without the protocol it asked for.

The algorithm families' own ``secvfl train`` flags (missing feature blocks, the saddle-point family) join through
this mechanism too, from their family packages; they add no layer.

Stack positions (outbound order; inbound is the reverse): compression 10, differential privacy 20, secure channel 90
(outermost: it encrypts whatever the inner layers produced).
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from secvfl.errors import ConfigError, UnsupportedError
from secvfl.registry import Registry
from secvfl.transport.layers import Aggregation, AlgorithmTraits, Layer

if TYPE_CHECKING:
    from secvfl.algorithms.base import Algorithm, RunContext
    from secvfl.config import TrainConfig

__all__ = ["ProtocolPlugin", "ProtocolSetup", "PROTOCOLS", "ENTRY_POINT_GROUP", "load_plugins", "unavailable_plugins",
           "option_defaults", "check_options", "configure_protocols"]

ENTRY_POINT_GROUP = "secvfl.protocols"


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
    # Options this plugin reads that have no flag of their own (library use), besides its flags' destinations.
    extra_options: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this protocol's flags (with defaults that switch it off)."""

    @abstractmethod
    def configure(self, cfg: TrainConfig, traits: AlgorithmTraits, ctx: RunContext) -> ProtocolSetup | None:
        """What to add to the run, or None when the protocol is not requested. Raise UnsupportedError when invalid."""


PROTOCOLS: Registry[ProtocolPlugin] = Registry("protocol")
_unavailable: dict[str, str] = {}  # entry point name -> why its module could not be imported
_loaded = False


def _entry_points() -> Iterable[EntryPoint]:
    return entry_points(group=ENTRY_POINT_GROUP)


def _register(ep: EntryPoint) -> None:
    try:
        obj = ep.load()
    except ImportError as exc:  # not installed (or a dependency of it is not): usable runs go on without it
        _unavailable[ep.name] = f"{ep.value}: {exc}"
        return
    plugin = obj() if isinstance(obj, type) else obj
    if not isinstance(plugin, ProtocolPlugin):
        raise TypeError(f"entry point {ep.name} = {ep.value!r} of group {ENTRY_POINT_GROUP} is not a ProtocolPlugin")
    PROTOCOLS.add(ep.name, plugin)


def load_plugins() -> list[ProtocolPlugin]:
    """Every installed plugin, in name order (loaded once per process)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for ep in sorted(_entry_points(), key=lambda e: e.name):
            _register(ep)
    return [PROTOCOLS.get(n) for n in PROTOCOLS.names()]


def unavailable_plugins() -> dict[str, str]:
    """Plugins that are declared but could not be loaded: name -> the reason."""
    load_plugins()
    return dict(_unavailable)


def option_defaults() -> dict[str, dict[str, Any]]:
    """Plugin name -> {option: default} for every flag it adds (None for its :attr:`ProtocolPlugin.extra_options`)."""
    load_plugins()
    out = {}
    for name in PROTOCOLS.names():
        plugin = PROTOCOLS.get(name)
        parser = argparse.ArgumentParser(add_help=False)
        plugin.add_arguments(parser)
        out[name] = {**{a.dest: a.default for a in parser._actions}, **dict.fromkeys(plugin.extra_options)}
    return out


def _switches_on(value: Any) -> bool:
    """Whether an option's value asks for a protocol: every plugin is switched on by a flag that is true or names a
    choice (``--privacy dp``, ``--he ckks``, ``--compress SPEC``, ``--secure-channel``); numbers are parameters of such
    a switch, and ``none``/``default``/``auto`` what the switches default to."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "none", "default", "auto")
    return value is True


def check_options(cfg: TrainConfig) -> None:
    """Refuse a configuration that switches on an option no loaded plugin takes (its plugin is not installed, or
    could not be loaded), instead of training without the protocol it asks for."""
    known = {dest for defaults in option_defaults().values() for dest in defaults}
    asked = {k: v for k, v in cfg.options.items() if k not in known and _switches_on(v)}
    if not asked:
        return
    listed = ", ".join(f"--{k.replace('_', '-')} {v!r}" for k, v in sorted(asked.items()))
    broken = unavailable_plugins()
    if broken:
        why = "; ".join(f"plugin {name!r} could not be loaded ({reason})" for name, reason in sorted(broken.items()))
        raise UnsupportedError(f"{listed}: no loaded protocol plugin takes this option; {why}: install what it needs "
                               "(pip install -e . in the secvfl checkout) or drop the option")
    installed = ", ".join(PROTOCOLS.names()) or (f"none: no entry points of group {ENTRY_POINT_GROUP} are installed, "
                                                 "reinstall secvfl with pip install -e .")
    raise ConfigError(f"{listed}: no installed protocol plugin takes this option (plugins: {installed}); check its "
                      "name, or install the package that provides it")


def configure_protocols(cfg: TrainConfig, traits: AlgorithmTraits, ctx: RunContext) -> list[ProtocolSetup]:
    check_options(cfg)
    setups = [s for p in load_plugins() if (s := p.configure(cfg, traits, ctx)) is not None]
    aggregations = [s.aggregation for s in setups if s.aggregation is not None]
    if len(aggregations) > 1:
        names = ", ".join(a.name for a in aggregations)
        raise UnsupportedError(f"only one secure aggregation can be used at a time, got {names}; choose one")
    return setups
