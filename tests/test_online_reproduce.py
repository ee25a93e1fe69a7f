"""`secvfl reproduce online` (issue 17): the 18 cells run at a tiny sample count and leave their files; the paper's
three claims are decided from the numbers in the table, so they flip when the numbers do."""

from __future__ import annotations

import copy
import json

import pytest

from secvfl.cli.main import main
from secvfl.experiments.online import ACTIVATIONS, ALGOS, STREAMS, check_claims


def _table(**changes: dict[str, float]) -> dict:
    """Numbers shaped like the paper's (stationary): DLR below OGD, SLR 40x, bytes (1 + a)/2 of Full."""
    cells = {}
    for algo in ALGOS:
        for act, rate in (("full", 1.0), ("random", 0.5), ("event", 0.6)):
            error = {"ogd": 0.10, "slr": 0.09, "dlr": 0.06}[algo] + (0.0 if act == "full" else 0.01)
            payload = 2048.0 * (40 if algo == "slr" else 1) * (1 + rate) / 2
            cells[f"{algo}-{act}"] = {"error": error, "payload_bytes": payload, "seconds": 100.0 * (0.2 + 0.8 * rate),
                                      "rate": rate}
    for cell, values in changes.items():
        cells[cell].update(values)
    return {"stationary": cells}


def _verdicts(table: dict) -> dict[int, bool]:
    return {c["claim"]: c["held"] for c in check_claims(table)}


def test_the_claims_hold_on_numbers_shaped_like_the_papers() -> None:
    assert _verdicts(_table()) == {1: True, 2: True, 3: True}


@pytest.mark.parametrize("changes, broken", [
    ({"dlr-event": {"error": 0.2}}, 1),  # DLR-Event above OGD-Event
    ({"dlr-random": {"error": 0.12}}, 1),  # DLR-Random above OGD-Random
    ({f"slr-{act}": {"payload_bytes": 2048.0 * 10 * (1 + rate) / 2}  # SLR only 10x OGD's bytes
      for act, rate in (("full", 1.0), ("random", 0.5), ("event", 0.6))}, 2),
    ({"ogd-random": {"payload_bytes": 2048.0}}, 3),  # partial activation saved no bytes
    ({"dlr-event": {"seconds": 100.0}}, 3),  # ... or no client compute
    ({"dlr-random": {"seconds": 30.0}}, 3),  # ... or more than in proportion to the rate (0.3 < 0.5)
])
def test_each_claim_is_decided_from_the_numbers(changes: dict, broken: int) -> None:
    verdicts = _verdicts(_table(**changes))
    assert verdicts[broken] is False
    assert all(held for claim, held in verdicts.items() if claim != broken)


def test_a_claim_with_missing_cells_is_not_held() -> None:
    table = copy.deepcopy(_table())
    for act in ACTIVATIONS:
        del table["stationary"][f"slr-{act}"]
    claims = {c["claim"]: c for c in check_claims(table)}
    assert claims[2]["held"] is False and claims[2]["verdict"].startswith("not checked")


@pytest.mark.slow
def test_reproduce_online_runs_every_cell_and_writes_its_files(tmp_path) -> None:
    out = tmp_path / "repro"
    assert main(["reproduce", "online", "--dataset", "digits", "--samples", "60", "--block", "30",
                 "--out-dir", str(out), "--out", str(tmp_path / "summary.json")]) == 0
    result = json.loads((out / "results.json").read_text())
    cells = result["cells"]
    assert {(c["algo"], c["activation"], c["stream"]) for c in cells} == {
        (a, act, s) for a in ALGOS for act in ACTIVATIONS for s in STREAMS}
    for c in cells:
        assert c["samples"] == 60 and 0.0 <= c["accumulated_error"] <= 1.0
        assert c["payload_bytes"] > 0 and c["wire_bytes"] > c["payload_bytes"]
        assert c["client_compute_seconds"] > 0
        assert (out / "cells" / f"{c['algo']}-{c['activation']}-{c['stream']}-seed0.json").is_file()
        if c["activation"] == "full":
            assert c["activation_rate"] == pytest.approx(1.0)
    # OGD and DLR send the same messages: one 4-party round is 4 embeddings + 4 gradients of 64 float32
    full = {c["algo"]: c for c in cells if c["activation"] == "full" and c["stream"] == "stationary"}
    assert full["ogd"]["payload_bytes"] == full["dlr"]["payload_bytes"] == 60 * 8 * 64 * 4
    # the claims in the file are those the table's numbers give
    assert result["claims"] == json.loads(json.dumps(check_claims(result["table"])))
    table = (out / "table.md").read_text()
    assert "0.0649" in table and "0.0561" in table  # the paper's DLR-Random errors beside ours
    assert table.count("**held**") + table.count("**not held**") == 6  # three claims per stream
    for stream in STREAMS:
        png = out / f"error_{stream}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second invocation reuses every finished cell
    assert main(["reproduce", "online", "--dataset", "digits", "--samples", "60", "--block", "30",
                 "--out-dir", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["cells_run_now"] == 0
