"""Imports run one way: core (``secvfl`` minus its application layer) <- ``protocols`` <- ``attacks`` <- commands.

The core defines the interfaces every side needs (layers, aggregations, traits, roles, the plugin registry) and finds
protocol plugins through entry points, so it never names ``protocols`` or ``attacks``: not at module level, not
inside a function, not under ``TYPE_CHECKING``, not as a string handed to ``importlib``. The application layer
(``secvfl.cli``, ``secvfl.bench``, ``secvfl.experiments``: the commands) may import everything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APP_LAYER = ("cli", "bench", "experiments")  # secvfl's commands: they may import protocols and attacks
_DYNAMIC = {"import_module", "__import__"}


def _core_files() -> list[Path]:
    root = REPO / "secvfl"
    return sorted(p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in APP_LAYER)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``, wherever it sits, and of every literal module name
    handed to ``importlib.import_module`` / ``__import__``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in _DYNAMIC and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: imports {module}"
            for path in files for line, module in _imported(path)
            if module.split(".")[0] in forbidden]


def test_the_scan_sees_every_kind_of_import(tmp_path: Path) -> None:
    # The scanner itself must catch a reverse import wherever it hides, or the tests below could not fail.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "import protocols.dp\n"
        "if TYPE_CHECKING:\n"
        "    from attacks.base import Attack\n"
        "def f():\n"
        "    from protocols import ckks\n"
        "    import importlib\n"
        "    return importlib.import_module('attacks.grid')\n"
        "from . import protocols as fine\n"  # a relative import stays inside its package
    )
    assert sorted(m for _, m in _imported(sample) if m.split(".")[0] in ("protocols", "attacks")) == [
        "attacks.base", "attacks.grid", "protocols", "protocols.dp"]


def test_core_never_imports_protocols_or_attacks() -> None:
    files = _core_files()
    assert len(files) > 40  # the scan found the package
    bad = _violations(files, ("protocols", "attacks"))
    assert not bad, "the core must not import protocols or attacks:\n" + "\n".join(bad)


def test_protocols_never_import_attacks_or_the_commands() -> None:
    files = sorted((REPO / "protocols").rglob("*.py"))
    bad = _violations(files, ("attacks",))
    bad += [f"{p.relative_to(REPO)}:{line}: imports {m}" for p in files for line, m in _imported(p)
            if m.split(".")[:2] in (["secvfl", layer] for layer in APP_LAYER)]
    assert not bad, "protocols may import the core only:\n" + "\n".join(bad)


def test_attacks_never_import_the_commands() -> None:
    files = sorted((REPO / "attacks").rglob("*.py"))
    bad = [f"{p.relative_to(REPO)}:{line}: imports {m}" for p in files for line, m in _imported(p)
           if m.split(".")[:2] in (["secvfl", layer] for layer in APP_LAYER)]
    assert not bad, "attacks may import the core and protocols only:\n" + "\n".join(bad)


_IMPORT_ALL_CORE = """
import importlib, pkgutil, sys
import secvfl
skip = tuple("secvfl." + layer for layer in sys.argv[1:])
names = [m.name for m in pkgutil.walk_packages(secvfl.__path__, "secvfl.")
         if not any(m.name == s or m.name.startswith(s + ".") for s in skip)]
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("protocols", "attacks"))
print(len(names), loaded)
"""


def test_importing_every_core_module_loads_no_protocol_or_attack() -> None:
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL_CORE, *APP_LAYER], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    count, loaded = out.stdout.strip().split(" ", 1)
    assert int(count) > 40
    assert loaded == "[]", f"importing the core loaded {loaded}"


def test_installed_plugins_are_the_ones_pyproject_declares() -> None:
    # Entry points live in the installed metadata: after editing pyproject.toml, `pip install -e .` refreshes them.
    from importlib.metadata import entry_points

    from secvfl.plugins import ENTRY_POINT_GROUP

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    installed = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert installed == declared, "reinstall (pip install -e .) so the installed entry points match pyproject.toml"


@pytest.mark.parametrize("family", ["missing", "saddle"])
def test_algorithm_families_are_packages(family: str) -> None:
    from secvfl.algorithms import FAMILIES

    assert (REPO / "secvfl" / "algorithms" / family / "__init__.py").is_file()
    assert f"secvfl.algorithms.{family}" in FAMILIES
