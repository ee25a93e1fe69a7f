"""Chaos: a federation on loopback in which one party misbehaves, row by row of the attack table (slow, CPU).

Three party processes as ``secvfl launch`` starts them (``secvfl party`` each, the label party coordinating a
split-NN run on breast_cancer, LASER-VFL on digits for the lost-party row), of which party1 is the misbehaving
double of ``chaos_party.py``. Every row must end in a stop of the label party with one line naming party1 and what
it did, the honest party0 stopping cleanly when told (exit 0) within its timeouts, and the label party's peak memory
within 64 MiB of the same run without the misbehaviour -- or, for the idle streams and connections, the run going
on to the same metrics as the honest run. The references are the honest run of the same federation and the rows'
own facts (which party, which limit, which step).

Plus a soak: a launched run (``secvfl launch``) in which a party process is killed with SIGKILL three times at
random (seeded) moments and resumed each time ends with the in-process run's metrics and every byte counter (a
launched run equals the in-process one: tests/test_deploy.py).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_deploy import _federation, _in_process, _launch

from secvfl.federation import load_federation

pytestmark = pytest.mark.slow

_MIB = 1 << 20
_COMMON = ("--threads", "1", "--party-timeout", "30", "--peer-timeout", "5", "--heartbeat", "0.5")
_SPLIT = ("--algo", "splitnn", "--dataset", "breast_cancer", "--parties", "2", "--epochs", "1", "--batch-size", "32",
          "--seed", "4")
_LASER = ("--algo", "laser", "--dataset", "digits", "--parties", "2", "--epochs", "1", "--seed", "4")

EXPECTED = {  # row -> what the label party's one line says about party1
    "nan-inf": "its embedding message to label \\(step 2\\) holds 1 non-finite value",
    "extra-column": "has 17 columns in 'embedding'; the run's embedding width is 16",
    "one-row-short": "has 31 rows in 'embedding'; the batch has 32",
    "overflowing-header": "bytes that are not a message .*dimensions whose product overflows",
    "int64": "carries 'embedding' as torch.int64, not a floating-point tensor",
    "step-plus-1000": "is for step 1002, but label is at step 2",
    "replay": "is for step 0, but label is at step 2",
    "duplicate": "is for step 2, but label is at step 3",
    "unknown-kind-flood": "it sent a message of an unknown kind 'junk'",
    "declared-4-billion-chunks": "it declared 4294967295 chunks for one embedding message",
    "oversize-chunk": "it sent a chunk of 2101190 bytes",
    "million-empty-messages": "filling its receive buffer",
    "kind-not-utf8": "malformed frame \\(a frame's kind is not UTF-8 text",
    "kind-past-frame": "malformed frame \\(a frame's kind of 4000 bytes runs past",
    "count-zero": "malformed frame \\(a frame declares a count of 0",
    "party-lost": "says that party party0 is gone, but label still hears from party0",
    "stats": "its byte counters are false \\(party1 says it sent",
    "deep-json": "its answer to __hello__: malformed party-result message from party1: its values are nested more",
    "fields-as-list": "a PredictorSpec needs exactly the fields",
    "plan-width": "it announced the column widths \\[.*2000000\\]",
}


@pytest.fixture(scope="module")
def fork() -> multiprocessing.context.BaseContext:
    """Party processes forked from a server that imported torch and secvfl once (a federation starts in a second)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["chaos_party"])
    # (Python 3.11's fork server imports its preload with the environment's path, not the parent's sys.path)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), saved) if p)
    try:
        warm = ctx.Process(target=time.sleep, args=(0,))
        warm.start()
        warm.join(300)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def _start(fork, argv: list[str], log: Path, **kwargs) -> multiprocessing.Process:  # noqa: ANN001
    from chaos_party import run_party

    proc = fork.Process(target=run_party, args=(argv, str(log)), kwargs=kwargs, daemon=False)
    proc.start()
    return proc


