"""`--help` of every command shows each option's default (flags added by plugins and registries included)."""

from __future__ import annotations

import argparse

__all__ = ["show_defaults"]


def show_defaults(p: argparse.ArgumentParser) -> None:
    """Append each option's default to its help, unless the help already states one (idempotent).

    Done on the built parser rather than with ``ArgumentDefaultsHelpFormatter`` so that help texts which explain
    their default in words ("default: all parties") are not followed by a second, literal one.
    """
    for action in p._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS) or "default" in action.help:
            continue
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            continue  # unset, or a switch that is off: nothing worth saying
        default = action.default
        if isinstance(default, (list, tuple)):  # "0 1 2" as typed on the command line, not "[0, 1, 2]"
            shown = " ".join(str(v) for v in default) if default else "none"
        else:
            shown = "%(default)s"
        action.help += f" (default: {shown})"
