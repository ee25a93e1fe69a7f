"""Attack metrics: AUC bookkeeping, matched accuracy, reconstruction baselines, DCS."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attacks import AttackResult, MaliciousOptimizer
from attacks.metrics import (
    accuracy,
    best_label_matching,
    dcs,
    majority_rate,
    per_batch_auc,
    random_guess_mse,
    randomized_response_ceiling,
    roc_auc,
)
from secvfl.errors import ConfigError, DataError


def test_roc_auc_perfect_reversed_and_undefined() -> None:
    y = np.array([0, 0, 1, 1])
    assert roc_auc(np.array([0.1, 0.2, 0.8, 0.9]), y) == pytest.approx(1.0, abs=1e-12)
    assert roc_auc(np.array([0.9, 0.8, 0.2, 0.1]), y) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(roc_auc(np.array([0.1, 0.2]), np.array([1, 1])))
    with pytest.raises(DataError, match="binary"):
        roc_auc(np.array([0.1, 0.2]), np.array([0, 2]))


def test_per_batch_auc_skips_single_class_batches_and_summarises() -> None:
    scores = [np.array([0.0, 1.0]), np.array([1.0, 0.0]), np.array([0.3, 0.4])]
    labels = [np.array([0, 1]), np.array([0, 1]), np.array([1, 1])]
    s = per_batch_auc(scores, labels)
    assert s.aucs == pytest.approx([1.0, 0.0], abs=1e-12) and s.skipped == 1
    assert s.mean == pytest.approx(0.5) and s.p95_abs_deviation == pytest.approx(0.5)
    assert s.as_dict()["batches_skipped_single_class"] == 1


def test_dcs_known_values() -> None:
    assert dcs(0.5, 0.8, ap_star=0.5, mp_star=0.8) == pytest.approx(1.0)
    # perfect attack, no utility loss: 1 / (1 + sqrt(0.5 * 0.5^2))
    assert dcs(1.0, 0.8, ap_star=0.5, mp_star=0.8) == pytest.approx(1 / (1 + math.sqrt(0.125)))
    # one-sided: below-chance attacks and better-than-undefended main tasks cost nothing
    assert dcs(0.3, 0.9, ap_star=0.5, mp_star=0.8) == pytest.approx(1.0)
    assert dcs(0.7, 0.6, ap_star=0.5, mp_star=0.8, beta=0.0) == pytest.approx(1 / 1.2)
    with pytest.raises(DataError):
        dcs(float("nan"), 0.5, ap_star=0.5, mp_star=0.5)


@settings(max_examples=60, deadline=None)
@given(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 0.5))
def test_dcs_is_bounded_and_decreases_with_attack_performance(ap, mp, ap_star, mp_star, beta, delta) -> None:
    d = dcs(ap, mp, ap_star=ap_star, mp_star=mp_star, beta=beta)
    assert 0 < d <= 1
    assert dcs(ap + delta, mp, ap_star=ap_star, mp_star=mp_star, beta=beta) <= d + 1e-12


@settings(max_examples=50, deadline=None)
@given(st.permutations(list(range(5))), st.integers(0, 10_000))
def test_best_label_matching_recovers_any_relabelling(perm, seed) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 5, 200)
    clusters = np.asarray(perm)[labels]  # cluster ids are a relabelling of the classes
    mapping = best_label_matching(clusters, labels, 5, 5)
    assert accuracy(mapping[clusters], labels) == pytest.approx(1.0, abs=1e-12)


def test_majority_rate_and_accuracy() -> None:
    assert majority_rate(np.array([0, 0, 0, 1])) == pytest.approx(0.75)
    assert accuracy(np.array([1, 2, 3]), np.array([1, 2, 0])) == pytest.approx(2 / 3)
    with pytest.raises(DataError):
        accuracy(np.array([1]), np.array([1, 2]))


def test_random_guess_mse_matches_monte_carlo() -> None:
    rng = np.random.default_rng(0)
    x = rng.random((2000, 3)) ** 2
    guess = rng.random((200, 2000, 3))
    mc = ((guess - x) ** 2).mean(axis=(0, 1))
    assert np.allclose(random_guess_mse(x), mc, atol=2e-3)
    assert random_guess_mse(np.zeros((1, 1)))[0] == pytest.approx(1 / 3)


def test_randomized_response_ceiling() -> None:
    assert randomized_response_ceiling(3.0) == pytest.approx(0.9526, abs=1e-4)
    assert randomized_response_ceiling(0.0, 4) == pytest.approx(0.25)


def test_attack_result_summary_has_the_contract_keys() -> None:
    r = AttackResult("norm", "attacker: a feature party", ap=0.9, metric="auc", chance=0.5, details={"batches": 3})
    s = r.summary(mp=0.7, mp_star=0.75)
    assert {"attack", "threat_model", "AP", "MP", "chance", "DCS"} <= set(s)
    assert s["DCS"] == pytest.approx(dcs(0.9, 0.7, ap_star=0.5, mp_star=0.75))
    assert r.summary()["DCS"] is None
    assert r.advantage == pytest.approx(0.4)


@pytest.mark.parametrize("scale", ["update", "gradient"])
def test_malicious_optimizer_scales_sgd_steps_by_the_clamped_gradient_ratio(scale: str) -> None:
    import torch

    p = torch.nn.Parameter(torch.zeros(4))
    opt = MaliciousOptimizer(torch.optim.SGD([p], lr=1.0), scale=scale)
    g1 = torch.tensor([1.0, 1.0, 1.0, -2.0])
    g2 = torch.tensor([0.5, -1.0, 10.0, -2.0])
    p.grad = g1.clone()
    opt.step()  # first step: nothing to compare with, plain SGD
    assert torch.allclose(p.detach(), -g1)
    p.grad = g2.clone()
    opt.step()
    ratio = torch.tensor([1.5, 1.0, 5.0, 2.0])  # 1 + g2/g1 = [1.5, 0, 11, 2] clamped to [1, 5]
    assert torch.allclose(p.detach(), -g1 - ratio * g2, atol=1e-5)
    assert opt.last_mean_ratio == pytest.approx(float(ratio.mean()), rel=1e-5)
    with pytest.raises(ConfigError):
        MaliciousOptimizer(torch.optim.SGD([p], lr=1.0), r_min=2, r_max=1)


def test_malicious_optimizer_survives_adams_normalisation() -> None:
    """Adam divides a scaled gradient by its own running scale; scaling the update keeps the acceleration."""
    import torch

    def second_step(scale: str | None) -> torch.Tensor:
        p = torch.nn.Parameter(torch.zeros(3))
        inner = torch.optim.Adam([p], lr=0.1)
        opt = inner if scale is None else MaliciousOptimizer(inner, scale=scale)
        for g in (torch.tensor([1.0, 1.0, -1.0]), torch.tensor([1.0, 1.0, -1.0])):
            before = p.detach().clone()
            p.grad = g.clone()
            opt.step()
        return p.detach() - before

    honest, update, gradient = second_step(None), second_step("update"), second_step("gradient")
    assert torch.allclose(update, 2.0 * honest)  # r = 1 + g/g = 2 on every entry
    assert (gradient.abs() < 1.5 * honest.abs()).all()  # Adam cancels most of a scaled gradient
