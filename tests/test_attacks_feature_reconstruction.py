"""Feature reconstruction: equation solving recovers exactly where it must; GRN beats random guessing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from attacks import (
    EquationSolving,
    GenerativeRegressionNetwork,
    GRNConfig,
    score_reconstruction,
    solve_linear_features,
    train_generator,
)
from secvfl.errors import ConfigError, DataError


def lr_model(n_out: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n_out, d)), rng.normal(size=n_out)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize(("n_classes", "d_target"), [(5, 4), (5, 2), (3, 2)])
def test_equation_solving_recovers_softmax_features_exactly(n_classes: int, d_target: int) -> None:
    rng = np.random.default_rng(n_classes + d_target)
    d_adv = 3
    w, b = lr_model(n_classes, d_adv + d_target, seed=1)
    x = rng.random((200, d_adv + d_target))
    adv, tgt = list(range(d_adv)), list(range(d_adv, d_adv + d_target))
    scores = softmax(x @ w.T + b)
    sol = solve_linear_features(w, b, x[:, adv], scores, adv, tgt)
    assert sol.exact and sol.unknowns == d_target and sol.equations == n_classes - 1
    assert np.abs(sol.x_target - x[:, tgt]).max() < 1e-6


def test_equation_solving_binary_sigmoid_and_interleaved_columns() -> None:
    rng = np.random.default_rng(0)
    w, b = lr_model(1, 5, seed=2)
    x = rng.random((100, 5))
    adv, tgt = [0, 1, 3, 4], [2]  # the target party's column sits between the attacker's
    p = 1 / (1 + np.exp(-(x @ w.T + b)))
    res = EquationSolving().run(weight=w, bias=b, x_adv=x[:, adv], scores=p[:, 0], adv_columns=adv,
                                target_columns=tgt, target_features=x[:, tgt], bounds=(0.0, 1.0))
    assert res.details["exact"] and res.details["max_abs_error"] < 1e-6
    assert res.ap == pytest.approx(1.0, abs=1e-10) and res.chance < 0.9


def test_equation_solving_from_logits_uses_every_output() -> None:
    rng = np.random.default_rng(1)
    w, b = lr_model(3, 5, seed=3)
    x = rng.random((50, 5))
    sol = solve_linear_features(w, b, x[:, :2], x @ w.T + b, [0, 1], [2, 3, 4], scores_are="logits")
    assert sol.exact and np.abs(sol.x_target - x[:, 2:]).max() < 1e-6


def test_equation_solving_is_not_exact_when_unknowns_outnumber_equations() -> None:
    rng = np.random.default_rng(2)
    w, b = lr_model(3, 6, seed=4)
    x = rng.random((100, 6))
    sol = solve_linear_features(w, b, x[:, :2], softmax(x @ w.T + b), [0, 1], [2, 3, 4, 5])
    assert not sol.exact and sol.rank == 2
    assert np.abs(sol.x_target - x[:, 2:]).max() > 1e-2


def test_equation_solving_rejects_mismatched_inputs() -> None:
    w, b = lr_model(3, 4, seed=0)
    with pytest.raises(DataError, match="partition"):
        solve_linear_features(w, b, np.zeros((2, 2)), np.full((2, 3), 1 / 3), [0, 1], [1, 2])
    with pytest.raises(DataError, match="outputs"):
        solve_linear_features(w, b[:2], np.zeros((2, 2)), np.full((2, 3), 1 / 3), [0, 1], [2, 3])


class TwoPartyModel(nn.Module):
    """A white-box trained model on (attacker features, target features) with softmax scores."""

    def __init__(self, d_adv: int, d_target: int, n_out: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d_adv + d_target, 16), nn.Tanh(), nn.Linear(16, n_out))

    def forward(self, x_adv: torch.Tensor, x_target: torch.Tensor) -> torch.Tensor:
        return torch.softmax(3 * self.net(torch.cat([x_adv, x_target], dim=1)), dim=1)


def grn_case(correlated: bool, seed: int = 0) -> tuple[TwoPartyModel, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    model = TwoPartyModel(3, 3, n_out=6, seed=seed)
    x_adv = rng.random((512, 3)).astype(np.float32)
    if correlated:  # the target party's features are a smooth (unknown to the attacker) function of x_adv
        mix = rng.normal(size=(3, 3))
        x_t = (1 / (1 + np.exp(-2 * (x_adv - 0.5) @ mix))).astype(np.float32)
    else:
        x_t = rng.random((512, 3)).astype(np.float32)
    with torch.no_grad():
        scores = model(torch.as_tensor(x_adv), torch.as_tensor(x_t)).numpy()
    return model, x_adv, x_t, scores


def test_grn_recovers_correlated_features_from_scores_alone() -> None:
    model, x_adv, x_t, scores = grn_case(correlated=True)
    before = [p.detach().clone() for p in model.parameters()]
    res = GenerativeRegressionNetwork(GRNConfig(epochs=40, batch_size=64, lr=3e-3, variance_penalty=0.0)).run(
        model=model, x_adv=x_adv, scores=scores, target_features=x_t, bounds=(0.0, 1.0))
    assert res.details["mse"] < 0.05 * res.details["random_guess_mse"]
    assert res.details["mse"] < 0.1 * res.details["constant_half_mse"]
    assert res.ap > res.chance
    # the attacked model is untouched, left trainable, and has no stray gradients
    assert all(torch.equal(a, p) and p.requires_grad for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_grn_on_independent_features_needs_the_scores_as_input() -> None:
    # Luo et al.'s G(x_adv, z) cannot tell rows with the same x_adv apart: with independent features it can only
    # learn the conditional mean. Feeding it the observed scores (same threat model) lets it invert per row.
    model, x_adv, x_t, scores = grn_case(correlated=False)
    cfg = GRNConfig(epochs=40, batch_size=64, lr=3e-3, variance_penalty=0.0)
    paper = GenerativeRegressionNetwork(cfg).run(model=model, x_adv=x_adv, scores=scores, target_features=x_t,
                                                 bounds=(0.0, 1.0))
    assert paper.details["mse"] == pytest.approx(paper.details["constant_half_mse"], rel=0.15)
    conditioned = GenerativeRegressionNetwork(replace(cfg, condition_on_scores=True)).run(
        model=model, x_adv=x_adv, scores=scores, target_features=x_t, bounds=(0.0, 1.0))
    assert conditioned.details["mse"] < 0.5 * paper.details["mse"]


def test_grn_variance_penalty_trades_fit_for_spread() -> None:
    # The penalty pulls reconstructions together: a heavy one collapses them towards a constant (the least spread
    # reconstruction), where the unpenalised generator spreads them like the true features.
    model, x_adv, x_t, scores = grn_case(correlated=True)
    spread = {}
    for lam in (0.0, 100.0):
        rec, _ = train_generator(model, x_adv, scores, 3, bounds=(0.0, 1.0),
                                 config=GRNConfig(epochs=15, batch_size=64, lr=3e-3, variance_penalty=lam))
        spread[lam] = float(rec.std(axis=0).mean())
    assert spread[0.0] > 0.5 * float(x_t.std(axis=0).mean())
    assert spread[100.0] < 0.3 * spread[0.0]
    with pytest.raises(ConfigError):
        GRNConfig(variance_penalty=-1.0)


def test_grn_learns_nothing_from_scores_that_ignore_the_target() -> None:
    """If the scores do not depend on the target features, the generator has nothing to fit: no better than 0.5."""
    rng = np.random.default_rng(1)

    def blind(x_adv: torch.Tensor, x_target: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x_adv.sum(dim=1, keepdim=True)) + 0 * x_target.sum(dim=1, keepdim=True)

    x_adv = rng.random((256, 2)).astype(np.float32)
    x_t = rng.random((256, 2)).astype(np.float32)
    scores = blind(torch.as_tensor(x_adv), torch.as_tensor(x_t)).numpy()
    res = GenerativeRegressionNetwork(GRNConfig(epochs=5)).run(model=blind, x_adv=x_adv, scores=scores,
                                                               target_features=x_t, bounds=(0.0, 1.0))
    assert res.details["mse"] >= 0.8 * res.details["constant_half_mse"]


def test_reconstruction_is_scored_in_unit_scale() -> None:
    truth = np.array([[0.0, 10.0], [2.0, 30.0]])
    s = score_reconstruction(truth, truth)
    assert s["mse"] == pytest.approx(0.0, abs=1e-12) and s["ap"] == pytest.approx(1.0, abs=1e-12)
    s = score_reconstruction(np.array([[2.0, 30.0], [0.0, 10.0]]), truth)
    assert s["mse"] == pytest.approx(1.0, abs=1e-12)  # every value off by the full range
    with pytest.raises(DataError):
        score_reconstruction(truth[:, :1], truth)
