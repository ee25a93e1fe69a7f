"""Label DP by releasing each label once: randomized response with a learned prior (LP-2ST) and ALIBI, the loss the
label party trains on afterwards, and how --dp-mechanism auto chooses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import protocols.dp.staged as staged_module
import secvfl.runner as runner
from protocols.dp.alibi import alibi_noise_scale, alibi_posterior, alibi_soft_labels, laplace
from protocols.dp.choice import RR_PRIOR_MIN_SIGNAL, choose_mechanism
from protocols.dp.rng import SeededNoise
from protocols.dp.staged import TwoStageRR, stage2_epoch_for, stage_split
from protocols.dp.targets import TargetBackward
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError, ProtocolError
from secvfl.runner import build_run, run_training


def _quiet(*_: object) -> None:
    pass


def _dp_layer(run):  # noqa: ANN001, ANN202
    return next(layer for layer in run.net.layers if layer.name == "dp")


def _rr_prior_cfg(**options) -> TrainConfig:
    opts = {"privacy": "dp", "epsilon": 2.0, "dp_mechanism": "rr-prior", "dp_reproducible": True, **options}
    return TrainConfig(dataset="wine", parties=2, epochs=4, batch_size=32, seed=3, device="cpu", options=opts)


def _train_capturing(cfg: TrainConfig) -> tuple[dict, object]:
    runs: list = []
    summary = run_training(cfg, progress=False, log=_quiet, on_build=runs.append)
    return summary, runs[0]


# -- randomized response with a prior (LP-2ST) ------------------------------------------------------------------------
def test_a_stage2_prior_does_not_depend_on_that_samples_label(monkeypatch) -> None:
    """Neighbouring training sets that differ in one part-2 label give that sample the same prior (and every other
    sample the same released label): the prior comes from features and part 1's randomised labels only."""
    cfg = _rr_prior_cfg()
    _, plain = _train_capturing(cfg)
    base = _dp_layer(plain).staged
    row = int(np.flatnonzero(~base.stage1)[0])  # a part-2 sample
    load = runner.load_dataset

    def neighbour(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        data = load(*args, **kwargs)
        data.y_train = data.y_train.copy()
        data.y_train[row] = (data.y_train[row] + 1) % data.n_classes
        return data

    monkeypatch.setattr(runner, "load_dataset", neighbour)
    _, other = _train_capturing(cfg)
    flipped = _dp_layer(other).staged
    assert np.array_equal(flipped.stage1, base.stage1)
    # priors are computed in float32 by the same code on the same inputs: equal to the last bit, compared loosely
    np.testing.assert_allclose(flipped.priors, base.priors, rtol=0, atol=1e-9)
    others = np.setdiff1d(np.arange(base.labels.size), [row])
    assert np.array_equal(flipped.labels[others], base.labels[others])


def test_each_label_is_randomised_exactly_once(monkeypatch) -> None:
    calls: list[tuple[str, int]] = []
    rr, rr_prior = staged_module.randomized_response, staged_module.rr_with_prior

    def counting_rr(labels, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(("rr", len(labels)))
        return rr(labels, *args, **kwargs)

    def counting_rr_prior(labels, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(("rr-prior", len(labels)))
        return rr_prior(labels, *args, **kwargs)

    monkeypatch.setattr(staged_module, "randomized_response", counting_rr)
    monkeypatch.setattr(staged_module, "rr_with_prior", counting_rr_prior)
    summary, run = _train_capturing(_rr_prior_cfg())
    st_ = _dp_layer(run).staged
    n = run.ctx.rows("train")
    assert calls == [("rr", int(st_.stage1.sum())), ("rr-prior", int((~st_.stage1).sum()))]
    assert sum(c for _, c in calls) == n and st_.released.all()
    with pytest.raises(ProtocolError, match="already released"):
        st_.release_stage2(st_.priors, SeededNoise(0))  # a second release is refused
    # the label party trained on the released labels: each row's likelihood peaks at its released label
    targets = run.algorithm.label_party.labels("train").numpy()
    assert np.array_equal(targets.argmax(axis=1), st_.labels)
    assert summary["privacy"]["released"]["stages"]["stage2_released"] is True
    assert summary["privacy"]["epsilon"] == pytest.approx(2.0) and summary["privacy"]["delta"] == 0.0


def _best_set_size(prior: np.ndarray, eps: float) -> int:
    """Brute force over k of sum_{top k} p * e^eps / (e^eps + k - 1) (Ghazi et al., Alg. 2)."""
    top = np.sort(prior)[::-1]
    return 1 + int(np.argmax([top[:k].sum() * math.exp(eps) / (math.exp(eps) + k - 1) for k in range(1, len(top) + 1)]))


@pytest.mark.parametrize("eps", [0.5, 1.5])
def test_stage2_keeps_the_label_with_the_rr_with_prior_probability(eps: float) -> None:
    prior = np.array([0.05, 0.4, 0.3, 0.2, 0.05])
    k = _best_set_size(prior, eps)
    assert 1 < k < 5  # a prior whose best set is a strict, non-trivial subset
    n = 4000
    true = np.full(2 * n, 1)  # class 1 is the prior's most likely class, so it is in the set
    stage1 = np.zeros(2 * n, dtype=bool)
    stage1[:n] = True
    two = TwoStageRR(true, 5, eps, stage1, stage2_epoch=1)
    two.release_stage1(SeededNoise(10))
    two.release_stage2(np.tile(prior, (2 * n, 1)), SeededNoise(11))
    kept = int(np.sum(two.labels[n:] == 1))
    expected = math.exp(eps) / (math.exp(eps) + k - 1)
    assert stats.binomtest(kept, n, expected).pvalue > 1e-3
    # the other reports fall uniformly on the other k - 1 classes of the set, never outside it
    top = set(np.argsort(-prior)[:k].tolist())
    assert set(np.unique(two.labels[n:]).tolist()) <= top
    # stage 1 is plain randomized response: keep probability e^eps / (e^eps + 4)
    kept1 = int(np.sum(two.labels[:n] == 1))
    assert stats.binomtest(kept1, n, math.exp(eps) / (math.exp(eps) + 4)).pvalue > 1e-3


def test_rr_prior_state_is_reused_on_resume_and_never_holds_true_labels() -> None:
    cfg = _rr_prior_cfg()
    _, done = _train_capturing(cfg)
    state = _dp_layer(done).state_dict()["rr_prior"]
    assert set(state) == {"labels", "stage1", "priors", "stage2_epoch"}  # released values only, no true labels
    fresh = build_run(cfg)  # a resumed run: a fresh stage 1 first, then the saved releases come back
    layer = _dp_layer(fresh)
    layer.load_state_dict(_dp_layer(done).state_dict())
    assert np.array_equal(layer.staged.labels, _dp_layer(done).staged.labels)
    assert layer.staged.stage2_done
    installed = fresh.algorithm.label_party.labels("train").numpy()
    np.testing.assert_allclose(installed, done.algorithm.label_party.labels("train").numpy(), atol=1e-7)
    before = layer.staged.labels.copy()
    torch.manual_seed(0)
    fresh.algorithm.train_epoch(cfg.epochs - 1)  # resumed in stage 2: trains, releases nothing again
    assert np.array_equal(layer.staged.labels, before)


def test_stage_split_is_label_independent_and_stage2_starts_half_way() -> None:
    a, b = stage_split(100, 0.3, seed=1), stage_split(100, 0.3, seed=1)
    assert np.array_equal(a, b) and a.sum() == 30
    assert not np.array_equal(a, stage_split(100, 0.3, seed=2))
    assert stage2_epoch_for(2) == 1 and stage2_epoch_for(10) == 5 and stage2_epoch_for(5) == 3
    with pytest.raises(ConfigError, match="--epochs >= 2"):
        stage2_epoch_for(1)
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        stage_split(10, 1.0, seed=0)


# -- the loss on released targets -------------------------------------------------------------------------------------
def test_likelihood_targets_reduce_to_cross_entropy_and_skip_unreleased_rows() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(3, 4).double()
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 1, 2, 0, 1])
    targets = torch.nn.functional.one_hot(labels, 4).double()
    targets[4:] = 0.0  # two rows not released yet
    rule = TargetBackward(likelihood=True)
    loss = rule(head, lambda xs: head(xs[0]), [x], targets, lambda *_: None)
    # reference: plain cross-entropy over the released rows only, in float64
    ref_x = x.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(head(ref_x[:4]), labels[:4])
    grad_ref = torch.autograd.grad(ref, ref_x)[0]
    assert loss == pytest.approx(float(ref.detach()), rel=1e-12)
    torch.testing.assert_close(x.grad, grad_ref, rtol=1e-10, atol=1e-12)
    assert torch.all(x.grad[4:] == 0)  # unreleased rows send zero gradient rows
    assert rule.pending_release and rule.rows_trained == 4


def test_likelihood_loss_is_the_log_likelihood_of_the_reported_label() -> None:
    eps, k = 1.0, 3
    keep, other = math.exp(eps) / (math.exp(eps) + k - 1), 1 / (math.exp(eps) + k - 1)
    logits = torch.tensor([[0.3, -1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    lik = torch.tensor([[other, keep, other]], dtype=torch.float64)  # label 1 reported
    loss = TargetBackward(likelihood=True)(None, lambda xs: xs[0], [logits], lik, lambda *_: None)
    p = torch.softmax(logits.detach(), dim=1)[0].numpy()
    assert loss == pytest.approx(-math.log(other * p[0] + keep * p[1] + other * p[2]), rel=1e-12)


def test_binary_targets_use_the_single_logit() -> None:
    z = torch.tensor([[0.7], [-1.2]], dtype=torch.float64, requires_grad=True)
    soft = torch.tensor([[0.2, 0.8], [1.0, 0.0]], dtype=torch.float64)
    loss = TargetBackward()(None, lambda xs: xs[0], [z], soft, lambda *_: None)
    ref = torch.nn.functional.binary_cross_entropy_with_logits(z.detach()[:, 0], soft[:, 1])
    assert loss == pytest.approx(float(ref), rel=1e-12)


def test_training_on_true_labels_is_refused() -> None:
    head = torch.nn.Linear(2, 3)
    with pytest.raises(ProtocolError, match="not the released targets"):
        TargetBackward()(head, lambda xs: head(xs[0]), [torch.randn(4, 2)], torch.tensor([0, 1, 2, 0]), lambda *_: None)


# -- ALIBI --------------------------------------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(eps=st.floats(0.05, 20.0), k=st.integers(2, 12), seed=st.integers(0, 2**31 - 1))
def test_alibi_posterior_is_a_distribution(eps: float, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    noisy = np.eye(k)[rng.integers(0, k, 20)] + rng.laplace(0, 2 / eps, (20, k)) * rng.uniform(0, 5)
    post = alibi_posterior(noisy, eps)
    assert np.all(post >= 0) and np.all(np.isfinite(post))
    np.testing.assert_allclose(post.sum(axis=1), 1.0, rtol=0, atol=1e-12)


def test_alibi_posterior_is_bayes_rule_under_laplace_noise() -> None:
    eps, k = 1.3, 4
    b = 2 / eps
    rng = np.random.default_rng(0)
    noisy = np.eye(k)[rng.integers(0, k, 50)] + rng.laplace(0, b, (50, k))
    # reference: product of scipy Laplace densities of o - e_y over coordinates, normalised over y (uniform prior)
    like = np.array([[np.prod(stats.laplace.pdf(o - np.eye(k)[y], scale=b)) for y in range(k)] for o in noisy])
    np.testing.assert_allclose(alibi_posterior(noisy, eps), like / like.sum(axis=1, keepdims=True), rtol=1e-9)


def test_laplace_draws_have_the_calibrated_scale() -> None:
    eps = 2.0
    assert alibi_noise_scale(eps) == pytest.approx(1.0)  # one-hot L1 sensitivity 2 over epsilon
    draws = laplace(SeededNoise(5), 40_000, alibi_noise_scale(eps))
    assert stats.kstest(draws, stats.laplace(scale=1.0).cdf).pvalue > 1e-3


@settings(max_examples=60, deadline=None)
@given(eps=st.floats(0.1, 10.0), k=st.integers(2, 8), y=st.integers(0, 7), y2=st.integers(0, 7),
       o=st.lists(st.floats(-20, 20), min_size=8, max_size=8))
def test_alibi_density_ratio_is_bounded_by_e_to_the_epsilon(eps: float, k: int, y: int, y2: int, o: list[float]) -> None:
    """The noise scale gives epsilon-DP: for any output, two labels' densities differ by at most e^eps."""
    b = alibi_noise_scale(eps)
    out = np.array(o[:k])
    log_ratio = (np.abs(out - np.eye(k)[y2 % k]).sum() - np.abs(out - np.eye(k)[y % k]).sum()) / b
    assert log_ratio <= eps * (1 + 1e-9)


def test_alibi_soft_labels_match_an_independent_simulation() -> None:
    """End to end: the mean posterior of the true class equals a simulation with numpy's Laplace at scale 2/eps."""
    eps, k, n = 1.0, 3, 20_000
    y = np.zeros(n, dtype=np.int64)
    mine = alibi_soft_labels(y, k, eps, SeededNoise(8))[:, 0]
    rng = np.random.default_rng(1)
    ref = alibi_posterior(np.eye(k)[y] + rng.laplace(0, 2 / eps, (n, k)), eps)[:, 0]
    assert stats.ks_2samp(mine, ref).pvalue > 1e-3
    assert abs(mine.mean() - ref.mean()) < 4 * ref.std() / math.sqrt(n) * math.sqrt(2)


def test_alibi_runs_releases_once_and_resumes_with_the_same_soft_labels() -> None:
    cfg = TrainConfig(dataset="wine", parties=2, epochs=2, batch_size=32, device="cpu",
                      options={"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "alibi"})
    summary, run = _train_capturing(cfg)
    assert summary["privacy"]["mechanism"] == "alibi" and summary["privacy"]["delta"] == 0.0
    soft = run.algorithm.label_party.labels("train").numpy()
    assert soft.shape == (run.ctx.rows("train"), 3)
    np.testing.assert_allclose(soft.sum(axis=1), 1.0, atol=1e-5)
    again = build_run(cfg)
    _dp_layer(again).load_state_dict(_dp_layer(run).state_dict())
    np.testing.assert_allclose(again.algorithm.label_party.labels("train").numpy(), soft, atol=1e-7)


# -- auto ---------------------------------------------------------------------------------------------------------------
def test_auto_chooses_per_task() -> None:
    common = {"protects": "labels", "epochs": 10}
    assert choose_mechanism(**common, n_classes=2, epsilon=3.0, n_train=20_000)[0] == "rr"
    assert choose_mechanism(**common, n_classes=10, epsilon=3.0, n_train=50_000)[0] == "rr-prior"
    # too little signal for a learned prior: n * (keep - 1/K) below the threshold
    small = choose_mechanism(**common, n_classes=10, epsilon=1.0, n_train=1300)
    keep = math.exp(1.0) / (math.exp(1.0) + 9)
    assert 1300 * (keep - 0.1) < RR_PRIOR_MIN_SIGNAL and small[0] == "rr"
    assert choose_mechanism(protects="labels", epochs=1, n_classes=10, epsilon=3.0, n_train=50_000)[0] == "rr"
    assert choose_mechanism(protects="features", epochs=10, n_classes=2, epsilon=3.0, n_train=10)[0] == "gradient"
    forced = choose_mechanism(**common, n_classes=10, epsilon=3.0, n_train=50_000, gradient_flags=["--dp-clip"])
    assert forced[0] == "gradient" and "--dp-clip" in forced[1]
    no_backward = choose_mechanism(**common, n_classes=10, epsilon=3.0, n_train=50_000, backward_pass=False)
    assert no_backward[0] == "rr" and "no gradients" in no_backward[1]


@pytest.mark.parametrize(
    "dataset, options, expected",
    [
        ("breast_cancer", {}, "rr"),
        ("digits", {}, "rr-prior"),
        ("digits", {"epsilon": 1.0}, "rr"),
        ("digits", {"dp_clip": "jacobian"}, "gradient"),
        ("breast_cancer", {"dp_protect": "features"}, "gradient"),
        ("digits", {"algo": "vimadmm"}, "rr"),  # sends duals, not gradients: rr-prior would be refused
    ],
)
def test_the_run_uses_and_states_what_auto_chose(dataset: str, options: dict, expected: str) -> None:
    options = dict(options)
    algo = options.pop("algo", "splitnn")
    run = build_run(TrainConfig(algo=algo, dataset=dataset, epochs=2, device="cpu",
                                options={"privacy": "dp", "epsilon": 3.0, **options}))
    plan = _dp_layer(run).plan
    assert plan.mechanism == expected and plan.config.auto_reason
    from protocols.dp.statement import privacy_statement

    text = privacy_statement(plan, secure_rng=True, n_classes=run.ctx.data.n_classes)
    assert "Mechanism chosen by --dp-mechanism auto (the default)" in text and plan.config.auto_reason in text


def test_digits_at_epsilon_3_with_the_default_settings_stays_useful() -> None:
    """The issue's headline command (digits, 10 classes, default epochs): was 0.29 with the gradient mechanism."""
    s = run_training(TrainConfig(device="cpu", threads=1, options={"privacy": "dp", "epsilon": 3.0,
                                                                    "dp_reproducible": True}),
                     progress=False, log=_quiet)
    assert s["dataset"] == "digits" and s["privacy"]["target_epsilon"] == 3.0
    assert s["metrics"]["test"]["accuracy"] >= 0.85
    assert "utility_warning" not in s["privacy"]


# -- the utility-collapse warning ---------------------------------------------------------------------------------------
def test_a_collapsed_run_says_so_with_the_reason_and_what_to_change(tmp_path) -> None:
    lines: list[str] = []
    cfg = TrainConfig(epochs=2, device="cpu", threads=1,
                      options={"privacy": "dp", "epsilon": 0.3, "dp_mechanism": "gradient", "dp_reproducible": True})
    s = run_training(cfg, out=tmp_path / "r", progress=False, log=lines.append)
    y_test = build_run(cfg).ctx.data.y_test
    chance = np.bincount(y_test).max() / len(y_test)
    assert s["metrics"]["test"]["accuracy"] < chance + 0.05  # the model is useless ...
    warning = s["privacy"]["utility_warning"]  # ... and the run says so, in summary.json and at the end of its output
    assert warning.startswith("WARNING: utility collapsed") and f"majority class scores {chance:.3f}" in warning
    assert "gradient mechanism" in warning and "--dp-mechanism auto" in warning and "--epsilon" in warning
    assert lines[-1].endswith(warning)
    assert '"utility_warning"' in (tmp_path / "r" / "summary.json").read_text()


def test_collapse_thresholds() -> None:
    from protocols.dp.collapse import chance_accuracy, utility_collapse
    from protocols.dp.config import DPConfig, plan_dp

    plan = plan_dp(DPConfig(mechanism="rr", epsilon=0.5), n_train=200, epochs=2, batch_size=32)
    assert chance_accuracy(np.array([0, 0, 0, 1])) == pytest.approx(0.75)
    low = utility_collapse({"auc": 0.53, "accuracy": 0.8}, 0.8, plan, 2)
    assert low is not None and "test AUC 0.530" in low and "probability about 0.62" in low  # e^.5/(1+e^.5)
    assert utility_collapse({"auc": 0.56, "accuracy": 0.8}, 0.8, plan, 2) is None
    assert utility_collapse({"accuracy": 0.14}, 0.1, plan, 10) is not None
    assert utility_collapse({"accuracy": 0.16}, 0.1, plan, 10) is None


# -- kill -9 and --resume: the released labels come back, nothing is released twice -------------------------------------
RESUME_FLAGS = ["--dataset", "wine", "--parties", "2", "--epochs", "4", "--batch-size", "64", "--privacy", "dp",
                "--epsilon", "2", "--dp-reproducible", "--no-progress", "--threads", "1", "--device", "cpu"]


@pytest.mark.parametrize(
    "mechanism, kill_at",
    [
        ("rr-prior", 7),  # wine: 2 batches per epoch; stage 2 starts at epoch 3, so this resumes inside stage 2
        pytest.param("rr-prior", 3, marks=pytest.mark.slow),  # resumes in stage 1: stage 2 happens after the resume
        pytest.param("alibi", 5, marks=pytest.mark.slow),
    ],
)
def test_a_killed_and_resumed_run_ends_as_an_uninterrupted_one(mechanism: str, kill_at: int, tmp_path) -> None:
    import json
    import os
    import signal
    import subprocess
    import sys

    from secvfl.cli.main import main
    from secvfl.runner import KILL_AT_BATCH_ENV

    flags = [*RESUME_FLAGS, "--dp-mechanism", mechanism]
    assert main(["train", *flags, "--out", str(tmp_path / "full")]) == 0
    env = {**{k: v for k, v in os.environ.items() if k != KILL_AT_BATCH_ENV}, "OMP_NUM_THREADS": "1"}

    def train(args: list[str], extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "secvfl.cli.main", "train", *args], capture_output=True,
                              text=True, env={**env, **extra}, timeout=300)

    killed = train([*flags, "--out", str(tmp_path / "cut")], {KILL_AT_BATCH_ENV: str(kill_at)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = train(["--resume", str(tmp_path / "cut"), "--no-progress"], {})
    assert resumed.returncode == 0, resumed.stderr
    full, cut = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "cut"))
    assert cut["metrics"]["test"] == pytest.approx(full["metrics"]["test"], abs=1e-12)
    assert cut["comm"]["bytes_total"] == full["comm"]["bytes_total"]  # the stage-2 prior pass happened once
    assert cut["privacy"]["released"] == full["privacy"]["released"]
