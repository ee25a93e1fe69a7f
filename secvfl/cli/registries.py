"""Registries for nested command families: `secvfl bench NAME`, `secvfl reproduce NAME`, `secvfl attack NAME`.

Each entry is an object with ``add_arguments(parser)`` and ``run(args) -> dict``; the dict is printed and written as
JSON to ``--out`` when given. Modules in :data:`PLUGIN_MODULES` register entries when imported.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from secvfl.registry import Registry

__all__ = ["Command", "BENCHES", "REPRODUCTIONS", "ATTACK_COMMANDS", "PLUGIN_MODULES", "load_command_plugins"]


class Command(Protocol):
    help: str

    def add_arguments(self, parser: Any) -> None: ...

    def run(self, args: Any) -> dict: ...


BENCHES: Registry[Command] = Registry("benchmark")
REPRODUCTIONS: Registry[Command] = Registry("reproduction")
ATTACK_COMMANDS: Registry[Command] = Registry("attack command")

PLUGIN_MODULES: list[str] = [
    "secvfl.bench.dp",
    "secvfl.experiments.laser",
    "secvfl.bench.laser",
    "secvfl.bench.overhead",
    "secvfl.bench.crypto",
    "secvfl.bench.decode",
    "secvfl.cli.attack",
    "secvfl.experiments.saddle",
    "secvfl.bench.online",
    "secvfl.experiments.online",
    "secvfl.experiments.online_ablation",
    "secvfl.experiments.vim",
    "secvfl.bench.vim",
    "secvfl.bench.vim_defaults",
    "secvfl.bench.transport",
    "secvfl.bench.serve",
    "secvfl.bench.device",
    "secvfl.bench.scale",
]
_loaded = False


def load_command_plugins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in PLUGIN_MODULES:
            importlib.import_module(module)
