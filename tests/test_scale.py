"""Size as a feature: an epoch never copies the table, and `secvfl bench scale` measures what it says (CPU)."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from secvfl.bench.scale import make_federation_files
from secvfl.config import TrainConfig
from secvfl.data.dataset import Dataset
from secvfl.data.partition import partition_columns
from secvfl.runner import build_run


def test_an_epoch_and_an_evaluation_do_not_copy_the_table() -> None:
    """Training batches are row indices into each party's resident block, evaluation goes in batches: numpy never
    allocates a tenth of the table during an epoch (the epoch's row order, 16 bytes a row, is the largest thing)."""
    rng = np.random.default_rng(0)
    n, d = 40_000, 100
    X = rng.standard_normal((n, d), dtype=np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    data = Dataset("t", X, y, X[:2000], y[:2000], X[:2000], y[:2000], 2, [f"x{j}" for j in range(d)], ["0", "1"])
    run = build_run(TrainConfig(algo="splitnn", parties=2, batch_size=2048, eval_batch_size=500, threads=1,
                                device="cpu"),  # numpy allocations, measured on CPU
                    (data, partition_columns(d, 2)))
    run.algorithm.train_epoch(0)  # first calls import and cache what they need
    tracemalloc.start()
    try:
        run.algorithm.train_epoch(1)
        run.algorithm.evaluate("val")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < X.nbytes / 10, f"{peak} bytes allocated during an epoch of a {X.nbytes}-byte table"


def test_generated_federation_files_hold_the_stated_overlap(tmp_path: Path) -> None:
    files = make_federation_files(tmp_path, 1000, 0.9, columns=3, formats=["csv", "parquet"], chunk=300)
    ids = {p: pq.read_table(f["parquet"]).column("id").to_pylist() for p, f in files.items()}
    assert all(len(v) == len(set(v)) == 1000 for v in ids.values())
    assert len(set(ids["label"]) & set(ids["party0"])) == len(set(ids["label"]) & set(ids["party1"])) == 900
    assert not set(ids["party0"]) - set(ids["label"]) & set(ids["party1"])  # each feature party's own ids are its own
    header = files["party0"]["csv"].read_text().splitlines()[0]
    assert header == '"id","party0_x0","party0_x1","party0_x2"'
    assert pq.read_table(files["label"]["parquet"]).column_names == ["id", "label"]


@pytest.mark.slow
def test_bench_scale_runs_every_part_and_checks_the_intersection(tmp_path: Path) -> None:
    from secvfl.cli.main import main

    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--sizes", "3000", "--overlaps", "0.5", "--repeats", "1", "--columns", "4",
                 "--epoch-columns", "3", "--formats", "csv", "--workers", "1", "--parts", "align", "load", "epoch",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())["sizes"]["3000"]
    pair = result["overlap 0.5"]["pair"]
    assert pair["parties"]["label"]["shared"] == {"party0": 1500}  # checked against the truth inside the bench too
    assert pair["bytes_total"] > 2 * 3000 * (32 + 8)
    assert result["overlap 0.5"]["federation"]["parties"]["label"]["shared"] == {"party0": 1500, "party1": 1500}
    load = result["overlap 0.5"]["load"]["csv"]
    assert load["rows"] == 3000 and load["columns"] == 4 and load["dtype"] == "float32"
    assert result["epoch"]["steps"] == -(-3000 // 64)
