"""`secvfl bench device` on tiny sizes (this machine's CPU; the CUDA side runs in scripts/gpu-check.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from secvfl.bench.device import CASES, DeviceBench, table
from secvfl.cli.main import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run of a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line_and_times_the_cpu_side(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "device.json"
    assert main(["bench", "device", "--dataset", "digits", "--train-rows", "96", "--epochs", "1", "--cpu-threads", "1",
                 "--cases", "splitnn-mlp-b64", "splitnn-cnn-b64", "vimadmm", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if line] == [
        f"secvfl bench device: no CUDA device here (torch {torch.__version__} finds none); timing the CPU side only"]
    result = json.loads(out.read_text())
    assert result["cuda_device"] is None and result["cpu_threads"] == [1] and result["train_rows"] == 96
    assert [r["case"] for r in result["cases"]] == ["splitnn-mlp-b64", "splitnn-cnn-b64", "vimadmm"]
    for row in result["cases"]:
        side = row["sides"]["cpu-1"]
        assert set(row["sides"]) == {"cpu-1"} and side["threads"] == 1 and side["device"] == "cpu"
        assert len(side["epoch_seconds_all"]) == 2 and side["epoch_seconds"] == side["epoch_seconds_all"][1]
        assert side["test"]["accuracy"] > 0 and side["bytes_total"] > 0 and row["bytes_equal"]
        assert "ratio_cuda_over_best_cpu" not in row
    assert "| `vimadmm` |" in captured.out and "no CUDA device; CPU threads 1" in captured.out


def test_the_ratio_is_cuda_over_the_best_cpu_side_and_the_goals_are_the_issues() -> None:
    def side(seconds: float, acc: float) -> dict:
        return {"epoch_seconds": seconds, "test": {"accuracy": acc}, "bytes_total": 100}

    row = DeviceBench._row(CASES["splitnn-cnn-b256"], {"cpu-1": side(4.0, 0.9), "cpu-16": side(2.0, 0.91),
                                                       "cuda": side(0.3, 0.905)})
    assert row["best_cpu"] == "cpu-16" and row["ratio_cuda_over_best_cpu"] == 0.15
    assert row["goal"] == 0.2 and row["met"] and row["test_difference"] == pytest.approx(0.005)
    slow = DeviceBench._row(CASES["splitnn-mlp-b64"], {"cpu-1": side(1.0, 0.9), "cuda": side(1.7, 0.9)})
    assert slow["ratio_cuda_over_best_cpu"] == 1.7 and not slow["met"]
    text = table({"cpu_threads": [1, 16], "cuda_device": "NVIDIA H200", "cases": [row], "dataset": "mnist",
                  "parties": 4, "train_rows": 100, "epochs_timed": 2})
    assert "| `splitnn-cnn-b256` | 4.000 | 2.000 | 0.300 | 0.150 | <= 0.20 (met) | 0.0050 | yes |" in text
    assert {c.name: c.goal for c in CASES.values() if c.goal} == pytest.approx(
        {"splitnn-mlp-b64": 1.0, "splitnn-mlp-b1024-h1024": 0.3, "splitnn-cnn-b256": 0.2, "vimadmm": 1 / 3})
