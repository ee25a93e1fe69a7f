"""Label DP for the online algorithms (issue 17): randomized response of each streamed label, once, as it arrives.

The references are independent of the code under test: the flip rate is compared with the K-ary randomized-response
probability by an exact binomial test; the feature parties' gradients of a private run are compared with those of a
non-private run that is simply given the randomised labels as its true labels; the epsilon a crashed stream run
spends is counted from the kill points, block by block.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from protocols.dp.choice import STREAM_REASON, choose_mechanism
from protocols.dp.config import DPConfig, plan_dp
from protocols.dp.ledger import epsilon_spent, ledger_header, releases_per_sample
from secvfl.cli.main import main
from secvfl.config import TrainConfig
from secvfl.errors import ProtocolError
from secvfl.runner import KILL_AT_BATCH_ENV, build_run, run_training

EPS = 1.0
SMALL = {"online_embedding": 8, "online_head": 16}


def _quiet(*_: object) -> None:
    pass


def _cfg(algo: str = "dlr", privacy: bool = True, epochs: int = 1, **options) -> TrainConfig:
    dp = {"privacy": "dp", "epsilon": EPS, "dp_reproducible": True} if privacy else {}
    window = {"online_window": 4} if algo != "ogd" else {}
    return TrainConfig(algo=algo, dataset="wine", parties=2, epochs=epochs, seed=3, device="cpu", threads=1,
                       options={"samples": 60, **SMALL, **window, **dp, **options})


def _dp_layer(run):  # noqa: ANN001, ANN202
    return next(layer for layer in run.net.layers if layer.name == "dp")


# -- the mechanism -------------------------------------------------------------------------------------------------
def test_the_flip_rate_of_streamed_labels_is_randomized_response_at_the_runs_epsilon() -> None:
    """20,000 streamed labels through the transform the run installed on the label party: flipped with probability
    1 - e^eps / (e^eps + K - 1), and a flipped label is uniform over the K - 1 others."""
    run = build_run(_cfg(epsilon=3.0))
    k, eps = 3, 3.0  # wine: three classes
    transform = _dp_layer(run).stream
    rng = np.random.default_rng(0)
    true = rng.integers(0, k, 20_000)
    released = np.array([transform(i, int(y)) for i, y in enumerate(true)])
    flip = 1 - math.exp(eps) / (math.exp(eps) + k - 1)
    flipped = released != true
    test = stats.binomtest(int(flipped.sum()), flipped.size, flip)
    assert test.pvalue > 1e-4, (flipped.mean(), flip)
    # among flipped labels, the offset to the true label is uniform over the K - 1 others
    offsets = (released[flipped] - true[flipped]) % k
    counts = np.bincount(offsets, minlength=k)[1:]
    assert stats.chisquare(counts).pvalue > 1e-4
    assert _dp_layer(run).stream.released == 20_000


def test_auto_picks_randomized_response_for_a_stream_even_where_a_prior_would_win() -> None:
    kw = {"protects": "labels", "n_classes": 10, "epochs": 5, "epsilon": 3.0, "n_train": 50_000}
    assert choose_mechanism(**kw)[0] == "rr-prior"  # a batch run with this much signal
    assert choose_mechanism(**kw, streamed_labels=True) == ("rr", STREAM_REASON)


# -- what leaves the label party ---------------------------------------------------------------------------------
def _drive(algo: str, *, privacy: bool, relabel: list[int] | None, rounds: int = 150) -> dict:
    """Run ``rounds`` rounds of the replayed stream by hand; ``relabel`` replaces the stream's labels (by round)."""
    run = build_run(_cfg(algo, privacy=privacy))
    view = run.net.record("party0")
    randomised: list[int] = []
    if privacy:  # record what the run's mechanism released, through the same public hook
        mechanism = _dp_layer(run).stream
        run.algorithm.protocol_hooks().label_stream.install_label_transform(
            lambda e, y: randomised.append(mechanism(e, y)) or randomised[-1])
    algo_ = run.algorithm
    true, correct, losses = [], [], []
    for t in range(rounds):
        algo_.stream.emit(algo_.stream.round, algo_.feeds, algo_.label_feed)
        entity, y = algo_.label_feed.take()
        y = int(y) if relabel is None else relabel[t]
        algo_.label_feed.put(entity, y)
        true.append(y)
        errors = algo_.meter.errors
        losses.append(algo_.run_round())
        correct.append(algo_.meter.errors == errors)
    grads = [m.tensor("gradient").clone() for m in view.received_of("gradient")]
    return {"true": true, "randomised": randomised, "correct": correct, "losses": losses, "grads": grads}


