"""Per-sample joint clipping and the label-sensitivity reductions of the gradient mechanism.

Everything here works on *parts*: a list of tensors whose first dimension is the sample index (the cut-layer
gradient row of every feature party, each head parameter's per-sample gradient, ...). A sample's *joint vector* is
the concatenation of its slices of all parts; clipping and sensitivity always refer to that joint vector, because
the released row and the head update are released together, and the row slices of different feature parties are
one row to colluding feature parties.

Four ways to turn per-sample quantities into a release with a known L2 sensitivity under the neighbouring relation
"one sample's label replaced by another" (:data:`LABEL_NEIGHBOURING`). All rest on one fact: a sample's label enters
every gradient only through ``r = d loss / d z``, the derivative of its loss w.r.t. its logits; the Jacobian ``J`` of
the logits w.r.t. the cut-layer row and the head parameters depends on features and on earlier (already private)
releases, never on the label.

``residual``  (default) release ``r + N(0, (s Delta)^2 I)`` and compute every gradient from it, ``J^T r~`` (rows and
              head update alike). Everything the feature parties see is post-processing of the noisy residuals.
              BCE: ``r = sigmoid(z) - y`` moves by exactly 1 when the label flips, so ``Delta = 1`` with no clipping;
              softmax CE: ``r = p - e_y`` moves by ``e_y - e_y'``, ``Delta = sqrt(2)``; any other loss: ``r`` clipped
              to norm ``C``, ``Delta = 2C``. The noise lives in ``K`` dimensions per sample instead of the whole
              joint vector's, which is why this is the most accurate reduction at a given epsilon.
``gradient``  (any loss) clip the per-sample loss gradient to norm ``C``. A label change can move it from one point
              of the ``C``-ball to any other: sensitivity ``2C``.
``bce``       (binary cross-entropy on one logit ``z``) the per-sample gradient is ``(sigmoid(z) - y) * J``. Clip ``J``
              to ``C`` and release ``(sigmoid(z) - y) * clip(J)``: a label change moves it by ``+-clip(J)``,
              sensitivity ``C`` (half of ``gradient``).
``softmax``   (softmax cross-entropy over ``K`` logits) the gradient is ``sum_k (p_k - [k = y]) J_k``. Because the
              coefficients sum to zero, any label-independent ``c`` can be subtracted from every ``J_k``; take the mean
              row, clip each centred row ``J_k - c`` to ``C / 2`` and release ``sum_k (p_k - [k = y]) clip(J_k - c)``.
              A label change ``y -> y'`` moves it by ``clip(J_y - c) - clip(J_y' - c)``: sensitivity ``C``. For
              ``K = 2`` this is exactly the ``bce`` reduction applied to ``J_1 - J_0``. The released vector's norm is
              at most ``C (1 - p_y) <= C``.
``bce`` and ``softmax`` (``--dp-clip jacobian``) and ``gradient`` add isotropic noise to the whole joint vector.

Clipping shrinks to ``C * (1 - CLIP_MARGIN)`` in float64 so that the float32 result provably has norm <= ``C``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from secvfl.errors import ConfigError

__all__ = [
    "CLIP_MARGIN",
    "LABEL_NEIGHBOURING",
    "FEATURE_NEIGHBOURING",
    "CLIP_MODES",
    "joint_norms",
    "clip_jointly",
    "Release",
    "clip_loss_gradients",
    "bce_jacobian_release",
    "softmax_jacobian_release",
    "sensitivity_factor",
    "release_sensitivity",
    "label_residuals",
    "BOUNDED_LOSSES",
]

CLIP_MARGIN = 1e-6
LABEL_NEIGHBOURING = "replace-one-label: two training sets are neighbours if they differ in the label of one sample"
FEATURE_NEIGHBOURING = (
    "replace-one-row: two training sets are neighbours if they differ in one sample's feature row held by the "
    "protected party"
)
CLIP_MODES = ("residual", "gradient", "bce", "softmax")
BOUNDED_LOSSES = ("bce", "ce")


def sensitivity_factor(mode: str) -> float:
    """Joint L2 sensitivity of a clipped release in units of the clip norm ``C`` (label replaced)."""
    if mode == "gradient":
        return 2.0
    if mode in ("bce", "softmax"):
        return 1.0
    raise ConfigError(f"unknown clipping mode {mode!r}; valid: {', '.join(CLIP_MODES)}")


def release_sensitivity(mode: str, loss: str, clip_norm: float) -> float:
    """L2 sensitivity of one sample's release in ``mode`` for ``loss`` (``bce``, ``ce`` or another name)."""
    if mode == "residual":
        if loss == "bce":
            return 1.0
        if loss == "ce":
            return math.sqrt(2.0)
        return 2.0 * clip_norm
    return sensitivity_factor(mode) * clip_norm


