"""`secvfl --version` and `secvfl --help` load no training stack (torch, numpy, the protocol plugins, the command
modules), and the command list they print is the commands' own. CPU; fresh interpreters (a subprocess each), since
this test process has imported everything already."""

from __future__ import annotations

import subprocess
import sys

import pytest

from secvfl.cli.main import COMMANDS, build_parser

_PROBE = """
import sys
from secvfl.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "protocols", "attacks", "grpc")
               or m.startswith(("secvfl.cli.", "secvfl.algorithms", "secvfl.plugins")) and m != "secvfl.cli.main")
print("LOADED", heavy)
"""


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["-h"]])
def test_version_and_help_import_no_training_stack(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    loaded = [line for line in done.stdout.splitlines() if line.startswith("LOADED")]
    assert loaded == ["LOADED []"], done.stdout[-2000:] + done.stderr[-2000:]
    shown = done.stdout + done.stderr
    assert ("secvfl 0." in shown) if argv == ["--version"] else all(name in shown for name in COMMANDS)


def test_the_listed_commands_are_the_commands_modules_own() -> None:
    parser = build_parser()  # every command's module loaded
    sub = parser._subparsers._group_actions[0]
    listed = {action.dest: action.help for action in sub._choices_actions}
    assert listed == {name: help_text for name, (_, help_text) in COMMANDS.items()}
    for name, (module, _) in COMMANDS.items():  # each one is its module's real parser, not a listed name
        assert module in sys.modules and len(sub.choices[name]._actions) > 1, name
    listed_only = build_parser(None)._subparsers._group_actions[0]
    assert all(len(p._actions) == 1 for p in listed_only.choices.values())  # --help: names and help, nothing else
