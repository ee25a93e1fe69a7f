"""Live sources (issue 17): rounds formed by entity id from interleaved, delayed and missing events, a missing party
passive after the timeout, and memory bounded whatever the stream's length."""

from __future__ import annotations

import pytest

from secvfl.algorithms.online.live import LABEL_SOURCE, RoundJoin
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.runner import build_run


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_interleaved_events_form_rounds_by_entity_id_in_label_order() -> None:
    clock = Clock()
    join = RoundJoin(["a", "b"], timeout=5, clock=clock)
    join.offer("b", "e2", 20)
    join.offer("a", "e1", 1)
    join.offer(LABEL_SOURCE, "e2", "y2")
    join.offer("b", "e1", 10)
    join.offer(LABEL_SOURCE, "e1", "y1")
    assert [r.entity for r in join.ready()] == ["e1"]  # e2 still waits for party a
    join.offer("a", "e2", 2)
    (r2,) = join.ready()
    assert (r2.entity, r2.label, r2.features, r2.missing) == ("e2", "y2", {"a": 2, "b": 20}, [])
    assert len(join) == 0


def test_a_delayed_party_within_the_timeout_still_joins_its_round() -> None:
    clock = Clock()
    join = RoundJoin(["a", "b"], timeout=5, clock=clock)
    join.offer(LABEL_SOURCE, 7, 1)
    join.offer("a", 7, "xa")
    clock.now = 4.9
    assert list(join.ready()) == []
    join.offer("b", 7, "xb")
    (r,) = join.ready()
    assert r.missing == [] and r.features == {"a": "xa", "b": "xb"}


def test_a_party_missing_at_the_timeout_is_left_out_and_its_late_event_dropped() -> None:
    clock = Clock()
    join = RoundJoin(["a", "b"], timeout=5, clock=clock)
    join.offer(LABEL_SOURCE, 1, 0)
    join.offer("a", 1, "xa")
    clock.now = 5.0
    (r,) = join.ready()
    assert r.missing == ["b"] and r.features == {"a": "xa"}
    join.offer("b", 1, "late")
    assert join.dropped["late"] == 1 and len(join) == 0


def test_features_whose_label_never_comes_expire() -> None:
    clock = Clock()
    join = RoundJoin(["a"], timeout=2, clock=clock)
    join.offer("a", "x", 1)
    clock.now = 3
    assert list(join.ready()) == [] and join.dropped["unlabelled"] == 1 and len(join) == 0


def test_bad_live_settings_are_one_clear_line() -> None:
    with pytest.raises(ConfigError, match="timeout must be >= 0"):
        RoundJoin(["a"], timeout=-1)
    with pytest.raises(ConfigError, match="unknown live source 'c'"):
        RoundJoin(["a"], timeout=1).offer("c", 1, 0)


def test_an_online_run_trains_from_live_sources_with_missing_parties_passive() -> None:
    cfg = TrainConfig(algo="dlr", dataset="wine", parties=2, epochs=1, seed=1, device="cpu",
                      options={"online_embedding": 4, "online_head": 8, "online_window": 3})
    run = build_run(cfg)
    run.net.start_epoch(0)
    alg = run.algorithm
    clock = Clock()
    join = RoundJoin(alg.names, timeout=1, clock=clock)
    data = run.ctx.data
    blocks = [run.ctx.partition.blocks[k] for k in range(2)]
    for i in range(30):  # party1 never sees entities divisible by 3
        join.offer(LABEL_SOURCE, i, int(data.y_train[i]))
        join.offer("party0", i, data.X_train[i, blocks[0]].copy())
        if i % 3:
            join.offer("party1", i, data.X_train[i, blocks[1]].copy())
    assert alg.train_live(join) == 20  # complete rounds at once
    clock.now = 2
    assert alg.train_live(join) == 10  # the others once the timeout passed
    rounds = {n: alg.feature_handles[k].compute()["rounds"] for k, n in enumerate(alg.names)}
    assert rounds["party1"]["missing"] == 10 and rounds["party0"]["missing"] == 0
    assert run.net.stats.messages_by_kind["gradient"] == 30 + 20  # missing parties get no gradient
    assert alg.meter.samples == 30


def test_memory_is_bounded_over_a_million_events() -> None:
    """10^6 events (label and two parties, interleaved, 1 in 5 entities never labelled, 1 in 7 missing a party):
    the join never holds more than max_pending entities, nor more finished ids than that."""
    clock = Clock()
    join = RoundJoin(["a", "b"], timeout=3, max_pending=64, clock=clock)
    events, rounds, peak = 0, 0, 0
    entity = 0
    while events < 1_000_000:
        clock.now += 1
        if entity % 5:
            join.offer(LABEL_SOURCE, entity, 0)
            events += 1
        join.offer("a", entity, 1)
        events += 1
        if entity % 7:
            join.offer("b", entity, 2)
            events += 1
        entity += 1
        if entity % 16 == 0:
            rounds += sum(1 for _ in join.ready())
        peak = max(peak, len(join))
    assert peak <= 64 and len(join._done) <= 64
    assert rounds > 0.7 * entity  # most labelled entities made a round