def label_residuals(logits: torch.Tensor, labels: torch.Tensor, loss: str, clip_norm: float | None = None) -> torch.Tensor:
    """Per-sample ``d loss_i / d z_i`` as (B, K) float64, computed from the loss's formula (BCE, CE), so its bound
    does not depend on trusting a loss function; for other losses pass the derivatives as ``logits`` and a clip."""
    z = logits.detach().to(torch.float64)
    b = z.shape[0]
    if loss == "bce":
        y = labels.detach().reshape(-1).to(torch.float64)
        if y.shape[0] != b or not torch.all((y == 0) | (y == 1)):
            raise ConfigError("the bce residual needs one binary label in {0, 1} per sample")
        return (torch.sigmoid(z.reshape(b)) - y).reshape(b, 1)
    if loss == "ce":
        y = labels.detach().reshape(-1).long()
        z = z.reshape(b, -1)
        if y.shape[0] != b or int(y.min()) < 0 or int(y.max()) >= z.shape[1]:
            raise ConfigError(f"the ce residual needs {b} class indices in [0, {z.shape[1]})")
        return torch.softmax(z, dim=1) - torch.nn.functional.one_hot(y, z.shape[1]).to(torch.float64)
    if clip_norm is None:
        raise ConfigError(f"residuals of the loss {loss!r} are unbounded: give a clip norm")
    r = z.reshape(b, -1).clone()
    _clip_matrix(r, clip_norm)
    return r


def _joint(parts: Sequence[torch.Tensor], leading: int) -> tuple[torch.Tensor, list[int]]:
    """One float64 matrix (..., D) holding each sample's joint vector, and the width of each part in it."""
    if not parts:
        raise ConfigError("joint clipping needs at least one part")
    shape = parts[0].shape[:leading]
    for p in parts:
        if p.shape[:leading] != shape:
            raise ConfigError(f"parts disagree on their leading (per-sample) dimensions: {p.shape} vs {shape}")
    widths = [int(p[(0,) * leading].numel()) if p.numel() else 0 for p in parts]
    if any(p.numel() == 0 for p in parts):
        widths = [int(torch.Size(p.shape[leading:]).numel()) for p in parts]
    out = torch.empty(*shape, sum(widths), dtype=torch.float64)
    start = 0
    for p, w in zip(parts, widths, strict=True):
        out[..., start : start + w] = p.detach().reshape(*shape, w)  # one copy, converting to float64
        start += w
    return out, widths


def _split(joint: torch.Tensor, widths: list[int], parts: Sequence[torch.Tensor], leading: int) -> list[torch.Tensor]:
    pieces = torch.split(joint, widths, dim=-1)
    return [q.reshape(*joint.shape[:leading], *p.shape[leading:]) for q, p in zip(pieces, parts, strict=True)]


