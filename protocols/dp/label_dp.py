"""The label-DP gradient mechanism: the label party's backward pass, privatised.

Threat model
    Protected: each training sample's label. Adversary: the feature parties, colluding with each other (and anyone
    they pass things to), who see everything the label party sends them -- the cut-layer gradient rows -- plus, to
    keep the analysis simple and conservative, every update of the label party's head. They know which samples are
    in each batch (they computed the embeddings), so *no* amplification by subsampling is claimed.
    Neighbouring relation: two training sets differ in the label of one sample (replace-one-label).
    Not protected: the features (each feature party holds its own), batch membership, the number of samples and
    classes; the label party itself (it holds the labels) is trusted.

Mechanism, default ``residual`` reduction (one step, batch ``B``)
    A sample's label enters the step only through ``r_i = d loss_i / d z_i`` (``sigmoid(z) - y`` for BCE,
    ``softmax(z) - onehot(y)`` for CE); the logits ``z_i`` and their Jacobians are functions of features and earlier
    releases. Release ``r~_i = r_i + N(0, (s Delta)^2 I)`` (``Delta = 1`` BCE, ``sqrt(2)`` CE, ``2C`` for other losses
    with ``r`` clipped to ``C``) and compute everything from it: the rows sent to the feature parties,
    ``d z_i / d row_i ^T r~_i / B``, and the head update, ``sum_i d z_i / d theta ^T r~_i / B``. One Gaussian
    mechanism per sample per step; the transcript is post-processing of the noisy residuals.

Mechanism, ``jacobian``/``gradient`` reductions (one step, batch ``B``)
    For each sample ``i`` of the batch compute its *joint vector* ``v_i = [row_i (the cut-layer gradient row across
    ALL feature parties' slices), head_weight * g_i (its gradient of the head parameters)]`` with a per-sample
    reduction of :mod:`protocols.dp.mechanisms` (``bce``/``softmax``: clip the label-independent logit Jacobian;
    ``gradient``: clip the loss gradient), so a label change moves ``v_i`` by at most ``Delta`` in L2
    (``C`` or ``2 C``). Release ``row_i + N(0, (s Delta)^2 I)`` for every ``i`` and ``sum_i g_i + N(0, (s Delta)^2 I)``
    (the head part divided back by ``head_weight``), then divide by ``B`` (post-processing) to get the mean-loss
    gradients training expects. Changing one label changes one ``v_i`` only, so each step is one Gaussian mechanism
    with noise multiplier ``s`` for that sample.

Composition (all reductions)
    The head's parameters and the rows of other samples are functions of earlier releases and of labels that did
    not change, so by adaptive composition a sample that is in one batch per epoch is covered by ``epochs``
    Gaussian releases: ``GaussianEvent(s, epochs)`` (sample rate 1). The final model (bottom models and head) is
    post-processing of the releases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from protocols.dp.denoise import LabelPosterior
from protocols.dp.mechanisms import (
    LABEL_NEIGHBOURING,
    Release,
    bce_jacobian_release,
    clip_loss_gradients,
    label_residuals,
    release_sensitivity,
    softmax_jacobian_release,
)
from protocols.dp.rng import NoiseSource
from secvfl.errors import ConfigError, UnsupportedError

__all__ = ["LabelDPRule", "LabelDPBackward", "LabelDPStep", "check_dp_module", "clip_mode_for", "loss_for"]

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


def _canonical_loss(loss: str) -> str:
    return "ce" if loss in ("ce", "cross_entropy", "softmax") else loss


def clip_mode_for(loss: str, clip: str = "auto") -> str:
    """The per-sample reduction (see :mod:`protocols.dp.mechanisms`): ``residual`` (default), ``bce``/``softmax``
    (``--dp-clip jacobian``) or ``gradient``."""
    loss = _canonical_loss(loss)
    if clip in ("auto", "residual"):
        return "residual"
    if clip == "gradient":
        return "gradient"
    if clip != "jacobian":
        raise ConfigError(f"unknown --dp-clip {clip!r}; valid: auto, residual, jacobian, gradient")
    if loss == "bce":
        return "bce"
    if loss == "ce":
        return "softmax"
    raise UnsupportedError(
        f"Jacobian clipping needs a loss whose gradient is linear in the label (bce, ce), not {loss!r}; "
        "use --dp-clip residual or gradient"
    )


@dataclass
class LabelDPStep:
    """What one privatised backward step produced (mean-loss scale, dtype of the inputs/parameters)."""

    input_grads: list[torch.Tensor]  # noisy d(mean loss)/d(head input j), one per head input, shape like the input
    head_grads: dict[str, torch.Tensor]  # noisy mean gradient of each trainable head parameter
    loss: float  # the exact batch loss, for the label party's own log (never released)
    clipped_fraction: float
    noise_std: float  # standard deviation added to each per-sample release / the head sum, before dividing by B
    sensitivity: float
    batch_size: int


def _map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(fn, v) for k, v in obj.items()}
    return obj


def loss_for(loss: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean batch loss by name (``bce`` on one logit, ``ce`` softmax cross-entropy, ``mse``)."""
    if loss == "bce":
        return lambda z, y: nn.functional.binary_cross_entropy_with_logits(z.reshape(-1), y.to(z.dtype))
    if loss in ("ce", "cross_entropy", "softmax"):
        return lambda z, y: nn.functional.cross_entropy(z, y.long())
    if loss == "mse":
        return lambda z, y: nn.functional.mse_loss(z.reshape(-1), y.reshape(-1).to(z.dtype))
    raise UnsupportedError(f"label DP does not know the loss {loss!r}; valid: bce, ce, mse")


