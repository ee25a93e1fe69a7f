"""How protocol layers are switched on from the command line and attached to a run, and where every option type is
found.

A :class:`ProtocolPlugin` declares its options as one typed dataclass (``options_type``, see :mod:`secvfl.options`);
``secvfl train`` generates its flags from it and ``TrainConfig`` validates and holds the values. Given the resolved
configuration and the algorithm's traits, the plugin returns a :class:`ProtocolSetup`: layers with their position in
the stack, an aggregation, hooks on the run's parties (through the algorithm's public
:class:`~secvfl.parties.ProtocolHooks` only), and facts for ``summary.json``. Algorithms never see plugins; they see
only the network.

Discovery. Plugins are the entry points of the group ``secvfl.protocols`` (``[project.entry-points."secvfl.protocols"]``
in pyproject.toml: ``name = "module:PluginClass"``), as pytest and Flower find theirs: the core never imports a
protocol, and a package installed beside secvfl adds its plugins the same way. The registry name is the entry
point's; plugins are taken in name order, so the flags in ``secvfl train --help``, the order in which plugins
configure a run and the order of layers at the same stack position are the same in every process. A plugin whose
module cannot be imported (a dependency is not installed) is left out and remembered: a run that switches on an
option no loaded plugin takes (a saved run's config.toml, a TOML file, library options) is refused in one line that
names it and, when a plugin could not be loaded, why -- it never trains without the protocol it asked for.

Option types (:func:`option_groups`): the algorithm families' (``Algorithm.options_type``: ``--p-drop``,
``--saddle-*``, ...; an option of another algorithm than the one run is refused) and the plugins'. Every option name
belongs to one type.

Stack positions (outbound order; inbound is the reverse): compression 10, differential privacy 20, secure channel 90
(outermost: it encrypts whatever the inner layers produced).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from secvfl.errors import ConfigError, UnsupportedError
from secvfl.options import Options, build_options, option_fields, option_names, option_values
from secvfl.registry import Registry
from secvfl.transport.layers import Aggregation, AlgorithmTraits, Layer

if TYPE_CHECKING:
    from secvfl.algorithms.base import Algorithm, RunContext
    from secvfl.config import TrainConfig

__all__ = ["ProtocolPlugin", "ProtocolSetup", "PROTOCOLS", "ENTRY_POINT_GROUP", "load_plugins", "unavailable_plugins",
           "OptionGroup", "option_groups", "resolve_options", "option_defaults", "check_options",
           "configure_protocols"]

ENTRY_POINT_GROUP = "secvfl.protocols"


@dataclass
class ProtocolSetup:
    layers: list[tuple[int, Layer]] = field(default_factory=list)
    aggregation: Aggregation | None = None
    # Called once with the built algorithm, e.g. to install a per-sample backward rule on the label party (through
    # ``algorithm.protocol_hooks()``, never by reaching into the algorithm or a party).
    attach: list[Callable[[Algorithm], None]] = field(default_factory=list)
    # Called by the runner with the epoch, after the layers' ``start_epoch`` and before the algorithm trains it (e.g.
    # rr-prior's second stage releases labels from the model's predictions when its epoch comes).
    before_epoch: list[Callable[[int], None]] = field(default_factory=list)
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
    # This plugin's options (their flags are generated from it; their defaults switch the protocol off); read them
    # with ``cfg.options_for(type)``.
    options_type: ClassVar[type[Options] | None] = None

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


@dataclass(frozen=True)
class OptionGroup:
    """One options type: the plugin (by name) or the algorithm family (its algorithms) that reads it."""

    options_type: type[Options]
    title: str  # the --help section
    algorithms: tuple[str, ...] | None  # an algorithm family's algorithms; None: a protocol's, for any algorithm


def option_groups() -> list[OptionGroup]:
    """Every options type: the algorithm families' (in algorithm name order), then the loaded plugins'."""
    from secvfl.algorithms import algorithm_names, get_algorithm

    families: dict[type[Options], list[str]] = {}
    for name in algorithm_names():
        kind = get_algorithm(name).options_type
        if kind is not None:
            families.setdefault(kind, []).append(name)
    groups = [OptionGroup(k, k.title or k.__name__, tuple(algos)) for k, algos in families.items()]
    groups += [OptionGroup(p.options_type, p.name, None) for p in load_plugins() if p.options_type is not None]
    seen: dict[str, str] = {}
    for g in groups:
        for name in option_names(g.options_type):
            if name in seen:
                raise TypeError(f"option {name!r} is declared by both {seen[name]} and {g.options_type.__name__}")
            seen[name] = g.options_type.__name__
    return groups


def resolve_options(algo: str, values: Mapping[str, Any]) -> tuple[dict[type[Options], Options], dict[str, Any],
                                                                      list[str]]:
    """Typed options from flat values by name (``TrainConfig.options``): one instance per option type, the canonical
    flat values (every known option, typed; unknown names kept as given), and every problem found (wrong types,
    ranges, rules between fields, an algorithm family's option given for another algorithm).

    Names no type declares are refused by :func:`check_options` when they would switch a protocol on."""
    groups = option_groups()
    algorithms = _algorithm_names()
    typed: dict[type[Options], Options] = {}
    problems: list[str] = []
    known: set[str] = set()
    for g in groups:
        names = option_names(g.options_type)
        known |= names
        given = {k: v for k, v in values.items() if k in names}
        options, found = build_options(g.options_type, given)
        problems += found
        if g.algorithms is not None and algo in algorithms:  # an unknown algorithm is refused when the run is built
            for f in option_fields(g.options_type):
                applies = f.spec.algos or g.algorithms
                if f.name in given and given[f.name] != f.default and algo not in applies:
                    problems.append(f"{f.flag} applies to --algo {'/'.join(applies)} only, not {algo}")
        if options is not None:
            typed[g.options_type] = options
    flat = {k: v for options in typed.values() for k, v in option_values(options).items()}
    flat.update({k: v for k, v in values.items() if k not in known})
    return typed, flat, problems


def library_option_names() -> set[str]:
    """The options without a command-line flag (``option(..., cli=False)``): set from a library call or config.toml."""
    return {f.name for g in option_groups() for f in option_fields(g.options_type) if not f.spec.cli}


def _algorithm_names() -> set[str]:
    from secvfl.algorithms import algorithm_names

    return set(algorithm_names())


def option_defaults() -> dict[str, dict[str, Any]]:
    """Plugin name -> {option: default} for every option it declares."""
    return {p.name: option_values(p.options_type()) for p in load_plugins() if p.options_type is not None}


def _switches_on(value: Any) -> bool:
    """Whether an option's value asks for a protocol: every plugin is switched on by a flag that is true or names a
    choice (``--privacy dp``, ``--he ckks``, ``--compress SPEC``, ``--secure-channel``); numbers are parameters of such
    a switch, and ``none``/``default``/``auto`` what the switches default to."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "none", "default", "auto")
    return value is True


def check_options(options: Mapping[str, Any]) -> None:
    """Refuse option values that switch on an option no loaded plugin or algorithm family takes (its plugin is not
    installed, or could not be loaded), instead of training without the protocol they ask for."""
    known = {name for g in option_groups() for name in option_names(g.options_type)}
    asked = {k: v for k, v in options.items() if k not in known and _switches_on(v)}
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
    """Every requested protocol's setup. A run has one aggregation: protocols that each bring one (CKKS, masking)
    are refused together here, the one place that rule lives."""
    owners: list[tuple[str, ProtocolSetup]] = []  # (the flag that switched it on, its setup)
    for plugin in load_plugins():
        setup = plugin.configure(cfg, traits, ctx)
        if setup is not None:
            kind = plugin.options_type
            owners.append((option_fields(kind)[0].flag if kind is not None else plugin.name, setup))
    aggregations = [(name, s.aggregation) for name, s in owners if s.aggregation is not None]
    if len(aggregations) > 1:
        for _, aggregation in aggregations:
            aggregation.close()
        names = " and ".join(f"the {a.name} aggregation ({flag})" for flag, a in aggregations)
        raise UnsupportedError(f"{names} both replace how the parties' outputs are added and cannot be combined; "
                               "choose one")
    return [s for _, s in owners]