@pytest.mark.parametrize("algo", ["ogd", "slr", "dlr"])
def test_gradients_are_a_function_of_the_randomised_labels_and_scores_use_the_true_ones(algo: str) -> None:
    """A private run and a non-private run whose true labels ARE the private run's randomised labels send the feature
    parties the very same gradients and train on the same losses, though the true labels differ; the prequential
    score of the private run is against its true labels."""
    private = _drive(algo, privacy=True, relabel=None)
    plain = _drive(algo, privacy=False, relabel=private["randomised"])
    y, r = np.array(private["true"]), np.array(private["randomised"])
    flipped = y != r
    assert flipped.mean() > 0.2  # epsilon 1, three classes: 42 % expected
    assert len(private["grads"]) == len(plain["grads"]) > 0
    for a, b in zip(private["grads"], plain["grads"], strict=True):
        assert torch.equal(a, b)  # the same computation on the same inputs: bit for bit
    assert private["losses"] == plain["losses"]
    # the same predictions, scored against y (private) and against r (plain): where the labels agree so do the
    # scores; where they differ, at most one of the two can be right, and some rounds show it
    ca, cb = np.array(private["correct"]), np.array(plain["correct"])
    assert np.array_equal(ca[~flipped], cb[~flipped])
    assert not np.any(ca[flipped] & cb[flipped])
    assert np.any(ca[flipped] != cb[flipped])


def test_gradients_that_bypassed_the_randomisation_are_refused() -> None:
    run = build_run(_cfg("ogd"))
    run.algorithm.protocol_hooks().label_stream.install_label_transform(lambda e, y: y)  # the true label
    algo = run.algorithm
    algo.stream.emit(algo.stream.round, algo.feeds, algo.label_feed)
    with pytest.raises(ProtocolError, match="without a stream label randomised"):
        algo.run_round()


# -- the statement, the summary, resume --------------------------------------------------------------------------
def test_the_summary_and_statement_give_epsilon_per_stream_sample_however_long_the_stream(tmp_path: Path) -> None:
    logged: list[str] = []
    summary = run_training(_cfg("dlr", epochs=3), tmp_path / "run", progress=False, log=logged.append)
    privacy = summary["privacy"]
    assert privacy["mechanism"] == "rr" and privacy["auto_reason"] == STREAM_REASON
    assert privacy["epsilon"] == pytest.approx(EPS) and privacy["epsilon_spent"] == pytest.approx(EPS)  # 3 blocks
    assert privacy["delta"] == 0.0 and privacy["releases_per_sample"] == 1
    assert privacy["privacy_unit"].startswith("stream sample") and "one stream sample" in privacy["neighbouring"]
    assert privacy["released"] == {"stream_labels_released": 180}
    statement = next(line for line in logged if line.startswith("Privacy guarantee")).splitlines()[0]
    assert "epsilon = 1 per stream sample" in statement
    assert "does not grow with the length of the stream" in statement
    assert "r * epsilon for that row" in statement  # a replayed source row drawn r times
    assert "against the true labels it holds" in statement
    # 180 samples of wine at epsilon 1 stay near chance; the advice fits a stream (no other mechanism applies)
    assert "learn from a longer stream" in privacy["utility_warning"]
    text = (tmp_path / "run/PRIVACY.md").read_text()
    assert "## What epsilon means on a stream" in text and statement.split(" What this means: ")[0] in text
    assert text.count("## What this means") == 1 and "What this means:" not in text  # said once, in its section
    ledger = json.loads((tmp_path / "run/parties/label/dp-ledger.json").read_text())
    assert [(e["release"], e["epoch"]) for e in ledger["entries"]] == [("block", 0), ("block", 1), ("block", 2)]


