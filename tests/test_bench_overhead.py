"""`secvfl bench overhead`: the split and monolithic sides train the same model; both times are reported."""

from __future__ import annotations

import json

import pytest

from secvfl.cli.main import main


def test_bench_overhead_reports_cpu_and_wall_ratios(tmp_path, monkeypatch) -> None:
    """The reported times are the medians of what the bench's clock measured around each side's epochs (a fake
    clock gives known durations), the ratios divide them, and each timed epoch really trained: the split side
    moved one epoch's messages through the network, the monolithic side computed one loss per batch."""
    from secvfl import parties, runner
    from secvfl.bench import overhead

    runs, losses = [], []
    # From their home modules: another test that patched one while the bench module was first imported must not
    # leave its stand-in here.
    real_build_run, real_task_loss = runner.build_run, parties.task_loss

    def build_run(cfg):  # noqa: ANN001, ANN202
        runs.append(real_build_run(cfg))
        return runs[-1]

    def task_loss(n_classes):  # noqa: ANN001, ANN202 - counts the monolithic side's batches
        loss = real_task_loss(n_classes)
        return lambda *a: (losses.append(1), loss(*a))[1]

    # (wall s, cpu s) per timed epoch, in the bench's interleaved order: split, mono, bare split, split, ...
    fake = iter([(3.0, 2.0), (1.0, 0.5), (2.0, 1.0), (5.0, 4.0), (2.0, 1.0), (3.0, 2.0), (4.0, 3.0), (1.5, 0.8),
                 (2.5, 1.5)])
    timed: list[dict] = []

    def fake_timed_wall_cpu(fn):  # noqa: ANN001, ANN202
        bytes_before, losses_before = runs[0].net.stats.bytes_total, len(losses)
        fn()
        timed.append({"bytes": runs[0].net.stats.bytes_total - bytes_before, "losses": len(losses) - losses_before})
        return next(fake)

    monkeypatch.setattr(overhead, "build_run", build_run)
    monkeypatch.setattr(overhead, "task_loss", task_loss)
    monkeypatch.setattr(overhead, "timed_wall_cpu", fake_timed_wall_cpu)
    out = tmp_path / "o.json"
    batch, emb, parties = 256, 8, 4
    rc = main(["bench", "overhead", "--dataset", "digits", "--repeats", "3", "--hidden", "16",
               "--embedding-dim", str(emb), "--batch-size", str(batch), "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["threads"] == 1
    # medians of split (3, 5, 4) / (2, 4, 3) and monolithic (1, 2, 1.5) / (0.5, 1, 0.8)
    assert r["split_epoch_seconds"] == pytest.approx(4.0) and r["split_epoch_cpu_seconds"] == pytest.approx(3.0)
    assert r["monolithic_epoch_seconds"] == pytest.approx(1.5)
    assert r["monolithic_epoch_cpu_seconds"] == pytest.approx(0.8)
    assert r["ratio_wall"] == pytest.approx(4.0 / 1.5, abs=1e-4) and r["ratio"] == pytest.approx(3.0 / 0.8, abs=1e-4)
    assert [pytest.approx(pair) for pair in r["split_epoch_wall_cpu_all"]] == [[3.0, 2.0], [5.0, 4.0], [4.0, 3.0]]
    # bare split (2, 3, 2.5) / (1, 2, 1.5): the floor over the monolithic side, and the split over the floor
    assert r["bare_split_epoch_cpu_seconds"] == pytest.approx(1.5) and r["bare_split_epoch_seconds"] == pytest.approx(2.5)
    assert r["floor_ratio"] == pytest.approx(1.5 / 0.8, abs=1e-4)
    assert r["split_over_bare_split"] == pytest.approx(3.0 / 1.5, abs=1e-4)
    # the three sides trained the same weights (same initial weights, batches and Adam steps)
    assert all(d < 1e-5 for d in r["max_abs_weight_difference"].values()), r["max_abs_weight_difference"]
    # What was timed: split epochs moved bytes and computed no monolithic loss; monolithic epochs the opposite.
    n_batches = r["batches_per_epoch"]
    rows = len(runs[0].algorithm.train_rows())
    payload = parties * 2 * rows * emb * 4  # every row's embedding and gradient, float32, from/to each party
    for split, mono, bare in zip(timed[0::3], timed[1::3], timed[2::3], strict=True):
        assert split["losses"] == 0 and payload < split["bytes"] < payload + parties * 2 * n_batches * 1024
        assert mono == {"bytes": 0, "losses": n_batches}
        assert bare == {"bytes": 0, "losses": n_batches}
    assert r["bytes_per_epoch"] == sum(t["bytes"] for t in timed) // 3
