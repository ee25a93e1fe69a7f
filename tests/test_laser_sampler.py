"""Pattern-grouped batch sampler and the missing-block metrics of the LASER-VFL paper."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import f1_score

from secvfl.algorithms.missing.eval import binary_f1, evaluate_predictions, majority_vote, random_predictions
from secvfl.data.pattern_sampler import PatternBatchSampler, observed_parties, pattern_codes
from secvfl.errors import ConfigError, DataError


def random_mask(n, K, p, seed):
    return np.random.default_rng(seed).random((n, K)) >= p


# --- uniform mode ----------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), K=st.integers(1, 5), p=st.sampled_from([0.0, 0.1, 0.5, 0.8]),
       B=st.integers(1, 40), seed=st.integers(0, 1000), epoch=st.integers(0, 5))
def test_uniform_epoch_uses_every_usable_sample_once_in_single_pattern_batches(n, K, p, B, seed, epoch):
    mask = random_mask(n, K, p, seed)
    if not mask.any():
        with pytest.raises(DataError, match="no sample is observed"):
            PatternBatchSampler(mask, B, seed=seed)
        return
    sampler = PatternBatchSampler(mask, B, seed=seed)
    batches = sampler.epoch(epoch)
    seen = np.concatenate([b.indices for b in batches])
    usable = np.flatnonzero(mask.any(axis=1))
    assert sorted(seen.tolist()) == usable.tolist()  # each usable sample exactly once
    assert sampler.n_unobserved == n - len(usable)
    for b in batches:
        assert 1 <= len(b) <= B
        expected = tuple(np.flatnonzero(mask[b.indices[0]]).tolist())
        assert b.observed == expected
        assert (mask[b.indices] == mask[b.indices[0]]).all()  # one observation pattern per batch
    counts = sampler.pattern_counts()
    assert len(batches) == sum(-(-c // B) for c in counts.values())  # only one partial batch per pattern


def test_same_seed_same_batches_other_seed_or_epoch_differs():
    mask = random_mask(500, 4, 0.3, 0)
    a = PatternBatchSampler(mask, 16, seed=3)
    b = PatternBatchSampler(mask.copy(), 16, seed=3)  # another party, same public mask and seed

    def flat(batches):
        return [(bt.observed, bt.indices.tolist()) for bt in batches]

    assert flat(a.epoch(2)) == flat(b.epoch(2))
    assert flat(a.epoch(2)) != flat(a.epoch(3))
    assert flat(a.epoch(2)) != flat(PatternBatchSampler(mask, 16, seed=4).epoch(2))
    # Batches of different patterns are interleaved, not run pattern after pattern.
    patterns = [bt.observed for bt in a.epoch(0)]
    changes = sum(p != q for p, q in zip(patterns, patterns[1:], strict=False))
    assert changes > len(set(patterns))


def test_codes_roundtrip():
    mask = np.array([[True, False, True], [False, False, False], [False, True, True]])
    codes = pattern_codes(mask)
    assert codes.tolist() == [5, 0, 6]
    assert observed_parties(5, 3) == (0, 2) and observed_parties(6, 3) == (1, 2)


def test_bad_arguments():
    mask = random_mask(10, 2, 0.0, 0)
    with pytest.raises(DataError, match="boolean"):
        PatternBatchSampler(mask.astype(int), 4, seed=0)
    with pytest.raises(ConfigError, match="batch size"):
        PatternBatchSampler(mask, 0, seed=0)
    with pytest.raises(ConfigError, match="needs the labels"):
        PatternBatchSampler(mask, 4, seed=0, class_balanced=True)
    with pytest.raises(DataError, match="one entry per sample"):
        PatternBatchSampler(mask, 4, seed=0, class_balanced=True, labels=np.zeros(3, dtype=int))


# --- class-balanced mode ---------------------------------------------------------------------------------------


def test_class_balanced_epochs_are_balanced_even_and_cover_everything():
    rng = np.random.default_rng(0)
    n = 1000
    y = (rng.random(n) < 0.2).astype(np.int64)  # 20 % positives, like the credit data
    mask = random_mask(n, 4, 0.5, 1)
    sampler = PatternBatchSampler(mask, 32, seed=5, labels=y, class_balanced=True)
    usable = np.flatnonzero(mask.any(axis=1))
    n_usable = len(usable)
    seen_major = set()
    for epoch in range(4):
        batches = sampler.epoch(epoch)
        idx = np.concatenate([b.indices for b in batches])
        assert len(idx) == n_usable
        per_class = np.bincount(y[idx], minlength=2)
        assert abs(per_class[0] - per_class[1]) <= 1
        for b in batches:
            assert (mask[b.indices] == mask[b.indices[0]]).all() and len(b) <= 32
        # Minority samples are repeated as evenly as possible: multiplicities differ by at most one per epoch
        # (plus one at a cycle boundary).
        minority = usable[y[usable] == 1]
        mult = np.bincount(idx[y[idx] == 1], minlength=n)[minority]
        assert mult.max() - mult.min() <= 2 and mult.min() >= 1
        seen_major |= set(idx[y[idx] == 0].tolist())
    # Majority samples: no repeats within an epoch's share, and all reached within the first epochs.
    assert seen_major == set(usable[y[usable] == 0].tolist())
    again = PatternBatchSampler(mask, 32, seed=5, labels=y, class_balanced=True)
    assert [b.indices.tolist() for b in again.epoch(3)] == [b.indices.tolist() for b in sampler.epoch(3)]


def test_describe_is_json_like():
    mask = random_mask(50, 3, 0.5, 2)
    d = PatternBatchSampler(mask, 8, seed=0).describe()
    assert d["n_usable"] + d["n_unobserved"] == 50
    assert sum(d["patterns"].values()) == d["n_usable"]


# --- metrics ---------------------------------------------------------------------------------------------------


def test_metrics_hand_computed():
    y = np.array([1, 0, 1, 0])
    observed = np.array([[True, True], [True, False], [False, False], [False, True]])
    preds = np.array([[1, 0], [0, 9], [0, 0], [9, 1]])  # 9: where a party does not observe (ignored)
    m = evaluate_predictions(preds, y, observed, n_classes=2)
    # sample 0: 1/2 right; sample 1: 1/1; sample 2: nobody observes (left out); sample 3: 0/1
    assert m.accuracy == pytest.approx((0.5 + 1 + 0) / 3)
    assert m.n_evaluated == 3 and m.n_unpredictable == 1
    # party 0 on rows 0,1: preds (1,0) vs (1,0): F1 = 1. party 1 on rows 0,3: preds (0,1) vs (1,0): F1 = 0.
    assert m.f1_per_party == pytest.approx((1.0, 0.0), abs=1e-12)
    assert m.f1 == pytest.approx(0.5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(1, 4))
def test_f1_matches_sklearn_per_party(seed, K):
    rng = np.random.default_rng(seed)
    n = 60
    y = rng.integers(0, 2, n)
    observed = rng.random((n, K)) < 0.7
    preds = rng.integers(0, 2, (n, K))
    m = evaluate_predictions(preds, y, observed, n_classes=2)
    expected = [f1_score(y[observed[:, k]], preds[observed[:, k], k], zero_division=0)
                for k in range(K) if observed[:, k].any()]
    assert m.f1 == pytest.approx(float(np.mean(expected)))
    assert binary_f1(preds[:, 0], y) == pytest.approx(f1_score(y, preds[:, 0], zero_division=0))


def test_party_that_left_is_excluded_from_f1_and_multiclass_has_no_f1():
    y = np.array([0, 1, 2, 1])
    observed = np.array([[True, False]] * 4)
    preds = np.stack([y, np.zeros(4, dtype=int)], axis=1)
    m = evaluate_predictions(preds, y, observed, n_classes=3)
    assert m.accuracy == pytest.approx(1.0, abs=1e-12) and m.f1 is None
    assert m.accuracy_per_party[0] == pytest.approx(1.0, abs=1e-12) and m.accuracy_per_party[1] is None
    mb = evaluate_predictions(np.stack([y % 2, y % 2], 1), y % 2, observed, n_classes=2)
    assert mb.f1_per_party[0] == pytest.approx(1.0, abs=1e-12) and mb.f1_per_party[1] is None
    assert mb.f1 == pytest.approx(1.0, abs=1e-12)


def test_majority_vote_and_ties():
    rng = np.random.default_rng(0)
    votes = np.array([[1, 1, 0], [2, 0, 0], [0, 1, 2]])
    observed = np.array([[True, True, True], [True, True, True], [False, False, False]])
    out = majority_vote(votes, observed, 3, rng)
    assert out.tolist() == [1, 0, -1]
    # A 1-1 tie between classes 0 and 2 goes to each about half the time, never to class 1.
    tie_votes = np.tile([[0, 2, 1]], (4000, 1))
    tie_obs = np.tile([[True, True, False]], (4000, 1))
    winners = majority_vote(tie_votes, tie_obs, 3, rng)
    assert set(winners.tolist()) == {0, 2}
    assert abs(np.mean(winners == 0) - 0.5) < 0.05
    r = random_predictions(3000, 4, rng)
    assert set(r.tolist()) == {0, 1, 2, 3}
