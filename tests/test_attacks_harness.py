"""The attack harness end to end on small real runs: `secvfl attack ...` trains, records, attacks and scores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attacks.harness import defence_options, load_view, save_view, undefended
from secvfl.cli.main import main
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.messages import Message
from secvfl.transport.layers import Role
from secvfl.transport.network import Network

SMALL = ["--dataset", "breast_cancer", "--parties", "2", "--epochs", "1", "--device", "cpu"]


def attack(*argv: str) -> int:
    return main(["attack", *argv])


def summary(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


def test_direct_inference_is_exact_on_an_fdml_run_and_the_run_can_be_attacked_again(tmp_path: Path) -> None:
    d = tmp_path / "direct"
    assert attack("label-inference", "--attack", "direct", "--algo", "fdml", *SMALL, "--dir", str(d)) == 0
    s = summary(d)
    assert s["attack"] == "direct" and s["AP"] == pytest.approx(1.0, abs=1e-9) and s["metric"] == "accuracy"
    assert {"attack", "threat_model", "AP", "MP", "chance", "DCS"} <= set(s)
    # MP* of an undefended run is its own MP, the same number copied, hence exact equality
    assert s["MP_star"] == s["MP"] and s["DCS"] == pytest.approx(1 / (1 + np.sqrt(0.5) * (1 - s["chance"])))
    view = d / "run" / "attack-view-party0.svfl"
    assert view.is_file()
    # a second attack on the recorded run, without training
    assert attack("label-inference", "--attack", "direction", "--run", str(d / "run")) == 0
    s2 = summary(d / "run" / "attack-direction")
    assert s2["MP"] == s["MP"] and 0.5 < s2["AP"] <= 1.0  # MP is read back from the run, not recomputed
    assert (d / "run" / "attack-direction" / "roc.png").is_file()


def test_direct_inference_is_refused_when_parties_send_embeddings(tmp_path: Path, capsys) -> None:
    assert attack("label-inference", "--attack", "direct", *SMALL, "--dir", str(tmp_path / "x")) == 2
    assert "--algo fdml" in capsys.readouterr().err


def test_equation_solving_recovers_a_linear_models_party_exactly(tmp_path: Path) -> None:
    # digits: 10 classes give 9 equations per row; 8 parties hold 8 pixels each, so a party's pixels are determined.
    d = tmp_path / "eq"
    assert attack("feature-reconstruction", "--attack", "equation", "--device", "cpu", "--dataset", "digits", "--parties", "8",
                  "--hidden", "", "--head-hidden", "", "--dtype", "float64", "--epochs", "1", "--dir", str(d)) == 0
    s = summary(d)
    assert s["details"]["exact"] and s["details"]["unknowns"] == 8 and s["details"]["equations"] == 9
    assert s["details"]["max_abs_error"] < 1e-6
    assert s["AP"] == pytest.approx(1.0, abs=1e-9) and s["chance"] < 0.9


def test_equation_solving_refuses_a_nonlinear_model(tmp_path: Path, capsys) -> None:
    assert attack("feature-reconstruction", "--attack", "equation", "--device", "cpu", "--dataset", "digits", "--parties", "8",
                  "--epochs", "1", "--dir", str(tmp_path / "eq")) == 2
    assert "linear" in capsys.readouterr().err


def test_grn_reconstruction_is_scored_against_baselines(tmp_path: Path) -> None:
    d = tmp_path / "grn"
    assert attack("feature-reconstruction", "--attack", "grn", "--device", "cpu", "--dataset", "breast_cancer", "--parties", "3",
                  "--epochs", "2", "--grn-epochs", "5", "--rows", "100", "--dir", str(d)) == 0
    s = summary(d)
    assert s["details"]["target"] == "party2" and s["details"]["rows"] == 100
    assert s["details"]["mse"] < s["details"]["random_guess_mse"]
    assert s["AP"] > s["chance"] and (d / "reconstruction.png").is_file()


def test_model_completion_reports_every_n_with_baselines(tmp_path: Path) -> None:
    d = tmp_path / "mc"
    assert attack("label-inference", "--attack", "model-completion", "--device", "cpu", "--dataset", "digits", "--parties", "4",
                  "--epochs", "2", "--known-labels", "10", "20", "--completion-epochs", "2", "--dir", str(d)) == 0
    s = summary(d)
    rows = s["by_known_labels"]
    assert [r["known_labels"] for r in rows] == [10, 20]
    assert all(r["scratch_train_accuracy"] is not None and r["test_accuracy"] is not None for r in rows)
    assert s["AP"] == rows[-1]["AP"] and s["chance"] < 0.2  # the headline AP is the last row's, copied
    assert (d / "accuracy_vs_known_labels.png").is_file()


def test_active_model_completion_compares_with_an_honest_run(tmp_path: Path) -> None:
    d = tmp_path / "amc"
    assert attack("label-inference", "--attack", "active-model-completion", "--device", "cpu", "--dataset", "digits", "--parties", "4",
                  "--epochs", "1", "--known-labels", "20", "--completion-epochs", "1", "--no-baselines",
                  "--dir", str(d)) == 0
    s = summary(d)
    row = s["by_known_labels"][0]
    assert row["gain_over_passive"] == pytest.approx(row["AP"] - row["passive_train_accuracy"])
    assert "main_task_change" in s and "malicious" in s["threat_model"]
    assert (d / "honest" / "summary.json").is_file() and (d / "run" / "summary.json").is_file()


def test_grid_writes_table_plot_and_reports_refused_defences(tmp_path: Path) -> None:
    d = tmp_path / "grid"
    assert attack("grid", *SMALL, "--defences", "dp:3", "ckks", "--seeds", "0", "--attacks", "norm", "direction",
                  "direct", "--dir", str(d)) == 0
    md = (d / "grid.md").read_text()
    assert "| none |" in md and "| dp:3 |" in md and "| ckks | refused |" in md
    assert "direct: direct label inference reads gradients w.r.t. logits" in md  # splitnn sends embeddings
    result = json.loads((d / "grid.json").read_text())
    none, dp = result["rows"][0], result["rows"][1]
    assert none["defence"] == "none" and none["dcs"]["direction"]["mean"] < 1.0
    assert 0.99 * 3.0 <= dp["privacy"]["epsilon"] <= 3.0  # calibrated: never above the target, within 1%
    assert (d / "grid.png").is_file()


def test_defence_specs_and_the_undefended_reference() -> None:
    assert defence_options("none") == {}
    assert defence_options("dp:3") == {"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "gradient"}
    assert defence_options("rr:1.5")["dp_mechanism"] == "rr"
    with pytest.raises(ConfigError, match="unknown defence"):
        defence_options("dpp:3")
    with pytest.raises(ConfigError, match="number"):
        defence_options("dp:x")
    cfg = TrainConfig(algo="laser", options={"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "rr",
                                             "class_balanced": True})
    plain = undefended(cfg)
    assert plain.options["privacy"] == "none" and plain.options["epsilon"] is None
    assert plain.options["class_balanced"] is True  # an algorithm's option, not a defence: kept


def test_recorded_view_round_trips_through_the_wire_format(tmp_path: Path) -> None:
    net = Network({"label": Role.LABEL, "party0": Role.FEATURE})
    view = net.record("party0")
    net.send(Message("embedding", "party0", "label", 3, {"embedding": torch.randn(4, 2)}, meta={"ids": [1, 2, 3, 4]}))
    net.receive("label")
    net.send(Message("gradient", "label", "party0", 3, {"gradient": torch.randn(4, 2)}))
    net.receive("party0")
    save_view(view, tmp_path / "v.svfl")
    back = load_view(tmp_path / "v.svfl")
    assert back.party == "party0" and len(back.sent) == 1 and len(back.received) == 1
    assert torch.equal(back.received[0].tensor("gradient"), view.received[0].tensor("gradient"))
    assert back.sent[0].meta["ids"] == [1, 2, 3, 4] and back.received[0].step == 3


def test_a_defended_run_gets_its_mp_star_from_an_undefended_reference(tmp_path: Path) -> None:
    d = tmp_path / "dp"
    assert attack("label-inference", "--attack", "norm", *SMALL, "--privacy", "dp", "--epsilon", "3",
                  "--dir", str(d)) == 0
    s = summary(d)
    assert s["training"]["options"]["privacy"] == "dp" and s["training"]["privacy"]["epsilon"] == pytest.approx(3.0, abs=1e-3)
    assert "reference" in s["MP_star_source"] and (d / "reference" / "summary.json").is_file()
    reference = json.loads((d / "reference" / "summary.json").read_text())
    # copied from the reference run's summary, so exactly equal
    assert s["MP_star"] == reference["metrics"]["test"]["auc"] and "privacy" not in reference
