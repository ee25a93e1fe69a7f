"""`secvfl bench|reproduce|attack NAME ...`: nested command families backed by registries."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from secvfl.cli.helptext import show_defaults
from secvfl.cli.registries import ATTACK_COMMANDS, BENCHES, REPRODUCTIONS, load_command_plugins
from secvfl.io import write_json_atomic
from secvfl.registry import Registry

__all__ = ["register"]


def _family(subparsers: argparse._SubParsersAction, name: str, registry: Registry, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=help_text)
    sub = p.add_subparsers(dest="target", metavar="NAME", required=True)
    for target in registry.names():
        cmd = registry.get(target)
        if isinstance(cmd, type):  # registered as a class: one instance per command line
            cmd = cmd()
        tp = sub.add_parser(target, help=getattr(cmd, "help", ""), description=getattr(cmd, "help", ""))
        if not getattr(cmd, "writes_own_output", False):  # such a command takes --out as its output directory
            tp.add_argument("--out", type=Path, help="write the results as JSON to this file")
        cmd.add_arguments(tp)
        show_defaults(tp)
        tp.set_defaults(func=_runner(cmd))


def _runner(cmd):  # noqa: ANN001, ANN202
    def run(args: argparse.Namespace) -> int:
        t0 = time.perf_counter()
        result = cmd.run(args)
        if getattr(cmd, "writes_own_output", False):  # it wrote its files and printed its own short report
            return 0
        result.setdefault("wall_seconds", round(time.perf_counter() - t0, 3))
        result.setdefault("peak_rss_mb", round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
        result.setdefault("command", "secvfl " + " ".join(sys.argv[1:]))
        if args.out is not None:
            write_json_atomic(args.out, result)
        print(json.dumps(result, indent=2, default=str))
        return 0

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    load_command_plugins()
    _family(subparsers, "bench", BENCHES, "benchmarks: wall time, peak RSS and thread count of what they measure")
    _family(subparsers, "reproduce", REPRODUCTIONS, "reproduce a paper's experiments (tables, JSON, plots)")
    if ATTACK_COMMANDS.names():
        _family(subparsers, "attack", ATTACK_COMMANDS, "leakage attacks and their evaluation")
