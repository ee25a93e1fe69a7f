"""Nothing is lost at --out: a run never writes into a directory that holds anything but itself, one process at a
time writes a run directory (a lock held for the run's life), and a DP run killed in its first epoch keeps the record
of the privacy it spent. CPU, in process except for the lock holder (a separate process, as a second user would be).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from secvfl.cli.main import main
from secvfl.runlock import LOCK_FILE

_WINE = ("--dataset", "wine", "--parties", "2", "--no-progress", "--device", "cpu")


def _train(*argv: str | Path) -> int:
    return main(["train", *map(str, argv)])


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    return errors[0]


def test_out_refuses_a_directory_that_holds_other_files_and_leaves_them_as_they_were(tmp_path, capsys) -> None:
    attack = tmp_path / "attack-out"  # e.g. an attack's output directory: a summary.json that is not a run's
    attack.mkdir()
    (attack / "summary.json").write_text('{"attack": "direction"}')
    assert _train(*_WINE, "--epochs", "1", "--out", attack) == 2
    line = _error(capsys)
    assert "is not empty (summary.json) and holds no run" in line and "choose a new or empty directory" in line
    assert (attack / "summary.json").read_text() == '{"attack": "direction"}'
    assert sorted(p.name for p in attack.iterdir()) == ["summary.json"]  # not even a lock file was left


def test_out_refuses_a_run_of_other_settings_and_accepts_the_same_run_stopped_before_its_first_checkpoint(
        tmp_path, capsys) -> None:
    for name in ("run", "same"):  # runs stopped before their first checkpoint
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.toml").write_text('dataset = "wine"\nparties = 2\nepochs = 1\nlr = 0.01\ndevice = "cpu"\n')
    run = tmp_path / "run"
    assert _train(*_WINE, "--epochs", "1", "--out", run) == 2
    line = _error(capsys)
    assert "holds a run with other settings (--lr 0.001 (it has 0.01))" in line
    hint = line.split("`")[1]
    assert hint == f"secvfl train --resume {run}" and main(hint.split()[1:]) == 0  # the hint runs as printed
    assert json.loads((run / "summary.json").read_text())["epochs"] == 1
    same = tmp_path / "same"
    assert _train(*_WINE, "--epochs", "1", "--lr", "0.01", "--out", same) == 0  # the same run: it starts again
    assert json.loads((same / "summary.json").read_text())["epochs"] == 1


def test_resume_on_a_directory_that_is_not_a_run_never_suggests_writing_into_it(tmp_path, capsys) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert _train("--resume", other) == 2
    line = _error(capsys)
    assert "not a run directory (no config.toml), and it holds other files" in line
    assert f"--out {other}" not in line
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _train("--resume", empty) == 2
    assert f"start a new run with `secvfl train --out {empty}`" in _error(capsys)


_HOLD = """
import sys, time
from pathlib import Path
from secvfl.runlock import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_writer_gets_one_line_naming_the_holder_and_a_killed_holder_leaves_no_stale_lock(
        tmp_path, capsys) -> None:
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert _train(*_WINE, "--epochs", "1", "--out", run) == 2
        line = _error(capsys)
        assert f"--out {run} is in use: secvfl process {holder.pid} is writing a run there" in line
        (run / "config.toml").write_text('dataset = "wine"\nparties = 2\nepochs = 1\ndevice = "cpu"\n')
        assert _train("--resume", run) == 2
        assert f"is in use: secvfl process {holder.pid}" in _error(capsys)
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # as a crash would: the kernel drops its lock
        holder.wait(timeout=30)
    assert _train("--resume", run) == 0  # no stale lock to remove by hand
    assert (run / LOCK_FILE).is_file() and (run / "summary.json").is_file()


def _interrupt_at_batch(monkeypatch: pytest.MonkeyPatch, algo: str, at: int) -> None:
    """The next run of ``algo`` stops with KeyboardInterrupt at its ``at``-th training batch (a process killed there,
    as far as its run directory is concerned: no later write happens)."""
    from secvfl.algorithms import get_algorithm

    cls = get_algorithm(algo)
    original = cls.train_epoch
    seen = []

    def interrupted(self, epoch, progress=None):  # noqa: ANN001, ANN202
        def tick(loss):  # noqa: ANN001, ANN202
            seen.append(loss)
            if len(seen) == at:
                raise KeyboardInterrupt
            progress(loss)

        return original(self, epoch, tick)

    monkeypatch.setattr(cls, "train_epoch", interrupted)


@pytest.mark.parametrize("reproducible", [False, True], ids=["secure-noise", "seeded-noise"])
def test_a_dp_run_killed_in_its_first_epoch_resumes_with_the_released_part_charged(
        tmp_path, capsys, monkeypatch, reproducible) -> None:
    run = tmp_path / "run"
    dp = ("--privacy", "dp", "--epsilon", "3", "--dp-mechanism", "gradient", *(["--dp-reproducible"] * reproducible))
    _interrupt_at_batch(monkeypatch, "splitnn", 3)
    assert _train(*_WINE, "--dataset", "breast_cancer", "--epochs", "2", *dp, "--out", run) == 130
    interrupted = capsys.readouterr().err
    assert f"`secvfl train --resume {run}` continues the run" in interrupted
    monkeypatch.undo()
    ledger = run / "parties" / "label" / "dp-ledger.json"
    assert json.loads(ledger.read_text())["entries"][0]["epoch"] == 0  # epoch 0 was being released
    code = _train("--resume", run)
    if reproducible:  # the resumed process releases the very same values again: no new release, within the plan
        assert code == 0
        spent = json.loads((run / "summary.json").read_text())["privacy"]
        assert spent["epsilon_spent"] == pytest.approx(3.0, rel=1e-3) and spent["within_plan"]
        assert spent["repeated_releases"] == {}
        return
    assert code == 2  # epoch 0 released twice with fresh noise: refused, the budget already spent stated
    line = _error(capsys)
    assert "finishing this run would spend epsilon" in line and "epsilon spent so far" in line
    assert f"{run} is kept as it is" in line and "remove" not in line
    hint = line.split("run `")[1].split("`")[0]
    assert hint.startswith(f"secvfl train --resume {run} --dp-accept-epsilon ")
    assert main(hint.split()[1:]) == 0  # the hint runs as printed
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    assert privacy["epsilon_spent"] > 3.0 and privacy["repeated_releases"] == {"epoch 1": 2}
    assert ledger.is_file()