def _federation_run(fork, tmp: Path, row: str, *, train: tuple[str, ...] = _SPLIT, fed: Path | None = None,  # noqa: ANN001
                    label_kwargs: dict | None = None, before_parties=None) -> dict:  # noqa: ANN001
    """Start label, party0 and party1 (misbehaving as ``row``); wait for the label party, then for party0; stop the
    misbehaving one. Returns each party's exit code, log and peak RSS."""
    fed = fed or _federation(tmp / "fed", 2)
    run = tmp / "run"
    procs = {"label": _start(fork, ["party", "--federation", str(fed), "--name", "label", "--out", str(run / "label"),
                                    "--no-progress", *_COMMON, *train], tmp / "label.log", **(label_kwargs or {}))}
    if before_parties is not None:
        before_parties(fed)
    for name in ("party0", "party1"):
        procs[name] = _start(fork, ["party", "--federation", str(fed), "--name", name, "--out", str(run / name),
                                    "--no-progress", "--party-timeout", "30", "--peer-timeout", "5", "--heartbeat",
                                    "0.5"], tmp / f"{name}.log", row=row if name == "party1" else "")
    out = {}
    try:
        procs["label"].join(120)
        t_label = time.monotonic()
        procs["party0"].join(30)  # told to stop by the label party, or its own timeouts
        out["party0_stopped_after"] = time.monotonic() - t_label
    finally:
        for proc in procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(10)
    for name, proc in procs.items():
        text = (tmp / f"{name}.log").read_text(errors="replace")
        peak = [int(line.split()[-1]) for line in text.splitlines() if line.startswith("chaos: exit")]
        out[name] = {"code": proc.exitcode, "log": text, "peak": peak[0] if peak else None}
    summary = run / "label" / "summary.json"
    out["summary"] = json.loads(summary.read_text()) if summary.exists() else None
    return out


@pytest.fixture(scope="module")
def honest(fork, tmp_path_factory) -> dict:  # noqa: ANN001
    """The same federation's run without misbehaviour: the reference for metrics and memory."""
    got = _federation_run(fork, tmp_path_factory.mktemp("honest"), "")
    assert got["label"]["code"] == 0 and got["summary"] is not None, got["label"]["log"][-3000:]
    return got


def _one_line_error(log: str) -> str:
    errors = [line for line in log.splitlines() if line.startswith("secvfl: error:")]
    assert len(errors) == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return errors[0]


@pytest.mark.parametrize("row", list(EXPECTED))
def test_a_misbehaving_party_is_named_and_the_honest_ones_stop_cleanly(fork, honest, tmp_path: Path, row: str  # noqa: ANN001
                                                                       ) -> None:
    fed = None
    train = _LASER if row == "party-lost" else _SPLIT
    if row == "plan-width":  # the row plan exists only when every party reads its own file
        from test_deploy_data import _files

        from secvfl.deploy.loopback import loopback_federation

        fed = loopback_federation(tmp_path / "fed", 2, data=_files(tmp_path / "fed")["tables"])
        train = ("--algo", "splitnn", "--parties", "2", "--epochs", "1", "--batch-size", "32", "--seed", "4")
    got = _federation_run(fork, tmp_path, row, train=train, fed=fed)
    line = _one_line_error(got["label"]["log"])
    assert got["label"]["code"] == 2, got["label"]["log"][-3000:]
    assert line.startswith("secvfl: error: party party1 broke the protocol: "), line
    assert __import__("re").search(EXPECTED[row], line), line
    assert "--lr" not in line and "step size" not in line
    assert got["summary"] is None  # nothing reported as if the run had finished
    assert got["party0"]["code"] == 0 and "party0: the run is over; stopping" in got["party0"]["log"], \
        got["party0"]["log"][-2000:]
    assert got["party0_stopped_after"] < 15
    assert got["label"]["peak"] - honest["label"]["peak"] < 64 * _MIB, (got["label"]["peak"], honest["label"]["peak"])


