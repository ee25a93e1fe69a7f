"""The DP budget is charged for every release that happened, across kill -9 and resume (issue 14, section 3).

Checkpoints are per epoch, so a process killed in the middle of an epoch has released part of it with no checkpoint
saying so; before this issue the resumed run released those samples again with fresh noise and still reported the
planned epsilon (breast_cancer, 2 epochs, killed in epoch 2: epsilon 3.77 spent, 3.00 reported, ``within_plan``
true). Here the releases that happened are counted independently of the code under test: a run killed by
``$SECVFL_KILL_AT_BATCH=N`` released exactly its first ``N`` training batches (counted from the run's first batch)
and a process that finishes released every batch from its checkpoint on; the public batch order (seed, epoch) says
which samples each batch holds, so each sample's number of releases is counted, and its maximum gives the epsilon
the run really spent (exactly, under the analytic Gaussian curve: a lower bound for every accountant).

The tests check that the epsilon a run reports at the end is at least that, that a run whose finish would exceed its
plan stops with one clear line and keeps its directory (unless ``--dp-accept-epsilon`` allows it, and then
``within_plan`` is false), that rr-prior's stage-2 release is not redrawn after a crash, that the training loss
computed from the true labels appears nowhere but in the label party's own file, and that the accountant refuses an
event it does not know instead of pricing it at zero.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq
from scipy.stats import norm

from protocols.dp.accounting import (
    GaussianEvent,
    GdpAccountant,
    PrvAccountant,
    RdpAccountant,
    compose,
    epsilon_of,
    make_accountant,
)
from protocols.dp.config import DPConfig, plan_dp
from protocols.dp.ledger import ReleaseLedger, ledger_header, releases_per_sample
from secvfl.algorithms.base import batch_ids
from secvfl.cli.main import main
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError, UnsupportedError
from secvfl.runlock import LOCK_FILE
from secvfl.runner import KILL_AT_BATCH_ENV, run_training

BATCH = 64
COMMON = ["--dataset", "breast_cancer", "--parties", "2", "--batch-size", str(BATCH), "--hidden", "8",
          "--head-hidden", "8", "--embedding-dim", "4", "--seed", "3", "--threads", "1", "--no-progress", "--device", "cpu"]
GRADIENT = ["--algo", "splitnn", "--privacy", "dp", "--dp-mechanism", "gradient", "--epsilon", "3"]
FEATURES = ["--algo", "vafl", "--privacy", "dp", "--dp-protect", "features", "--epsilon", "3"]
TOO_MUCH = "finishing this run would spend epsilon"


# -- the independent count ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Process:
    """One process of a run: it trained from the checkpoint after ``start`` epochs up to global batch ``stop``."""

    start: int
    stop: int


def true_releases(processes: list[Process], n_train: int, per_epoch: int, *, batch: int = BATCH, seed: int = 3) -> int:
    """How often the most released training sample was released by these processes (``per_epoch``: releases of a
    sample per visit, 1 for label DP and 2 for feature DP: its row and the model update)."""
    batches = -(-n_train // batch)
    counts = np.zeros(n_train, dtype=np.int64)
    for p in processes:
        for index in range(p.start * batches, p.stop):
            epoch, b = divmod(index, batches)
            counts[list(batch_ids(n_train, batch, seed, epoch))[b]] += per_epoch
    return int(counts.max())


def exact_epsilon(sigma: float, releases: int, delta: float) -> float:
    """Exact epsilon of ``releases`` adaptive Gaussian releases at multiplier ``sigma`` (analytic Gaussian curve of
    sqrt(T)/sigma-GDP, Dong, Roth & Su 2019): every valid accountant reports at least this."""
    mu = math.sqrt(releases) / sigma

    def excess(eps: float) -> float:
        return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)) - delta

    return float(brentq(excess, 0.0, 200.0, xtol=1e-12))


# -- running ------------------------------------------------------------------------------------------------------
def killed(flags: list[str], out: Path, at_batch: int) -> None:
    """``secvfl train`` in a fresh process that SIGKILLs itself after its ``at_batch``-th batch."""
    env = {**{k: v for k, v in os.environ.items() if k != KILL_AT_BATCH_ENV}, KILL_AT_BATCH_ENV: str(at_batch),
           "OMP_NUM_THREADS": "1"}
    if (out / "config.toml").exists():
        argv = ["--resume", str(out), "--no-progress", *flags]
    else:
        argv = [*flags, "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "secvfl.cli.main", "train", *argv], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr


def train(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``secvfl train`` in this process: exit code and the error line (if any)."""
    code = main(["train", *argv])
    err = capsys.readouterr().err
    return code, next((line for line in err.splitlines() if "error:" in line), "")


