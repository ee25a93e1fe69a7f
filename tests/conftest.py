"""Shared fixtures and the rules of the test run.

Real datasets come from a data directory: $SECVFL_DATA_DIR, else ../shared/data beside the repo. The header of every
run says which directory is used, or that none was found. Outside CI a missing directory skips the tests that need
it, and the end of the run counts them and says how to run them; in CI (CI=true) it is an error, so a broken
checkout cannot pass by skipping.

Tests longer than ~15 s are marked ``slow``: the README's test command leaves them out (``-m "not slow"``), CI runs
them after it (``-m slow``), and ``pytest`` with no ``-m`` runs everything.

Devices: every test says which device it trains on. A test that compares with a CPU reference or needs the CPU's
exact results pins ``cpu`` (``device="cpu"``, ``--device cpu``); a test of the CUDA path is marked ``gpu`` and is
skipped where torch finds no CUDA device (the end of the run counts them and says how to run them); a test meant to
run on whatever ``--device auto`` picks (the README's defaults) is marked ``auto_device``. Any other test that
resolves ``--device auto`` in this process fails and says so: on a machine with a GPU, auto picks CUDA, and a test
that leaned on the CPU without saying so would fail there. (Tests that start ``secvfl`` in a subprocess pass
``--device`` themselves.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
_MISSING_DATA = "real datasets not found"
_FIX = "set SECVFL_DATA_DIR=/path/to/shared/data (or put shared/data beside the checkout) to run them"
_NO_CUDA = "no CUDA device"
_GPU_FIX = 'run them on a machine with an NVIDIA GPU and torch built with CUDA: python -m pytest -m gpu'


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _candidates() -> list[Path]:
    env = os.environ.get("SECVFL_DATA_DIR")
    return ([Path(env)] if env else []) + [REPO.parent / "shared" / "data"]


def _data_dir() -> Path | None:
    return next((cand for cand in _candidates() if cand.is_dir()), None)


def pytest_report_header(config: pytest.Config) -> str:
    d = _data_dir()
    if d is not None:
        return f"secvfl data: {d}"
    looked = ", ".join(str(c) for c in _candidates())
    what = "tests that need it FAIL (CI=true)" if _in_ci() else "tests that need it are SKIPPED"
    return f"secvfl data: NOT FOUND (looked in {looked}); {what}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"{_NO_CUDA} (a gpu test: {_GPU_FIX})")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if _MISSING_DATA in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(
            f"secvfl: {len(skipped)} test(s) skipped, {_MISSING_DATA}: {_FIX}", yellow=True, bold=True)
    no_gpu = [r for r in terminalreporter.stats.get("skipped", []) if _NO_CUDA in str(r.longrepr)]
    if no_gpu:
        terminalreporter.write_line(
            f"secvfl: {len(no_gpu)} gpu test(s) skipped, {_NO_CUDA}: {_GPU_FIX}", yellow=True, bold=True)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    d = _data_dir()
    if d is None:
        if _in_ci():
            pytest.fail(f"{_MISSING_DATA} in CI: {_FIX}")
        pytest.skip(f"{_MISSING_DATA} ({_FIX})")
    return d


@pytest.fixture(autouse=True, scope="session")
def _runs_outside_the_checkout(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Commands run without --out write to $SECVFL_RUNS_DIR: a temporary folder here, never runs/ in the checkout."""
    os.environ["SECVFL_RUNS_DIR"] = str(tmp_path_factory.mktemp("runs"))


@pytest.fixture(autouse=True)
def _device_chosen_on_purpose(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a test that resolves ``--device auto`` without saying it means to (see the module docstring)."""
    if request.node.get_closest_marker("auto_device") is not None or request.node.get_closest_marker("gpu") is not None:
        return
    import secvfl.runner

    resolve = secvfl.runner.resolve_device

    def chosen(name: str) -> torch.device:
        if name == "auto":
            pytest.fail("this test resolves --device auto, which is CUDA on a machine with a GPU: pin device='cpu' "
                        "(--device cpu) where it compares with CPU results, or mark it @pytest.mark.auto_device if it "
                        "is meant to run on whatever device the machine has", pytrace=False)
        return resolve(name)

    monkeypatch.setattr(secvfl.runner, "resolve_device", chosen)