def test_a_resumed_reproducible_run_continues_the_noise_stream_exactly(tmp_path: Path) -> None:
    """Two blocks, then --resume to three: the same randomised labels, metrics and bytes as three blocks at once (the
    RR stream's position is in the checkpoint; restarting it would re-draw the first block's noise)."""
    full = run_training(_cfg("dlr", epochs=3), tmp_path / "full", progress=False, log=_quiet)
    run_training(_cfg("dlr", epochs=2), tmp_path / "cut", progress=False, log=_quiet)
    resumed = run_training(None, resume=tmp_path / "cut", changes={"epochs": 3}, progress=False, log=_quiet)
    # the last block's training loss is computed from its randomised labels: another noise position gives other labels
    # (the model may predict one class everywhere at epsilon 1, so the errors alone would not tell)
    assert resumed["metrics"]["val"]["train_loss"] == pytest.approx(full["metrics"]["val"]["train_loss"], rel=1e-12)
    assert resumed["metrics"]["test"] == pytest.approx(full["metrics"]["test"], rel=1e-12)
    np.testing.assert_allclose(resumed["online"]["block_error"], full["online"]["block_error"], rtol=1e-12)
    assert resumed["comm"] == full["comm"]
    assert resumed["privacy"]["released"] == full["privacy"]["released"]
    assert resumed["privacy"]["epsilon_spent"] == pytest.approx(EPS)


# -- the budget across crashes, block by block ------------------------------------------------------------------
def _stream_plan(blocks: int):
    config = DPConfig(mechanism="rr", epsilon=EPS, stream=True)
    return plan_dp(config, n_train=100, epochs=blocks, batch_size=1)


@settings(max_examples=80, deadline=None)
@given(blocks=st.integers(1, 6), data=st.data())
def test_the_ledger_charges_the_most_repeated_block(blocks: int, data: st.DataObject) -> None:
    """Processes killed inside random blocks, each resumed from the checkpoint before: the samples of the block a
    process died in are released again by the next one (fresh noise), so they are the most released samples."""
    plan = _stream_plan(blocks)
    kills = data.draw(st.lists(st.integers(0, blocks - 1), max_size=4))
    entries, process, start = [], 1, 0
    starts = {b: 0 for b in range(blocks)}  # processes that started each block: the independent count
    for kill in sorted(kills):
        kill = max(kill, start)
        for b in range(start, kill + 1):
            entries.append({"release": "block", "epoch": b, "process": process, "replay": None})
            starts[b] += 1
        process, start = process + 1, kill  # the next process resumes at the block that was interrupted
    for b in range(start, blocks):
        entries.append({"release": "block", "epoch": b, "process": process, "replay": None})
        starts[b] += 1
    assert releases_per_sample(plan, entries) == max(starts.values())
    assert epsilon_spent(plan, entries) == pytest.approx(EPS * max(starts.values()))
    # a reproducible replay (same replay key) sends the same labels again: no new release
    same = [{**e, "replay": "seeded/cpu/threads=1"} for e in entries]
    assert epsilon_spent(plan, same) == pytest.approx(EPS)


@pytest.mark.slow
def test_a_crash_mid_block_with_secure_noise_is_charged_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    """Killed 15 rounds into block 3 of 3 (secure generator): the resumed process randomises those stream samples'
    labels again with fresh noise, 2 epsilon for them; the resume is refused, then allowed and reported as spent."""
    run = tmp_path / "run"
    flags = ["--algo", "ogd", "--dataset", "wine", "--parties", "2", "--samples", "30", "--epochs", "3",
             "--online-embedding", "8", "--online-head", "16", "--seed", "3", "--privacy", "dp", "--epsilon", "1",
             "--no-progress", "--device", "cpu", "--out", str(run)]
    env = {**{k: v for k, v in os.environ.items() if k != KILL_AT_BATCH_ENV}, KILL_AT_BATCH_ENV: "75",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "secvfl.cli.main", "train", *flags], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "would spend epsilon 2, more than its budget of 1" in error and "block 3 released 2 times" in error
    assert main(["train", "--resume", str(run), "--no-progress", "--dp-accept-epsilon", "2"]) == 0
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    assert privacy["epsilon"] == pytest.approx(2.0) and privacy["within_plan"] is False
    assert privacy["repeated_releases"] == {"block 3": 2}
    assert privacy["released"] == {"stream_labels_released": 90}  # the checkpoint's count: the replayed rounds once


def test_a_stream_ledger_is_not_a_batch_ledger() -> None:
    batch = plan_dp(DPConfig(mechanism="rr", epsilon=EPS), n_train=100, epochs=2, batch_size=1)
    assert "stream" not in ledger_header(batch, "label")  # earlier runs' ledgers keep their header
    assert ledger_header(_stream_plan(2), "label")["stream"] is True
