"""The `secvfl` command."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from secvfl import __version__
from secvfl.errors import SecvflError, SecvflWarning

__all__ = ["main", "build_parser"]

# Top-level subcommand modules, each with register(subparsers). One line per command.
SUBCOMMANDS = [
    "secvfl.cli.train",
    "secvfl.cli.families",
    "secvfl.cli.privacy_sweep",
    "secvfl.cli.predict",
    "secvfl.cli.align",
    "secvfl.cli.certs",
    "secvfl.cli.deploy",
    "secvfl.cli.serve",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="secvfl", description="Privacy-preserving vertical federated learning.",
    )
    parser.add_argument("--version", action="version", version=f"secvfl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def _one_line_warnings(show_other):  # noqa: ANN001, ANN202
    """secvfl's own warnings are news for the user, not for a developer: one line, no source location."""

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        if issubclass(category, SecvflWarning):
            print(f"secvfl: warning: {message}", file=sys.stderr if file is None else file)
        else:
            show_other(message, category, filename, lineno, file, line)

    return show


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["train"]  # `secvfl` alone runs the main job with its defaults
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():  # restores the usual warning display when main returns
            warnings.showwarning = _one_line_warnings(warnings.showwarning)
            return int(args.func(args) or 0)
    except SecvflError as exc:
        print(f"secvfl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("secvfl: interrupted; `secvfl train --resume RUN_DIR` continues a training run from its last "
              "checkpoint (the run directory is printed when the run starts)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
