"""`secvfl launch` watches its parties and says why a federation stopped; every resume hint it prints runs as
printed. CPU; real party processes on 127.0.0.1, each stopped by its process id.

The fail-fast test is quick by construction: the broken party fails while reading its own file, before it listens,
so the launch ends as soon as that process has started and read it (a few seconds), not after --party-timeout.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from secvfl.cli.main import main
from secvfl.deploy.loopback import loopback_federation


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


@pytest.mark.slow  # (four Python processes that import torch: about 8 s on 2 idle cores)
def test_a_launch_with_a_broken_party_file_ends_at_once_with_that_party_s_error_first(tmp_path: Path) -> None:
    from test_deploy_data import _files

    fed = loopback_federation(tmp_path / "fed", 2, data=_files(tmp_path / "fed")["tables"])
    with open(tmp_path / "fed" / "p1.csv", "a") as f:  # party1's own file repeats an id
        f.write(",c0003,1,2,3,4,low\n" * 2)
    cmd = [sys.executable, "-m", "secvfl.cli.main", "launch", "--federation", str(fed), "--out", str(tmp_path / "run"),
           "--algo", "splitnn", "--parties", "2", "--epochs", "1", "--threads", "1", "--party-timeout", "300"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert done.returncode == 2, done.stderr[-3000:]
    assert elapsed < 30 if os.getloadavg()[0] < 4 else elapsed < 90, elapsed  # not the party timeout's 300 s
    errors = _errors(done.stderr)
    assert errors and errors[0].startswith("[party1] secvfl: error: ") and "repeats 1 id(s) in 'id'" in errors[0], \
        done.stderr[-3000:]
    assert len(errors) == 1  # the others were stopped: no consequence reported as an error
    assert "secvfl launch: party party1 exited with code 2; every other party was stopped" in done.stderr
    assert "is gone" not in done.stderr and "--resume" not in done.stderr  # nothing had started: nothing to resume


def test_a_party_whose_port_is_taken_or_whose_ca_is_garbage_says_so_in_one_line(tmp_path: Path, capsys) -> None:
    fed = loopback_federation(tmp_path / "fed", 1)
    port = int(fed.read_text().split("[parties.party0]\naddress = \"127.0.0.1:")[1].split('"')[0])
    argv = ["party", "--federation", str(fed), "--name", "party0", "--out", str(tmp_path / "p0")]
    with socket.socket() as other:  # another program listens on party0's port
        other.bind(("127.0.0.1", port))
        other.listen()
        t0 = time.monotonic()
        assert main(argv) == 2
        assert time.monotonic() - t0 < 10
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and f"party party0 cannot listen on 127.0.0.1:{port}: the port is in use by another " \
                               "process" in errors[0]
    (tmp_path / "fed" / "certs" / "ca.pem").write_text("garbage\n")  # the ports are free now
    assert main(argv) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and "certs/ca.pem is not a PEM certificate" in errors[0] and "listen" not in errors[0]


def _hint(stderr: str) -> list[str]:
    """The resume command the launch printed last (between backticks), as arguments of `secvfl`."""
    line = [text for text in stderr.splitlines() if "secvfl launch --resume" in text][-1]
    command = line.split("`")[1]
    assert command.startswith("secvfl launch --resume ")
    return shlex.split(command)[1:]


@pytest.mark.slow
def test_ctrl_c_during_a_launch_prints_the_command_that_continues_it_and_that_command_runs_as_printed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fed = loopback_federation(tmp_path / "fed", 2)
    run = tmp_path / "run"
    common = ("--algo", "splitnn", "--dataset", "digits", "--parties", "2", "--epochs", "3", "--batch-size", "8",
              "--seed", "1", "--threads", "1", "--device", "cpu")
    cmd = [sys.executable, "-m", "secvfl.cli.main", "launch", "--federation", str(fed), "--out", str(run),
           "--party-timeout", "60", *common]
    # Ctrl-C as at a terminal: a test run started in the background (`cmd &` in a script) ignores SIGINT, and so
    # would the launcher it starts; the launcher gets the terminal's default disposition back
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not (run / "label" / "checkpoints" / "latest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C at the terminal reaches the launcher
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, err[-3000:]
    assert f"secvfl: interrupted; `secvfl launch --resume {run}` continues the run" in err
    assert f"[label] run directory: {run / 'label'} (continue an interrupted run with `secvfl launch --resume {run}`)" \
        in err  # the label party's own hint is the same command
    assert "secvfl train --resume" not in err
    assert not (run / "label" / "summary.json").exists()
    # a launched label party's directory is no `secvfl train` run: one line naming the command that continues it
    assert main(["train", "--resume", str(run / "label")]) == 2
    assert f"continues with `secvfl launch --resume {run}`" in capsys.readouterr().err
    resumed = subprocess.run([sys.executable, "-m", "secvfl.cli.main", *_hint(err)], capture_output=True, text=True,
                             timeout=400)  # as printed: no --federation
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = json.loads((run / "label" / "summary.json").read_text())
    assert main(["train", "--out", str(tmp_path / "inproc"), "--no-progress", *common]) == 0
    expected = json.loads((tmp_path / "inproc" / "summary.json").read_text())
    assert got["metrics"]["test"] == pytest.approx(expected["metrics"]["test"], rel=1e-9)
    assert got["comm"] == expected["comm"]
