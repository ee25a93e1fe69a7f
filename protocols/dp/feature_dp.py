"""Feature DP: protect one feature party's rows from everyone else.

Threat model
    Protected: each training sample's feature row held by the protecting feature party. Adversary: every other party
    (the label party and the other feature parties, colluding), seeing everything the protecting party sends (its
    embedding rows) and, conservatively, treating every update of the protecting party's bottom model as released
    (later embeddings of *other* samples are computed with it). Batch membership is known to all, so no
    subsampling amplification is claimed. Neighbouring relation: one sample's row at the protecting party replaced.
    Not protected: labels (use label DP), batch membership, row counts, the other parties' features.

Mechanism (one step, batch ``B``, one multiplier ``s`` for both parts)
    1. Forward: clip each embedding row to ``C_e`` and release it plus ``N(0, (2 s C_e)^2 I)``; a replaced row moves
       a clipped row by at most ``2 C_e``.
    2. Backward: per-sample gradients of the bottom model (through the clipping) for the returned upstream
       gradients, each clipped to ``C_g``; release their sum plus ``N(0, (2 s C_g)^2 I)`` (DP-SGD, replace-one: ``2 C_g``),
       divided by ``B`` for the mean.
    Each is one Gaussian mechanism with multiplier ``s`` for the replaced row, so a sample seen once per epoch costs
    ``GaussianEvent(s, 2 * epochs)`` in the accountant. Everything the other parties compute is post-processing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from protocols.dp.accounting import GaussianEvent
from protocols.dp.label_dp import check_dp_module
from protocols.dp.mechanisms import CLIP_MARGIN, FEATURE_NEIGHBOURING, clip_jointly
from protocols.dp.rng import NoiseSource
from secvfl.errors import ConfigError

__all__ = ["FeatureDP"]


def _clip_rows(e: torch.Tensor, c: float) -> torch.Tensor:
    """Differentiable per-row clipping (same rule as :func:`clip_jointly`)."""
    flat = e.reshape(e.shape[0], -1)
    norms = flat.norm(dim=1)
    target = c * (1.0 - CLIP_MARGIN)
    factor = torch.where(norms > target, target / norms.clamp_min(1e-30), torch.ones_like(norms))
    return (flat * factor.unsqueeze(1)).reshape(e.shape)


class FeatureDP:
    """The protecting feature party's side of feature DP (its bottom model stays in its hands)."""

    def __init__(
        self,
        bottom: nn.Module,
        *,
        embedding_clip: float,
        gradient_clip: float,
        noise_multiplier: float,
        noise: NoiseSource,
        chunk: int = 256,
    ) -> None:
        for what, v in (("embedding clip norm", embedding_clip), ("gradient clip norm", gradient_clip)):
            if not v > 0:
                raise ConfigError(f"feature DP {what} must be > 0, got {v}")
        if not noise_multiplier >= 0:
            raise ConfigError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        check_dp_module(bottom, "feature party's bottom model")
        self.bottom = bottom
        self.embedding_clip = float(embedding_clip)
        self.gradient_clip = float(gradient_clip)
        self.noise_multiplier = float(noise_multiplier)
        self.noise = noise
        self.chunk = int(chunk)

    @property
    def neighbouring(self) -> str:
        return FEATURE_NEIGHBOURING

    @property
    def embedding_noise_std(self) -> float:
        return self.noise_multiplier * 2.0 * self.embedding_clip

    @property
    def gradient_noise_std(self) -> float:
        return self.noise_multiplier * 2.0 * self.gradient_clip

    @staticmethod
    def event(noise_multiplier: float, epochs: int) -> GaussianEvent:
        """Privacy cost of ``epochs`` epochs (two Gaussian releases per sample per epoch)."""
        return GaussianEvent(noise_multiplier, 2 * epochs)

    def clip(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Clipped rows without noise (what evaluation on non-training rows releases)."""
        return _clip_rows(embeddings, self.embedding_clip)

    def release_embeddings(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Clip each training row to ``C_e`` and add ``N(0, (2 s C_e)^2)`` per coordinate."""
        clipped, _ = clip_jointly([embeddings], self.embedding_clip)
        return self.noise.add_gaussian(clipped[0].to(embeddings.dtype), self.embedding_noise_std)

    def bottom_gradients(self, x: torch.Tensor, upstream: torch.Tensor, scale: float | None = None) -> dict[str, torch.Tensor]:
        """Privatised mean gradient of the bottom model for one batch.

        ``upstream`` is d(mean loss)/d(released row) as received (so it carries a 1/B factor); per-sample gradients
        are taken of ``<clip(f(x_i)), scale * upstream_i>`` with ``scale = B`` by default, i.e. per-sample loss
        gradients, clipped to ``C_g``, summed, noised, and divided by ``B``.
        """
        b = x.shape[0]
        if upstream.shape[0] != b:
            raise ConfigError(f"feature DP: {b} rows but {upstream.shape[0]} upstream gradient rows")
        scale = float(b) if scale is None else float(scale)
        params = {n: p.detach() for n, p in self.bottom.named_parameters() if p.requires_grad}
        buffers = {n: t.detach() for n, t in self.bottom.named_buffers()}
        bottom, c_e = self.bottom, self.embedding_clip

        def inner(p: dict[str, torch.Tensor], xi: torch.Tensor, gi: torch.Tensor) -> torch.Tensor:
            e = functional_call(bottom, (p, buffers), (xi.unsqueeze(0),))
            return (_clip_rows(e, c_e) * gi.unsqueeze(0)).sum()

        per_sample = vmap(grad(inner), in_dims=(None, 0, 0))
        names = list(params)
        totals = {n: torch.zeros_like(params[n], dtype=torch.float64) for n in names}
        g_all = upstream.detach().to(x.dtype) * scale
        for start in range(0, b, self.chunk):
            sl = slice(start, start + self.chunk)
            grads = per_sample(params, x[sl].detach(), g_all[sl])
            clipped, _ = clip_jointly([grads[n] for n in names], self.gradient_clip)
            for n, c in zip(names, clipped, strict=True):
                totals[n] += c.sum(0)
        return {
            n: (self.noise.add_gaussian(totals[n], self.gradient_noise_std) / b).to(params[n].dtype) for n in names
        }

    def apply(self, grads: dict[str, torch.Tensor]) -> None:
        for n, p in self.bottom.named_parameters():
            if n in grads:
                p.grad = grads[n].clone()

    def describe(self) -> dict[str, Any]:
        return {
            "embedding_clip": self.embedding_clip,
            "gradient_clip": self.gradient_clip,
            "noise_multiplier": self.noise_multiplier,
            "embedding_noise_std": self.embedding_noise_std,
            "gradient_noise_std": self.gradient_noise_std,
        }
