"""The DP command line: `train --privacy dp`, `privacy-sweep`, `bench dp`, `bench dp-audit`; audits' statistics."""

from __future__ import annotations

import json
import math
import statistics

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
    # binary task: auto chooses randomized response and says so
    assert "Privacy guarantee (splitnn): label differential privacy by randomized response, epsilon = 3" in out
    assert "Mechanism chosen by --dp-mechanism auto (the default): randomized response, because" in out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["privacy"]["mechanism"] == "rr" and summary["privacy"]["epsilon"] == pytest.approx(3.0)
    assert "binary" in summary["privacy"]["auto_reason"]
    md = (tmp_path / "r" / "PRIVACY.md").read_text()
    # the attacker's ceiling, e^3 / (1 + e^3), next to the attacks measured against randomized response at epsilon 3
    ceiling = math.exp(3) / (1 + math.exp(3))
    section = md.split("## What an attacker can still infer", 1)[1].split("## Parameters", 1)[0]
    assert f"= {ceiling:.3f}" in section and f"| 3 | 2 | direction scoring | AUC 0.942 | {ceiling:.3f} |" in section


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--privacy", "dp", "--epsilon", "0"], "--epsilon must be > 0"),
        (["--privacy", "dp", "--epsilon", "3", "--dp-mechanism", "gradient", "--delta", "0.5"], "not below 1/N"),
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


def test_privacy_sweep_writes_json_plot_and_table(tmp_path, capsys) -> None:
    rc = main(["privacy-sweep", *SMALL, "--epochs", "2", "--epsilons", "1", "inf", "--seeds", "0", "1",
               "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert [c["mechanism"] for c in result["curves"]] == ["gradient", "rr", "rr-prior", "alibi"]  # all, by default
    for curve in result["curves"]:
        (point,) = curve["points"]
        assert point["epsilon"] == 1.0 and point["private"] and len(point["values"]) == 2
        assert all(r["privacy"]["epsilon"] <= 1.0 and r["privacy"]["mechanism"] == curve["mechanism"]
                   for r in point["runs"])
        assert point["mean"] == pytest.approx(statistics.fmean(r["test"]["auc"] for r in point["runs"]))
    assert result["metric"] == "auc" and not result["non_private"]["private"]
    assert all(r["privacy"] is None for r in result["non_private"]["runs"])
    assert result["auto_mechanism"] == [{"epsilon": 1.0, "mechanism": "rr"}]  # binary task
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "sweep.md").read_text()
    rr = next(c for c in result["curves"] if c["mechanism"] == "rr")["points"][0]
    cell = f"{rr['mean']:.3f} ± {rr['std']:.3f} ({rr['mean'] - result['non_private']['mean']:+.3f})"
    assert f"| rr | {cell}" in table and f"| **auto (default)** | {cell}" in table and cell + " = rr |" in table
    assert table in capsys.readouterr().out


def test_privacy_sweep_refuses_rr_prior_with_one_epoch(tmp_path, capsys) -> None:
    rc = main(["privacy-sweep", *SMALL, "--epsilons", "1", "--mechanisms", "rr-prior", "--out", str(tmp_path)])
    assert rc == 2 and "needs --epochs >= 2 (got 1)" in capsys.readouterr().err
    assert not (tmp_path / "sweep.json").exists()


def test_bench_dp_times_each_configuration_with_its_own_mechanism(tmp_path, capsys) -> None:
    out = tmp_path / "b.json"
    rc = main(["bench", "dp", "--datasets", "breast_cancer", "--repeats", "3", "--batch-size", "64",
               "--mechanisms", "none", "labels-gradient", "labels-rr-prior", "features", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["results"]["breast_cancer"]
    # each row timed the configuration it names: the DP layer of the built run says what it installed
    assert r["none"]["dp"] is None
    assert r["labels-gradient"]["dp"] == {"mechanism": "gradient", "protects": "labels", "epsilon": pytest.approx(3.0, rel=1e-3)}
    assert r["labels-rr-prior"]["dp"]["mechanism"] == "rr-prior"
    assert r["features"]["dp"]["protects"] == "features"
    for row in r.values():  # the reported median and ratio are those of the timed epochs
        assert len(row["epochs_timed"]) == 3
        assert row["epoch_seconds"] == pytest.approx(statistics.median(row["epochs_timed"]), abs=1e-4)
        assert row["ratio_to_no_dp"] == pytest.approx(row["epoch_seconds"] / r["none"]["epoch_seconds"], rel=0.01)


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


@pytest.mark.parametrize("epsilon, classes, grade", [(3.0, 2, "weak"), (1.0, 2, "moderate"), (0.3, 2, "strong"),
                                                     (3.0, 10, "weak"), (1.0, 10, "strong")])
def test_privacy_md_says_what_the_bound_means_for_a_person_once_in_plain_words(epsilon, classes, grade) -> None:
    from protocols.dp.config import DPConfig, plan_dp
    from protocols.dp.statement import privacy_markdown

    plan = plan_dp(DPConfig(epsilon=epsilon, mechanism="rr"), n_train=1000, epochs=2, batch_size=64)
    md = privacy_markdown(plan, secure_rng=True, n_classes=classes)
    bound = math.exp(epsilon) / (math.exp(epsilon) + classes - 1)  # an independent reference: the RR keep rate
    section = md.split("## What this means\n", 1)[1].split("\n## ", 1)[0]
    assert md.count("What this means") == 1  # once: not repeated word for word after the statement
    assert f"at most {bound:.3f}" in section and f"with probability {1 / classes:.3f}" in section
    assert f"**{grade} protection**" in section
    assert "Epsilon measures" in section  # the jargon explained
    share = (bound - 1 / classes) / (1 - 1 / classes)
    assert f"{share:.0%} of the way from a blind guess to certainty" in section
