"""The label-DP gradient mechanism: the label party's backward pass, privatised.

Threat model
    Protected: each training sample's label. Adversary: the feature parties, colluding with each other (and anyone
    they pass things to), who see everything the label party sends them -- the cut-layer gradient rows -- plus, to
    keep the analysis simple and conservative, every update of the label party's head. They know which samples are
    in each batch (they computed the embeddings), so *no* amplification by subsampling is claimed.
    Neighbouring relation: two training sets differ in the label of one sample (replace-one-label).
    Not protected: the features (each feature party holds its own), batch membership, the number of samples and
    classes; the label party itself (it holds the labels) is trusted.

Mechanism (one step, batch ``B``)
    For each sample ``i`` of the batch compute its *joint vector* ``v_i = [row_i (the cut-layer gradient row across
    ALL feature parties' slices), head_weight * g_i (its gradient of the head parameters)]`` with a per-sample
    reduction of :mod:`protocols.dp.mechanisms` (``bce``/``softmax``: clip the label-independent logit Jacobian;
    ``gradient``: clip the loss gradient), so a label change moves ``v_i`` by at most ``Delta`` in L2
    (``C`` or ``2 C``). Release ``row_i + N(0, (s Delta)^2 I)`` for every ``i`` and ``sum_i g_i + N(0, (s Delta)^2 I)``
    (the head part divided back by ``head_weight``), then divide by ``B`` (post-processing) to get the mean-loss
    gradients training expects. Changing one label changes one ``v_i`` only, so each step is one Gaussian mechanism
    with noise multiplier ``s`` for that sample. The head's parameters and the rows of other samples are functions of
    earlier releases and of labels that did not change, so by adaptive composition a sample that is in one batch per
    epoch is covered by ``epochs`` Gaussian releases: ``GaussianEvent(s, epochs)`` (sample rate 1).
    The final model (bottom models and head) is post-processing of the releases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from protocols.dp.mechanisms import (
    LABEL_NEIGHBOURING,
    Release,
    bce_jacobian_release,
    clip_loss_gradients,
    sensitivity_factor,
    softmax_jacobian_release,
)
from protocols.dp.rng import NoiseSource
from secvfl.errors import ConfigError, UnsupportedError

__all__ = ["LabelDPBackward", "LabelDPStep", "check_dp_module", "clip_mode_for"]

HeadCall = Callable[[Callable[..., torch.Tensor], Sequence[torch.Tensor]], torch.Tensor]


def _default_call(module: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    return module(*inputs)


def check_dp_module(module: nn.Module, what: str) -> None:
    """Refuse modules whose per-sample gradients are not per-sample (BatchNorm and friends), via Opacus's validator."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(module, strict=False)
    if errors:
        raise UnsupportedError(
            f"the {what} cannot be trained with differential privacy: {errors[0]} "
            "(use LayerNorm/GroupNorm instead of BatchNorm)"
        )


def clip_mode_for(loss: str, clip: str = "auto") -> str:
    """The per-sample reduction for a loss: ``bce``/``softmax`` (Jacobian clipping, sensitivity C) or ``gradient``."""
    if clip == "gradient":
        return "gradient"
    if clip not in ("auto", "jacobian"):
        raise ConfigError(f"unknown DP clipping {clip!r}; valid: auto, jacobian, gradient")
    if loss == "bce":
        return "bce"
    if loss in ("ce", "cross_entropy", "softmax"):
        return "softmax"
    if clip == "jacobian":
        raise UnsupportedError(
            f"Jacobian clipping needs a loss whose gradient is linear in the label (bce, ce), not {loss!r}; "
            "use --dp-clip gradient (twice the noise)"
        )
    return "gradient"


@dataclass
class LabelDPStep:
    """What one privatised backward step produced (float32, mean-loss scale)."""

    input_grads: list[torch.Tensor]  # noisy d(mean loss)/d(head input j), one per head input, shape like the input
    head_grads: dict[str, torch.Tensor]  # noisy mean gradient of each trainable head parameter
    loss: float  # the exact batch loss, for the label party's own log (never released)
    clipped_fraction: float
    noise_std: float  # standard deviation added to each per-sample release / the head sum, before dividing by B
    sensitivity: float
    batch_size: int