def privacy(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())["privacy"]


def snapshot(run: Path) -> dict[str, bytes]:
    # (the run's lock file names the process holding it: each new process writes its id there)
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and p.name != LOCK_FILE}


def check_reported(run: Path, processes: list[Process], per_epoch: int) -> None:
    p = privacy(run)
    releases = true_releases(processes, p["n_train"], per_epoch)
    truth = exact_epsilon(p["noise_multiplier"], releases, p["delta"])
    assert p["epsilon"] >= truth  # the acceptance criterion: never less than what really happened
    assert p["epsilon_spent"] >= truth
    # and no more than that: with one epoch repeated, the ledger's count is exact (the accountant's rdp bound of it)
    assert p["releases_per_sample"] == releases
    assert p["epsilon"] == pytest.approx(epsilon_of(GaussianEvent(p["noise_multiplier"], releases), p["delta"]),
                                         rel=1e-9)
    assert p["within_plan"] is (p["epsilon_spent"] <= p["epsilon_planned"] * (1 + 1e-9))


# -- kill -9, resume ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "per_epoch", "at_batch"), [
    pytest.param(GRADIENT, 1, 10, id="label-dp-gradient"),  # 7 batches per epoch: 3 batches into epoch 2
    pytest.param(GRADIENT, 1, 8, id="label-dp-first-batch-after-a-checkpoint", marks=pytest.mark.slow),
    pytest.param(FEATURES, 2, 10, id="feature-dp", marks=pytest.mark.slow),
])
def test_kill_mid_epoch_resume_is_refused_then_charged(flags: list[str], per_epoch: int, at_batch: int, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run, argv = tmp_path / "run", [*COMMON, "--epochs", "3", *flags]
    killed(argv, run, at_batch=at_batch)
    assert json.loads((run / "checkpoints/latest.json").read_text())["epoch"] == 1
    before = snapshot(run)
    code, error = train(["--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and TOO_MUCH in error and "--dp-accept-epsilon" in error
    assert "epoch 2 released 2 times" in error
    assert snapshot(run) == before  # refused before anything in the run directory changed
    assert not (run / "summary.json").exists()

    allowed = error.split("--dp-accept-epsilon ")[1].split("`")[0]
    code, error = train(["--resume", str(run), "--no-progress", "--dp-accept-epsilon", allowed], capsys)
    assert code == 0, error
    check_reported(run, [Process(0, at_batch), Process(1, 21)], per_epoch)
    p = privacy(run)
    assert p["within_plan"] is False and p["epsilon"] > 3.0 and p["epsilon_accepted"] == pytest.approx(float(allowed))
    assert p["repeated_releases"] == {"epoch 2": 2}
    assert f"epsilon = {p['epsilon']:.4g}" in (run / "PRIVACY.md").read_text()


@pytest.mark.slow
def test_kill_before_the_first_checkpoint_then_a_new_run_in_that_directory(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run, argv = tmp_path / "run", [*COMMON, "--epochs", "2", *GRADIENT]
    killed(argv, run, at_batch=3)
    code, error = train(["--resume", str(run), "--no-progress"], capsys)  # resumes from the beginning, charged
    assert code == 2 and TOO_MUCH in error and "epoch 1 released 2 times" in error and "remove" not in error
    code, error = train([*argv, "--out", str(run)], capsys)  # the same run started again there: charged the same
    assert code == 2 and TOO_MUCH in error and "epoch 1 released 2 times" in error
    code, error = train(["--resume", str(run), "--no-progress", "--dp-accept-epsilon", "4"], capsys)
    assert code == 0, error
    check_reported(run, [Process(0, 3), Process(0, 14)], 1)


@pytest.mark.slow
def test_kill_at_the_end_of_an_epoch_before_its_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, argv = tmp_path / "run", [*COMMON, "--epochs", "3", *GRADIENT]
    killed(argv, run, at_batch=14)  # the last batch of epoch 2: all of it released, its checkpoint never written
    assert json.loads((run / "checkpoints/latest.json").read_text())["epoch"] == 1
    code, error = train(["--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and TOO_MUCH in error
    code, error = train(["--resume", str(run), "--no-progress", "--dp-accept-epsilon", "5"], capsys)
    assert code == 0, error
    check_reported(run, [Process(0, 14), Process(1, 21)], 1)


@pytest.mark.slow
def test_killed_twice_in_the_same_epoch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, argv = tmp_path / "run", [*COMMON, "--epochs", "3", *GRADIENT]
    killed(argv, run, at_batch=9)
    killed(["--dp-accept-epsilon", "9"], run, at_batch=12)  # resumed from epoch 1, killed again in epoch 2
    code, error = train(["--resume", str(run), "--no-progress", "--dp-accept-epsilon", "3.5"], capsys)
    assert code == 2 and "more than its budget of 3.5" in error and "epoch 2 released 3 times" in error
    assert train(["--resume", str(run), "--no-progress"], capsys)[0] == 0  # config.toml kept the accepted 9
    check_reported(run, [Process(0, 9), Process(1, 12), Process(1, 21)], 1)


def test_rewinding_with_from_epoch_charges_the_epochs_trained_again(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run, argv = tmp_path / "run", [*COMMON, "--epochs", "2", *GRADIENT]
    assert train([*argv, "--out", str(run)], capsys)[0] == 0
    assert privacy(run)["within_plan"] is True and privacy(run)["repeated_releases"] == {}
    code, error = train(["--resume", str(run), "--from-epoch", "1", "--no-progress"], capsys)
    assert code == 2 and "epoch 2 released 2 times" in error
    assert json.loads((run / "checkpoints/latest.json").read_text())["epoch"] == 2  # nothing discarded


def test_seeded_noise_repeats_only_on_the_same_threads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dp-reproducible redraws the same noise from the restored state: the same values again, no new release
    (test_resume_kill checks the bit-for-bit repeat); other --threads may change the last bits, so it counts."""
    run, argv = tmp_path / "run", [*COMMON, "--epochs", "2", *GRADIENT, "--dp-reproducible"]
    assert train([*argv, "--out", str(run)], capsys)[0] == 0
    code, error = train(["--resume", str(run), "--from-epoch", "1", "--threads", "2", "--no-progress"], capsys)
    assert code == 2 and "epoch 2 released 2 times" in error
    assert train(["--resume", str(run), "--from-epoch", "1", "--no-progress"], capsys)[0] == 0
    assert privacy(run)["within_plan"] is True and privacy(run)["repeated_releases"] == {}


# -- rr-prior: stage 2 is released once ------------------------------------------------------------------------------
class _Crash(Exception):
    pass


def test_rr_prior_stage2_is_not_released_again_after_a_crash(tmp_path: Path) -> None:
    from protocols.dp.plugin import DPLayer
    from secvfl.cli.main import build_parser
    from secvfl.cli.train import config_from_args

    args = build_parser().parse_args(["train", "--dataset", "digits", "--parties", "2", "--epochs", "2",
                                      "--batch-size", "256", "--hidden", "16", "--seed", "1", "--privacy", "dp",
                                      "--dp-mechanism", "rr-prior", "--epsilon", "1", "--threads", "1", "--device",
                                      "cpu"])
    layers: list[DPLayer] = []

    def crash_in_stage_2(run) -> None:  # noqa: ANN001 - the runner's Run
        layers.append(next(la for la in run.net.layers if isinstance(la, DPLayer)))
        inner = run.algorithm.train_epoch

        def train_epoch(epoch: int, progress) -> dict:  # noqa: ANN001
            def tick(loss: float) -> None:
                progress(loss)
                if epoch == 1:  # stage 2 was released as the epoch began; one batch trained on it
                    raise _Crash

            return inner(epoch, tick)

        run.algorithm.train_epoch = train_epoch

    run = tmp_path / "run"
    with pytest.raises(_Crash):
        run_training(config_from_args(args), out=run, progress=False, log=lambda *_: None, on_build=crash_in_stage_2)
    used = layers[0].staged.labels.copy()
    assert layers[0].staged.stage2_done and (used >= 0).all()
    run_training(TrainConfig(), resume=run, progress=False, log=lambda *_: None, on_build=lambda r: layers.append(
        next(la for la in r.net.layers if isinstance(la, DPLayer))))
    np.testing.assert_array_equal(layers[1].staged.labels, used)  # the labels the crashed process trained on
    p = privacy(run)
    assert p["epsilon"] == pytest.approx(1.0) and p["within_plan"] is True and p["repeated_releases"] == {}


# -- the training loss from true labels stays with the label party ---------------------------------------------------
def test_true_label_loss_is_only_in_the_label_partys_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    code = main(["train", *COMMON, "--epochs", "2", *GRADIENT, "--out", str(run)])
    out = capsys.readouterr().out
    assert code == 0
    kept = [json.loads(line) for line in (run / "parties/label/train-loss.jsonl").read_text().splitlines()]
    assert [k["epoch"] for k in kept] == [1, 2] and all(0 < k["train_loss"] < 5 for k in kept)
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    assert [h["train_loss"] for h in history] == [None, None]
    assert summary["metrics"]["val"]["train_loss"] is None
    assert "loss private" in out
    shared = {name: data for name, data in snapshot(run).items() if not name.startswith("parties/")}
    for k in kept:  # the number itself is nowhere in what the other parties can read, nor in the log
        text = repr(k["train_loss"])[:8]
        assert text not in out
        assert not [name for name, data in shared.items() if text.encode() in data]
    assert "the label party keeps it to itself" in (run / "PRIVACY.md").read_text()


def test_released_label_loss_stays_public(tmp_path: Path) -> None:
    """Randomized response trains on the released labels only: its loss is post-processing and is reported."""
    run = tmp_path / "run"
    assert main(["train", *COMMON, "--epochs", "1", "--algo", "splitnn", "--privacy", "dp", "--dp-mechanism", "rr",
                 "--epsilon", "3", "--out", str(run)]) == 0
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert history[0]["train_loss"] > 0 and not (run / "parties/label/train-loss.jsonl").exists()


# -- the ledger's count -------------------------------------------------------------------------------------------
def _plan(epochs: int, protects: str = "labels", n_train: int = 40):
    return plan_dp(DPConfig(mechanism="gradient", protects=protects, noise_multiplier=2.0), n_train=n_train,
                   epochs=epochs, batch_size=8)


@settings(max_examples=60, deadline=None)
@given(epochs=st.integers(1, 4), n_train=st.integers(8, 40), kills=st.integers(0, 4), data=st.data())
def test_ledger_counts_at_least_every_release(epochs: int, n_train: int, kills: int, data: st.DataObject) -> None:
    """Any sequence of kills and resumes: the ledger's count is never below the most released sample's."""
    batch = 8
    batches = -(-n_train // batch)
    plan = _plan(epochs, n_train=n_train)
    ledger = ReleaseLedger("label", ledger_header(plan, "label"), replay=None)
    processes, done = [], 0
    for kill in range(kills + 1):
        last = kill == kills  # the last process finishes the run
        stop = epochs * batches if last else data.draw(st.integers(done * batches + 1, epochs * batches))
        processes.append(Process(done, stop))
        for epoch in range(done, -(-stop // batches)):  # the epochs it began, each recorded before its releases
            ledger.record("epoch", epoch)
        ledger.process += 1
        # killed in the tick after a batch: the epoch that batch ended is not checkpointed
        done = epochs if last else (stop - 1) // batches
    assert releases_per_sample(plan, ledger.entries) >= true_releases(processes, n_train, 1, batch=batch)


def test_ledger_replay_keys() -> None:
    plan = _plan(2)
    entries = [{"release": "epoch", "epoch": e, "process": p, "replay": r}
               for e, p, r in [(0, 1, "k"), (1, 1, "k"), (1, 2, "k"), (1, 3, None), (1, 4, "other")]]
    assert releases_per_sample(plan, entries) == 1 + 3  # epoch 2: "k" once, the secure repeat, "other"
    assert releases_per_sample(_plan(2, "features"), entries) == 2 * 4  # the row and the model update


def test_ledger_refuses_what_it_cannot_count(tmp_path: Path) -> None:
    plan = _plan(2)
    ledger = ReleaseLedger("label", ledger_header(plan, "label"), replay=None)
    with pytest.raises(ConfigError, match="has trained 1 epoch.*no DP release ledger"):
        ledger.open(tmp_path, trained_epochs=1)
    ledger.open(tmp_path, trained_epochs=0)
    ledger.record("epoch", 0)
    other = ReleaseLedger("label", ledger_header(_plan(2, n_train=41), "label"), replay=None)
    with pytest.raises(ConfigError, match="other settings.*n_train 40 \\(now 41\\)"):
        other.open(tmp_path, trained_epochs=1)
    (tmp_path / "parties/label/dp-ledger.json").write_text('{"format": "secvfl-dp-ledger/1", "entries": [{}]}')
    with pytest.raises(ConfigError, match="is damaged"):
        ReleaseLedger("label", ledger_header(plan, "label"), replay=None).open(tmp_path, trained_epochs=1)


# -- the accountant fails closed ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaplaceEvent:  # a release no accountant here knows
    scale: float
    count: int = 1


@pytest.mark.parametrize("accountant", [RdpAccountant, PrvAccountant, GdpAccountant])
def test_accountant_refuses_an_unknown_event(accountant: type) -> None:
    acc = accountant()
    acc.events.extend([GaussianEvent(2.0, 3), LaplaceEvent(1.0)])  # past compose()'s own check
    with pytest.raises(UnsupportedError, match="LaplaceEvent"):
        acc.get_epsilon(1e-5)
    with pytest.raises(UnsupportedError, match="LaplaceEvent"):
        make_accountant("rdp").compose(compose(GaussianEvent(2.0), LaplaceEvent(1.0)))  # type: ignore[arg-type]
