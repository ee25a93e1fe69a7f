"""The label-DP gradient mechanism: exactness without noise, clipping, calibrated noise, neighbouring transcripts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from protocols.dp.accounting import calibrate_noise_multiplier
from protocols.dp.label_dp import LabelDPBackward, clip_mode_for
from protocols.dp.mechanisms import joint_norms
from protocols.dp.rng import SeededNoise
from secvfl.errors import ConfigError, UnsupportedError


class ConcatHead(nn.Module):
    def __init__(self, d: int, k: int, hidden: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, k)) if hidden else nn.Linear(d, k)

    def forward(self, *parts: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat(parts, dim=1))


def _batch(b: int = 40, dims: tuple[int, ...] = (3, 5), k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, d, generator=g) * 2 for d in dims]
    y = torch.randint(0, k, (b,), generator=g)
    return xs, y


def _loss(out: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    if loss == "bce":
        return nn.functional.binary_cross_entropy_with_logits(out.reshape(-1), y.float())
    if loss == "mse":
        return nn.functional.mse_loss(out.reshape(-1), y.float())
    return nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize(
    "loss, k, clip, hidden",
    [("bce", 1, "auto", 0), ("bce", 1, "jacobian", 3), ("bce", 1, "gradient", 6), ("ce", 4, "auto", 6),
     ("ce", 4, "jacobian", 6), ("ce", 2, "jacobian", 0), ("ce", 3, "gradient", 0), ("mse", 1, "auto", 4),
     ("mse", 1, "gradient", 4)],
)
def test_without_noise_and_clipping_it_is_the_ordinary_backward(loss: str, k: int, clip: str, hidden: int) -> None:
    torch.manual_seed(0)
    head = ConcatHead(8, k, hidden)
    xs, y = _batch(k=max(k, 2))
    mech = LabelDPBackward(head, loss=loss, clip_norm=1e6, noise_multiplier=0.0, noise=SeededNoise(0), clip=clip)
    step = mech(xs, y)
    xs2 = [x.clone().requires_grad_() for x in xs]
    head.zero_grad()
    _loss(head(*xs2), y, loss).backward()
    for a, x in zip(step.input_grads, xs2, strict=True):
        assert a.shape == x.shape
        assert torch.allclose(a, x.grad, atol=1e-6)
    for n, p in head.named_parameters():
        assert torch.allclose(step.head_grads[n], p.grad, atol=1e-6)
    assert step.clipped_fraction == 0.0


@pytest.mark.parametrize("loss, k", [("bce", 1), ("ce", 3)])
def test_every_released_joint_row_is_clipped_before_noise(loss: str, k: int) -> None:
    torch.manual_seed(1)
    head = ConcatHead(8, k, hidden=5)
    xs, y = _batch(k=max(k, 2))
    mech = LabelDPBackward(head, loss=loss, clip_norm=0.05, noise_multiplier=1.0, noise=SeededNoise(0), clip="jacobian")
    release, _ = mech.per_sample_release(xs, y)
    norms = joint_norms([p.to(torch.float32) for p in release.parts])  # rows of all parties + head, jointly
    assert torch.all(norms <= 0.05)
    assert release.clipped_fraction > 0.5  # the test really clips


@pytest.mark.parametrize("loss, k, sensitivity", [("bce", 1, 1.0), ("ce", 5, 2**0.5)])
def test_residual_noise_equals_multiplier_times_sensitivity(loss: str, k: int, sensitivity: float) -> None:
    """Default mode: the regression multiplier times the residual's sensitivity is the noise actually added."""
    sigma = calibrate_noise_multiplier(3.0, 1e-5, 20)
    assert sigma == pytest.approx(6.68, abs=0.01)
    torch.manual_seed(2)
    head = ConcatHead(30, k, hidden=4)
    xs, y = _batch(b=2000, dims=(10, 20), k=max(k, 2))
    mech = LabelDPBackward(head, loss=loss, clip_norm=0.5, noise_multiplier=sigma, noise=SeededNoise(3))
    assert mech.mode == "residual" and mech.sensitivity == pytest.approx(sensitivity)
    mech(xs, y)
    exact, noisy = mech.rule.last_residuals
    added = (noisy - exact).reshape(-1)
    assert float(added.std()) == pytest.approx(sigma * sensitivity, rel=0.03)
    assert abs(float(added.mean())) < 4 * sigma * sensitivity / added.numel() ** 0.5


