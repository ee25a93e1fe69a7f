"""Option validation, the calibrated plan, summary.json's privacy entry and the plain-words statement."""

from __future__ import annotations

import math

import pytest

from protocols.dp.accounting import GaussianEvent, epsilon_of
from protocols.dp.config import DPConfig, default_delta, plan_dp
from protocols.dp.statement import privacy_markdown, privacy_statement, privacy_summary
from secvfl.errors import ConfigError, UnsupportedError

N = 21_000
RUN = {"n_train": N, "epochs": 10, "batch_size": 1024}


@pytest.mark.parametrize(
    "config, match",
    [
        (DPConfig(epsilon=0.0), "--epsilon must be > 0"),
        (DPConfig(epsilon=-1.0), "--epsilon must be > 0"),
        (DPConfig(epsilon=math.nan), "--epsilon must be > 0"),
        (DPConfig(epsilon=math.inf), "--privacy none"),
        (DPConfig(), "--epsilon E"),
        (DPConfig(epsilon=3.0, delta=1.0 / N), "not below 1/N"),
        (DPConfig(epsilon=3.0, delta=0.5), "not below 1/N"),
        (DPConfig(epsilon=3.0, delta=1.5), r"\[0, 1\)"),
        (DPConfig(epsilon=3.0, delta=0.0), "delta > 0"),
        (DPConfig(epsilon=3.0, clip_norm=0.0), "clip-norm"),
        (DPConfig(epsilon=3.0, clip_norm=-2.0), "clip-norm"),
        (DPConfig(epsilon=3.0, mechanism="laplace"), "--dp-mechanism"),
        (DPConfig(epsilon=3.0, protects="everything"), "--dp-protect"),
        (DPConfig(epsilon=3.0, accountant="moments"), "--dp-accountant"),
        (DPConfig(epsilon=3.0, mechanism="rr", protects="features"), "labels only"),
        (DPConfig(epsilon=3.0, mechanism="rr", noise_multiplier=2.0), "no meaning"),
        (DPConfig(noise_multiplier=-1.0), "--noise-multiplier"),
        (DPConfig(epsilon=1e-6), "noise multiplier above"),
    ],
)
def test_refusals_name_the_problem(config: DPConfig, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_dp(config, **RUN)


def test_refuses_batch_larger_than_data_and_jacobian_for_mse() -> None:
    with pytest.raises(ConfigError, match="batch size"):
        plan_dp(DPConfig(epsilon=1.0), n_train=100, epochs=1, batch_size=200)
    with pytest.raises(UnsupportedError, match="Jacobian"):
        plan_dp(DPConfig(epsilon=1.0, clip="jacobian"), **RUN, loss="mse")


def test_default_delta() -> None:
    assert default_delta(1000) == 1e-5
    assert default_delta(1_000_000) == pytest.approx(1e-7)
    plan = plan_dp(DPConfig(epsilon=3.0), **RUN)
    assert plan.delta == pytest.approx(1 / (10 * N))


def test_noise_multiplier_overrides_and_reports_epsilon() -> None:
    plan = plan_dp(DPConfig(noise_multiplier=4.0, delta=1e-5), **RUN)
    assert plan.noise_multiplier == 4.0
    assert plan.epsilon == pytest.approx(epsilon_of(GaussianEvent(4.0, 10), 1e-5))
    over = plan_dp(DPConfig(epsilon=1.0, noise_multiplier=4.0, delta=1e-5), **RUN)
    assert over.epsilon > 1.0 and "MORE than requested" in over.notes[0]


def test_clip_modes_set_the_sensitivity() -> None:
    # default (residual): bounded losses need no clip; other losses clip the residual to C
    assert plan_dp(DPConfig(epsilon=3.0, clip_norm=2.0), **RUN, loss="bce").sensitivity == 1.0
    res_ce = plan_dp(DPConfig(epsilon=3.0, clip_norm=2.0), **RUN, loss="ce")
    assert res_ce.clip_mode == "residual" and res_ce.sensitivity == pytest.approx(math.sqrt(2))
    assert plan_dp(DPConfig(epsilon=3.0, clip_norm=2.0), **RUN, loss="mse").sensitivity == 4.0
    # Jacobian clipping: C; loss-gradient clipping: 2C
    assert plan_dp(DPConfig(epsilon=3.0, clip_norm=2.0, clip="jacobian"), **RUN, loss="bce").sensitivity == 2.0
    assert plan_dp(DPConfig(epsilon=3.0, clip_norm=2.0, clip="jacobian"), **RUN, loss="ce").clip_mode == "softmax"
    assert plan_dp(DPConfig(epsilon=3.0, clip_norm=2.0, clip="gradient"), **RUN).sensitivity == 4.0
    feat = plan_dp(DPConfig(epsilon=3.0, protects="features"), **RUN)
    assert feat.releases_per_sample == 20 and feat.sensitivity == 2.0


def test_accountants_change_the_calibration() -> None:
    rdp = plan_dp(DPConfig(epsilon=3.0, delta=1e-5), **RUN).noise_multiplier
    gdp = plan_dp(DPConfig(epsilon=3.0, delta=1e-5, accountant="gdp"), **RUN).noise_multiplier
    assert rdp == pytest.approx(4.72, abs=0.01)
    assert gdp < rdp  # the exact analysis needs less noise


def test_summary_has_the_required_keys_and_values() -> None:
    plan = plan_dp(DPConfig(epsilon=3.0, clip_norm=0.7, clip="jacobian"), **RUN)
    s = privacy_summary(plan, secure_rng=True)
    for key in ("mechanism", "protects", "epsilon", "delta", "accountant", "noise_multiplier", "clip_norm",
                "neighbouring", "secure_rng"):
        assert key in s
    assert s["mechanism"] == "gradient" and s["protects"] == "labels" and s["accountant"] == "rdp"
    assert s["epsilon"] <= 3.0 and s["clip_norm"] == 0.7 and s["secure_rng"] is True
    assert "label" in s["neighbouring"]
    residual = privacy_summary(plan_dp(DPConfig(epsilon=3.0, clip_norm=0.7), **RUN), secure_rng=True)
    assert residual["clip_norm"] is None and residual["sensitivity"] == 1.0 and residual["clip_mode"] == "residual"
    rr = privacy_summary(plan_dp(DPConfig(epsilon=2.0, mechanism="rr"), **RUN), secure_rng=False)
    assert rr["delta"] == 0.0 and rr["epsilon"] == 2.0 and rr["noise_multiplier"] is None and rr["accountant"] == "pure"


def test_statement_says_what_whom_how_much_and_what_not() -> None:
    plan = plan_dp(DPConfig(epsilon=3.0), **RUN)
    text = privacy_statement(plan, secure_rng=True, algorithm="splitnn")
    for fact in ("label", "feature parties", "epsilon = 3", f"{plan.delta:.3g}", "Renyi", "Not protected",
                 "subsampling", f"{plan.noise_multiplier:.4g}", "cryptographically secure"):
        assert fact in text, fact
    assert "\n" not in text  # one paragraph
    seeded = privacy_statement(plan, secure_rng=False, seed=17)
    assert "WARNING" in seeded and "17" in seeded
    rr = privacy_statement(plan_dp(DPConfig(epsilon=1.0, mechanism="rr"), **RUN), secure_rng=True, n_classes=10)
    assert "randomized response" in rr and "delta = 0" in rr and "9 class" in rr
    feat = privacy_statement(plan_dp(DPConfig(epsilon=1.0, protects="features"), **RUN), secure_rng=True,
                             protected_parties=["bank"])
    assert "bank" in feat and "Not protected: labels" in feat
    md = privacy_markdown(plan, secure_rng=True)
    assert md.startswith("# Privacy statement") and '"noise_multiplier"' in md
