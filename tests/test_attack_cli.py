"""`secvfl attack`: refusals before training, one output directory, a short report on stdout, tty-only progress."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attacks.plots as plots
import secvfl.runner as runner
from attacks.harness import outline_run, short_dataset_name
from secvfl.cli.main import main
from secvfl.cli.registries import load_command_plugins
from secvfl.config import TrainConfig
from secvfl.data import load_dataset

SMALL = ["--parties", "2", "--epochs", "1", "--threads", "1", "--device", "cpu"]


def attack(*argv: str) -> int:
    try:
        return main(["attack", *argv])
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty current directory: whatever a command writes outside --out shows up here."""
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    monkeypatch.delenv("SECVFL_RUNS_DIR", raising=False)  # the default runs/ under the current directory
    return d


def files_under(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


# --- refused before any training ----------------------------------------------------------------------------------

REFUSED = [
    (["label-inference", "--attack", "norm", "--dataset", "wine"], "needs a binary task and wine has 3 classes"),
    (["label-inference", "--attack", "direct", "--dataset", "breast_cancer"], "(use --algo fdml)"),
    (["label-inference", "--attack", "direction", "--algo", "laser", "--dataset", "breast_cancer"],
     "needs a split model"),
    (["label-inference", "--attack", "model-completion", "--algo", "local", "--dataset", "wine"],
     "needs a split model"),
    (["label-inference", "--attack", "active-model-completion", "--dataset", "wine", "--completion-method",
      "mixmatch"], "mixmatch augments images"),
    (["feature-reconstruction", "--attack", "equation", "--dataset", "breast_cancer"], "linear"),
    (["feature-reconstruction", "--attack", "grn", "--algo", "eg", "--dataset", "breast_cancer"],
     "needs a split model"),
    (["feature-reconstruction", "--attack", "grn", "--dataset", "wine", "--target", "party7"],
     "--target 'party7' is not a feature party"),
    (["label-inference", "--attack", "norm", "--dataset", "breast_cancer", "--attacker", "label"],
     "--attacker 'label' is not a feature party"),
    (["grid", "--attacks", "norm", "--dataset", "wine", "--defences", "dp:3", "--seeds", "0"],
     "none of the attacks can serve splitnn on wine"),
]


@pytest.mark.parametrize(("argv", "fragment"), REFUSED, ids=[" ".join(a[:3] + a[-2:]) for a, _ in REFUSED])
def test_a_combination_the_attack_cannot_serve_is_refused_before_training(
        argv: list[str], fragment: str, cwd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    built: list[object] = []

    def no_run(*args: object, **kwargs: object) -> None:
        built.append(args)
        raise AssertionError("a run was built for a combination that is refused")

    # Import every command module first: one imported while the patch is on would keep the stand-in for good.
    load_command_plugins()
    monkeypatch.setattr(runner, "build_run", no_run)
    monkeypatch.setattr(runner, "run_training", no_run)
    out = tmp_path / "out"
    assert attack(*argv, *SMALL, "--out", str(out)) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and fragment in errors[0]
    assert built == [] and not out.exists() and files_under(cwd) == set()


def test_a_multiclass_task_is_served_by_direction_scoring(tmp_path: Path) -> None:
    # the refusal of norm scoring on wine points to --attack direction: it must work there
    out = tmp_path / "dir"
    assert attack("label-inference", "--attack", "direction", "--dataset", "wine", *SMALL, "--out", str(out)) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["metric"] == "accuracy" and s["details"]["n_classes"] == 3 and 0.0 <= s["AP"] <= 1.0


def test_the_outline_knows_the_class_count_of_the_built_dataset() -> None:
    for name in ("wine", "breast_cancer", "digits"):
        cfg = TrainConfig(dataset=name, parties=2, device="cpu")
        assert outline_run(cfg).n_classes == load_dataset(name).n_classes


# --- one output directory -----------------------------------------------------------------------------------------


def test_out_holds_every_file_and_nothing_is_written_elsewhere(cwd: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert attack("label-inference", "--attack", "norm", "--dataset", "breast_cancer", *SMALL, "--out", str(out)) == 0
    files = files_under(out)
    assert {"summary.json", "roc.png", "run/summary.json", "run/config.toml", "run/attack-view-party0.svfl"} <= files
    s = json.loads((out / "summary.json").read_text())
    assert Path(s["run"]) == out / "run" and Path(s["plot"]) == out / "roc.png"
    assert files_under(cwd) == set()
    assert f"summary: {out / 'summary.json'}" in capsys.readouterr().out


def test_without_out_a_fresh_directory_under_runs_is_used_and_printed(cwd: Path, capsys) -> None:
    assert attack("label-inference", "--attack", "norm", "--dataset", "breast_cancer", *SMALL) == 0
    (made,) = (cwd / "runs").iterdir()
    assert made.name.startswith("attack-norm-splitnn-breast_cancer-")
    assert {p.name for p in cwd.iterdir()} == {"runs"}
    assert f"summary: {Path('runs') / made.name / 'summary.json'}" in capsys.readouterr().out


def test_an_out_directory_with_results_is_not_overwritten(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert attack("label-inference", "--attack", "norm", "--dataset", "breast_cancer", *SMALL, "--out", str(out)) == 2
    assert "already holds files" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == "{}" and files_under(out) == {"summary.json"}


# --- what a person reads ------------------------------------------------------------------------------------------


def cell(header: str, row: str, column: str) -> str:
    """The value under ``column`` in an aligned table row (columns start where their header starts)."""
    start = re.search(rf"(?<!\S){re.escape(column)}(?!\S)", header).start()
    return row[start:].split()[0]


def test_stdout_is_a_short_table_with_the_metric_and_the_json_path(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert attack("label-inference", "--attack", "norm", "--dataset", "breast_cancer", *SMALL, "--out", str(out)) == 0
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    assert len(lines) < 20 and "{" not in stdout
    s = json.loads((out / "summary.json").read_text())
    row = next(line for line in lines if line.startswith("norm "))
    assert cell(lines[0], row, "metric") == "auc"
    assert float(cell(lines[0], row, "AP")) == pytest.approx(s["AP"], abs=5e-5)
    assert float(cell(lines[0], row, "chance")) == pytest.approx(0.5, abs=5e-5)
    assert float(cell(lines[0], row, "MP")) == pytest.approx(s["MP"], abs=5e-5)
    assert float(cell(lines[0], row, "DCS")) == pytest.approx(s["DCS"], abs=5e-5)


def test_json_flag_prints_the_summary_that_is_on_disk(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert attack("label-inference", "--attack", "norm", "--dataset", "breast_cancer", *SMALL, "--out", str(out),
                  "--json") == 0
    assert json.loads(capsys.readouterr().out) == json.loads((out / "summary.json").read_text())


def test_grid_prints_a_line_per_defence(tmp_path: Path, capsys) -> None:
    out = tmp_path / "grid"
    assert attack("grid", "--dataset", "breast_cancer", *SMALL, "--defences", "dp:3", "ckks", "--seeds", "0",
                  "--attacks", "norm", "direct", "--out", str(out)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) < 20
    result = json.loads((out / "grid.json").read_text())
    by_defence = {line.split()[0]: line for line in lines[1:] if line.split()[0] in result["defences"]}
    assert set(by_defence) == {"none", "dp:3", "ckks"}
    for row in result["rows"]:
        cells = by_defence[row["defence"]].split()
        if "refused" in row:
            assert cells[1] == "refused"
        else:
            assert float(cells[2]) == pytest.approx(row["ap"]["norm"]["mean"], abs=5e-4)
            assert "direct: not applicable" in by_defence[row["defence"]]
    assert f"summary: {out / 'grid.json'}" in lines and {"grid.md", "grid.png", "grid.json"} <= files_under(out)


def test_no_progress_is_accepted_and_redirected_stderr_gets_lines_not_a_bar(tmp_path: Path, capsys) -> None:
    for i, flags in enumerate((["--no-progress"], [])):
        out = tmp_path / f"out{i}"
        assert attack("label-inference", "--attack", "norm", "--dataset", "breast_cancer", *SMALL, *flags,
                      "--out", str(out)) == 0
        err = capsys.readouterr().err
        assert "epoch 1/1" in err and "\r" not in err  # stderr is not a terminal here


@pytest.mark.parametrize("plot", ["label_scores", "completion", "reconstruction", "grid"])
def test_plot_titles_fit_in_the_figure(plot: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    title = ("norm scoring on csv:/data/exports/2024/quarterly/risk-team/loan_applications_with_outcomes_final_v3"
             ".csv:defaulted (splitnn, attacker party0)")
    checked: list[int] = []
    save = plots.save_figure_atomic

    def check_then_save(fig, path):  # noqa: ANN001, ANN202
        fig.tight_layout()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [t for t in [fig._suptitle, *(ax.title for ax in fig.axes)] if t is not None and t.get_text()]
        for t in texts:
            box = t.get_window_extent(renderer)
            assert box.x0 >= -1 and box.x1 <= fig.bbox.width + 1 and box.y1 <= fig.bbox.height + 1, t.get_text()
        checked.append(len(texts))
        return save(fig, path)

    monkeypatch.setattr(plots, "save_figure_atomic", check_then_save)
    rng = np.random.default_rng(0)
    path = tmp_path / "p.png"
    if plot == "label_scores":
        truth = [rng.integers(0, 2, 50) for _ in range(3)]
        plots.plot_label_scores(path, [rng.normal(size=50) for _ in range(3)], truth, [0.5, 0.6, 0.7], title)
    elif plot == "completion":
        plots.plot_completion(path, [{"known_labels": n, "train_accuracy": 0.5, "test_accuracy": 0.4}
                                     for n in (10, 40)], title)
    elif plot == "reconstruction":
        details = {"mse_per_feature": [0.1, 0.2], "random_guess_mse_per_feature": [0.3, 0.3], "mse": 0.15,
                   "random_guess_mse": 0.3, "constant_half_mse": 0.2}
        plots.plot_reconstruction(path, details, title)
    else:
        rows = [{"defence": "none", "mp": {"mean": 0.9, "std": 0.0}, "ap": {"norm": {"mean": 0.8, "std": 0.0}}}]
        plots.plot_grid(path, rows, ["norm"], "auc", title)
    assert checked and checked[0] >= 1 and path.is_file()


@settings(max_examples=60, deadline=None)
@given(folders=st.lists(st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True).filter(lambda s: s not in (".", "..")),
                        max_size=6),
       name=st.from_regex(r"[A-Za-z0-9_-]{1,20}\.csv(\.gz)?", fullmatch=True),
       label=st.one_of(st.none(), st.from_regex(r"[A-Za-z_#0-9]{1,10}", fullmatch=True)))
def test_short_dataset_name_is_the_file_name_of_a_path_spec(folders: list[str], name: str, label: str | None) -> None:
    spec = "csv:" + os.sep + os.sep.join([*folders, name]) + (f":{label}" if label else "")
    assert short_dataset_name(spec) == name
    assert short_dataset_name(f"svmlight:/d/{name},/d/{name}.t") == name
    assert short_dataset_name("credit") == "credit" and short_dataset_name("idx:/data/mnist") == "mnist"


@pytest.mark.parametrize(("mechanism", "has_ceiling"), [(None, True), ("rr-prior", True), ("gradient", False)])
def test_the_label_dp_ceiling_follows_the_mechanism_the_run_used(mechanism: str | None, has_ceiling: bool,
                                                                tmp_path: Path) -> None:
    # `--privacy dp` without --dp-mechanism resolves to `auto` (randomized response on a binary task): the summary
    # must carry the RR ceiling for what ran, not only when `rr` was spelt out.
    flags = ["--privacy", "dp", "--epsilon", "2"] + (["--dp-mechanism", mechanism] if mechanism else [])
    out = tmp_path / "out"
    assert attack("label-inference", "--attack", "norm", "--dataset", "breast_cancer", *SMALL, "--epochs", "2",
                  *flags, "--out", str(out)) == 0
    details = json.loads((out / "summary.json").read_text())["details"]
    if has_ceiling:
        assert details["rr_ceiling"] == pytest.approx(math.exp(2) / (1 + math.exp(2)))
    else:
        assert "rr_ceiling" not in details
