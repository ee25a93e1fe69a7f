"""The DP command line: `train --privacy dp`, `privacy-sweep`, `bench dp`, `bench dp-audit`; audits' statistics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from protocols.dp.audit import audit_label_gradient, audit_randomized_response, epsilon_lower_bound
from protocols.dp.rng import SeededNoise
from secvfl.cli.main import main

SMALL = ["--dataset", "breast_cancer", "--parties", "2", "--epochs", "1", "--batch-size", "64", "--device", "cpu"]


def test_train_prints_the_statement_and_writes_privacy_md(tmp_path, capsys) -> None:
    rc = main(["train", *SMALL, "--privacy", "dp", "--epsilon", "3", "--no-progress", "--out", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Privacy guarantee (splitnn): label differential privacy with epsilon = 3" in out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] <= 3.0
    assert (tmp_path / "r" / "PRIVACY.md").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--privacy", "dp", "--epsilon", "0"], "--epsilon must be > 0"),
        (["--privacy", "dp", "--epsilon", "3", "--delta", "0.5"], "not below 1/N"),
        (["--privacy", "dp", "--epsilon", "3", "--dp-clip-norm", "0"], "clip-norm"),
        (["--epsilon", "3"], "--privacy dp"),
        (["--algo", "local", "--privacy", "dp", "--epsilon", "3"], "label DP cannot protect"),
    ],
)
def test_train_refuses_with_a_clear_message(flags: list[str], message: str, capsys) -> None:
    rc = main(["train", *SMALL, *flags, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("secvfl: error:") and message in err


def test_privacy_sweep_writes_json_and_plot(tmp_path, capsys) -> None:
    rc = main(["privacy-sweep", *SMALL, "--epsilons", "1", "inf", "--seeds", "0", "1", "--mechanisms", "gradient", "rr",
               "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert [c["mechanism"] for c in result["curves"]] == ["gradient", "rr"]
    for curve in result["curves"]:
        (point,) = curve["points"]
        assert point["epsilon"] == 1.0 and point["private"] and len(point["values"]) == 2
        assert all(r["privacy"]["epsilon"] <= 1.0 and r["privacy"]["mechanism"] == curve["mechanism"]
                   for r in point["runs"])
    assert result["metric"] == "auc" and not result["non_private"]["private"]
    assert all(r["privacy"] is None for r in result["non_private"]["runs"])
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_dp_reports_ratios(tmp_path, capsys) -> None:
    out = tmp_path / "b.json"
    rc = main(["bench", "dp", "--datasets", "breast_cancer", "--repeats", "1", "--batch-size", "64",
               "--mechanisms", "none", "labels-gradient", "features", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["results"]["breast_cancer"]
    assert r["none"]["ratio_to_no_dp"] == 1.0
    assert r["labels-gradient"]["epoch_seconds"] > 0 and r["features"]["ratio_to_no_dp"] > 0


def test_epsilon_lower_bound_on_known_distributions() -> None:
    rng = np.random.default_rng(0)
    same = epsilon_lower_bound(rng.normal(size=2000), rng.normal(size=2000))
    assert same["epsilon_lower_bound"] < 0.3  # indistinguishable worlds certify (almost) nothing
    far = epsilon_lower_bound(rng.normal(size=2000), rng.normal(-4, 1, size=2000))
    assert far["epsilon_lower_bound"] > 2.0  # clearly distinguishable worlds certify a lot


def test_rr_audit_is_tight_and_below_the_claim() -> None:
    r = audit_randomized_response(epsilon=2.0, draws=50_000, noise=SeededNoise(1))
    assert 1.7 < r["epsilon_lower_bound"] <= 2.0


def test_gradient_audit_matches_the_analysis_and_stays_below_the_claim() -> None:
    r = audit_label_gradient(epsilon=3.0, releases=2, trials=40, noise=SeededNoise(2))
    assert r["epsilon_lower_bound"] <= r["claimed_epsilon"]
    # the canary sits at the analysed sensitivity: scores have the analysed noise scale
    assert r["score_std_world0"] == pytest.approx(r["expected_score_std"], rel=0.3)
    assert math.isfinite(r["canary_mu"])