def test_a_party_s_error_text_with_escapes_reaches_the_log_on_one_escaped_line(fork, tmp_path: Path) -> None:  # noqa: ANN001
    got = _federation_run(fork, tmp_path, "error-escape")
    line = _one_line_error(got["label"]["log"])
    assert line.startswith("secvfl: error: party party1 is gone: forward failed\\n[label] \\x1b[2J\\x1b[1;1Hepoch 1/1")
    assert "\x1b" not in got["label"]["log"] and "\x1b" not in got["party0"]["log"]
    assert not any(ln.startswith("[label] \x1b") or ln.startswith("epoch 1/1 loss 0.0000")
                   for ln in got["label"]["log"].splitlines())
    assert got["party0"]["code"] == 0


def test_idle_streams_and_idle_connections_are_dropped_and_the_run_goes_on(fork, honest, tmp_path: Path) -> None:  # noqa: ANN001
    held: list[socket.socket] = []

    def strangers(fed: Path) -> None:  # 300 idle TCP connections to the label party, whose process may hold 256 files
        address = load_federation(fed).party("label").address
        deadline = time.monotonic() + 30
        while len(held) < 300 and time.monotonic() < deadline:
            try:
                held.append(socket.create_connection((address.host, address.port), timeout=2))
            except OSError:
                time.sleep(0.05)

    try:
        got = _federation_run(fork, tmp_path, "idle-streams", label_kwargs={"nofile": 256}, before_parties=strangers)
    finally:
        for s in held:
            s.close()
    assert len(held) == 300
    assert got["label"]["code"] == 0, got["label"]["log"][-3000:]
    assert got["summary"]["metrics"]["test"] == honest["summary"]["metrics"]["test"]
    assert got["summary"]["comm"] == honest["summary"]["comm"]
    assert got["label"]["peak"] - honest["label"]["peak"] < 64 * _MIB


# -- soak: three kills at random moments, three resumes --------------------------------------------------------------
def test_three_kills_at_random_moments_then_resumes_end_as_the_uninterrupted_run(tmp_path: Path) -> None:
    rng = random.Random(27)
    fed = _federation(tmp_path / "fed", 2)
    # long enough that each kill falls inside the run: every attempt waits for one more checkpoint, then kills
    common = ("--algo", "splitnn", "--dataset", "breast_cancer", "--parties", "2", "--epochs", "20", "--batch-size",
              "8", "--seed", "5")
    run = tmp_path / "run"
    latest = run / "label" / "checkpoints" / "latest.json"
    kills = []
    for attempt in range(3):
        cmd = [sys.executable, "-m", "secvfl.cli.main", "launch", "--federation", str(fed),
               *(("--resume", str(run)) if attempt else ("--out", str(run), *common)),
               "--threads", "1", "--party-timeout", "60", "--peer-timeout", "5"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            done = json.loads(latest.read_text())["epoch"] if latest.exists() else 0
            deadline = time.monotonic() + 240
            while not latest.exists() or json.loads(latest.read_text())["epoch"] <= done:  # one epoch more
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.4))  # a random moment of the next epoch (or of its checkpoint)
            victim = rng.choice(["label", "party0", "party1"])
            pids = subprocess.run(["pgrep", "-f", f"party --name {victim} --(out|resume) {run}/{victim}"],
                                  capture_output=True, text=True, timeout=10).stdout.split()
            assert len(pids) == 1, pids
            os.kill(int(pids[0]), signal.SIGKILL)
            kills.append((victim, json.loads(latest.read_text())["epoch"]))
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        assert proc.returncode != 0 and not (run / "label" / "summary.json").exists(), err[-3000:]
    assert [epoch for _, epoch in kills] == sorted({epoch for _, epoch in kills}) and kills[-1][1] < 20, kills
    resumed = _launch(fed, run, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = json.loads((run / "label" / "summary.json").read_text())
    expected = _in_process(tmp_path, *common)
    assert got["metrics"]["test"] == pytest.approx(expected["metrics"]["test"], rel=1e-9), kills
    assert got["comm"] == expected["comm"], kills