def _clip_matrix(joint: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale rows of ``joint`` (in place) to norm <= ``max_norm * (1 - CLIP_MARGIN)``; returns the original norms."""
    if not max_norm > 0:
        raise ConfigError(f"clip norm must be > 0, got {max_norm}")
    norms = torch.linalg.vector_norm(joint, dim=-1)
    target = max_norm * (1.0 - CLIP_MARGIN)
    factor = torch.where(norms > target, target / norms.clamp_min(1e-300), torch.ones_like(norms))
    joint.mul_(factor.unsqueeze(-1))
    return norms


def joint_norms(parts: Sequence[torch.Tensor], leading: int = 1) -> torch.Tensor:
    """L2 norm of each sample's joint vector (float64), shape = the parts' first ``leading`` dimensions."""
    joint, _ = _joint(parts, leading)
    return torch.linalg.vector_norm(joint, dim=-1)


def clip_jointly(
    parts: Sequence[torch.Tensor], max_norm: float, leading: int = 1
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Scale each sample's joint vector to norm <= ``max_norm``; returns (clipped parts in float64, original norms)."""
    if not max_norm > 0:
        raise ConfigError(f"clip norm must be > 0, got {max_norm}")
    joint, widths = _joint(parts, leading)
    norms = _clip_matrix(joint, max_norm)
    return _split(joint, widths, parts, leading), norms


@dataclass
class Release:
    """Per-sample vectors ready for noise: ``parts`` (float64, leading dim = sample) with joint L2 ``sensitivity``."""

    parts: list[torch.Tensor]
    sensitivity: float
    clip_norm: float
    mode: str
    clipped_fraction: float  # share of samples whose (centred) vectors were shrunk


def clip_loss_gradients(grads: Sequence[torch.Tensor], clip_norm: float) -> Release:
    """``gradient`` mode: clip per-sample loss gradients jointly to ``clip_norm``; sensitivity ``2 * clip_norm``."""
    clipped, norms = clip_jointly(grads, clip_norm)
    frac = float((norms > clip_norm * (1 - CLIP_MARGIN)).double().mean()) if norms.numel() else 0.0
    return Release(clipped, 2.0 * clip_norm, clip_norm, "gradient", frac)


def bce_jacobian_release(
    logit_jacobians: Sequence[torch.Tensor], logits: torch.Tensor, labels: torch.Tensor, clip_norm: float
) -> Release:
    """``bce`` mode. ``logit_jacobians``: parts of shape (B, ...) = d z_i / d (row, head params) per sample i;
    ``logits``: (B,) or (B, 1); ``labels``: (B,) in {0, 1}. Sensitivity ``clip_norm``."""
    z = logits.detach().reshape(-1).to(torch.float64)
    y = labels.detach().reshape(-1).to(torch.float64)
    if z.shape[0] != logit_jacobians[0].shape[0] or y.shape != z.shape:
        raise ConfigError(f"bce release: {z.shape[0]} logits, {y.shape[0]} labels, {logit_jacobians[0].shape[0]} rows")
    if not torch.all((y == 0) | (y == 1)):
        raise ConfigError("the bce clipping mode needs binary labels in {0, 1}")
    joint, widths = _joint(logit_jacobians, 1)
    norms = _clip_matrix(joint, clip_norm)
    joint.mul_((torch.sigmoid(z) - y).unsqueeze(1))  # d BCE / d z, in (-1, 1)
    parts = _split(joint, widths, logit_jacobians, 1)
    frac = float((norms > clip_norm * (1 - CLIP_MARGIN)).double().mean()) if norms.numel() else 0.0
    return Release(parts, clip_norm, clip_norm, "bce", frac)


def softmax_jacobian_release(
    logit_jacobians: Sequence[torch.Tensor], logits: torch.Tensor, labels: torch.Tensor, clip_norm: float
) -> Release:
    """``softmax`` mode. ``logit_jacobians``: parts of shape (B, K, ...) = d z_ik / d (row, head params);
    ``logits``: (B, K); ``labels``: (B,) in [0, K). Sensitivity ``clip_norm``."""
    z = logits.detach().to(torch.float64)
    if z.dim() != 2:
        raise ConfigError(f"softmax release needs (batch, classes) logits, got shape {tuple(z.shape)}")
    b, k = z.shape
    y = labels.detach().reshape(-1).long()
    if y.shape[0] != b or int(y.min()) < 0 or int(y.max()) >= k:
        raise ConfigError(f"softmax release: labels must be {b} class indices in [0, {k})")
    for j in logit_jacobians:
        if j.shape[:2] != (b, k):
            raise ConfigError(f"softmax release: Jacobian part of shape {tuple(j.shape)} is not (batch={b}, K={k}, ...)")
    joint, widths = _joint(logit_jacobians, 2)  # (B, K, D)
    joint.sub_(joint.mean(dim=1, keepdim=True))  # label-independent shift; see module docstring
    norms = _clip_matrix(joint, clip_norm / 2.0)
    coeff = torch.softmax(z, dim=1) - torch.nn.functional.one_hot(y, k).to(torch.float64)  # (B, K)
    released = torch.einsum("bk,bkd->bd", coeff, joint)
    parts = [q.reshape(b, *j.shape[2:]) for q, j in zip(torch.split(released, widths, dim=-1), logit_jacobians,
                                                         strict=True)]
    frac = float((norms > clip_norm / 2 * (1 - CLIP_MARGIN)).any(dim=1).double().mean()) if norms.numel() else 0.0
    return Release(parts, clip_norm, clip_norm, "softmax", frac)
