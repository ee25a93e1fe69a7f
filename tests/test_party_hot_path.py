"""The per-step shortcuts of the parties' training hot path (issue 19) keep the behaviour they replace."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from secvfl.algorithms.base import RunContext
from secvfl.algorithms.missing.laser import LaserVFL
from secvfl.config import TrainConfig
from secvfl.data import Dataset, make_partition
from secvfl.parties import FeatureParty, PlainRelease, trainable_parameters
from secvfl.transport.network import Network


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout(0.5), nn.Linear(4, 2))


def test_trainable_parameters_follow_requires_grad_after_the_first_call():
    model = _mlp()
    assert trainable_parameters(model) == [p for p in model.parameters() if p.requires_grad]
    model[0].weight.requires_grad_(False)  # frozen after the list was first asked for
    got = trainable_parameters(model)
    assert got == [p for p in model.parameters() if p.requires_grad]
    assert len(got) == 3
    other = _mlp()  # a second model of the same shape gets its own parameters
    assert all(a is not b for a, b in zip(trainable_parameters(other), got, strict=False))


def test_plain_release_gradients_equal_autograd_with_a_frozen_layer():
    torch.manual_seed(0)
    model, x = _mlp().eval(), torch.randn(5, 3)
    rule = PlainRelease()
    out = model(x)
    g = torch.randn_like(out)
    rule.model_gradients(model, x, out, g)  # the parameter list is cached here ...
    model[3].bias.requires_grad_(False)  # ... and a layer frozen afterwards must drop out of the next step
    out = model(x)
    got = rule.model_gradients(model, x, out, g)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad((model(x) * g).sum(), params)  # eval mode: the same forward again
    assert len(got) == len(params) == 3
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_feature_party_switches_mode_even_when_its_model_was_switched_elsewhere():
    model = _mlp()
    party = FeatureParty("party0", {"train": np.ones((4, 3), np.float32)}, model,
                         torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"))
    party.forward(0, "train", np.arange(4), "label", train=False)
    assert not model.training and not model[2].training
    party.forward(1, "train", np.arange(4), "label", train=True)
    assert model.training and model[2].training
    model.eval()  # someone else (an attack, an evaluation helper) switched the model
    party.forward(2, "train", np.arange(4), "label", train=True)
    assert model.training and model[2].training  # dropout is on again for the training step


def test_laser_party_takes_received_tensors_in_its_own_dtype():
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((20, 4)).astype(np.float32), rng.integers(0, 2, 20)
    data = Dataset("synthetic", X, y, X[:0], y[:0], X, y, 2, [f"x{i}" for i in range(4)], ["0", "1"])
    cfg = TrainConfig(algo="laser", parties=2, batch_size=8, hidden=(4,), embedding_dim=3, val_fraction=0.0)
    masks = {s: np.ones((len(getattr(data, f"y_{s}")), 2), dtype=bool) for s in ("train", "val", "test")}
    ctx = RunContext(cfg, data, make_partition(4, 2), masks, torch.device("cpu"), torch.float32)
    party = LaserVFL(ctx, Network(LaserVFL.party_roles(2), traits=LaserVFL.traits)).laser_parties[0]
    wide = torch.randn(3, 4, dtype=torch.float64)
    local = party._local(wide)
    assert local.dtype == torch.float32
    torch.testing.assert_close(local, wide.float())
    same = torch.randn(3, 4)
    assert party._local(same) is same  # already right: no copy, no dispatch

