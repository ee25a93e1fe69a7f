"""`secvfl bench overhead`: the split and monolithic sides train the same model; both times are reported."""

from __future__ import annotations

import json

import pytest

from secvfl.cli.main import main


def test_bench_overhead_reports_cpu_and_wall_ratios(tmp_path) -> None:
    out = tmp_path / "o.json"
    rc = main(["bench", "overhead", "--dataset", "digits", "--repeats", "1", "--hidden", "16",
               "--embedding-dim", "8", "--batch-size", "64", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["threads"] == 1
    assert r["ratio"] == pytest.approx(r["split_epoch_cpu_seconds"] / r["monolithic_epoch_cpu_seconds"], rel=1e-2)
    assert r["ratio_wall"] == pytest.approx(r["split_epoch_seconds"] / r["monolithic_epoch_seconds"], rel=1e-2)
    # Every embedding and gradient of the epoch was serialised and counted: 4 parties x 2 messages per batch.
    assert r["bytes_per_epoch"] > r["batches_per_epoch"] * 4 * 2 * 64 * 8 * 4 * 0.5
