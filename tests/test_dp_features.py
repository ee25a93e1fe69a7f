"""Feature DP: clipped + noised embedding rows, DP-SGD bottom model through the clipping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from protocols.dp.accounting import GaussianEvent
from protocols.dp.feature_dp import FeatureDP
from protocols.dp.mechanisms import joint_norms
from protocols.dp.rng import SeededNoise
from secvfl.errors import ConfigError, UnsupportedError


def _bottom() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def test_released_rows_are_clipped_and_noised_with_replace_one_sensitivity() -> None:
    bottom = _bottom()
    x = torch.randn(3000, 6) * 3
    e = bottom(x).detach()
    clean = FeatureDP(bottom, embedding_clip=0.5, gradient_clip=1.0, noise_multiplier=0.0, noise=SeededNoise(0))
    rows = clean.release_embeddings(e)
    assert torch.all(joint_norms([rows]) <= 0.5)
    mech = FeatureDP(bottom, embedding_clip=0.5, gradient_clip=1.0, noise_multiplier=1.7, noise=SeededNoise(0))
    noisy = mech.release_embeddings(e)
    assert mech.embedding_noise_std == pytest.approx(1.7 * 2 * 0.5)
    assert float((noisy - rows).double().std()) == pytest.approx(1.7, rel=0.03)
    assert FeatureDP.event(1.7, 10) == GaussianEvent(1.7, 20)


def test_bottom_gradients_equal_autograd_without_noise_and_clipping() -> None:
    bottom = _bottom()
    x = torch.randn(20, 6)
    upstream = torch.randn(20, 4) / 20  # d(mean loss)/d(row)
    mech = FeatureDP(bottom, embedding_clip=1e6, gradient_clip=1e6, noise_multiplier=0.0, noise=SeededNoise(0), chunk=6)
    grads = mech.bottom_gradients(x, upstream)
    bottom.zero_grad()
    (bottom(x) * upstream).sum().backward()
    for n, p in bottom.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-6)


def test_bottom_gradient_noise_and_clipping() -> None:
    bottom = _bottom()
    x = torch.randn(64, 6)
    upstream = torch.randn(64, 4)
    clipped = FeatureDP(bottom, embedding_clip=0.5, gradient_clip=0.01, noise_multiplier=0.0, noise=SeededNoise(1))
    g = clipped.bottom_gradients(x, upstream)
    total = torch.sqrt(sum((v.double() * 64) .pow(2).sum() for v in g.values()))
    assert float(total) <= 64 * 0.01  # sum of 64 clipped per-sample gradients
    noisy = FeatureDP(bottom, embedding_clip=0.5, gradient_clip=0.01, noise_multiplier=3.0, noise=SeededNoise(1))
    gn = noisy.bottom_gradients(x, upstream)
    added = torch.cat([((gn[n] - g[n]) * 64).reshape(-1) for n in g])
    assert float(added.double().std()) == pytest.approx(3.0 * 2 * 0.01, rel=0.15)  # 76 parameters


def test_refusals() -> None:
    with pytest.raises(ConfigError):
        FeatureDP(_bottom(), embedding_clip=0.0, gradient_clip=1.0, noise_multiplier=1.0, noise=SeededNoise(0))
    with pytest.raises(UnsupportedError, match="BatchNorm"):
        FeatureDP(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)), embedding_clip=1.0, gradient_clip=1.0,
                  noise_multiplier=1.0, noise=SeededNoise(0))


def test_rows_a_party_does_not_hold_never_train_its_model_under_feature_dp() -> None:
    """The release rule sees a zero gradient for rows outside the party's block (missing-block simulation), so
    per-sample DP gradients of those rows are zero too; without noise the update equals plain backprop's."""
    import numpy as np

    from protocols.dp.plugin import FeatureDPRelease
    from secvfl.messages import Message, decode, encode
    from secvfl.parties import FeatureParty

    class _Layer:
        feature_released: dict = {}

    def party(rule: bool) -> FeatureParty:
        model = _bottom()
        fp = FeatureParty("p", {"train": np.random.default_rng(0).normal(size=(8, 6))}, model,
                          torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"),
                          observed={"train": np.array([1, 1, 0, 0, 1, 0, 1, 1], dtype=bool)})
        if rule:
            fp.release_rule = FeatureDPRelease(FeatureDP(model, embedding_clip=1e6, gradient_clip=1e6,
                                                         noise_multiplier=0.0, noise=SeededNoise(0)), _Layer())
        return fp

    ids = np.arange(8)
    grad = torch.randn(8, 4)
    updated = []
    for rule in (False, True):
        fp = party(rule)
        out = fp.forward(0, "train", ids, "label").tensor("embedding")
        assert torch.all(out[[2, 3, 5]] == 0)
        fp.backward(decode(encode(Message("gradient", "label", "p", 0, {"gradient": grad}))))
        updated.append([p.detach().clone() for p in fp.model.parameters()])
    for a, b in zip(*updated, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


# -- the utility-collapse warning covers feature DP ------------------------------------------------------------------
def test_chance_f1_is_the_macro_f1_of_always_predicting_the_majority_class() -> None:
    import numpy as np
    from sklearn.metrics import f1_score

    from protocols.dp.collapse import chance_f1

    rng = np.random.default_rng(0)
    for y in (rng.integers(0, 2, 50) | (rng.random(50) < 0.6), rng.integers(0, 5, 300), np.array([1, 1, 1, 2])):
        y = y.astype(np.int64)
        constant = np.full_like(y, np.bincount(y).argmax())
        assert chance_f1(y) == pytest.approx(f1_score(y, constant, average="macro", zero_division=0), abs=1e-12)


def test_a_feature_dp_model_that_predicts_one_class_is_flagged_though_its_auc_clears_the_floor() -> None:
    # `secvfl train --algo vafl --dataset credit --parties 4 --privacy dp --epsilon 3 --dp-protect features`: every
    # test row predicted negative, f1_positive 0.0, AUC 0.64 (above the 0.55 floor) and no warning
    import numpy as np

    from protocols.dp.collapse import chance_accuracy, chance_f1, utility_collapse
    from protocols.dp.config import DPConfig, plan_dp

    y = np.r_[np.zeros(4673), np.ones(1327)].astype(np.int64)  # credit's test split: 22.1 % positive
    plan = plan_dp(DPConfig(protects="features", epsilon=3.0), n_train=21600, epochs=10, batch_size=64)
    chance, majority = chance_accuracy(y), chance_f1(y)
    collapsed = {"accuracy": chance, "f1": majority, "f1_positive": 0.0, "auc": 0.64}
    warning = utility_collapse(collapsed, chance, plan, 2, majority_f1=majority)
    assert warning is not None and warning.startswith("WARNING: utility collapsed")
    assert "predicts one class" in warning and "test AUC 0.640" in warning and "F1 of the positive class 0.000" in warning
    assert "feature DP adds Gaussian noise" in warning and "--dp-parties" in warning
    # a model that does predict both classes (credit without DP: f1 0.68, f1_positive 0.47) is not flagged
    healthy = {"accuracy": 0.82, "f1": 0.68, "f1_positive": 0.47, "auc": 0.77}
    assert utility_collapse(healthy, chance, plan, 2, majority_f1=majority) is None
