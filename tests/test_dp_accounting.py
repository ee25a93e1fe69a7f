"""Accounting: our numbers equal Opacus's, calibration is minimal and never overshoots, regression values hold."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import PRVAccountant, RDPAccountant

from protocols.dp.accounting import (
    DEFAULT_ORDERS,
    GaussianEvent,
    PureDPEvent,
    RdpAccountant,
    SampledGaussianEvent,
    calibrate_noise_multiplier,
    compose,
    epsilon_of,
    gaussian_delta,
    gaussian_epsilon,
    make_accountant,
)
from protocols.dp.config import DPConfig, plan_dp
from secvfl.errors import ConfigError, UnsupportedError


# -- regression: the numbers the issue fixes ------------------------------------------------------------------
@pytest.mark.parametrize("releases, expected", [(20, 6.68), (10, 4.72), (5, 3.34)])
def test_calibrated_multiplier_regression(releases: int, expected: float) -> None:
    sigma = calibrate_noise_multiplier(3.0, 1e-5, releases)
    assert sigma == pytest.approx(expected, abs=0.01)
    # Opacus's own accountant, sample rate 1, agrees that this multiplier spends epsilon 3.00 (and not more)
    acc = RDPAccountant()
    for _ in range(releases):
        acc.step(noise_multiplier=sigma, sample_rate=1.0)
    eps = acc.get_epsilon(1e-5)
    assert eps <= 3.0
    assert eps == pytest.approx(3.0, abs=0.005)


def test_plan_uses_regression_multiplier_for_label_gradient_mechanism() -> None:
    plan = plan_dp(DPConfig(epsilon=3.0, delta=1e-5), n_train=50_000, epochs=20, batch_size=1024, loss="bce")
    assert plan.releases_per_sample == 20
    assert plan.noise_multiplier == pytest.approx(6.68, abs=0.01)
    assert plan.sensitivity == 1.0  # Jacobian clipping for BCE: sensitivity = C


# -- equality with Opacus -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma, steps, delta", [(0.8, 1, 1e-5), (1.1, 30, 1e-6), (6.68, 20, 1e-5), (25.0, 50, 1e-7)])
def test_rdp_epsilon_equals_opacus_rdp_accountant(sigma: float, steps: int, delta: float) -> None:
    opacus = RDPAccountant()
    opacus.history = [(sigma, 1.0, steps)]
    ours_same_orders = RdpAccountant(orders=RDPAccountant.DEFAULT_ALPHAS).compose(GaussianEvent(sigma, steps))
    assert ours_same_orders.get_epsilon(delta) == pytest.approx(opacus.get_epsilon(delta), rel=1e-12)
    # with our extended orders we match Opacus handed the same orders, and are never worse than its defaults
    ours = epsilon_of(GaussianEvent(sigma, steps), delta)
    assert ours == pytest.approx(opacus.get_epsilon(delta, alphas=list(DEFAULT_ORDERS)), rel=1e-12)
    assert ours <= opacus.get_epsilon(delta) + 1e-12


def test_heterogeneous_and_sampled_composition_equals_opacus() -> None:
    opacus = RDPAccountant()
    opacus.history = [(2.0, 1.0, 7), (1.3, 0.01, 300)]
    event = compose(GaussianEvent(2.0, 3), GaussianEvent(2.0, 4), SampledGaussianEvent(1.3, 0.01, 300))
    ours = RdpAccountant(orders=RDPAccountant.DEFAULT_ALPHAS).compose(event)
    assert ours.get_epsilon(1e-5) == pytest.approx(opacus.get_epsilon(1e-5), rel=1e-12)


def test_prv_equals_opacus_prv_and_brackets_exact_gdp() -> None:
    sigma, steps, delta = 6.68, 20, 1e-5
    opacus = PRVAccountant()
    opacus.history = [(sigma, 1.0, steps)]
    import warnings

    import numpy as np

    with warnings.catch_warnings(), np.errstate(divide="ignore"):
        warnings.simplefilter("ignore")
        expected = opacus.get_epsilon(delta)
    prv = epsilon_of(GaussianEvent(sigma, steps), delta, "prv")
    gdp = epsilon_of(GaussianEvent(sigma, steps), delta, "gdp")
    rdp = epsilon_of(GaussianEvent(sigma, steps), delta, "rdp")
    assert prv == pytest.approx(expected, rel=1e-9)
    # PRV reports an upper bound within its eps_error (0.01) of the exact curve; RDP is looser than both.
    assert gdp <= prv <= gdp + 0.02
    assert prv < rdp


def test_gdp_is_exact_for_composed_gaussians() -> None:
    # T releases at multiplier s == one release at s / sqrt(T) (Gaussian DP composition)
    a = epsilon_of(GaussianEvent(6.0, 16), 1e-5, "gdp")
    b = epsilon_of(GaussianEvent(1.5, 1), 1e-5, "gdp")
    assert a == pytest.approx(b, rel=1e-9)
    # the curve is inverted correctly
    mu = 0.7
    eps = gaussian_epsilon(mu, 1e-6)
    assert gaussian_delta(eps, mu) == pytest.approx(1e-6, rel=1e-6)
    # one Gaussian: delta at eps = 0 is the total variation 2 Phi(mu / 2) - 1
    from scipy.stats import norm

    assert gaussian_delta(0.0, 1.0) == pytest.approx(2 * norm.cdf(0.5) - 1, rel=1e-12)


def test_pure_dp_events() -> None:
    acc = make_accountant("rdp").compose(PureDPEvent(1.0), count=3)
    assert acc.get_epsilon(0.0) == pytest.approx(3.0)
    assert acc.get_epsilon(1e-5) <= 3.0
    with pytest.raises(UnsupportedError):
        epsilon_of(PureDPEvent(1.0), 1e-5, "gdp")
    with pytest.raises(UnsupportedError):
        epsilon_of(PureDPEvent(1.0), 1e-5, "prv")


def test_empty_accountant_and_bad_input() -> None:
    assert make_accountant("rdp").get_epsilon(1e-5) == 0.0
    assert make_accountant("gdp").get_epsilon(1e-5) == 0.0
    with pytest.raises(ConfigError, match="unknown DP accountant"):
        make_accountant("moments")
    with pytest.raises(ConfigError):
        GaussianEvent(0.0, 3)
    with pytest.raises(ConfigError):
        GaussianEvent(1.0, -1)
    with pytest.raises(ConfigError):
        make_accountant("rdp").compose(GaussianEvent(1.0)).get_epsilon(1.5)
    with pytest.raises(ConfigError, match="epsilon"):
        calibrate_noise_multiplier(0.0, 1e-5, 10)
    with pytest.raises(ConfigError, match="delta"):
        calibrate_noise_multiplier(1.0, 0.0, 10)


def test_epsilon_grows_with_releases_and_shrinks_with_noise() -> None:
    eps = [epsilon_of(GaussianEvent(5.0, t), 1e-5) for t in (1, 2, 5, 10, 40)]
    assert eps == sorted(eps) and len(set(eps)) == len(eps)
    eps = [epsilon_of(GaussianEvent(s, 10), 1e-5) for s in (1.0, 2.0, 4.0, 8.0)]
    assert eps == sorted(eps, reverse=True)


# -- calibration properties -----------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    releases=st.integers(1, 60),
    target=st.floats(0.2, 20.0),
    delta=st.sampled_from([1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3]),
)
def test_calibration_is_minimal_within_one_percent_and_never_overshoots(releases: int, target: float, delta: float) -> None:
    sigma = calibrate_noise_multiplier(target, delta, releases)
    assert epsilon_of(GaussianEvent(sigma, releases), delta) <= target
    assert epsilon_of(GaussianEvent(sigma * 0.99, releases), delta) > target


@settings(max_examples=8, deadline=None)
@given(releases=st.integers(1, 40), target=st.floats(0.5, 10.0), accountant=st.sampled_from(["gdp", "prv"]))
def test_calibration_other_accountants(releases: int, target: float, accountant: str) -> None:
    sigma = calibrate_noise_multiplier(target, 1e-5, releases, accountant=accountant)
    assert epsilon_of(GaussianEvent(sigma, releases), 1e-5, accountant) <= target
    assert epsilon_of(GaussianEvent(sigma * 0.99, releases), 1e-5, accountant) > target


@settings(max_examples=40, deadline=None)
@given(
    n_train=st.integers(100, 10**6),
    epochs=st.integers(1, 40),
    batch_frac=st.floats(0.001, 1.0),
    target=st.floats(0.25, 16.0),
    delta_scale=st.floats(0.001, 0.99),
    protects=st.sampled_from(["labels", "features"]),
    loss=st.sampled_from(["bce", "ce", "mse"]),
)
def test_plan_never_exceeds_target_epsilon(
    n_train: int, epochs: int, batch_frac: float, target: float, delta_scale: float, protects: str, loss: str
) -> None:
    batch = max(1, int(batch_frac * n_train))
    delta = delta_scale / n_train
    plan = plan_dp(
        DPConfig(epsilon=target, delta=delta, protects=protects), n_train=n_train, epochs=epochs, batch_size=batch,
        loss=loss,
    )
    assert plan.epsilon <= target
    # no amplification: batch size does not enter; one (labels) or two (features) releases per epoch
    assert plan.releases_per_sample == epochs * (1 if protects == "labels" else 2)
    assert epsilon_of(GaussianEvent(plan.noise_multiplier * 0.99, plan.releases_per_sample), delta) > target
    assert math.isfinite(plan.noise_multiplier)