class LabelDPBackward:
    """Privatised backward of the label party's head; see the module docstring for the analysis.

    ``head`` maps the batch inputs (one tensor per feature party for a concat head, or the one aggregated tensor)
    to logits: shape (B,) or (B, 1) for ``loss="bce"``, (B, K) for ``loss="ce"``. ``call(module, inputs)`` says how
    to invoke it (default ``module(*inputs)``). ``chunk`` bounds the per-sample Jacobians held in memory at once.
    """

    def __init__(
        self,
        head: nn.Module,
        *,
        loss: str,
        clip_norm: float,
        noise_multiplier: float,
        noise: NoiseSource,
        clip: str = "auto",
        head_weight: float = 1.0,
        call: HeadCall = _default_call,
        chunk: int = 256,
    ) -> None:
        if not clip_norm > 0:
            raise ConfigError(f"DP clip norm must be > 0, got {clip_norm}")
        if not noise_multiplier >= 0:
            raise ConfigError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        if not head_weight > 0:
            raise ConfigError(f"head weight must be > 0, got {head_weight}")
        check_dp_module(head, "label party's head")
        self.head = head
        self.loss = loss
        self.mode = clip_mode_for(loss, clip)
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.noise = noise
        self.head_weight = float(head_weight)
        self.call = call
        self.chunk = int(chunk)
        self.sensitivity = sensitivity_factor(self.mode) * self.clip_norm
        self.noise_std = self.noise_multiplier * self.sensitivity

    @property
    def neighbouring(self) -> str:
        return LABEL_NEIGHBOURING

    def _params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.head.named_parameters() if p.requires_grad}

    def per_sample_release(self, inputs: Sequence[torch.Tensor], labels: torch.Tensor) -> tuple[Release, torch.Tensor]:
        """Clipped per-sample joint vectors ``[input rows..., head_weight * head grads...]`` (no noise) and logits."""
        params = self._params()
        names = list(params)
        buffers = {n: b.detach() for n, b in self.head.named_buffers()}
        inputs = [x.detach() for x in inputs]
        call, head, w = self.call, self.head, self.head_weight
        bce = self.mode == "bce" or self.loss == "bce"

        def logits_of(p: dict[str, torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
            def bound(*a: torch.Tensor) -> torch.Tensor:  # the head with parameters ``p``, for a custom ``call``
                return functional_call(head, (p, buffers), a)

            out = call(bound, [x.unsqueeze(0) for x in xs])
            # one logit per sample for bce: a scalar, so Jacobians have the shape of what they differentiate
            return out.reshape(()) if bce else out.squeeze(0)

        with torch.no_grad():
            logits = call(head, inputs)
        if self.mode == "bce":
            logits = logits.reshape(-1)
            if logits.shape[0] != labels.shape[0]:
                raise ConfigError(f"the bce loss needs one logit per sample; the head gave shape {tuple(logits.shape)}")
        argnums = tuple(range(1, len(inputs) + 1))
        if self.mode == "gradient":
            y_all = labels

            def loss_of(p: dict[str, torch.Tensor], y: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
                z = logits_of(p, *xs)
                if self.loss == "bce":
                    return nn.functional.binary_cross_entropy_with_logits(z.reshape(()), y.to(z.dtype))
                if self.loss in ("ce", "cross_entropy", "softmax"):
                    return nn.functional.cross_entropy(z.reshape(1, -1), y.reshape(1))
                if self.loss == "mse":
                    return nn.functional.mse_loss(z.reshape(-1), y.reshape(-1).to(z.dtype))
                raise UnsupportedError(f"label DP does not know the loss {self.loss!r}")

            fn = vmap(grad(loss_of, argnums=(0, *[a + 1 for a in argnums])), in_dims=(None, 0, *[0] * len(inputs)))
        else:
            fn = vmap(jacrev(logits_of, argnums=(0, *argnums)), in_dims=(None, *[0] * len(inputs)))

        releases: list[Release] = []
        b = labels.shape[0]
        for start in range(0, b, self.chunk):
            sl = slice(start, start + self.chunk)
            xs = [x[sl] for x in inputs]
            if self.mode == "gradient":
                out = fn(params, y_all[sl], *xs)
            else:
                out = fn(params, *xs)
            pgrads, xgrads = out[0], list(out[1:])
            parts = xgrads + [w * pgrads[n] for n in names]
            if self.mode == "gradient":
                releases.append(clip_loss_gradients(parts, self.clip_norm))
            elif self.mode == "bce":
                releases.append(bce_jacobian_release(parts, logits[sl], labels[sl], self.clip_norm))
            else:
                releases.append(softmax_jacobian_release(parts, logits[sl], labels[sl], self.clip_norm))
        merged = [torch.cat([r.parts[i] for r in releases]) for i in range(len(releases[0].parts))]
        frac = sum(r.clipped_fraction * r.parts[0].shape[0] for r in releases) / b
        first = releases[0]
        return Release(merged, first.sensitivity, first.clip_norm, first.mode, frac), logits

    def __call__(self, inputs: Sequence[torch.Tensor], labels: torch.Tensor) -> LabelDPStep:
        """Privatised mean-loss gradients for the head inputs and the head parameters of one batch."""
        labels = labels.detach().reshape(-1)
        b = labels.shape[0]
        if b == 0:
            raise ConfigError("label DP got an empty batch")
        for x in inputs:
            if x.shape[0] != b:
                raise ConfigError(f"head input has {x.shape[0]} rows but the batch has {b} labels")
        release, logits = self.per_sample_release(inputs, labels)
        n_in = len(inputs)
        names = list(self._params())
        std = self.noise_std
        input_grads = [
            (self.noise.add_gaussian(r, std) / b).to(inputs[i].dtype) for i, r in enumerate(release.parts[:n_in])
        ]
        head_grads = {}
        for n, r in zip(names, release.parts[n_in:], strict=True):
            total = self.noise.add_gaussian(r.sum(0), std) / self.head_weight
            head_grads[n] = (total / b).to(dict(self.head.named_parameters())[n].dtype)
        with torch.no_grad():
            if self.mode == "bce" or (self.mode == "gradient" and self.loss == "bce"):
                loss = nn.functional.binary_cross_entropy_with_logits(logits.reshape(-1), labels.to(logits.dtype))
            elif self.loss in ("ce", "cross_entropy", "softmax"):
                loss = nn.functional.cross_entropy(logits, labels.long())
            else:
                loss = nn.functional.mse_loss(logits.reshape(-1), labels.to(logits.dtype))
        return LabelDPStep(input_grads, head_grads, float(loss), release.clipped_fraction, std, self.sensitivity, b)

    def apply(self, step: LabelDPStep) -> None:
        """Write the privatised head gradients into ``.grad`` (ready for the label party's optimizer step)."""
        for n, p in self.head.named_parameters():
            if n in step.head_grads:
                p.grad = step.head_grads[n].clone()

    def describe(self) -> dict[str, Any]:
        return {
            "clip_mode": self.mode,
            "clip_norm": self.clip_norm,
            "sensitivity": self.sensitivity,
            "noise_multiplier": self.noise_multiplier,
            "noise_std": self.noise_std,
            "head_weight": self.head_weight,
        }
