"""Every hint secvfl prints about continuing a run is a command that runs as printed: each test below makes the
situation, takes the command out of the message (between backticks) and runs it exactly. CPU, in process, wine.
(The launched federation's hints: tests/test_deploy_launch.py and tests/test_deploy.py; the DP budget's:
tests/test_runner_dirs.py.)
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from secvfl.cli.main import main

_RUN = ("--dataset", "wine", "--parties", "2", "--batch-size", "8", "--no-progress", "--device", "cpu")  # 16 batches an epoch


def _hint(text: str) -> list[str]:
    """The command in ``text`` (the first one between backticks that starts with `secvfl`), as main's arguments."""
    commands = [part for part in text.split("`")[1::2] if part.startswith("secvfl ")]
    assert commands, text
    assert "remove" not in text  # no hint advises deleting a run directory (it may hold a DP ledger)
    return shlex.split(commands[0])[1:]


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    return errors[0]


def _finished(run: Path, epochs: int = 2) -> None:
    assert main(["train", *_RUN, "--epochs", str(epochs), "--out", str(run)]) == 0


def test_the_start_line_s_and_ctrl_c_s_hints_continue_the_run(tmp_path, capsys, monkeypatch) -> None:
    from test_runner_dirs import _interrupt_at_batch

    run = tmp_path / "run"
    _interrupt_at_batch(monkeypatch, "splitnn", 20)  # in the second epoch: after the first checkpoint
    assert main(["train", *_RUN, "--epochs", "3", "--out", str(run)]) == 130
    out, err = capsys.readouterr()
    start = [line for line in out.splitlines() if line.startswith("run directory:")][0]
    assert _hint(start) == _hint(err) == ["train", "--resume", str(run)]
    monkeypatch.undo()
    assert main(_hint(err)) == 0
    assert json.loads((run / "summary.json").read_text())["epochs"] == 3


def test_out_on_an_unfinished_or_a_finished_run_names_the_command_that_continues_it(tmp_path, capsys,
                                                                                   monkeypatch) -> None:
    from test_runner_dirs import _interrupt_at_batch

    run = tmp_path / "run"
    _interrupt_at_batch(monkeypatch, "splitnn", 20)
    assert main(["train", *_RUN, "--epochs", "2", "--out", str(run)]) == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["train", *_RUN, "--epochs", "2", "--out", str(run)]) == 2
    assert main(_hint(_error(capsys))) == 0  # secvfl train --resume RUN
    assert main(["train", *_RUN, "--epochs", "2", "--out", str(run)]) == 2
    assert main(_hint(_error(capsys))) == 0  # finished: secvfl train --resume RUN --epochs 4
    assert json.loads((run / "summary.json").read_text())["epochs"] == 4
    assert main(["train", "--resume", str(run)]) == 2
    assert main(_hint(_error(capsys))) == 0  # finished again: --epochs 8
    assert json.loads((run / "summary.json").read_text())["epochs"] == 8


@pytest.mark.parametrize("damage", ["latest-checkpoint", "every-checkpoint", "pointer-missing"])
def test_a_damaged_checkpoint_s_hint_resumes_from_what_is_intact(tmp_path, capsys, damage) -> None:
    run = tmp_path / "run"
    _finished(run, epochs=2)
    ck = run / "checkpoints"
    if damage == "latest-checkpoint":
        (ck / "epoch-0002" / "network.pt").write_bytes(b"damaged")
    elif damage == "every-checkpoint":
        for epoch in ("epoch-0001", "epoch-0002"):
            (ck / epoch / "network.pt").write_bytes(b"damaged")
    else:
        (ck / "latest.json").unlink()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--epochs", "3"]) == 2
    hint = _hint(_error(capsys))
    assert hint[:3] == ["train", "--resume", str(run)] and "--from-epoch" in hint
    assert hint[hint.index("--from-epoch") + 1] == ("0" if damage == "every-checkpoint" else
                                                    "1" if damage == "latest-checkpoint" else "2")
    assert main(hint) == 0
    assert json.loads((run / "summary.json").read_text())["epochs"] == 2


def test_a_run_stopped_before_its_first_checkpoint_names_the_command_that_starts_it_again(tmp_path, capsys,
                                                                                          monkeypatch) -> None:
    from test_runner_dirs import _interrupt_at_batch

    run = tmp_path / "run"
    _interrupt_at_batch(monkeypatch, "laser", 2)  # (secvfl predict serves LASER-VFL and its baselines)
    assert main(["train", *_RUN, "--algo", "laser", "--epochs", "1", "--out", str(run)]) == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["predict", "--run", str(run), "--observed", "0,1", "--out", str(tmp_path / "p.csv")]) == 2  # nothing to predict with yet
    line = _error(capsys)
    assert "no checkpoint yet" in line
    assert main(_hint(line)) == 0
    assert main(["predict", "--run", str(run), "--observed", "0,1", "--out", str(tmp_path / "p.csv")]) == 0
