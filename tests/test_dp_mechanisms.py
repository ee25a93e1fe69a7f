"""Joint clipping and the label-sensitivity reductions: norms, sensitivities, exactness when nothing is clipped."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.dp.mechanisms import (
    bce_jacobian_release,
    clip_jointly,
    clip_loss_gradients,
    joint_norms,
    sensitivity_factor,
    softmax_jacobian_release,
)
from secvfl.errors import ConfigError


def _parts(seed: int, b: int, shapes: list[tuple[int, ...]], scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, *s, generator=g) * scale for s in shapes]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    b=st.integers(1, 16),
    scale=st.floats(1e-3, 1e3),
    clip=st.floats(1e-2, 1e2),
)
def test_joint_clip_bounds_every_sample_in_float32(seed: int, b: int, scale: float, clip: float) -> None:
    parts = _parts(seed, b, [(3,), (2, 4), ()], scale)
    clipped, norms = clip_jointly(parts, clip)
    out = joint_norms([c.to(torch.float32) for c in clipped])
    assert torch.all(out <= clip)
    # samples already inside the ball are untouched; the others keep their direction
    for i in range(b):
        if norms[i] <= clip * (1 - 1e-6):
            for c, p in zip(clipped, parts, strict=True):
                assert torch.allclose(c[i], p[i].double())
        else:
            flat_c = torch.cat([c[i].reshape(-1) for c in clipped])
            flat_p = torch.cat([p[i].reshape(-1).double() for p in parts])
            assert torch.allclose(flat_c / flat_c.norm(), flat_p / flat_p.norm(), atol=1e-9)


def test_joint_clip_is_joint_not_per_part() -> None:
    # two parts of norm 3 and 4: joint norm 5; clipping to 1 scales both by 1/5, not each to 1
    parts = [torch.tensor([[3.0, 0.0]]), torch.tensor([[0.0, 4.0]])]
    clipped, norms = clip_jointly(parts, 1.0)
    assert float(norms[0]) == pytest.approx(5.0)
    assert clipped[0][0, 0].item() == pytest.approx(0.6, rel=1e-5)
    assert clipped[1][0, 1].item() == pytest.approx(0.8, rel=1e-5)


def test_bad_clip_and_shapes_refused() -> None:
    with pytest.raises(ConfigError, match="clip norm"):
        clip_jointly([torch.ones(2, 2)], 0.0)
    with pytest.raises(ConfigError, match="leading"):
        clip_jointly([torch.ones(2, 2), torch.ones(3, 2)], 1.0)
    with pytest.raises(ConfigError):
        sensitivity_factor("laplace")
    with pytest.raises(ConfigError, match="binary"):
        bce_jacobian_release([torch.ones(2, 3)], torch.zeros(2), torch.tensor([0, 2]), 1.0)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10**6), b=st.integers(1, 8), scale=st.floats(1e-2, 1e2), clip=st.floats(0.1, 10.0))
def test_bce_release_sensitivity_is_c(seed: int, b: int, scale: float, clip: float) -> None:
    jac = _parts(seed, b, [(5,), (2, 3)], scale)
    z = torch.randn(b, generator=torch.Generator().manual_seed(seed + 1)) * 3
    y = torch.randint(0, 2, (b,), generator=torch.Generator().manual_seed(seed + 2))
    r = bce_jacobian_release(jac, z, y, clip)
    r2 = bce_jacobian_release(jac, z, 1 - y, clip)  # every label flipped: each sample is a neighbour
    assert r.sensitivity == clip
    assert torch.all(joint_norms(r.parts) <= clip)
    diff = joint_norms([a - c for a, c in zip(r.parts, r2.parts, strict=True)])
    assert torch.all(diff <= clip * (1 + 1e-9))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), b=st.integers(1, 6), k=st.integers(2, 6), scale=st.floats(1e-2, 1e2),
       clip=st.floats(0.1, 10.0))
def test_softmax_release_sensitivity_is_c_for_every_label_pair(seed: int, b: int, k: int, scale: float, clip: float) -> None:
    jac = _parts(seed, b, [(k, 4), (k, 3, 2)], scale)
    z = torch.randn(b, k, generator=torch.Generator().manual_seed(seed + 1)) * 2
    releases = {y: softmax_jacobian_release(jac, z, torch.full((b,), y), clip) for y in range(k)}
    for y, y2 in itertools.combinations(range(k), 2):
        diff = joint_norms([a - c for a, c in zip(releases[y].parts, releases[y2].parts, strict=True)])
        assert torch.all(diff <= clip * (1 + 1e-9))
    for r in releases.values():
        assert torch.all(joint_norms(r.parts) <= clip * (1 + 1e-9))


def test_softmax_with_two_classes_is_bce_on_the_jacobian_difference() -> None:
    g = torch.Generator().manual_seed(0)
    jac = torch.randn(7, 2, 5, generator=g) * 4
    z = torch.randn(7, 2, generator=g)
    y = torch.randint(0, 2, (7,), generator=g)
    soft = softmax_jacobian_release([jac], z, y, 1.0)
    bce = bce_jacobian_release([jac[:, 1] - jac[:, 0]], z[:, 1] - z[:, 0], y, 1.0)
    assert torch.allclose(soft.parts[0], bce.parts[0], atol=1e-12)


def test_reductions_are_exact_when_nothing_is_clipped() -> None:
    g = torch.Generator().manual_seed(1)
    b, k = 5, 4
    jac = torch.randn(b, k, 6, generator=g, dtype=torch.float64)
    z = torch.randn(b, k, generator=g, dtype=torch.float64)
    y = torch.randint(0, k, (b,), generator=g)
    exact = torch.einsum("bk,bkd->bd", torch.softmax(z, 1) - torch.nn.functional.one_hot(y, k), jac)
    r = softmax_jacobian_release([jac], z, y, 1e6)
    assert torch.allclose(r.parts[0], exact, atol=1e-10)
    assert r.clipped_fraction == 0.0
    # gradient mode: plain clipping with sensitivity 2C
    r = clip_loss_gradients([exact], 1e-3)
    assert r.sensitivity == 2e-3 and r.clipped_fraction == 1.0
    assert torch.all(joint_norms(r.parts) <= 1e-3)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), b=st.integers(1, 16), k=st.integers(2, 8), scale=st.floats(0.1, 100.0))
def test_residuals_are_bounded_and_move_by_at_most_their_sensitivity(seed: int, b: int, k: int, scale: float) -> None:
    from protocols.dp.mechanisms import label_residuals, release_sensitivity

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, 1, generator=g) * scale
    y = torch.randint(0, 2, (b,), generator=g)
    r, r2 = label_residuals(z, y, "bce"), label_residuals(z, 1 - y, "bce")
    assert torch.all(r.abs() <= 1) and torch.allclose((r - r2).abs(), torch.ones_like(r))
    assert release_sensitivity("residual", "bce", 5.0) == 1.0
    zk = torch.randn(b, k, generator=g) * scale
    yk = torch.randint(0, k, (b,), generator=g)
    rk = label_residuals(zk, yk, "ce")
    for shift in range(1, k):
        moved = (rk - label_residuals(zk, (yk + shift) % k, "ce")).norm(dim=1)
        assert torch.all(moved <= release_sensitivity("residual", "ce", 5.0) * (1 + 1e-12))
    # any other loss: residuals clipped to C, sensitivity 2C
    clipped = label_residuals(torch.randn(b, 3, generator=g) * scale, yk, "mse", clip_norm=0.5)
    assert torch.all(joint_norms([clipped]) <= 0.5)
    assert release_sensitivity("residual", "mse", 0.5) == 1.0
