"""Bayesian soft labels from the noisy residual releases (post-processing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocols.dp.denoise import LabelPosterior
from secvfl.errors import ConfigError


def test_binary_posterior_matches_bayes_rule_and_sharpens_with_observations() -> None:
    post = LabelPosterior(4, 1, obs_std=2.0)
    ids = np.array([0, 1, 2, 3])
    obs = torch.tensor([[1.5], [-0.5], [0.5], [0.5]], dtype=torch.float64)
    post.update(ids, obs)
    pi = float(post.prior())
    q = post.soft_labels(ids)[:, 0]
    # Bayes with Gaussian likelihoods N(o; y, 4) and prior pi
    l1 = np.exp(-((obs[:, 0].numpy() - 1) ** 2) / 8) * pi
    l0 = np.exp(-(obs[:, 0].numpy() ** 2) / 8) * (1 - pi)
    assert np.allclose(q.numpy(), l1 / (l1 + l0))
    for _ in range(50):  # many observations of label 1 for row 0 drive its posterior to 1
        post.update(np.array([0]), torch.tensor([[1.0]], dtype=torch.float64))
    assert float(post.soft_labels(np.array([0]))[0, 0]) > 0.99


def test_multiclass_posterior_and_state_roundtrip() -> None:
    rng = np.random.default_rng(0)
    post = LabelPosterior(3, 4, obs_std=1.0)
    for _ in range(30):
        post.update(np.array([0, 1, 2]), torch.as_tensor(np.eye(4)[[2, 0, 3]] + rng.normal(0, 1, (3, 4))))
    q = post.soft_labels(np.array([0, 1, 2]))
    assert torch.allclose(q.sum(1), torch.ones(3, dtype=torch.float64))
    assert q.argmax(1).tolist() == [2, 0, 3]
    other = LabelPosterior(3, 4, obs_std=1.0)
    other.load_state_dict(post.state_dict())
    assert torch.equal(other.soft_labels(np.array([0, 1, 2])), q)
    with pytest.raises(ConfigError):
        post.update(np.array([5]), torch.zeros(1, 4))
    with pytest.raises(ConfigError):
        LabelPosterior(3, 1, obs_std=0.0)
