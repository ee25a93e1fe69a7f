"""Online VFL (issue 17): DLR windows against hand-computed sums, activation, passive parties, prequential scoring,
SLR's bytes, the stream replay (class probabilities, determinism, exact resume) and the options' parsing."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from secvfl.algorithms.online.activation import Activation, parse_activation
from secvfl.algorithms.online.buffers import GradientWindow
from secvfl.algorithms.online.parties import OnlineFeatureParty, WindowSpec, bottom_model
from secvfl.algorithms.online.streams import NONSTATIONARY_PERIOD, Feed, StreamReplay
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.messages import Message
from secvfl.runner import build_run
from secvfl.transport.layers import Role
from secvfl.transport.network import Network


# -- the DLR window -------------------------------------------------------------------------------------------------
def test_the_window_average_is_the_hand_computed_weighted_sum_with_passive_zeros() -> None:
    g = {t: torch.full((3,), float(t)) for t in range(1, 6)}
    window = GradientWindow(3, 0.5, 3, dtype=torch.float64)
    window.push(g[1])
    window.push(g[2])
    window.push(None)  # a passive round enqueues zeros
    window.push(g[4])  # l = 3: round 1 has left the window
    # (1/W)(alpha^0 g4 + alpha^1 * 0 + alpha^2 g2), W = 1 + 0.5 + 0.25
    assert window.average().tolist() == pytest.approx([(4 + 0.25 * 2) / 1.75] * 3)
    window.push(g[5])  # now g2 has left too: (g5 + 0.5 g4 + 0.25 * 0) / W
    assert window.average().tolist() == pytest.approx([(5 + 0.5 * 4) / 1.75] * 3)


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 6), alpha=st.floats(0.05, 1.0),
       rounds=st.lists(st.one_of(st.none(), st.lists(st.floats(-10, 10), min_size=2, max_size=2)), min_size=1,
                       max_size=15))
def test_the_window_matches_a_float64_reference_for_any_sequence(length, alpha, rounds) -> None:
    window = GradientWindow(length, alpha, 2, dtype=torch.float64)
    history: list[np.ndarray] = []
    for r in rounds:
        window.push(None if r is None else torch.tensor(r, dtype=torch.float64))
        history.append(np.zeros(2) if r is None else np.array(r))
        recent = history[::-1][:length]  # newest first; missing entries (start of the stream) are zeros
        weights = np.array([alpha**i for i in range(length)])
        want = sum(w * g for w, g in zip(weights, recent, strict=False)) / weights.sum()
        np.testing.assert_allclose(window.average().numpy(), want, rtol=1e-9, atol=1e-9)


def _party_network() -> Network:
    return Network({"party0": Role.FEATURE, "label": Role.LABEL})


def test_a_feature_party_steps_with_its_window_and_a_passive_round_only_enqueues_zero() -> None:
    """Three rounds of a DLR feature party (active, passive, active) against the update rule by hand: the gradient of
    an active round is v_t * dh/dw at that round's parameters; the step is lr times the window's weighted mean."""
    torch.manual_seed(0)
    lr, alpha, length = 0.1, 0.5, 2
    model = bottom_model(3, 2).double()
    reference = copy.deepcopy(model)
    feed = Feed()
    # event:0.8 on inputs averaging 1.17, 0.43, 1.03: active, passive, active (checked below)
    party = OnlineFeatureParty("party0", feed, model, Activation(parse_activation("event:0.8"), 1, 0),
                               WindowSpec("window", length, alpha), lr=lr, eval_blocks={}, dtype=torch.float64)
    net = _party_network()
    xs = [np.array([1.0, 2.0, 0.5]), np.array([0.3, -1.0, 2.0]), np.array([2.0, 0.1, 1.0])]
    vs = [torch.tensor([[1.0, -2.0]], dtype=torch.float64), None, torch.tensor([[0.5, 3.0]], dtype=torch.float64)]
    grads_by_round = []
    for t, (x, v) in enumerate(zip(xs, vs, strict=True)):
        feed.put(t, x)
        sent = party.forward(t, "label")
        assert sent.meta["active"] is (v is not None)
        if v is None:
            party.backward(None)
            grads_by_round.append([torch.zeros_like(p) for p in reference.parameters()])
            continue
        out = reference(torch.as_tensor(x[None]))
        grads_by_round.append(list(torch.autograd.grad(out, list(reference.parameters()), v)))
        net.send(Message("gradient", "label", "party0", t, {"gradient": v}))
        party.backward(net.receive("party0", kind="gradient"))
        with torch.no_grad():  # w <- w - lr/W * sum_i alpha^i g^{t-i}, i < l
            weights = [alpha**i for i in range(length)]
            recent = grads_by_round[::-1][:length]
            for k, p in enumerate(reference.parameters()):
                p -= lr * sum(w * g[k] for w, g in zip(weights, recent, strict=False)) / sum(weights)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# -- whole rounds through the algorithms ------------------------------------------------------------------------
def _run(algo: str, **options):
    cfg = TrainConfig(algo=algo, dataset="wine", parties=3, epochs=1, seed=5, device="cpu",
                      options={"samples": 40, "online_embedding": 8, "online_head": 16, **options})
    run = build_run(cfg)
    run.net.start_epoch(0)
    return run


def test_passive_parties_send_embeddings_but_get_no_gradient_and_keep_their_parameters(monkeypatch) -> None:
    # no party's features average above 1000: every round passive (a threshold TrainConfig refuses as degenerate,
    # used here to see passive rounds alone)
    monkeypatch.setattr("secvfl.algorithms.online.algorithms.check_event_threshold", lambda *_: None)
    run = _run("dlr", activation="event:1000")
    before = [copy.deepcopy(p.model.state_dict()) for p in run.algorithm.parties().values() if hasattr(p, "model")]
    head = copy.deepcopy(run.algorithm.parties()["label"].head.state_dict())
    run.algorithm.train_epoch(0)
    comm = run.net.stats.to_dict()
    assert comm["messages_by_kind"] == {"embedding": 3 * 40}  # every party answered every round, no gradient
    after = [p.model.state_dict() for p in run.algorithm.parties().values() if hasattr(p, "model")]
    for b, a in zip(before, after, strict=True):
        for k in b:
            assert torch.equal(b[k], a[k])
    assert any(not torch.equal(v, run.algorithm.parties()["label"].head.state_dict()[k]) for k, v in head.items())


def test_a_rounds_prediction_is_scored_before_the_update() -> None:
    """Replaying the first round by hand: the error counted for it is the prediction of the untrained head."""
    run = _run("ogd")
    alg = run.algorithm
    label = alg.parties()["label"]
    head0 = copy.deepcopy(label.head)
    feeds_before = copy.deepcopy(alg.stream.state_dict())
    alg.stream.emit(0, alg.feeds, alg.label_feed)
    xs, y = [], alg.label_feed._events[0][1]
    for party, feed in zip([alg.parties()[n] for n in alg.names], alg.feeds, strict=True):
        x = feed._events[0][1]
        xs.append(party.model(torch.as_tensor(x[None], dtype=torch.float32)).detach())
    predicted = int(head0(torch.cat(xs, dim=1)).argmax())
    alg.run_round()
    assert alg.meter.errors == int(predicted != y)
    assert feeds_before["round"] == 0


def test_slr_sends_the_window_of_embeddings_about_l_times_the_bytes_of_ogd() -> None:
    samples, window = 40, 5
    ogd, slr = _run("ogd"), _run("slr", online_window=window)
    ogd.algorithm.train_epoch(0)
    slr.algorithm.train_epoch(0)
    o, s = ogd.net.stats.to_dict(), slr.net.stats.to_dict()
    assert o["messages_by_kind"] == s["messages_by_kind"]  # same messages, larger tensors
    rows = sum(min(t + 1, window) for t in range(samples))  # embeddings per party over the run
    floats_ogd, floats_slr = 3 * samples * 8, 3 * rows * 8
    # payload = header + 4 bytes per float: the difference is exactly the extra rows' floats
    assert s["bytes_by_kind"]["embedding"] - o["bytes_by_kind"]["embedding"] == 4 * (floats_slr - floats_ogd)


def test_random_activation_rate_matches_p_and_decisions_are_per_party() -> None:
    act = [Activation(parse_activation("random:0.25"), 7, k) for k in range(2)]
    draws = np.array([[a.active(np.zeros(1)) for a in act] for _ in range(4000)])
    for k in range(2):
        assert stats.binomtest(int(draws[:, k].sum()), 4000, 0.25).pvalue > 1e-3
    assert not np.array_equal(draws[:, 0], draws[:, 1])


def test_event_activation_compares_the_mean_of_the_partys_features() -> None:
    rule = Activation(parse_activation("event:0.5"), 0, 0)
    assert rule.active(np.array([0.4, 0.8]))  # mean 0.6
    assert not rule.active(np.array([0.9, 0.0]))  # mean 0.45


@pytest.mark.parametrize("text, want", [("full", ("full", 1.0)), ("random:0.3", ("random", 0.3)),
                                        ("event:-0.2", ("event", -0.2)), ("Random:1", ("random", 1.0))])
def test_activation_specs_parse(text: str, want: tuple) -> None:
    spec = parse_activation(text)
    assert (spec.kind, spec.value) == (want[0], pytest.approx(want[1]))


@pytest.mark.parametrize("text", ["", "full:1", "random", "random:0", "random:1.5", "random:nan", "event:",
                                  "event:inf", "sometimes:1"])
def test_bad_activation_specs_are_one_clear_line(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_activation(text)
    assert "\n" not in str(err.value) and "--activation must be" in str(err.value)


# -- the stream replay ------------------------------------------------------------------------------------------
def _replay(**kw) -> StreamReplay:
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(300, 4)).astype(np.float32), np.repeat(np.arange(3), 100)
    return StreamReplay(X, y, 3, [np.array([0, 1]), np.array([2, 3])], seed=11, **kw)


def test_a_stationary_stream_draws_each_class_equally_often() -> None:
    counts = np.bincount([_replay_draw for _replay_draw in (r[1] for r in _draws(_replay(), 3000))], minlength=3)
    assert stats.chisquare(counts).pvalue > 1e-3


def _draws(replay: StreamReplay, n: int) -> list[tuple]:
    return [replay.draw() for _ in range(n)]


def test_a_nonstationary_stream_redraws_the_class_probabilities_every_50_rounds() -> None:
    replay = _replay(nonstationary=True)
    seen = []
    for _ in range(3 * NONSTATIONARY_PERIOD):
        replay.draw()
        seen.append(replay._probs.copy())
    for start in range(0, len(seen), NONSTATIONARY_PERIOD):
        block = seen[start : start + NONSTATIONARY_PERIOD]
        assert all(np.array_equal(block[0], p) for p in block)  # constant within a period
        assert block[0].sum() == pytest.approx(1.0)
    assert not np.allclose(seen[0], seen[NONSTATIONARY_PERIOD])  # redrawn at the boundary


def test_the_stream_is_deterministic_and_resumes_exactly_from_its_state() -> None:
    a, b = _replay(nonstationary=True), _replay(nonstationary=True)
    first = _draws(a, 70)
    assert all(np.array_equal(x[0], y[0]) and x[1:] == y[1:] for x, y in zip(first, _draws(b, 70), strict=True))
    state = a.state_dict()
    cont = _draws(a, 40)
    c = _replay(nonstationary=True)
    c.load_state_dict(state)
    assert all(np.array_equal(x[0], y[0]) and x[1:] == y[1:] for x, y in zip(cont, _draws(c, 40), strict=True))


def test_replayed_images_are_deformed_copies_of_their_source_rows() -> None:
    rng = np.random.default_rng(1)
    X = np.zeros((20, 64), np.float32)
    X[:, 18:22] = rng.uniform(1, 2, size=(20, 4))  # a bar in an 8x8 image
    X[:, 42:46] = rng.uniform(1, 2, size=(20, 4))
    replay = StreamReplay(X, np.zeros(20, np.int64), 1, [np.arange(64)], seed=3, image_shape=(8, 8), deform=True)
    for _ in range(20):
        x, _, row = replay.draw()
        assert not np.allclose(x, X[row])  # never the stored row itself
        assert np.corrcoef(x, X[row])[0, 1] > 0.5  # but a small deformation of it


def test_each_party_feed_receives_only_its_own_columns() -> None:
    replay = _replay()
    feeds, label = [Feed(), Feed()], Feed()
    replay.emit(0, feeds, label)
    (_, x0), (_, x1), (_, y) = feeds[0].take(), feeds[1].take(), label.take()
    assert x0.shape == (2,) and x1.shape == (2,) and isinstance(y, int)
