"""LASER-VFL and the missing-feature baselines as federations of isolated parties talking through the network."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from secvfl.algorithms.base import RunContext
from secvfl.algorithms.missing.baselines import Combinatorial, Ensemble, LocalBaseline, PlugVFL, StandardVFL
from secvfl.algorithms.missing.laser import LaserVFL
from secvfl.algorithms.missing.subsets import TaskTable, subsets_containing, task_weight
from secvfl.config import TrainConfig
from secvfl.data import Dataset, make_partition
from secvfl.errors import UnsupportedError
from secvfl.messages import header_size
from secvfl.transport.network import Network


def synthetic(n: int = 600, K: int = 3, cols: int = 2, seed: int = 0, noise: float = 0.3) -> Dataset:
    """Binary labels that every block predicts on its own (so every subset of parties can learn them)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    X = (np.repeat((2 * y - 1)[:, None], K * cols, axis=1) + noise * rng.standard_normal((n, K * cols)))
    X = X.astype(np.float32)
    tr, te = slice(0, n * 3 // 4), slice(n * 3 // 4, n)
    return Dataset("synthetic", X[tr], y[tr], X[:0], y[:0], X[te], y[te], 2, [f"x{i}" for i in range(K * cols)],
                   ["0", "1"])


def build(cls, data: Dataset, K: int, *, p_train: float = 0.0, seed: int = 0, **cfg_kw):
    cfg = TrainConfig(algo=cls.name, parties=K, batch_size=cfg_kw.pop("batch_size", 32), lr=cfg_kw.pop("lr", 0.01),
                      hidden=cfg_kw.pop("hidden", (8,)), embedding_dim=cfg_kw.pop("embedding_dim", 4),
                      head_hidden=cfg_kw.pop("head_hidden", ()), val_fraction=0.0, seed=seed, **cfg_kw)
    rng = np.random.default_rng([seed, 1])
    masks = {s: np.ones((len(getattr(data, f"y_{s}")), K), dtype=bool) for s in ("train", "val", "test")}
    if p_train:
        m = rng.random(masks["train"].shape) >= p_train
        m[~m.any(axis=1), 0] = True
        masks["train"] = m
    ctx = RunContext(cfg, data, make_partition(data.n_features, K), masks, torch.device("cpu"), torch.float32)
    torch.manual_seed(seed)
    return cls(ctx, Network(cls.party_roles(K), traits=cls.traits))


# --- LASER: the distributed step is the sampled objective's gradient ----------------------------------------


@pytest.mark.parametrize("head_hidden", [(), (3,)])  # closed-form linear-head path and the autograd path
@pytest.mark.parametrize("observed", [(0, 1, 2), (0, 2), (1,)])
def test_laser_step_equals_monolithic_sampled_objective(observed, head_hidden):
    """One step through isolated parties and serialised messages moves every parameter exactly as plain SGD on
    sum_k sum_j a_j * loss(g_k(mean of S_kj)), computed in one process with a per-subset loop."""
    data = synthetic(K=3)
    algo = build(LaserVFL, data, 3, optimizer="sgd", lr=1.0, head_hidden=head_hidden)
    assert (algo.laser_parties[0]._linear_head is None) == bool(head_hidden)
    parties = algo.laser_parties
    before = [(copy.deepcopy(p.f), copy.deepcopy(p.g)) for p in parties]
    rngs = [copy.deepcopy(p._rng) for p in parties]
    ids = np.arange(16)
    batch = type("B", (), {"observed": observed, "indices": ids})()
    algo.train_batch(batch)

    xs = [torch.as_tensor(algo.ctx.partition.take(data.X_train, k)[ids]) for k in range(3)]
    y = torch.as_tensor(data.y_train[ids]).float()
    reps = {k: before[k][0](xs[k]) for k in observed}
    total = 0.0
    n = len(observed)
    for k in observed:
        tasks = TaskTable.of(k, observed).sample(rngs[k])
        for J in tasks:
            z = before[k][1](torch.stack([reps[i] for i in J]).mean(0)).squeeze(1)
            total = total + task_weight(n, len(J)) * F.binary_cross_entropy_with_logits(z, y)
    total.backward()
    for k in range(3):
        for mod_before, mod_after in ((before[k][0], parties[k].f), (before[k][1], parties[k].g)):
            for pb, pa in zip(mod_before.parameters(), mod_after.parameters(), strict=True):
                expected = pb.detach() - (pb.grad if pb.grad is not None else 0.0)
                torch.testing.assert_close(pa.detach(), expected, rtol=1e-5, atol=1e-6)
                if k not in observed:
                    assert pb.grad is None  # an unobserved party is not touched


def test_laser_messages_one_per_pair_and_exact_bytes():
    data = synthetic(K=4, cols=1)
    algo = build(LaserVFL, data, 4, embedding_dim=5)
    batch = type("B", (), {"observed": (0, 1, 3), "indices": np.arange(10)})()
    algo.train_batch(batch)
    stats = algo.net.stats
    assert stats.messages_by_kind["embedding"] == 6 and stats.messages_by_kind["gradient"] == 6
    assert not any("party2" in link for link in stats.bytes_by_link)
    payload = 10 * 5 * 4
    # Every message carries one (10, 5) float32 tensor plus its header.
    assert stats.bytes_by_kind["embedding"] > 6 * payload
    from secvfl.messages import Message

    one = Message("embedding", "party0", "party1", 0, {"embedding": torch.zeros(10, 5)})
    assert stats.bytes_by_link["party0->party1"] == header_size(one) + payload + header_size(
        Message("gradient", "party0", "party1", 0, {"gradient": torch.zeros(10, 5)})) + payload


def test_every_predictor_h_kJ_is_usable_after_training():
    """After training with missing blocks, every party k predicts well with every J containing k."""
    K = 3
    data = synthetic(n=800, K=K)
    algo = build(LaserVFL, data, K, p_train=0.3, lr=0.02)
    for epoch in range(6):
        algo.train_epoch(epoch)
    X, y = data.X_test, data.y_test
    reps = {}
    for p in algo.laser_parties:
        p._mode(False)
        with torch.no_grad():
            reps[p.index] = p.f(torch.as_tensor(algo.ctx.partition.take(X, p.index)))
    for p in algo.laser_parties:
        for J in subsets_containing(p.index, range(K)):
            logits = p.predictor_logits(J, {i: reps[i] for i in J})
            acc = float(((logits.squeeze(1) > 0).long().numpy() == y).mean())
            assert acc > 0.9, (p.index, J, acc)
    # The same through the federation, for every observed set at test time.
    for J in subsets_containing(0, range(K)) + [(1,), (2,), (1, 2)]:
        mask = np.zeros((len(y), K), dtype=bool)
        mask[:, list(J)] = True
        assert algo.score("test", mask)["accuracy"] > 0.9


def test_a_party_that_left_does_not_stop_the_others():
    K = 4
    data = synthetic(n=800, K=K)
    algo = build(LaserVFL, data, K, p_train=0.2, lr=0.02)
    for epoch in range(4):
        algo.train_epoch(epoch)
    rng = np.random.default_rng(5)
    mask = rng.random((len(data.y_test), K)) >= 0.3
    mask[:, 2] = False  # party 2 left the federation after training
    mask[~mask.any(axis=1), 0] = True
    before = dict(algo.net.stats.bytes_by_link)
    preds = algo.predict_parties("test", mask)
    assert (preds[:, 2] == -1).all()  # the party that left predicts nothing ...
    assert (preds[mask] >= 0).all()  # ... and every remaining observed party predicts every row it holds
    # ... and no message went to or from it.
    after = algo.net.stats.bytes_by_link
    assert all(after[link] == before.get(link, 0) for link in after if "party2" in link)
    m = algo.score("test", mask)
    assert m["accuracy"] > 0.9 and m["f1_positive"] > 0.9


def test_checkpoint_roundtrip_continues_identically():
    data = synthetic(K=3)
    a = build(LaserVFL, data, 3, p_train=0.3)
    a.train_epoch(0)
    state = copy.deepcopy(a.state_dict())
    b = build(LaserVFL, data, 3, p_train=0.3, seed=0)
    b.load_state_dict(state)
    a.train_epoch(1)
    b.train_epoch(1)
    for pa, pb in zip(a.laser_parties, b.laser_parties, strict=True):
        for x, z in zip(pa.f.parameters(), pb.f.parameters(), strict=True):
            torch.testing.assert_close(x, z)


# --- baselines ---------------------------------------------------------------------------------------------


def test_standard_vfl_trains_only_on_complete_batches_and_guesses_otherwise():
    K = 3
    data = synthetic(n=800, K=K)
    algo = build(StandardVFL, data, K, p_train=0.5, lr=0.02)
    assert all(len(b.observed) == K for b in algo.epoch_batches(0))
    for e in range(5):
        algo.train_epoch(e)
    full = np.ones((len(data.y_test), K), dtype=bool)
    assert algo.score("test", full)["accuracy"] > 0.9
    partial = full.copy()
    partial[:, 1] = False
    acc = algo.score("test", partial)["accuracy"]
    assert 0.35 < acc < 0.65  # random guesses


def test_combinatorial_trains_exactly_the_contained_predictors_and_refuses_large_K():
    K = 3
    data = synthetic(K=K)
    algo = build(Combinatorial, data, K, optimizer="sgd")
    snap = {(p.index, key): [t.detach().clone() for t in p.f[key].parameters()]
            for p in algo.predictor_parties for key in p.f}
    batch = type("B", (), {"observed": (0, 2), "indices": np.arange(12)})()
    algo.train_batch(batch)
    for p in algo.predictor_parties:
        for key in p.f:
            members = tuple(int(v) for v in key[1:].split("-"))
            changed = any(not torch.equal(a, b) for a, b in zip(snap[(p.index, key)], p.f[key].parameters(),
                                                                  strict=True))
            assert changed == set(members).issubset({0, 2}), key
    # One embedding message per (member, holder) pair: party 2 -> holder 0 of predictor {0, 2} only.
    assert algo.net.stats.messages_by_kind["embedding"] == 1
    wide = synthetic(K=9, cols=1)
    with pytest.raises(UnsupportedError, match="at most 8 parties"):
        build(Combinatorial, wide, 9)


def test_plugvfl_skips_batches_without_the_active_party_and_drops_passive_ones():
    K = 3
    data = synthetic(K=K)
    algo = build(PlugVFL, data, K, p_train=0.5, options={"p_drop": 0.5})
    assert all(K - 1 in b.observed for b in algo.epoch_batches(0))
    presents = [algo.train_work((0, 1, 2), step)[0][1] for step in range(200)]
    assert all(2 in p for p in presents)
    share = np.mean([0 in p for p in presents])
    assert 0.35 < share < 0.65
    algo.train_epoch(0)
    mask = np.ones((len(data.y_test), K), dtype=bool)
    mask[:, 2] = False
    preds = algo.predict_parties("test", mask)
    assert (preds[:, :2] >= 0).all()  # random guesses, since the active party is missing


def test_local_and_ensemble_predict_from_own_blocks():
    K = 3
    data = synthetic(n=800, K=K)
    local = build(LocalBaseline, data, K, p_train=0.3, lr=0.02)
    ens = build(Ensemble, data, K, p_train=0.3, lr=0.02)
    for e in range(4):
        local.train_epoch(e)
        ens.train_epoch(e)
    assert local.net.stats.bytes_total == 0 and ens.net.stats.bytes_total == 0  # no training messages
    mask = np.random.default_rng(0).random((len(data.y_test), K)) >= 0.4
    mask[~mask.any(axis=1), 1] = True
    p_local = local.predict_parties("test", mask)
    p_ens = ens.predict_parties("test", mask)
    # Same seed, same batches, same models: Local and Ensemble train the same predictors, so with one observed
    # party per row (the vote of one) they predict identically.
    for k in range(K):
        alone = np.zeros_like(mask)
        alone[:, k] = True
        assert np.array_equal(local.predict_parties("test", alone), ens.predict_parties("test", alone))
    for row in range(len(mask)):
        obs = np.flatnonzero(mask[row])
        assert len(set(p_ens[row, obs].tolist())) == 1  # every observed party outputs the same vote
        counts = np.bincount(p_local[row, obs], minlength=2)
        if counts.max() > len(obs) / 2:  # a strict majority of the Local predictions wins the vote
            assert p_ens[row, obs[0]] == counts.argmax()
    assert ens.net.stats.messages_by_kind["prediction"] > 0
    assert local.score("test", mask)["accuracy"] > 0.9 and ens.score("test", mask)["accuracy"] > 0.9


@pytest.mark.parametrize("options", [{"he": "ckks"}, {"secagg": "mask"}])
def test_a_secure_aggregation_is_refused_because_it_would_protect_nothing(options):
    """LASER-VFL never sums through the network (traits: broadcast), so the secure aggregations refuse it."""
    from secvfl.runner import build_run

    cfg = TrainConfig(algo="laser", dataset="breast_cancer", parties=3, epochs=1, device="cpu", options=options)
    with pytest.raises(UnsupportedError, match="would protect nothing"):
        build_run(cfg)


def test_combinatorial_batched_models_equal_one_model_at_a_time():
    """A party runs its 2^(K-1) representation models as one batched MLP; training is the same as running them
    one by one (same initial weights, same batches)."""
    K = 3
    data = synthetic(K=K)
    a = build(Combinatorial, data, K, p_train=0.3)
    b = build(Combinatorial, data, K, p_train=0.3)
    assert all(p._layers is not None for p in a.predictor_parties)
    for p in b.predictor_parties:
        p._layers = None  # the one-model-at-a-time path
    for batch in a.epoch_batches(0)[:8]:
        a.train_batch(batch)
        b.train_batch(batch)
    for pa, pb in zip(a.predictor_parties, b.predictor_parties, strict=True):
        for key in pa.f:
            for x, z in zip(pa.f[key].parameters(), pb.f[key].parameters(), strict=True):
                torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-6)
    assert a.predict_parties("test").tolist() == b.predict_parties("test").tolist()
