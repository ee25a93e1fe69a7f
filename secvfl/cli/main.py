"""The `secvfl` command."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from secvfl import __version__
from secvfl.errors import SecvflError, SecvflWarning

__all__ = ["main", "build_parser"]

# Top-level commands: name -> (the module that registers it, its one-line help). `secvfl --help` and `--version`
# list them without importing any module (they load torch and the plugins: seconds and hundreds of MB); a command line
# imports the module of its command only. tests/test_cli_startup.py checks these lines against the modules' own.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("secvfl.cli.train", "train a VFL model"),
    "bench": ("secvfl.cli.families", "benchmarks: wall time, peak RSS and thread count of what they measure"),
    "reproduce": ("secvfl.cli.families", "reproduce a paper's experiments (tables, JSON, plots)"),
    "attack": ("secvfl.cli.families", "leakage attacks and their evaluation"),
    "privacy-sweep": ("secvfl.cli.privacy_sweep", "utility against epsilon (JSON + PNG)"),
    "predict": ("secvfl.cli.predict", "predict with a trained run and any subset of its parties"),
    "align": ("secvfl.cli.align", "align parties' rows by id with private set intersection (ECDH-PSI)"),
    "certs": ("secvfl.cli.certs", "create a federation's CA and one mutual-TLS certificate per party"),
    "party": ("secvfl.cli.deploy", "run one party of a federation (a long-lived process)"),
    "launch": ("secvfl.cli.deploy", "start every party of a federation as a local process (loopback)"),
    "serve": ("secvfl.cli.serve", "serve a trained federation: one party's serving process"),
    "demo-federation": ("secvfl.cli.serve", "write a federation on this host whose parties read their own files (for "
                        "trying secvfl launch and secvfl serve)"),
}
SUBCOMMANDS = list(dict.fromkeys(module for module, _ in COMMANDS.values()))  # one line per module


def build_parser(command: str | None = "*") -> argparse.ArgumentParser:
    """The `secvfl` parser with every command's module loaded (``command="*"``), or that of ``command`` only (None:
    none); the other commands are listed by name and help."""
    parser = argparse.ArgumentParser(
        prog="secvfl", description="Privacy-preserving vertical federated learning.",
    )
    parser.add_argument("--version", action="version", version=f"secvfl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = set(SUBCOMMANDS) if command == "*" else {COMMANDS[command][0]} if command in COMMANDS else set()
    for name, (module, help_text) in COMMANDS.items():
        if module in wanted:
            wanted.discard(module)
            importlib.import_module(module).register(sub)
        if name not in sub.choices:  # listed in --help; its module is loaded when it is the command given
            sub.add_parser(name, help=help_text)
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
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
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
        from secvfl.runlock import interrupted_hint

        print(f"secvfl: {interrupted_hint()}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
