"""Shared fixtures. Real datasets come from a data directory: $SECVFL_DATA_DIR, else ../shared/data beside the repo.

Outside CI a missing data directory skips the tests that need it; in CI (CI=true) it is an error, so a broken
checkout cannot pass by skipping.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def _data_dir() -> Path | None:
    env = os.environ.get("SECVFL_DATA_DIR")
    for cand in ([Path(env)] if env else []) + [REPO.parent / "shared" / "data"]:
        if cand.is_dir():
            return cand
    return None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    d = _data_dir()
    if d is None:
        if os.environ.get("CI"):
            pytest.fail("real datasets not found: set SECVFL_DATA_DIR or put shared/data beside the repo")
        pytest.skip("real datasets not found (set SECVFL_DATA_DIR)")
    return d
