"""VIMADMM and VIMADMM-J against references written from the paper's equations, missing feature blocks, party
importance and exact resume from a checkpoint."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from scipy.special import expit, logsumexp

from secvfl.algorithms.vim.parties import ADMMFeatureParty, _LocalSteps
from secvfl.config import TrainConfig
from secvfl.messages import Message, decode, encode
from secvfl.runner import build_run, run_training

RHO = {"vimadmm": 2.0, "vimadmm-j": 0.5}
LR, BETA, MOMENTUM, STEPS = 0.05, 0.005, 0.9, 3


def _config(algo: str, **kw) -> TrainConfig:
    # the step size and weight decay are given: the reference below computes with LR and BETA, whatever the defaults
    options = {"vim_lr": LR, "vim_beta": BETA, **({"vim_local_steps": STEPS} if algo != "vimsgd" else {})}
    options.update(kw.pop("options", {}))
    base = dict(algo=algo, dataset="wine", parties=2, epochs=1, batch_size=1000, val_fraction=0.2, seed=1,
                dtype="float64", device="cpu", options=options)
    return TrainConfig(**{**base, **kw})


def _z(v: np.ndarray, lam: np.ndarray, y: np.ndarray, rho: float) -> np.ndarray:
    """eq. 6 sample by sample with scipy's L-BFGS-B (the paper's solver)."""
    out = []
    for vj, lj, yj in zip(v, lam, y, strict=True):
        def f(z, vj=vj, lj=lj, yj=int(yj)):
            if z.size == 1:
                loss, d = np.logaddexp(0, z[0]) - yj * z[0], np.array([expit(z[0]) - yj])
            else:
                loss, d = logsumexp(z) - z[yj], np.exp(z - logsumexp(z)) - np.eye(z.size)[yj]
            return loss - lj @ z + rho / 2 * np.sum((vj - z) ** 2), d - lj + rho * (z - vj)
        out.append(minimize(f, vj.copy(), jac=True, method="L-BFGS-B", options={"gtol": 1e-11, "ftol": 1e-16}).x)
    return np.stack(out)


def _momentum_sgd(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list, lr: float) -> None:
    """torch.optim.SGD(momentum, weight_decay) written out: g += beta p; buf = g, then momentum buf + g; p -= lr buf."""
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        g = g + BETA * p.detach()
        buffers[i] = g if buffers[i] is None else MOMENTUM * buffers[i] + g
        p.data -= lr * buffers[i]


def _objective(out: torch.Tensor, lam: torch.Tensor, s: torch.Tensor, rho: float, anchor: torch.Tensor | None = None,
               gamma: float = 0.0) -> torch.Tensor:
    value = (lam * out).sum(1) + rho / 2 * ((s - out) ** 2).sum(1)
    if anchor is not None:  # the proximal Jacobian term (Deng et al. 2017)
        value = value + gamma / 2 * ((out - anchor) ** 2).sum(1)
    return value.mean()


@pytest.mark.parametrize(("algo", "prox", "residual"), [
    ("vimadmm", 0.0, "new-heads"), ("vimadmm", 0.5, "new-heads"), ("vimadmm", 0.0, "round-start"),
    ("vimadmm-j", 0.0, None), ("vimadmm-j", 0.5, None)])
def test_one_round_matches_the_papers_equations(algo: str, prox: float, residual: str | None) -> None:
    """One round (the whole training split is one batch) against eqs. 6-10 (vimadmm) or 16-20 (vimadmm-j), with
    the z-update by scipy, the head step and the parties' momentum SGD written out here, in float64. ``prox`` C > 0
    adds gamma/2 ||o - o_0||^2, gamma = C (M - 1) rho, to the parties' local objectives (o_0: the output when the
    round began, with the round's new head for vimadmm). ``residual`` round-start: eq. 9 with the heads W^t."""
    options = {"vim_prox": prox} if prox else {}
    if residual is not None:
        options["vim_residual"] = residual
    run = build_run(_config(algo, options=options))
    gamma = prox * (2 - 1) * RHO[algo]
    alg, rho = run.algorithm, RHO[algo]
    models = [copy.deepcopy(fp.model) for fp in alg.feature_parties]
    heads = copy.deepcopy(alg.label_party.head)
    ids = next(iter(alg.schedule.batches(0)))
    xs = [torch.as_tensor(run.ctx.partition.take(run.ctx.data.X_train, k)[ids], dtype=torch.float64) for k in range(2)]
    y = run.ctx.data.y_train[ids]
    run.net.start_epoch(0)
    alg.train_epoch(0)

    with torch.no_grad():
        if algo == "vimadmm":
            hs = [m(x) for m, x in zip(models, xs, strict=True)]
            v = sum(h @ w for h, w in zip(hs, heads.weights, strict=True)) + heads.bias
        else:
            v = sum(m(x) for m, x in zip(models, xs, strict=True))
    z = torch.as_tensor(_z(v.numpy(), np.zeros_like(v.numpy()), y, rho))
    lam = rho * (v - z)
    np.testing.assert_allclose(alg.label_party.lam[torch.as_tensor(ids)].numpy(), lam.numpy(), atol=1e-7)
    if algo == "vimadmm":
        g_out = (lam + rho * (v - z)) / len(ids)  # d/d(output) of mean_j lam_j^T out_j + rho/2 ||out_j - z_j||^2
        weights = [w.detach() - LR * (h.T @ g_out + BETA * w.detach()) for h, w in zip(hs, heads.weights, strict=True)]
        bias = heads.bias.detach() - LR * (g_out.sum(0) + BETA * heads.bias.detach())
        for w, got in zip(weights, alg.label_party.head.weights, strict=True):
            np.testing.assert_allclose(got.detach().numpy(), w.numpy(), atol=1e-7)
        if residual == "round-start":  # the heads the round began with (v is their output)
            residuals = [z - (v - h @ w) for h, w in zip(hs, heads.weights, strict=True)]
        else:
            full = sum(h @ w for h, w in zip(hs, weights, strict=True)) + bias
            residuals = [z - (full - h @ w) for h, w in zip(hs, weights, strict=True)]  # eq. 9
    else:
        with torch.no_grad():
            own = [m(x) for m, x in zip(models, xs, strict=True)]
        residuals = [z - v + o for o in own]  # eq. 18: z - sum_{i != k} o^i
    for k, (model, x) in enumerate(zip(models, xs, strict=True)):
        if algo == "vimadmm":
            params = list(model.parameters())
            buffers: list = [None] * len(params)
            with torch.no_grad():
                anchor = model(x) @ weights[k]
            for _ in range(STEPS):
                out = model(x) @ weights[k]
                objective = _objective(out, lam, residuals[k], rho, anchor, gamma)
                _momentum_sgd(params, torch.autograd.grad(objective, params), buffers, LR)
        else:
            bottom, head = model[0], model[1]
            pb, ph = list(bottom.parameters()), list(head.parameters())
            bb: list = [None] * len(pb)
            bh: list = [None] * len(ph)
            anchor = own[k]
            for _ in range(STEPS):  # eq. 19 on the head with the bottom fixed, then eq. 20 with the new head
                h = bottom(x).detach()
                objective = _objective(head(h), lam, residuals[k], rho, anchor, gamma)
                _momentum_sgd(ph, torch.autograd.grad(objective, ph), bh, LR)
                objective = _objective(head(bottom(x)), lam, residuals[k], rho, anchor, gamma)
                _momentum_sgd(pb, torch.autograd.grad(objective, pb), bb, LR)
        for p, got in zip(model.parameters(), alg.feature_parties[k].model.parameters(), strict=True):
            np.testing.assert_allclose(got.detach().numpy(), p.detach().numpy(), atol=1e-7)


