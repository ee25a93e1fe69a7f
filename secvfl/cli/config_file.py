"""Values from a TOML config file, checked against the flags they stand for.

Every key must be a flag's name and its value must have the type that flag takes on the command line: a boolean
for a switch (``secure_channel = "false"`` is refused: a non-empty string would switch the channel *on*), an integer
for an integer flag (never a boolean), a number for a float flag (``lr = 1`` is fine), a string for a text flag, an
array for a flag that takes several values, and a value among the flag's choices. The expected type is read from
the argparse action (switch, ``nargs``, ``type``, ``choices``). The flags of the algorithm families and protocol
plugins are generated from their typed options (:mod:`secvfl.options`), so their TOML values are checked against
those declarations without a line here; ``TrainConfig`` then validates the values again, typed, with their ranges
and rules (as it does for a saved run's config.toml, which ``--resume`` reads without this module).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from secvfl.errors import ConfigError

__all__ = ["typed_defaults", "toml_value"]

# Keys that are flags of `secvfl train` but make no sense inside the file they would be read from.
_NOT_SETTABLE = {"help": "--help is not a setting", "config": "a config file cannot name another config file"}


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (datetime.date, datetime.time)):
        return "a date/time"
    return type(value).__name__


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    text = {"True": "true", "False": "false"}.get(text, text)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool)  # store_true/false


def _takes_list(action: argparse.Action) -> bool:
    return action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)


def _scalar(action: argparse.Action, value: Any, refuse: Any) -> Any:
    """One command-line value from a TOML scalar; ``refuse(expected)`` raises the one-line error."""
    t = action.type
    if isinstance(value, bool):  # only switches take booleans, and they never get here
        refuse(_expected(action))
    if t is int:
        if not isinstance(value, int):
            refuse("an integer")
        return value
    if t is float:
        if not isinstance(value, (int, float)):
            refuse("a number")
        return float(value)
    if t in (None, str, Path):
        if not isinstance(value, str):
            refuse(_expected(action))
        return value
    # A parsing function (e.g. comma-separated widths): give it the text the command line would have given it.
    if isinstance(value, list) and all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value):
        text = ",".join(str(v) for v in value)
    elif isinstance(value, (int, float, str)):
        text = str(value)
    else:
        refuse(_expected(action))
    try:
        t(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        refuse(_expected(action), reason=str(exc))
    return text  # argparse applies the type to a string default itself


def _expected(action: argparse.Action) -> str:
    if _is_switch(action):
        return "a boolean (true or false, without quotes)"
    if action.choices is not None:
        return "one of " + ", ".join(f'"{c}"' if isinstance(c, str) else str(c) for c in action.choices)
    t = action.type
    if t is int:
        return "an integer"
    if t is float:
        return "a number"
    if t in (None, str):
        return "a string"
    if t is Path:
        return "a path (a string)"
    return getattr(t, "toml_expected", "a string or a number, as on the command line")


def toml_value(action: argparse.Action, key: str, value: Any, source: str) -> Any:
    """The value to use as the flag's default, or ConfigError naming the key, the type found and the type expected."""
    flag = max(action.option_strings, key=len) if action.option_strings else key

    def refuse(expected: str, reason: str = "") -> None:
        why = f" ({reason})" if reason else ""
        raise ConfigError(f"{source}: {key} = {_show(value)} is {_kind(value)}, but {flag} takes {expected}{why}")

    if _is_switch(action):
        if not isinstance(value, bool):
            refuse(_expected(action))
        return value
    if _takes_list(action):
        if not isinstance(value, list):
            refuse(f"an array of values, e.g. {key} = [{_example(action)}]")
        if not value and action.nargs == "+":
            refuse("at least one value")
        items = [_list_item(action, v, refuse) for v in value]
        _check_choices(action, items, refuse)
        return items
    converted = _scalar(action, value, refuse)
    _check_choices(action, [converted], refuse)
    return converted


def _list_item(action: argparse.Action, value: Any, refuse: Any) -> Any:
    item = _scalar(action, value, lambda expected, reason="": refuse(f"an array of {_plural(expected)}", reason))
    if isinstance(item, str) and action.type not in (None, str):
        return action.type(item)  # argparse converts a string default, never the items of a list default
    return item


def _plural(expected: str) -> str:
    for article in ("an ", "a "):
        if expected.startswith(article):
            return expected[len(article):].replace("integer", "integers").replace("number", "numbers")
    return expected


def _example(action: argparse.Action) -> str:
    if action.default:
        return ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in action.default)
    return "1, 2" if action.type in (int, float) else '"a", "b"'


def _check_choices(action: argparse.Action, values: list[Any], refuse: Any) -> None:
    if action.choices is None:
        return
    for v in values:
        converted = action.type(v) if isinstance(v, str) and action.type not in (None, str) else v
        if converted not in action.choices:
            refuse(_expected(action))


def typed_defaults(parser: argparse.ArgumentParser, values: dict[str, Any], source: str) -> dict[str, Any]:
    """Parser defaults (by dest) from flat TOML values; every problem in one ConfigError line."""
    from secvfl.plugins import library_option_names

    actions = {a.dest: a for a in parser._actions}
    # Options without a flag (library use and config.toml only) pass through: TrainConfig checks their types.
    library = library_option_names() - set(actions)
    unknown = sorted(k for k in values if k.replace("-", "_") not in actions.keys() | library)
    if unknown:
        raise ConfigError(f"{source}: unknown settings {unknown}; every key must be a `secvfl train` flag name")
    defaults: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in values.items():
        dest = key.replace("-", "_")
        if dest in _NOT_SETTABLE:
            problems.append(f"{source}: {key}: {_NOT_SETTABLE[dest]}")
            continue
        if dest in library:
            defaults[dest] = value
            continue
        try:
            defaults[dest] = toml_value(actions[dest], key, value, source)
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems))
    return defaults
