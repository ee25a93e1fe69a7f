"""Model completion: a trained bottom model plus a few labels leaks labels; semi-supervision adds to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attacks import CompletionConfig, PassiveModelCompletion, accuracy, complete_model, predict
from secvfl.errors import ConfigError, DataError
from secvfl.models import SmallCNN


def train_bottom(bottom: nn.Module, x: np.ndarray, y: np.ndarray, n_classes: int, steps: int, seed: int = 0) -> None:
    """Stand-in for VFL training: the bottom model learns a representation of the task from the labels."""
    torch.manual_seed(seed)
    with torch.no_grad():
        width = bottom(torch.as_tensor(x[:1])).shape[1]
    head = nn.Linear(width, n_classes)
    opt = torch.optim.Adam([*bottom.parameters(), *head.parameters()], lr=1e-2)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (128,), generator=g)
        loss = F.cross_entropy(head(bottom(xt[idx])), yt[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


def xor_table(n: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Four classes from sign patterns -- hard to learn from a dozen labels, easy once a bottom model has."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = ((x[:, 0] * x[:, 1] > 0).astype(np.int64) + 2 * (x[:, 2] > 0)).astype(np.int64)
    return x, y


def test_completing_a_trained_bottom_beats_a_fresh_model_on_the_same_labels() -> None:
    x, y = xor_table()
    torch.manual_seed(0)
    bottom = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    train_bottom(bottom, x, y, 4, steps=300)
    before = [p.detach().clone() for p in bottom.parameters()]
    rng = np.random.default_rng(1)
    known = {int(i): int(y[i]) for i in rng.choice(len(y), 12, replace=False)}
    res = PassiveModelCompletion(CompletionConfig(epochs=10, max_steps_per_epoch=20)).run(
        bottom=bottom, features=x, known=known, labels=y, n_classes=4, test_features=x[:100], test_labels=y[:100])
    assert res.metric == "accuracy" and res.chance < 0.3
    assert res.ap >= 0.65
    assert res.ap > res.details["scratch_train_accuracy"] + 0.25
    assert res.details["test_accuracy"] is not None and res.details["known_labels"] == 12
    # the attacker's own model is copied, never modified
    assert all(torch.equal(a, b) for a, b in zip(before, bottom.parameters(), strict=True))


def elongated_clusters(n: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two long, well separated clusters: a boundary fitted to two labels per class is easily tilted wrong, the
    unlabelled rows show where it must go."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = np.stack([np.where(y == 1, 1.0, -1.0) + 0.3 * rng.normal(size=n), 4 * rng.normal(size=n)], axis=1)
    return x.astype(np.float32), y


def test_label_spreading_beats_supervised_only_on_clustered_rows() -> None:
    x, y = elongated_clusters()
    gains = []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        kn = np.concatenate([rng.choice(np.flatnonzero(y == c), 2, replace=False) for c in (0, 1)])
        un = np.setdiff1d(np.arange(len(y)), kn)
        acc = {}
        for method in ("supervised", "label-spreading"):
            cfg = CompletionConfig(epochs=10, max_steps_per_epoch=20, method=method, seed=seed)
            model = complete_model(nn.Identity(), 2, x[kn], y[kn], x[un], config=cfg)
            acc[method] = accuracy(predict(model, x[un]), y[un])
        assert acc["label-spreading"] >= 0.85
        gains.append(acc["label-spreading"] - acc["supervised"])
    assert np.mean(gains) > 0.05


def bar_images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Noisy 8x8 images with a short horizontal (class 0) or vertical (class 1) bar at a random place."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    img = 0.5 * rng.normal(size=(n, 8, 8))
    pos, start = rng.integers(0, 8, n), rng.integers(0, 5, n)
    for i in range(n):
        if y[i] == 0:
            img[i, pos[i], start[i] : start[i] + 4] += 1.0
        else:
            img[i, start[i] : start[i] + 4, pos[i]] += 1.0
    return img.reshape(n, 64).astype(np.float32), y


def test_mixmatch_completion_of_an_image_bottom_model() -> None:
    x, y = bar_images(800)
    torch.manual_seed(0)
    bottom = SmallCNN((8, 8), 8)
    train_bottom(bottom, x, y, 2, steps=60)
    known = {int(i): int(y[i]) for i in np.random.default_rng(0).choice(len(y), 4, replace=False)}
    cfg = CompletionConfig(epochs=10, max_steps_per_epoch=10, shift=1, method="mixmatch")
    res = PassiveModelCompletion(cfg, image_shape=(8, 8)).run(bottom=bottom, features=x, known=known, labels=y,
                                                                n_classes=2)
    assert res.details["config"]["method"] == "mixmatch"
    assert res.ap >= 0.85
    assert res.ap > res.details["scratch_train_accuracy"] + 0.2


def test_completion_refuses_bad_inputs() -> None:
    x, y = xor_table(100)
    bottom = nn.Linear(8, 4)
    attack = PassiveModelCompletion(baselines=False)
    with pytest.raises(ConfigError, match="known label"):
        attack.run(bottom=bottom, features=x, known={}, labels=y, n_classes=4)
    with pytest.raises(DataError, match="index"):
        attack.run(bottom=bottom, features=x, known={500: 1}, labels=y, n_classes=4)
    with pytest.raises(DataError, match="labels"):
        complete_model(bottom, 2, x[:3], np.array([0, 1, 7]))
    with pytest.raises(ConfigError, match="image_shape"):
        complete_model(bottom, 4, x[:3], y[:3], x[3:], config=CompletionConfig(method="mixmatch"))
    with pytest.raises(ConfigError, match="method"):
        CompletionConfig(method="fixmatch")