def _neighbouring_batches(k: int) -> tuple[ConcatHead, int, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A head with ``k`` outputs and a batch of 32 under two label vectors that differ only at row 7 (the canary)."""
    torch.manual_seed(4)
    head = ConcatHead(8, k, hidden=6)
    b = 32
    xs, y = _batch(b=b, k=max(k, 2))
    y2 = y.clone()
    y2[7] = (y[7] + 1) % max(k, 2)
    return head, b, xs, y, y2


@pytest.mark.parametrize("loss, k", [("bce", 1), ("ce", 4)])
def test_residual_mode_neighbours_differ_only_in_the_canary_residual(loss: str, k: int) -> None:
    """Everything released is computed from the noisy residuals; one label moves one residual by <= Delta."""
    head, b, xs, y, y2 = _neighbouring_batches(k)
    runs = []
    for labels in (y, y2):
        mech = LabelDPBackward(head, loss=loss, clip_norm=0.3, noise_multiplier=2.0, noise=SeededNoise(9))
        step = mech(xs, labels)
        runs.append((step, mech.rule.last_residuals[1]))
    (a, ra), (c, rc) = runs
    diff = (ra - rc).norm(dim=1)
    assert torch.all(diff[torch.arange(b) != 7] == 0)
    assert 0 < float(diff[7]) <= mech.sensitivity * (1 + 1e-12)
    for u, v in zip(a.input_grads, c.input_grads, strict=True):
        others = torch.arange(b) != 7
        assert torch.equal(u[others], v[others])  # other samples' rows are bit-identical


def test_noise_added_equals_multiplier_times_joint_sensitivity() -> None:
    """Jacobian/gradient modes: the regression multiplier is what ends up in the released rows."""
    sigma = calibrate_noise_multiplier(3.0, 1e-5, 20)
    b = 400
    torch.manual_seed(2)
    head = ConcatHead(30, 1)
    xs, y = _batch(b=b, dims=(10, 20))
    for clip, expected_sensitivity in (("jacobian", 0.5), ("gradient", 1.0)):
        mech = LabelDPBackward(head, loss="bce", clip_norm=0.5, noise_multiplier=sigma, noise=SeededNoise(3), clip=clip)
        clean = LabelDPBackward(head, loss="bce", clip_norm=0.5, noise_multiplier=0.0, noise=SeededNoise(3), clip=clip)
        noisy, exact = mech(xs, y), clean(xs, y)
        assert mech.sensitivity == expected_sensitivity
        added = torch.cat([((a - c) * b).reshape(-1) for a, c in zip(noisy.input_grads, exact.input_grads, strict=True)])
        added_head = torch.cat([((noisy.head_grads[n] - exact.head_grads[n]) * b).reshape(-1) for n in exact.head_grads])
        target = sigma * expected_sensitivity
        assert noisy.noise_std == pytest.approx(target)
        # 12,000 row coordinates: the empirical std is within 3% of the calibrated one
        assert float(added.double().std()) == pytest.approx(target, rel=0.03)
        assert float(added_head.double().pow(2).mean().sqrt()) == pytest.approx(target, rel=0.5)  # only 31 draws


@pytest.mark.parametrize("loss, k", [("bce", 1), ("ce", 4)])
def test_changing_one_label_changes_the_transcript_only_within_the_sensitivity(loss: str, k: int) -> None:
    """Jacobian mode, same noise seed: only the canary's row and the head sum move, by <= Delta jointly."""
    head, b, xs, y, y2 = _neighbouring_batches(k)
    clip = 0.3
    runs = []
    for labels in (y, y2):
        mech = LabelDPBackward(head, loss=loss, clip_norm=clip, noise_multiplier=2.0, noise=SeededNoise(9),
                               clip="jacobian")
        runs.append(mech(xs, labels))
    a, c = runs
    row_diff = [(u - v) * b for u, v in zip(a.input_grads, c.input_grads, strict=True)]
    others = torch.ones(b, dtype=torch.bool)
    others[7] = False
    for d in row_diff:
        assert torch.all(d[others] == 0)  # other samples' rows are bit-identical
    canary_part = [d[7] for d in row_diff] + [(a.head_grads[n] - c.head_grads[n]) * b for n in a.head_grads]
    moved = float(torch.sqrt(sum((p.double() ** 2).sum() for p in canary_part)))
    assert 0 < moved <= mech.sensitivity * (1 + 1e-4)


def test_refusals() -> None:
    with pytest.raises(UnsupportedError, match="BatchNorm"):
        LabelDPBackward(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)), loss="bce",
                        clip_norm=1.0, noise_multiplier=1.0, noise=SeededNoise(0))
    with pytest.raises(ConfigError, match="clip norm"):
        LabelDPBackward(nn.Linear(3, 1), loss="bce", clip_norm=0.0, noise_multiplier=1.0, noise=SeededNoise(0))
    with pytest.raises(UnsupportedError, match="Jacobian clipping"):
        clip_mode_for("mse", "jacobian")
    assert clip_mode_for("mse") == "residual"
    assert clip_mode_for("bce", "jacobian") == "bce" and clip_mode_for("ce", "jacobian") == "softmax"
    mech = LabelDPBackward(nn.Linear(3, 1), loss="bce", clip_norm=1.0, noise_multiplier=1.0, noise=SeededNoise(0))
    with pytest.raises(ConfigError, match="rows"):
        mech([torch.ones(4, 3)], torch.ones(5))
    with pytest.raises(ConfigError, match="binary"):
        mech([torch.ones(4, 3)], torch.tensor([0, 1, 2, 1]))