def _guarded_quadratic_round(a: float, lr: float) -> tuple[torch.nn.Parameter, torch.optim.SGD, _LocalSteps]:
    """20 safeguarded heavy-ball steps (momentum 0.9) on f(p) = a/2 p^2 from p = 1, the round then restored."""
    p = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=lr, momentum=0.9)
    steps = _LocalSteps(opt)
    for _ in range(20):
        opt.zero_grad()
        value = a / 2 * (p ** 2).sum()
        value.backward()
        steps.step(float(value.detach()))
    steps.restore()
    return p, opt, steps


def test_local_steps_restart_momentum_and_halve_the_step_when_the_objective_blows_up() -> None:
    """f(p) = a/2 p^2 with lr * a = 5 (heavy ball is stable below 2 (1 + momentum) = 3.8): plain SGD with momentum
    blows up (checked here, so the test has power); the safeguarded steps (momentum reset, step halved when f more
    than doubles) end below the start, and the configured step size is back after the round."""
    a, lr = 2.0, 2.5
    start = a / 2  # f at p = 1
    p, opt, steps = _guarded_quadratic_round(a, lr)
    assert float(a / 2 * p.detach() ** 2) < start
    assert steps.restarts >= 1 and opt.param_groups[0]["lr"] == pytest.approx(lr)

    q, buf = 1.0, 0.0  # the same 20 steps without the safeguard
    for _ in range(20):
        buf = 0.9 * buf + a * q
        q -= lr * buf
    assert a / 2 * q * q > 1e6 * start


def test_local_steps_undo_a_step_that_blows_the_objective_up() -> None:
    """f(p) = a/2 p^2 with lr * a = 50, far beyond what any data set's curvature allows at the default step size: each
    blown-up step is undone (the parameters go back to where the objective was last measured) and the step halved,
    until it is small enough; the round ends below its start. Halving without undoing, as a party did before, keeps
    every overshoot: the round ends more than 10^6 times above its start."""
    a, lr = 2.0, 25.0
    p, opt, steps = _guarded_quadratic_round(a, lr)
    assert a / 2 * float(p.detach()) ** 2 < 1e-3 * (a / 2)
    assert steps.rejected >= 4 and opt.param_groups[0]["lr"] == pytest.approx(lr)  # 25 -> 1.56 < 2/a takes 4 halvings

    q, buf, step = 1.0, 0.0, lr  # halving (and resetting the momentum) without undoing, as before
    previous = math.inf
    for _ in range(20):
        value = a / 2 * q * q
        if value > previous:
            buf = 0.0
            if value - previous > abs(previous):
                step *= 0.5
        previous = value
        buf = 0.9 * buf + a * q
        q -= step * buf
    assert a / 2 * q * q > 1e6 * (a / 2)


