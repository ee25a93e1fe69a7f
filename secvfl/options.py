"""Typed options of the algorithm families and protocol plugins: one frozen dataclass of :func:`option` fields per
owner (``Algorithm.options_type``, ``ProtocolPlugin.options_type``).

A field says everything about its option in one place: the type (checked strictly by msgspec: ``"false"`` is no
boolean, ``True`` no integer, ``"0.1"`` no number), the default, the help text, the valid range (``check``) and,
for an algorithm family's option, the algorithms it applies to (``algos``); rules between fields go in
:meth:`Options.problems`. The ``secvfl train`` flags are generated from the fields (:func:`add_option_arguments`),
so help and defaults cannot drift from what the code reads, and a TOML value is checked against the flag generated
from its field (:mod:`secvfl.cli.config_file`).

``TrainConfig(options={...})`` takes option values by flag destination (the form of the command line and of a run's
config.toml) and resolves them into one validated instance per type (:func:`secvfl.plugins.resolve_options`), which
code reads typed: ``cfg.options_for(SaddleOptions).saddle_iters``. The core never imports a protocol: the plugins
bring their own types, and the algorithm families theirs.

A default of ``None`` means "not given" where that matters: the value then depends on other settings (``--saddle-mu``
defaults to ``--weight-decay`` when set), or giving the flag at all is refused where it has no effect (``--dp-clip-norm
1`` under a mechanism without clipping). The checks (``check``, ``algos``) apply to given values only.

Why not tyro or simple-parsing (dataclass-driven CLIs): either would replace argparse for every subcommand, change
the help and error texts the bad-input catalogue pins, and add a dependency, while the part that matters here, strict
types from one declaration, is msgspec's, which secvfl already uses for its wire format.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import msgspec
import numpy as np

__all__ = ["Options", "OptionField", "option", "option_fields", "option_names", "build_options", "option_values",
           "given_fields", "add_option_arguments", "flag_of"]

_KEY = "secvfl.option"
O = TypeVar("O", bound="Options")  # noqa: E741 - the conventional name of a type variable


@dataclass(frozen=True)
class Options:
    """Base of every options type: subclasses are ``@dataclass(frozen=True)`` with :func:`option` fields."""

    # The --help section of an algorithm family's options (a protocol plugin's section is the plugin's name), and what
    # the section says before its flags (empty: nothing).
    title: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def problems(self) -> list[str]:
        """Rules between fields (e.g. a flag that only takes effect with another): one phrase per problem."""
        return []


@dataclass(frozen=True)
class _Spec:
    help: str
    flag: str | None = None
    metavar: str | None = None
    check: tuple[Callable[[Any], bool], str] | None = None
    algos: tuple[str, ...] | None = None
    cli: bool = True


def option(default: Any, help: str, *, flag: str | None = None, metavar: str | None = None,  # noqa: A002
           check: tuple[Callable[[Any], bool], str] | None = None, algos: tuple[str, ...] | None = None,
           cli: bool = True) -> Any:
    """A field of an :class:`Options` type.

    ``check``: ``(valid, what)``; a given value ``v`` (not None) with ``not valid(v)`` is refused as "--flag must be
    {what}, got v". ``algos``: the algorithms of the family the option applies to (default: all of them); a value
    other than the default is refused for the others. ``cli=False``: no flag (library use and config.toml only).
    """
    return dataclasses.field(default=default, metadata={_KEY: _Spec(help, flag, metavar, check, algos, cli)})


@dataclass(frozen=True)
class OptionField:
    name: str
    type: Any
    default: Any
    spec: _Spec

    @property
    def flag(self) -> str:
        return self.spec.flag or "--" + self.name.replace("_", "-")


@functools.cache
def option_fields(kind: type[Options]) -> tuple[OptionField, ...]:
    hints = typing.get_type_hints(kind)
    out = []
    for f in dataclasses.fields(kind):
        if _KEY not in f.metadata:
            raise TypeError(f"{kind.__name__}.{f.name} is not an option(...) field")
        out.append(OptionField(f.name, hints[f.name], f.default, f.metadata[_KEY]))
    return tuple(out)


def option_names(kind: type[Options]) -> set[str]:
    return {f.name for f in option_fields(kind)}


def flag_of(kind: type[Options], name: str) -> str:
    return next(f.flag for f in option_fields(kind) if f.name == name)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type without ``| None``, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _expected(tp: Any) -> str:
    inner, optional = _unwrap(tp)
    if typing.get_origin(inner) is Literal:
        text = "one of " + ", ".join(str(c) for c in typing.get_args(inner))
    else:
        text = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(inner, str(inner))
    return text + (" (or unset)" if optional else "")


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def build_options(kind: type[O], values: Mapping[str, Any]) -> tuple[O | None, list[str]]:
    """``kind`` from option values by name (absent ones take their defaults), or None and every problem found."""
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for f in option_fields(kind):
        if f.name not in values:
            continue
        value = values[f.name]
        if isinstance(value, np.generic):  # numpy scalars are what their Python values are
            value = value.item()
        try:
            converted = msgspec.convert(value, f.type, strict=True)
        except msgspec.ValidationError:
            problems.append(f"{f.flag} must be {_expected(f.type)}, got {value!r} ({type(value).__name__})")
            continue
        if f.spec.check is not None and converted is not None and not f.spec.check[0](converted):
            problems.append(f"{f.flag} must be {f.spec.check[1]}, got {_shown(converted)}")
        kwargs[f.name] = converted
    if problems:
        return None, problems
    options = kind(**kwargs)
    return options, options.problems()


def option_values(options: Options) -> dict[str, Any]:
    """Option values by name: the flat form of the command line and config.toml."""
    return {f.name: getattr(options, f.name) for f in option_fields(type(options))}


def given_fields(options: Options) -> list[OptionField]:
    """The fields whose value differs from their default."""
    return [f for f in option_fields(type(options)) if getattr(options, f.name) != f.default]


def add_option_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, kind: type[Options]) -> None:
    """One flag per field: a switch for a boolean, choices for a Literal, the type's parser otherwise."""
    for f in option_fields(kind):
        if not f.spec.cli:
            continue
        inner, _ = _unwrap(f.type)
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.spec.help}
        if f.spec.metavar is not None:
            kw["metavar"] = f.spec.metavar
        if inner is bool:
            if f.default is not False:
                raise TypeError(f"{kind.__name__}.{f.name}: a switch defaults to False")
            parser.add_argument(f.flag, action="store_true", **kw)
            continue
        if typing.get_origin(inner) is Literal:
            kw["choices"] = list(typing.get_args(inner))
        elif inner in (int, float, str):
            kw["type"] = inner
        else:
            raise TypeError(f"{kind.__name__}.{f.name}: no flag for type {inner!r}")
        parser.add_argument(f.flag, **kw)