def test_apply_writes_head_gradients_and_chunking_is_invisible() -> None:
    torch.manual_seed(5)
    head = ConcatHead(8, 3, hidden=4)
    xs, y = _batch(b=50, k=3)
    full = LabelDPBackward(head, loss="ce", clip_norm=0.2, noise_multiplier=1.0, noise=SeededNoise(1),
                           clip="jacobian")(xs, y)
    chunked_mech = LabelDPBackward(head, loss="ce", clip_norm=0.2, noise_multiplier=1.0, noise=SeededNoise(1), chunk=7,
                                   clip="jacobian")
    chunked = chunked_mech(xs, y)
    for u, v in zip(full.input_grads, chunked.input_grads, strict=True):
        assert torch.allclose(u, v, atol=1e-7)
    chunked_mech.apply(chunked)
    for n, p in head.named_parameters():
        assert torch.equal(p.grad, chunked.head_grads[n])


@pytest.mark.parametrize("clip, published", [("jacobian", True), ("gradient", False)])
def test_the_clipped_fraction_is_published_only_when_clipping_does_not_depend_on_the_label(
        clip: str, published: bool) -> None:
    # Under --dp-clip gradient a row is clipped or not depending on its label, so the count is a release no noise
    # protects; the Jacobian clip sees features and earlier releases only.
    from protocols.dp.label_dp import LabelDPRule

    torch.manual_seed(3)
    head = ConcatHead(8, 1, hidden=5)
    xs, y = _batch()
    rule = LabelDPRule(loss="bce", clip_norm=0.05, noise_multiplier=1.0, noise=SeededNoise(0), clip=clip)
    inputs = [x.clone().requires_grad_() for x in xs]
    rule(head, lambda t: head(*t), inputs, y.float(), lambda out, t: _loss(out, t.long(), "bce"))
    fraction = rule.describe()["clipped_fraction"]
    if published:
        assert fraction is not None and fraction > 0.5  # the clip is tight: most rows shrink
    else:
        assert fraction is None