@pytest.mark.parametrize("joint", [False, True])
def test_a_row_a_party_does_not_hold_adds_zero_and_never_trains_it(joint: bool) -> None:
    """Two copies of a party with the same rows missing get the same round, except that the dual and residual of the
    missing rows are replaced by noise in the second: both end with the same model. The missing rows' outputs are 0."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 5))
    held = np.array([True, False, True, True, False, True, False, True, True, True, False, True])
    d_c = 3
    bottom = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    model = torch.nn.Sequential(bottom, torch.nn.Linear(4, d_c)) if joint else bottom

    def party(m: torch.nn.Module) -> ADMMFeatureParty:
        params = m[0].parameters() if joint else m.parameters()
        head_opt = torch.optim.SGD(m[1].parameters(), lr=0.1, momentum=0.9) if joint else None
        return ADMMFeatureParty("party0", {"train": x}, m, torch.optim.SGD(params, lr=0.1, momentum=0.9), rho=1.0,
                                local_steps=4, joint=joint, algo="test", head_optimizer=head_opt,
                                device=torch.device("cpu"), dtype=torch.float64, observed={"train": held})

    a, b = party(copy.deepcopy(model)), party(copy.deepcopy(model))
    ids = np.arange(12)
    lam, res = rng.normal(size=(12, d_c)), rng.normal(size=(12, d_c))
    noisy_lam, noisy_res = lam.copy(), res.copy()
    noisy_lam[~held] = rng.normal(scale=100, size=((~held).sum(), d_c))
    noisy_res[~held] = rng.normal(scale=100, size=((~held).sum(), d_c))
    weight = torch.as_tensor(rng.normal(size=(4, d_c)))
    for p, (l_, r_) in ((a, (lam, res)), (b, (noisy_lam, noisy_res))):
        out = p.forward(0, "train", ids, "label").tensor(p.output_kind)
        assert float(out[torch.as_tensor(~held)].abs().max()) == 0.0
        dual = decode(encode(Message("dual", "label", "party0", 0, {"dual": torch.as_tensor(l_),
                                                                    "residual": torch.as_tensor(r_)})))
        head = None if joint else decode(encode(Message("head", "label", "party0", 0, {"weight": weight})))
        p.local_update(dual, head)
    moved = max(float((p0 - p1).detach().abs().max()) for p0, p1 in zip(model.parameters(), a.model.parameters(), strict=True))
    assert moved > 1e-3  # the held rows did train it
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-12)


@pytest.mark.parametrize("algo", ["vimsgd", "vimadmm", "vimadmm-j"])
def test_party_importance_is_the_frobenius_norm_of_each_partys_head(algo: str) -> None:
    run = build_run(_config(algo, batch_size=32))
    run.net.start_epoch(0)
    run.algorithm.train_epoch(0)
    got = run.algorithm.party_importance()
    if algo == "vimadmm-j":
        expected = [float(np.linalg.norm(fp.model[1].weight.detach().numpy())) for fp in run.algorithm.feature_parties]
    else:
        expected = [float(np.sqrt((w.detach().numpy() ** 2).sum())) for w in run.algorithm.label_party.head.weights]
    assert list(got) == ["party0", "party1"]
    assert list(got.values()) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("algo", ["vimadmm", "vimadmm-j"])
def test_resume_from_a_checkpoint_gives_the_metrics_and_bytes_of_an_uninterrupted_run(algo: str, tmp_path) -> None:
    """The duals are the label party's state: a run resumed after epoch 1 must end exactly where an uninterrupted one
    does (the bytes too)."""
    cfg = _config(algo, epochs=2, batch_size=16, dtype="float32", p_miss_train="0.2")
    whole = run_training(cfg, tmp_path / "whole", progress=False, log=lambda *_: None)
    run_training(TrainConfig(**{**cfg.to_dict(), "epochs": 1}), tmp_path / "cut", progress=False,
                 log=lambda *_: None)
    resumed = run_training(cfg, resume=tmp_path / "cut", changes={"epochs": 2}, progress=False, log=lambda *_: None)
    assert resumed["metrics"]["test"] == pytest.approx(whole["metrics"]["test"], rel=1e-9, abs=1e-12)
    assert resumed["comm"] == whole["comm"]
    # the second epoch's training loss depends on the duals the first one left (accuracy on wine may not)
    histories = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                 for d in ("whole", "cut")]
    assert len(histories[1]) == 2
    assert histories[1][1]["train_loss"] == pytest.approx(histories[0][1]["train_loss"], rel=1e-9)
