"""`--privacy dp` in real runs: every mechanism with the algorithms it serves, clear refusals, summary and statement."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from protocols.dp.label_dp import LabelDPRule
from protocols.dp.rng import SeededNoise
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError, ProtocolError, UnsupportedError
from secvfl.parties import standard_backward
from secvfl.runner import build_run, run_training


def _cfg(**kw) -> TrainConfig:
    options = kw.pop("options", {})
    base = dict(dataset="breast_cancer", parties=3, epochs=2, batch_size=64, embedding_dim=8, device="cpu")
    base.update(kw)
    return TrainConfig(**base, options=options)


def _quiet(*_: object) -> None:
    pass


@pytest.mark.parametrize("algo", ["splitnn", "vafl", "fdml"])
def test_label_dp_runs_with_each_split_algorithm_and_reports(tmp_path, algo: str) -> None:
    lines: list[str] = []
    s = run_training(_cfg(algo=algo, options={"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "gradient"}),
                     out=tmp_path / algo, progress=False, log=lines.append)
    p = s["privacy"]
    assert p["mechanism"] == "gradient" and p["protects"] == "labels" and p["epsilon"] <= 3.0
    assert p["secure_rng"] is True and p["accountant"] == "rdp" and p["clip_mode"] == "residual"
    assert p["released"]["steps"] == 2 * -(-p["n_train"] // 64) and p["within_plan"] is True
    saved = json.loads((tmp_path / algo / "summary.json").read_text())
    assert saved["privacy"]["noise_multiplier"] == p["noise_multiplier"]
    assert (tmp_path / algo / "PRIVACY.md").read_text().startswith("# Privacy statement")
    assert any(line.startswith("Privacy guarantee") for line in lines)
    assert any(layer["layer"] == "dp" for layer in s["protocols"]["layers"])


def test_label_dp_multiclass_uses_softmax_reduction() -> None:
    s = run_training(_cfg(dataset="wine", epochs=1, batch_size=32,
                          options={"privacy": "dp", "epsilon": 5.0, "dp_mechanism": "gradient"}), progress=False, log=_quiet)
    assert s["privacy"]["clip_mode"] == "residual" and s["privacy"]["sensitivity"] == pytest.approx(2**0.5)
    s = run_training(_cfg(dataset="wine", epochs=1, batch_size=32,
                          options={"privacy": "dp", "epsilon": 5.0, "dp_clip": "jacobian"}), progress=False, log=_quiet)
    assert s["privacy"]["clip_mode"] == "softmax" and s["privacy"]["sensitivity"] == 1.0


@pytest.mark.parametrize("algo", ["vafl", "splitnn", "fdml"])
def test_rule_without_noise_equals_standard_backward_through_the_label_party(algo: str) -> None:
    """The pre-hook/Jacobian path reproduces ordinary gradients (incl. vafl's per-row mean scaling)."""
    run = build_run(_cfg(algo=algo, p_miss_train="0.3", options={}))
    lp = run.algorithm.label_party
    alg = run.algorithm
    ids = alg.train_rows()[:40]
    alg._forward_all("train", ids, train=True)
    received = alg.label_handle._take()  # the inputs the label party took from the network
    scale = alg._scale("train", ids)
    aggregated = alg.traits.aggregation != "concat"
    results = []
    rules = [LabelDPRule(loss="bce", clip_norm=1e9, noise_multiplier=0.0, noise=SeededNoise(0), clip=clip)
             for clip in ("residual", "jacobian", "gradient")]
    for rule in (standard_backward, *rules):
        xs = lp._inputs(received)
        lp.head.zero_grad(set_to_none=True)
        rule(lp.head, lambda t: lp._forward(t, aggregated, scale), xs, lp.labels("train", ids), lp.loss_fn)
        results.append(([x.grad.clone() for x in xs], [p.grad.clone() for p in lp.head.parameters()]))
    (xa, pa), *others = results
    for xb, pb in others:
        for a, b in zip(xa + pa, xb + pb, strict=True):
            assert torch.allclose(a, b, atol=1e-6)


def test_rr_randomises_training_labels_once_and_resume_reuses_them(tmp_path) -> None:
    cfg = _cfg(epochs=2, options={"privacy": "dp", "epsilon": 1.0, "dp_mechanism": "rr"})
    run = build_run(cfg)
    lp = run.algorithm.label_party
    true = run.ctx.data.y_train
    noisy = lp.labels("train").numpy()
    flipped = np.mean(noisy != true)
    expected = 1 / (np.e + 1)
    assert abs(flipped - expected) < 4 * np.sqrt(expected * (1 - expected) / len(true))
    assert np.array_equal(lp.labels("test").numpy(), run.ctx.data.y_test)  # evaluation labels untouched
    layer = next(layer for layer in run.net.layers if layer.name == "dp")
    state = layer.state_dict()
    again = build_run(cfg)  # a resumed run: fresh randomisation first, then the saved one comes back
    again_layer = next(layer for layer in again.net.layers if layer.name == "dp")
    again_layer.load_state_dict(state)
    assert np.array_equal(again.algorithm.label_party.labels("train").numpy(), noisy)
    s = run_training(cfg, out=tmp_path / "rr", progress=False, log=_quiet)
    assert s["privacy"]["delta"] == 0.0 and s["privacy"]["accountant"] == "pure"


def test_feature_dp_runs_and_refuses_unaccounted_releases(tmp_path) -> None:
    cfg = _cfg(algo="splitnn", options={"privacy": "dp", "epsilon": 4.0, "dp_protect": "features",
                                        "dp_parties": "party1"})
    s = run_training(cfg, out=tmp_path / "f", progress=False, log=_quiet)
    assert s["privacy"]["protects"] == "features" and s["privacy"]["protected_parties"] == ["party1"]
    assert s["privacy"]["releases_per_sample"] == 4
    run = build_run(cfg)
    fp = run.algorithm.feature_parties[1]
    with pytest.raises(ProtocolError, match="training rows"):
        fp.forward(0, "train", np.arange(5), "label", train=False)
    # an evaluation release is clipped
    m = fp.forward(0, "test", np.arange(5), "label", train=False)
    assert torch.all(m.tensor("embedding").norm(dim=1) <= 1.0)
    s = run_training(_cfg(algo="vafl", options={"privacy": "dp", "epsilon": 4.0, "dp_protect": "features"}),
                     progress=False, log=_quiet)
    assert s["privacy"]["protected_parties"] == ["party0", "party1", "party2"]


def test_layer_refuses_feature_outputs_that_bypass_the_mechanism() -> None:
    from secvfl.parties import PlainRelease

    run = build_run(_cfg(options={"privacy": "dp", "epsilon": 3.0, "dp_protect": "features"}))
    fp = run.algorithm.feature_parties[0]
    fp.release_rule = PlainRelease()  # something that sidesteps the mechanism
    with pytest.raises(ProtocolError, match="bypassed"):
        run.algorithm.train_epoch(0)


def test_layer_refuses_gradients_that_bypass_the_rule() -> None:
    run = build_run(_cfg(options={"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "gradient"}))
    run.algorithm.label_party.backward_rule = standard_backward  # an algorithm that sidesteps the mechanism
    with pytest.raises(ProtocolError, match="did not go through"):
        run.algorithm.train_epoch(0)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(algo="local", options={"privacy": "dp", "epsilon": 3.0}), UnsupportedError, "sends the labels"),
        (dict(algo="local", options={"privacy": "dp", "epsilon": 3.0, "dp_protect": "features"}), UnsupportedError,
         "no feature rows"),
        (dict(options={"epsilon": 3.0}), ConfigError, "only take effect with --privacy dp"),
        (dict(options={"privacy": "dp"}), ConfigError, "--epsilon E"),
        (dict(options={"privacy": "dp", "epsilon": float("inf")}), ConfigError, "--privacy none"),
        (dict(options={"privacy": "dp", "epsilon": 3.0, "delta": 0.1, "dp_mechanism": "gradient"}), ConfigError,
         "not below 1/N"),
        (dict(options={"privacy": "dp", "epsilon": 3.0, "dp_protect": "features", "dp_parties": "bank"}),
         ConfigError, "unknown parties"),
        (dict(options={"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "rr", "noise_multiplier": 1.0}),
         UnsupportedError, "no meaning"),
        (dict(options={"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "rr", "dp_clip_norm": 1.0}),
         ConfigError, "no clip norm"),
        (dict(options={"privacy": "dp", "epsilon": 3.0, "dp_protect": "features", "dp_clip": "jacobian"}),
         ConfigError, "--dp-clip applies"),
        (dict(options={"privacy": "dp", "epsilon": 3.0, "dp_grad_clip_norm": 1.0}), ConfigError, "features only"),
        (dict(options={"privacy": "dp", "epsilon": 3.0, "dp_clip": "jacobian", "dp_denoise": "posterior"}),
         ConfigError, "--dp-denoise posterior works"),
    ],
)
def test_refusals(kw: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build_run(_cfg(**kw))


def test_laser_refuses_label_dp_and_serves_feature_dp() -> None:
    from secvfl.algorithms import algorithm_names

    assert "laser" in algorithm_names()  # a missing registration is a regression, not a reason to skip
    with pytest.raises(UnsupportedError, match="holds the labels"):
        build_run(_cfg(algo="laser", options={"privacy": "dp", "epsilon": 3.0}))
    s = run_training(_cfg(algo="laser", epochs=1, options={"privacy": "dp", "epsilon": 3.0, "dp_protect": "features"}),
                     progress=False, log=_quiet)
    assert s["privacy"]["protects"] == "features" and s["privacy"]["releases_per_sample"] == 2
    run = build_run(_cfg(algo="laser", options={"privacy": "dp", "epsilon": 3.0, "dp_protect": "features"}))
    with pytest.raises(ProtocolError, match="training rows"):
        run.algorithm.laser_parties[0].represent(0, "train", np.arange(3), ["party1"], train=False)


def test_reproducible_noise_is_reproducible_and_flagged() -> None:
    opts = {"privacy": "dp", "epsilon": 2.0, "dp_reproducible": True}
    a = run_training(_cfg(epochs=1, options=opts), progress=False, log=_quiet)
    b = run_training(_cfg(epochs=1, options=opts), progress=False, log=_quiet)
    assert a["privacy"]["secure_rng"] is False
    assert a["metrics"]["test"] == b["metrics"]["test"]


def test_posterior_denoising_sees_every_training_row_once_per_epoch() -> None:
    run = build_run(_cfg(options={"privacy": "dp", "epsilon": 3.0, "dp_denoise": "posterior"}))
    run.algorithm.train_epoch(0)
    layer = next(layer for layer in run.net.layers if layer.name == "dp")
    post = layer.rule.posterior
    assert post is not None and torch.all(post.counts == 1)
    state = layer.state_dict()
    again = build_run(_cfg(options={"privacy": "dp", "epsilon": 3.0, "dp_denoise": "posterior"}))
    again_layer = next(layer for layer in again.net.layers if layer.name == "dp")
    again_layer.load_state_dict(state)
    assert torch.equal(again_layer.rule.posterior.sums, post.sums)
    assert again_layer.rule.steps == layer.rule.steps
