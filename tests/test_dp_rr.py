"""Randomized response: exact flip probabilities for K classes, the DP ratio, RR with a prior."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from protocols.dp.rng import SeededNoise
from protocols.dp.rr import (
    randomized_response,
    rr_keep_probability,
    rr_transition_matrix,
    rr_with_prior,
    rr_with_prior_probabilities,
    rr_with_prior_set_sizes,
)
from secvfl.errors import ConfigError, DataError


@pytest.mark.parametrize("k", [2, 3, 10])
@pytest.mark.parametrize("eps", [0.5, 3.0])
def test_rr_flips_with_the_exact_probabilities(k: int, eps: float) -> None:
    keep = math.exp(eps) / (math.exp(eps) + k - 1)
    assert rr_keep_probability(eps, k) == pytest.approx(keep, rel=1e-12)
    n = 20_000
    rng = SeededNoise(int(eps * 10) + k)
    for y in (0, k - 1):
        out = randomized_response(np.full(n, y), k, eps, rng)
        counts = np.bincount(out, minlength=k)
        expected = np.full(k, (1 - keep) / (k - 1) * n)
        expected[y] = keep * n
        assert stats.chisquare(counts, expected).pvalue > 1e-4


@settings(max_examples=30, deadline=None)
@given(k=st.integers(2, 50), eps=st.floats(0.01, 30.0))
def test_rr_transition_matrix_is_eps_dp(k: int, eps: float) -> None:
    t = rr_transition_matrix(eps, k)
    assert np.allclose(t.sum(1), 1.0)
    ratio = t.max(0) / t.min(0)  # per output, the worst pair of inputs
    assert np.all(ratio <= math.exp(eps) * (1 + 1e-9))
    assert np.allclose(ratio, math.exp(eps))  # and RR is tight


def test_rr_accepts_tensors_and_rejects_bad_input() -> None:
    out = randomized_response(torch.tensor([0, 1, 1, 0]), 2, 1.0, SeededNoise(0))
    assert out.dtype == np.int64 and out.shape == (4,)
    with pytest.raises(DataError):
        randomized_response(np.array([0, 3]), 3, 1.0, SeededNoise(0))
    with pytest.raises(ConfigError):
        randomized_response(np.array([0, 1]), 2, 0.0, SeededNoise(0))
    with pytest.raises(ConfigError):
        randomized_response(np.array([0, 1]), 2, math.inf, SeededNoise(0))


@settings(max_examples=40, deadline=None)
@given(
    prior=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=8).filter(lambda p: sum(p) > 0.1),
    eps=st.floats(0.05, 8.0),
)
def test_rr_with_prior_is_eps_dp_and_picks_the_best_set(prior: list[float], eps: float) -> None:
    p = np.array(prior) / sum(prior)
    probs = rr_with_prior_probabilities(p, eps)
    assert np.allclose(probs.sum(1), 1.0)
    for o in range(len(p)):
        col = probs[:, o]
        if col.max() > 0:
            assert col.max() <= math.exp(eps) * col.min() * (1 + 1e-9)
    # the chosen k maximises the probability of reporting the true label (under the prior) over all k
    order, ks = rr_with_prior_set_sizes(p[None], eps)
    p_true = float(np.sum(p * np.diag(probs)))
    for k in range(1, len(p) + 1):
        alt = np.sum(np.sort(p)[::-1][:k]) * math.exp(eps) / (math.exp(eps) + k - 1)
        assert p_true >= alt - 1e-12


def test_rr_with_prior_empirical_frequencies() -> None:
    prior = np.array([0.55, 0.3, 0.1, 0.05])
    eps = 1.0
    probs = rr_with_prior_probabilities(prior, eps)
    n = 20_000
    rng = SeededNoise(21)
    for y in range(4):
        out = rr_with_prior(np.full(n, y), np.tile(prior, (n, 1)), eps, rng)
        counts = np.bincount(out, minlength=4)
        nz = probs[y] > 0
        assert np.all(counts[~nz] == 0)
        assert stats.chisquare(counts[nz], probs[y][nz] * n).pvalue > 1e-4


def test_rr_with_uniform_prior_is_plain_rr() -> None:
    for k in (2, 5):
        assert np.allclose(rr_with_prior_probabilities(np.full(k, 1 / k), 2.0), rr_transition_matrix(2.0, k))


def test_rr_with_prior_rejects_bad_priors() -> None:
    with pytest.raises(DataError):
        rr_with_prior(np.array([0, 1]), np.array([[0.5, 0.6], [0.5, 0.5]]), 1.0, SeededNoise(0))
    with pytest.raises(DataError):
        rr_with_prior(np.array([0, 1, 1]), np.array([[0.5, 0.5], [0.5, 0.5]]), 1.0, SeededNoise(0))
