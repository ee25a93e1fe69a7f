"""The LASER-VFL reproduction harness, `secvfl predict`, and the bench wiring."""

from __future__ import annotations

import json

import numpy as np
import pytest

from secvfl.experiments.laser import (
    BETA,
    SETTINGS,
    acceptance,
    aggregate,
    draw_test_mask,
    draw_train_mask,
    markdown_table,
    run_task,
)


def fake_result(method, p_train, seed, f1_by_test, key="f1_positive"):
    names = ["local", "ensemble"] if method == "local" else [method]
    return {"method": method, "p_train": str(p_train), "seed": seed,
            "scores": {n: {str(pe): {key: v / 100, "accuracy": 0.5} for pe, v in f1_by_test.items()} for n in names}}


def test_aggregate_table_and_acceptance():
    results = []
    for seed, jitter in enumerate([-1.0, 0.0, 1.0]):
        results.append(fake_result("laser", 0.5, seed, {0.0: 52 + jitter, 0.5: 46 + jitter}))
        results.append(fake_result("svfl", 0.5, seed, {0.0: 45 + jitter, 0.5: 31 + jitter}))
        results.append(fake_result("local", 0.5, seed, {0.0: 53 + jitter, 0.5: 40}))
    table = aggregate(results, "f1_positive", [0.5], [0.0, 0.5])
    # run files from before the rename (key "f1") aggregate to the same table
    legacy = [fake_result(r["method"], 0.5, r["seed"], {}, key="f1") for r in results]
    for old, new in zip(legacy, results, strict=True):
        old["scores"] = {n: {pe: {"f1": v["f1_positive"], "accuracy": 0.5} for pe, v in sc.items()}
                         for n, sc in new["scores"].items()}
    assert aggregate(legacy, "f1_positive", [0.5], [0.0, 0.5]) == table  # same numbers, same code: bit-identical
    cell = table["laser"]["0.5"]["0.0"]
    assert cell["mean"] == pytest.approx(52.0) and cell["std"] == pytest.approx(1.0) and cell["n"] == 3
    md = markdown_table(table, [0.5], [0.0, 0.5], "F1")
    assert "| LASER-VFL | 52.0 ± 1.0 | 46.0 ± 1.0 |" in md and "| Ensemble |" in md
    acc = acceptance(table, "credit")
    cells = {(c["p_train"], c["p_test"]): c for c in acc["laser_vs_best_baseline"]["cells"]}
    # Local at 53 beats LASER's 52, but within LASER's one standard deviation.
    assert cells[("0.5", "0.0")]["best_baseline"] in ("local", "ensemble") and cells[("0.5", "0.0")]["ok_within_1std"]
    assert acc["laser_minus_svfl_at_0.5_0.5"]["points"] == pytest.approx(15.0) and acc["laser_minus_svfl_at_0.5_0.5"]["ok"]
    ref = {(c["p_train"], c["p_test"]): c for c in acc["laser_vs_authors_code"]["cells"]}
    assert ref[(0.5, 0.0)]["ok_within_1std"] and not ref[(0.5, 0.5)]["ok_within_1std"]  # 46 + 1 < 48.1


def test_masks_depend_on_seed_and_rate_only_and_beta_shares_probabilities():
    a, b = draw_test_mask(1000, 4, 0.5, 3), draw_test_mask(1000, 4, 0.5, 3)
    assert np.array_equal(a, b) and not np.array_equal(a, draw_test_mask(1000, 4, 0.5, 4))
    assert abs(a.mean() - 0.5) < 0.05 and draw_test_mask(100, 4, 0.0, 0).all()
    tr, te = draw_train_mask(20000, 4, BETA, 1), draw_test_mask(20000, 4, BETA, 1)
    # Beta mode: the per-block observation rates of training and test come from the same draw.
    assert np.allclose(tr.mean(axis=0), te.mean(axis=0), atol=0.03)


@pytest.mark.slow
def test_one_credit_run_end_to_end(data_dir):
    r = run_task("credit", "laser", 0.5, 0, [0.0, 0.5], str(data_dir), epochs=1)
    assert set(r["scores"]["laser"]) == {"0.0", "0.5"}
    assert r["batches_per_epoch"] > 150 and r["sampler"]["class_balanced"]
    assert SETTINGS["credit"].columns == 20


def test_predict_cli_with_a_subset_of_parties(tmp_path, capsys):
    from secvfl.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--algo", "laser", "--dataset", "digits", "--epochs", "2", "--lr", "0.01",
                 "--p-miss-train", "0.3", "--device", "cpu", "--out", str(run), "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "pred.csv"
    assert main(["predict", "--run", str(run), "--observed", "1,3", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["observed"] == [1, 3] and report["absent"] == [0, 2]
    assert report["accuracy"] > 0.3  # 10 classes: chance is 0.1
    lines = out.read_text().splitlines()
    assert lines[0].startswith("row,label,party1,party3,party1:p_0,") and len(lines) == report["rows"] + 1
    for line in lines[1:]:  # each party's predicted class is the argmax of its predictor's probabilities
        cells = line.split(",")
        for k, party in enumerate((1, 3)):
            proba = [float(v) for v in cells[4 + 10 * k:14 + 10 * k]]
            assert int(cells[2 + k]) == proba.index(max(proba)), (party, line)
    # A party index that does not exist is a clear error, not a traceback.
    assert main(["predict", "--run", str(run), "--observed", "1,9"]) == 2
    assert "do not exist" in capsys.readouterr().err
    # Algorithms without per-subset predictors are refused.
    run2 = tmp_path / "run2"
    assert main(["train", "--algo", "splitnn", "--dataset", "digits", "--epochs", "1", "--out", str(run2),
                 "--device", "cpu", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["predict", "--run", str(run2), "--observed", "0"]) == 2
    assert "cannot predict with a subset" in capsys.readouterr().err
