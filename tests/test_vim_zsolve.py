"""VIM's z-update (eqs. 6/16) against an independent solver: scipy's L-BFGS-B on each sample alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize
from scipy.special import expit, logsumexp

from secvfl.algorithms.vim.zsolve import solve_z
from secvfl.errors import TrainingDiverged


def _scipy_z(v: np.ndarray, lam: np.ndarray, y: int, rho: float) -> np.ndarray:
    """argmin_z loss(z, y) - lam^T z + rho/2 ||v - z||^2 for one sample, written from the formula (numpy)."""
    def f(z: np.ndarray) -> tuple[float, np.ndarray]:
        if z.size == 1:  # logistic loss on one logit
            loss, dloss = np.logaddexp(0.0, z[0]) - y * z[0], np.array([expit(z[0]) - y])
        else:
            loss = logsumexp(z) - z[y]
            dloss = np.exp(z - logsumexp(z))
            dloss[y] -= 1
        value = loss - lam @ z + 0.5 * rho * np.sum((v - z) ** 2)
        return value, dloss - lam + rho * (z - v)

    res = minimize(f, v.copy(), jac=True, method="L-BFGS-B", options={"gtol": 1e-10, "ftol": 1e-15, "maxiter": 1000})
    return res.x


@settings(max_examples=30, deadline=None, derandomize=True)
@given(classes=st.sampled_from([1, 2, 3, 10]), batch=st.integers(1, 8), rho=st.floats(0.05, 10.0),
       scale=st.floats(0.1, 20.0), seed=st.integers(0, 2**31 - 1))
def test_z_update_matches_scipy_lbfgsb_per_sample(classes: int, batch: int, rho: float, scale: float, seed: int):
    rng = np.random.default_rng(seed)
    v = rng.normal(scale=scale, size=(batch, classes))
    lam = rng.normal(scale=scale / 4, size=(batch, classes))
    y = rng.integers(0, max(classes, 2), size=batch)
    z, steps = solve_z(torch.as_tensor(v), torch.as_tensor(lam), torch.as_tensor(y), rho)
    expected = np.stack([_scipy_z(v[j], lam[j], int(y[j]), rho) for j in range(batch)])
    np.testing.assert_allclose(z.numpy(), expected, atol=1e-5, rtol=0)
    assert steps <= 50


def test_z_update_of_a_float32_batch_comes_back_in_float32_and_within_tolerance():
    rng = np.random.default_rng(0)
    v = torch.as_tensor(rng.normal(size=(64, 10)), dtype=torch.float32)
    lam = torch.as_tensor(rng.normal(size=(64, 10)), dtype=torch.float32)
    y = torch.as_tensor(rng.integers(0, 10, 64))
    z, _ = solve_z(v, lam, y, 2.0)
    assert z.dtype == torch.float32
    # the optimality condition, recomputed here: p - onehot(y) - lam + rho (z - v) = 0
    z64 = z.double()
    grad = torch.softmax(z64, 1) - torch.nn.functional.one_hot(y, 10) - lam.double() + 2.0 * (z64 - v.double())
    assert float(grad.abs().max()) < 1e-5  # float32 rounding of z, not the solver's tolerance


def test_z_update_refuses_non_finite_inputs_with_one_line():
    v = torch.tensor([[float("nan"), 0.0]], dtype=torch.float64)
    with pytest.raises(TrainingDiverged, match="training diverged: .*non-finite values; lower --vim-lr"):
        solve_z(v, torch.zeros_like(v), torch.tensor([0]), 1.0)
    with pytest.raises(TrainingDiverged, match="non-finite"):
        solve_z(torch.zeros(1, 2), torch.tensor([[float("inf"), 0.0]]), torch.tensor([0]), 1.0)


@pytest.mark.parametrize("size", [1e3, 1e6])
def test_z_update_tolerance_scales_with_its_inputs(size):
    """Huge but finite logits and duals: float64 rounding alone leaves a gradient of ~1e-16 of their size, so an
    absolute 1e-9 can be out of reach; the relative tolerance is reached and the answer matches scipy's."""
    gen = torch.Generator().manual_seed(3)
    v = size * torch.randn(4, 3, generator=gen, dtype=torch.float64)
    lam = size * torch.randn(4, 3, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1])
    z, _ = solve_z(v, lam, y, 2.0)
    vn, ln = v.numpy(), lam.numpy()
    for j in range(4):
        def fg(q, j=j):  # the objective and its exact gradient, in numpy (scipy's reference, not the solver's code)
            onehot = np.eye(3)[int(y[j])]
            f = logsumexp(q) - q @ onehot - ln[j] @ q + (q - vn[j]) @ (q - vn[j])
            return f, np.exp(q - logsumexp(q)) - onehot - ln[j] + 2.0 * (q - vn[j])
        ref = minimize(fg, vn[j] + ln[j] / 2.0, jac=True, method="L-BFGS-B",
                       options={"ftol": 0.0, "gtol": 1e-9 * size, "maxiter": 1000})
        assert np.allclose(z[j].numpy(), ref.x, rtol=1e-9, atol=1e-8 * size)