class LabelDPRule:
    """The label party's backward rule under label DP (see the module docstring for the analysis).

    Call signature of ``secvfl.parties.BackwardRule``: ``rule(head, forward, inputs, labels, loss_fn) -> loss``. It
    writes the privatised mean-loss gradients into ``.grad`` of every input tensor (what the feature parties get)
    and of every trainable head parameter (what the label party's optimiser applies).

    Per-sample Jacobians: of the logits w.r.t. the inputs by one batched backward pass per logit (exact because no
    head layer mixes samples -- BatchNorm is refused), and w.r.t. the head parameters by ``vmap(jacrev)`` over the
    head's own input (captured with a forward pre-hook, so input scaling done by ``forward`` is respected).
    """

    def __init__(
        self,
        *,
        loss: str,
        clip_norm: float,
        noise_multiplier: float,
        noise: NoiseSource,
        clip: str = "auto",
        head_weight: float = 1.0,
        chunk: int = 0,
        posterior_rows: int | None = None,
    ) -> None:
        if not clip_norm > 0:
            raise ConfigError(f"DP clip norm must be > 0, got {clip_norm}")
        if not noise_multiplier >= 0:
            raise ConfigError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        if not head_weight > 0:
            raise ConfigError(f"head weight must be > 0, got {head_weight}")
        self.loss = _canonical_loss(loss)
        self.mode = clip_mode_for(loss, clip)
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.noise = noise
        self.head_weight = float(head_weight)
        self.chunk = int(chunk)
        self.sensitivity = release_sensitivity(self.mode, self.loss, self.clip_norm)
        self.noise_std = self.noise_multiplier * self.sensitivity
        self._checked: set[int] = set()
        # running facts for the summary (and for the layer's check that every release went through here)
        self.steps = 0
        self.rows_released = 0
        self.clipped_rows = 0.0
        self.pending_release = False
        self.last: LabelDPStep | None = None
        self.last_residuals: tuple[torch.Tensor, torch.Tensor] | None = None  # (exact, noisy), residual mode
        # optional post-processing (residual mode, bce/ce): soft labels from all of a sample's releases so far
        self.posterior: LabelPosterior | None = None
        self.posterior_rows: int | None = None
        if posterior_rows is not None:
            if self.mode != "residual" or self.loss not in ("bce", "ce"):
                raise UnsupportedError("the label posterior needs --dp-clip residual and a bce or ce loss")
            self.posterior_rows = int(posterior_rows)

    @property
    def neighbouring(self) -> str:
        return LABEL_NEIGHBOURING

    # -- the three stages -----------------------------------------------------------------------------------
    def _jacobians(
        self, head: nn.Module, forward: Callable[[list[torch.Tensor]], torch.Tensor], inputs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
        """Logits (B, K), input Jacobians [(B, K, *input shape)], and the head's captured (detached) arguments."""
        captured: list[tuple] = []
        handle = head.register_forward_pre_hook(lambda _m, args: captured.append(args))
        try:
            logits = forward(inputs)
        finally:
            handle.remove()
        if not captured:
            raise ConfigError("label DP: the forward function never called the head")
        b = inputs[0].shape[0]
        z = logits.reshape(b, -1)
        k = z.shape[1]
        per_class = []
        for j in range(k):
            grads = torch.autograd.grad(z[:, j].sum(), inputs, retain_graph=j < k - 1, allow_unused=True)
            per_class.append([torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True)])
        input_jacs = [torch.stack([pc[i] for pc in per_class], dim=1).detach() for i in range(len(inputs))]
        return logits.detach(), input_jacs, _map(lambda t: t.detach(), captured[-1])

    def _param_jacobian_fn(self, head: nn.Module) -> tuple[Callable, dict[str, torch.Tensor]]:
        params = {n: p.detach() for n, p in head.named_parameters() if p.requires_grad}
        buffers = {n: t.detach() for n, t in head.named_buffers()}

        def single(p: dict[str, torch.Tensor], args: Any) -> torch.Tensor:
            out = functional_call(head, (p, buffers), _map(lambda t: t.unsqueeze(0), args))
            return out.reshape(-1)

        return vmap(jacrev(single), in_dims=(None, 0)), params

    def _release(
        self, parts: list[torch.Tensor], logits: torch.Tensor, labels: torch.Tensor, loss_fn: Callable
    ) -> Release:
        """Per-sample clipped vectors from Jacobian parts of shape (b, K, ...)."""
        if self.mode == "bce":
            if parts[0].shape[1] != 1:
                raise ConfigError(f"the bce clipping needs one logit per sample, the head gives {parts[0].shape[1]}")
            return bce_jacobian_release([p[:, 0] for p in parts], logits.reshape(-1), labels, self.clip_norm)
        if self.mode == "softmax":
            return softmax_jacobian_release(parts, logits.reshape(logits.shape[0], -1), labels, self.clip_norm)
        # gradient mode: per-sample loss gradients = sum_k (d loss_i / d z_ik) J_ik, then plain clipping
        z = logits.detach().clone().requires_grad_(True)
        (dz,) = torch.autograd.grad(loss_fn(z, labels) * z.shape[0], z)  # mean loss x B: per-sample derivatives
        dz = dz.reshape(z.shape[0], -1).to(torch.float64)
        grads = [torch.einsum("bk,bk...->b...", dz, p.to(torch.float64)) for p in parts]
        return clip_loss_gradients(grads, self.clip_norm)

    # -- one step ---------------------------------------------------------------------------------------------
    def step(
        self,
        head: nn.Module,
        forward: Callable[[list[torch.Tensor]], torch.Tensor],
        inputs: list[torch.Tensor],
        labels: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        rows: np.ndarray | None = None,
    ) -> LabelDPStep:
        """Privatised gradients for one batch (nothing is written into ``.grad``); ``rows``: the batch's training row
        ids (needed by the posterior)."""
        if id(head) not in self._checked:
            check_dp_module(head, "label party's head")
            self._checked.add(id(head))
        labels = labels.detach().reshape(-1)
        b = labels.shape[0]
        if b == 0:
            raise ConfigError("label DP got an empty batch")
        for x in inputs:
            if x.shape[0] != b:
                raise ConfigError(f"head input has {x.shape[0]} rows but the batch has {b} labels")
            if not x.requires_grad:
                raise ConfigError("label DP needs head inputs that require grad")
        if self.mode == "residual":
            return self._residual_step(head, forward, inputs, labels, loss_fn, rows)
        logits, input_jacs, args = self._jacobians(head, forward, inputs)
        with torch.no_grad():
            loss = float(loss_fn(logits, labels))
        pfn, params = self._param_jacobian_fn(head)
        names = list(params)
        w = self.head_weight
        rows: list[list[torch.Tensor]] = [[] for _ in inputs]
        head_sums = {n: torch.zeros(params[n].shape, dtype=torch.float64) for n in names}
        clipped = 0.0
        z2 = logits.reshape(b, -1)
        chunk = self.chunk
        if chunk <= 0:  # auto: about 2**22 Jacobian entries (32 MiB in float64) per chunk
            width = z2.shape[1] * (sum(p.numel() for p in params.values()) + sum(x[0].numel() for x in inputs))
            chunk = max(1, (1 << 22) // max(1, width))
        for start in range(0, b, chunk):
            sl = slice(start, start + chunk)
            pj = pfn(params, _map(lambda t, sl=sl: t[sl], args)) if names else {}
            parts = [j[sl] for j in input_jacs] + [w * pj[n].reshape(pj[n].shape[0], z2.shape[1], *params[n].shape)
                                                   for n in names]
            rel = self._release(parts, logits[sl], labels[sl], loss_fn)
            for i in range(len(inputs)):
                rows[i].append(rel.parts[i])
            for n, r in zip(names, rel.parts[len(inputs):], strict=True):
                head_sums[n] += r.sum(0)
            clipped += rel.clipped_fraction * (min(b, start + chunk) - start)
        std = self.noise_std
        input_grads = [
            (self.noise.add_gaussian(torch.cat(r), std) / b).to(dtype=x.dtype, device=x.device)
            for r, x in zip(rows, inputs, strict=True)
        ]
        head_grads = {
            n: (self.noise.add_gaussian(head_sums[n], std) / (w * b)).to(dtype=params[n].dtype, device=params[n].device)
            for n in names
        }
        self.steps += 1
        self.rows_released += b
        self.clipped_rows += clipped
        self.last = LabelDPStep(input_grads, head_grads, loss, clipped / b, std, self.sensitivity, b)
        return self.last

    def _residual_step(
        self,
        head: nn.Module,
        forward: Callable[[list[torch.Tensor]], torch.Tensor],
        inputs: list[torch.Tensor],
        labels: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        rows: np.ndarray | None = None,
    ) -> LabelDPStep:
        """``residual`` mode: noise the per-sample ``d loss / d z`` once, back-propagate the noisy residuals."""
        b = labels.shape[0]
        logits = forward(inputs)
        if logits.shape[0] != b:
            raise ConfigError(f"the head gave {logits.shape[0]} rows of logits for a batch of {b}")
        if self.loss in ("bce", "ce"):
            if self.loss == "bce" and logits.reshape(b, -1).shape[1] != 1:
                raise ConfigError(f"the bce loss needs one logit per sample; the head gives {tuple(logits.shape)}")
            r = label_residuals(logits, labels, self.loss)
        else:  # another loss: its per-sample derivatives, clipped to C
            z = logits.detach().clone().requires_grad_(True)
            (dz,) = torch.autograd.grad(loss_fn(z, labels) * b, z)
            r = label_residuals(dz, labels, self.loss, self.clip_norm)
        with torch.no_grad():
            loss = float(loss_fn(logits.detach(), labels))
        noisy = self.noise.add_gaussian(r, self.noise_std)  # the only label-dependent release
        self.last_residuals = (r, noisy)
        if self.posterior is None and self.posterior_rows is not None:
            self.posterior = LabelPosterior(self.posterior_rows, r.shape[1], self.noise_std)
        if self.posterior is not None:
            # post-processing: the release is an observation of the label; train on the posterior soft label
            if rows is None or len(rows) != b:
                raise ConfigError("label DP with a posterior needs the batch's row ids (the label party's rows=)")
            base = (torch.sigmoid(logits.detach().to(torch.float64).reshape(b, 1)) if self.loss == "bce"
                    else torch.softmax(logits.detach().to(torch.float64).reshape(b, -1), dim=1))
            self.posterior.update(rows, base - noisy)
            noisy = base - self.posterior.soft_labels(rows)
        params = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(
            logits, [*inputs, *(p for _, p in params)],
            grad_outputs=(noisy / b).reshape(logits.shape).to(dtype=logits.dtype, device=logits.device),
            allow_unused=True,
        )
        n_in = len(inputs)
        input_grads = [torch.zeros_like(x) if g is None else g.detach() for g, x in zip(grads[:n_in], inputs, strict=True)]
        head_grads = {n: torch.zeros_like(p) if g is None else g.detach()
                      for (n, p), g in zip(params, grads[n_in:], strict=True)}
        self.steps += 1
        self.rows_released += b
        self.last = LabelDPStep(input_grads, head_grads, loss, 0.0, self.noise_std, self.sensitivity, b)
        return self.last

    def __call__(
        self,
        head: nn.Module,
        forward: Callable[[list[torch.Tensor]], torch.Tensor],
        inputs: list[torch.Tensor],
        labels: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        rows: np.ndarray | None = None,
    ) -> float:
        out = self.step(head, forward, inputs, labels, loss_fn, rows)
        for x, g in zip(inputs, out.input_grads, strict=True):
            x.grad = g
        for n, p in head.named_parameters():
            if n in out.head_grads:
                p.grad = out.head_grads[n].clone()
        self.pending_release = True
        return out.loss

    def describe(self) -> dict[str, Any]:
        unused = self.mode == "residual" and self.loss in ("bce", "ce")  # the residual is bounded by the loss
        return {
            "clip_mode": self.mode,
            "clip_norm": None if unused else self.clip_norm,
            "sensitivity": self.sensitivity,
            "noise_multiplier": self.noise_multiplier,
            "noise_std": self.noise_std,
            "head_weight": None if self.mode == "residual" else self.head_weight,
            "steps": self.steps,
            "rows_released": self.rows_released,
            # Under --dp-clip gradient whether a row is clipped depends on its label: the count would be an
            # unprotected release, so it is published only for the label-independent clips.
            "clipped_fraction": (round(self.clipped_rows / self.rows_released, 4)
                                 if self.rows_released and self.mode != "gradient" else None),
        }


class LabelDPBackward:
    """Module-level convenience around :class:`LabelDPRule`: ``head`` called as ``call(head, inputs)``.

    Used where no :class:`secvfl.parties.LabelParty` is involved (tests, audits): returns a :class:`LabelDPStep`
    for given inputs and labels; :meth:`apply` writes the head gradients.
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
        self.rule = LabelDPRule(loss=loss, clip_norm=clip_norm, noise_multiplier=noise_multiplier, noise=noise,
                                clip=clip, head_weight=head_weight, chunk=chunk)
        check_dp_module(head, "label party's head")
        self.head = head
        self.call = call
        self.loss_fn = loss_for(loss)

    @property
    def mode(self) -> str:
        return self.rule.mode

    @property
    def sensitivity(self) -> float:
        return self.rule.sensitivity

    @property
    def noise_std(self) -> float:
        return self.rule.noise_std

    def per_sample_release(self, inputs: Sequence[torch.Tensor], labels: torch.Tensor) -> tuple[Release, torch.Tensor]:
        """Clipped per-sample joint vectors ``[input rows..., head_weight * head grads...]`` (no noise) and logits."""
        xs = [x.detach().clone().requires_grad_(True) for x in inputs]
        labels = labels.detach().reshape(-1)
        logits, input_jacs, args = self.rule._jacobians(self.head, lambda t: self.call(self.head, t), xs)
        pfn, params = self.rule._param_jacobian_fn(self.head)
        pj = pfn(params, args)
        k = logits.reshape(len(labels), -1).shape[1]
        parts = input_jacs + [self.rule.head_weight * pj[n].reshape(len(labels), k, *params[n].shape) for n in params]
        return self.rule._release(parts, logits, labels, self.loss_fn), logits

    def __call__(self, inputs: Sequence[torch.Tensor], labels: torch.Tensor) -> LabelDPStep:
        xs = [x.detach().clone().requires_grad_(True) for x in inputs]
        return self.rule.step(self.head, lambda t: self.call(self.head, t), xs, labels, self.loss_fn)

    def apply(self, step: LabelDPStep) -> None:
        """Write the privatised head gradients into ``.grad`` (ready for the label party's optimizer step)."""
        for n, p in self.head.named_parameters():
            if n in step.head_grads:
                p.grad = step.head_grads[n].clone()

    def describe(self) -> dict[str, Any]:
        return self.rule.describe()
