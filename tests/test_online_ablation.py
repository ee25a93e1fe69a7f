"""`secvfl reproduce online-ablation` (issue 17): the sweeps run on a tiny stream and leave one table and one plot
per sweep; activation rates follow the grid and bytes follow the rates; the paper's statements are decided from the
numbers (the paper's own numbers satisfy them, and they flip when the numbers do)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.cli.main import main
from secvfl.errors import ConfigError
from secvfl.experiments.online_ablation import ABLATIONS, check_statements, parse_grid

_EMBEDDING, _PARTIES, _FLOAT = 64, 4, 4  # the online models' embedding width, parties, float32 bytes


def _paper_rows(name: str) -> list[dict]:
    """The paper's Tables 3-5 as rows: bytes as fractions of Full's MB, rates the means of Table 5."""
    full_mb = ABLATIONS["p"].paper[1.0]["mb"]
    rows = []
    for value, p in ABLATIONS[name].paper.items():
        rate = sum(p["rates"]) / len(p["rates"])
        rows.append({"value": value, "error": p["error"], "seconds": p["seconds"], "payload_bytes": p["mb"],
                     "rate": rate, "bytes_vs_full": p["mb"] / full_mb, "bytes_model": (1 + rate) / 2})
    return rows


def _verdicts(name: str, rows: list[dict]) -> dict[str, bool]:
    return {s["text"]: s["held"] for s in check_statements(name, rows)}


@pytest.mark.parametrize("name", ["p", "gamma"])
def test_the_papers_numbers_satisfy_the_papers_statements(name: str) -> None:
    verdicts = _verdicts(name, _paper_rows(name))
    assert len(verdicts) == 4 and all(verdicts.values()), verdicts


@pytest.mark.parametrize("name, value, changes, broken", [
    ("p", 0.25, {"rate": 0.4}, "the activation rate is p"),
    ("p", 0.25, {"error": 0.05}, "the smallest p has the largest accumulated error"),
    ("p", 0.75, {"seconds": 5000.0}, "client compute rises with p"),
    ("p", 0.5, {"bytes_vs_full": 0.9}, "bytes are (1 + rate) / 2 of Full's"),
    ("gamma", 0.2, {"rate": 0.8}, "fewer parties are activated as Gamma rises"),
    ("gamma", 0.6, {"error": 0.07}, "the accumulated error rises with Gamma"),
    ("gamma", 0.6, {"payload_bytes": 1300.0}, "client compute and bytes fall as Gamma rises"),
])
def test_each_statement_is_decided_from_the_numbers(name: str, value: float, changes: dict, broken: str) -> None:
    rows = _paper_rows(name)
    next(r for r in rows if r["value"] == value).update(changes)
    verdicts = _verdicts(name, rows)
    assert verdicts[broken] is False
    assert all(held for text, held in verdicts.items() if text != broken)


def test_window_and_alpha_statements() -> None:
    assert _verdicts("window", [{"value": 10, "error": 0.060}, {"value": 150, "error": 0.066}]) == {
        "DLR is stable across window lengths": True}
    assert _verdicts("window", [{"value": 10, "error": 0.060}, {"value": 150, "error": 0.090}]) == {
        "DLR is stable across window lengths": False}
    rows = [{"value": 0.99, "error": 0.07}, {"value": 0.95, "error": 0.06}, {"value": 0.9, "error": 0.065}]
    assert _verdicts("alpha", rows) == {"alpha = 0.95 and 0.9 do better than 0.99": True}
    rows[2]["error"] = 0.08
    assert _verdicts("alpha", rows) == {"alpha = 0.95 and 0.9 do better than 0.99": False}
    assert check_statements("alpha", rows[1:])[0]["verdict"] == "not checked (cells missing)"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=1e-6, max_value=1.0), min_size=1, max_size=6, unique=True),
       st.lists(st.integers(1, 10_000), min_size=1, max_size=4, unique=True))
def test_grid_values_parse_back(ps: list[float], windows: list[int]) -> None:
    grids = parse_grid([f"p={','.join(map(repr, ps))}", f"window={','.join(map(str, windows))}"])
    assert grids == {"p": tuple(ps), "window": tuple(float(w) for w in windows)}


@pytest.mark.parametrize("item", ["p=0", "p=1.5", "window=0", "window=2.5", "window=nan", "alpha=0", "gamma=inf",
                                  "p=", "p=0.5,0.5", "beta=1", "p"])
def test_bad_grid_values_are_refused(item: str) -> None:
    with pytest.raises(ConfigError, match="--grid"):
        parse_grid([item])


def test_reproduce_online_ablation_runs_each_sweep_and_writes_its_files(tmp_path) -> None:
    out, samples = tmp_path / "ablation", 200
    argv = ["reproduce", "online-ablation", "--dataset", "digits", "--samples", str(samples), "--out-dir", str(out),
            "--grid", "p=0.25,1", "gamma=-0.2,0.6", "window=10", "alpha=0.9"]
    assert main([*argv, "--out", str(tmp_path / "summary.json")]) == 0
    result = json.loads((out / "results.json").read_text())
    # p = 1 and l = 10 are the same DLR-Full cell: five distinct cells
    assert result["cells_run_now"] == 5 and len(result["cells"]) == 5
    sweeps = result["ablations"]
    assert list(sweeps) == ["p", "gamma", "window", "alpha"]
    rows = {name: {r["value"]: r for r in s["rows"]} for name, s in sweeps.items()}
    assert {name: sorted(r) for name, r in rows.items()} == {
        "p": [0.25, 1.0], "gamma": [-0.2, 0.6], "window": [10.0], "alpha": [0.9]}

    # Random p: each party draws its own activations; 4 x 200 Bernoulli(0.25) draws have sd 0.015
    assert rows["p"][0.25]["rate"] == pytest.approx(0.25, abs=0.06)
    assert rows["p"][1.0]["rate"] == 1.0 and rows["window"][10.0]["rate"] == 1.0
    # Event: a higher threshold activates fewer parties
    assert rows["gamma"][-0.2]["rate"] > rows["gamma"][0.6]["rate"]
    # every round sends 4 embeddings; gradients go to the active parties only: bytes (1 + rate)/2 of Full's
    full_bytes = samples * _PARTIES * 2 * _EMBEDDING * _FLOAT
    for by_value in rows.values():
        for r in by_value.values():
            assert r["samples"] == samples
            assert r["payload_bytes"] == pytest.approx(full_bytes * (1 + r["rate"]) / 2, rel=1e-9)
            assert r["bytes_vs_full"] == pytest.approx((1 + r["rate"]) / 2, rel=1e-9)

    # one table per sweep, one row per grid value, the paper's numbers beside ours where it has them
    table = (out / "table.md").read_text()
    sections = table.split("### ")[1:]
    assert [s.split(":")[0] for s in sections] == [ABLATIONS[n].title for n in ("p", "gamma", "window", "alpha")]
    for section, name in zip(sections, ("p", "gamma", "window", "alpha"), strict=True):
        assert f"Ours at {samples} samples per cell" in section and "the paper at 2,000,000" in section
        table_rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
        assert [line.split(" | ")[0] for line in table_rows] == [f"| {v:g}" for v in sorted(rows[name])]
    assert "| 0.25 | " in table and "| 0.0622 |" in table and "| 0.1057 |" in table  # Tables 3 and 4
    assert table.count("**held**") + table.count("**not held**") + table.count("**not checked") == 10
    for name in sweeps:
        png = out / f"ablation_{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a second invocation reuses every finished cell
    assert main(argv) == 0
    assert json.loads((out / "results.json").read_text())["cells_run_now"] == 0


def test_a_cell_left_behind_is_finished_or_started_again(tmp_path) -> None:
    """A finished run whose cell file is missing (killed in between) gives its numbers; a run left by other settings
    (here: another --samples) is started again, not resumed (both used to stop the reproduction with an error)."""
    out = tmp_path / "ablation"
    argv = ["reproduce", "online-ablation", "--dataset", "digits", "--ablations", "p", "--grid", "p=0.5",
            "--out-dir", str(out)]
    assert main([*argv, "--samples", "100"]) == 0
    (cell,) = (out / "cells").glob("*.json")
    first = json.loads(cell.read_text())
    cell.unlink()
    assert main([*argv, "--samples", "100"]) == 0
    again = json.loads(cell.read_text())
    assert again["samples"] == 100 and again["runtime_error"] == first["runtime_error"]
    assert again["payload_bytes"] == first["payload_bytes"]
    assert main([*argv, "--samples", "200"]) == 0
    longer = json.loads(cell.read_text())
    assert longer["samples"] == 200 and longer["settings"]["samples"] == 200
