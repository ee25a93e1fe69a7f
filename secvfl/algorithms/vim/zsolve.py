"""The z-update of VIMADMM and VIMADMM-J (eqs. 6 and 16), solved for a whole batch at once.

For each sample j of the batch, with ``v_j`` the label party's current output (``sum_k h_j^k W_k + b``, or the sum
of the parties' logits) and ``lam_j`` the dual variable::

    z_j = argmin_z  loss(z, y_j) - lam_j^T z + rho/2 ||v_j - z||^2

The objective is strongly convex (the loss is convex, the penalty adds ``rho I`` to its Hessian), so Newton's
method with a backtracking (Armijo) line search converges from any start; it starts from ``v_j``. Every sample
takes its own step and step length, in one batched tensor computation: no Python loop over samples. The losses are
those of :func:`secvfl.parties.task_loss` per sample: softmax cross-entropy on ``C`` logits (its Hessian
``diag(p) - p p^T``), or for a binary task the logistic loss on one logit (Hessian ``sigma (1 - sigma)``).

Tolerance: it stops when every sample's gradient has max-norm at most ``tol * scale`` (default tol 1e-9, in
float64), ``scale = max(1, max |lam|, rho max |v|)``: the gradient is a difference of terms of that size, so float64
rounding alone leaves ~1e-16 scale of it (scale is 1 for healthy logits and duals: then strong convexity with modulus
``rho`` bounds the distance to the exact minimiser by ``sqrt(C) tol / rho``). If it is not reached, the inputs hold
non-finite values or values so large that the run has diverged, and it says so.
``tests/test_vim_zsolve.py`` compares it with scipy's L-BFGS-B run sample by sample.
"""

from __future__ import annotations

import torch

from secvfl.errors import ConfigError, TrainingDiverged

__all__ = ["solve_z", "z_objective", "MAX_NEWTON_STEPS"]

MAX_NEWTON_STEPS = 50
_MAX_HALVINGS = 30
_ARMIJO = 1e-4
_DIVERGED = ("training diverged: the parties' outputs or the duals reached {what}; lower --vim-lr or raise "
             "--vim-prox (the parties' local steps overshoot)")


def _loss(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample loss: logistic on one logit (binary, ``y`` in {0, 1}), softmax cross-entropy otherwise."""
    if z.shape[1] == 1:
        return torch.nn.functional.softplus(z[:, 0]) - y.to(z.dtype) * z[:, 0]
    return torch.logsumexp(z, dim=1) - z.gather(1, y[:, None])[:, 0]


def z_objective(z: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, y: torch.Tensor, rho: float) -> torch.Tensor:
    """The per-sample objective of the z-update (shape ``(B,)``)."""
    return _loss(z, y) - (lam * z).sum(dim=1) + 0.5 * rho * ((v - z) ** 2).sum(dim=1)


def _gradient_and_hessian(z: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, y: torch.Tensor,
                          rho: float) -> tuple[torch.Tensor, torch.Tensor]:
    b, c = z.shape
    if c == 1:
        s = torch.sigmoid(z)
        grad = s - y.to(z.dtype)[:, None]
        hess = (s * (1 - s))[:, :, None]
    else:
        p = torch.softmax(z, dim=1)
        grad = p - torch.nn.functional.one_hot(y, c).to(z.dtype)
        hess = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    grad = grad - lam + rho * (z - v)
    hess = hess + rho * torch.eye(c, dtype=z.dtype, device=z.device)
    return grad, hess


def _halvings(z: torch.Tensor, direction: torch.Tensor, f0: torch.Tensor, slope: torch.Tensor,
              rounding: torch.Tensor, v64: torch.Tensor, lam64: torch.Tensor, y: torch.Tensor, rho: float
              ) -> torch.Tensor:
    """Each sample's step length: ``1/2^j`` for the first ``j`` whose step meets the Armijo condition, tried one
    halving after the other (each a host read of whether any sample is still short)."""
    t = torch.ones(z.shape[0], dtype=torch.float64, device=z.device)
    for _ in range(_MAX_HALVINGS):
        f1 = z_objective(z + t[:, None] * direction, v64, lam64, y, rho)
        short = f1 > f0 + _ARMIJO * t * slope + rounding
        if not bool(short.any()):
            break
        t = torch.where(short, t / 2, t)
    return t


def _halvings_at_once(z: torch.Tensor, direction: torch.Tensor, f0: torch.Tensor, slope: torch.Tensor,
                      rounding: torch.Tensor, v64: torch.Tensor, lam64: torch.Tensor, y: torch.Tensor, rho: float
                      ) -> torch.Tensor:
    """The step lengths of :func:`_halvings`, every halving tried at once (no host read; for a GPU, where the
    extra arithmetic costs less than a wait per halving)."""
    h, (b, c) = _MAX_HALVINGS, z.shape
    ts = torch.pow(torch.tensor(0.5, dtype=torch.float64, device=z.device),
                   torch.arange(h, dtype=torch.float64, device=z.device))  # 1, 1/2, ..., 2^-(h-1): exact
    tried = (z[None] + ts[:, None, None] * direction[None]).reshape(h * b, c)
    f1 = z_objective(tried, v64.repeat(h, 1), lam64.repeat(h, 1), y.repeat(h), rho).reshape(h, b)
    ok = ~(f1 > f0[None] + _ARMIJO * ts[:, None] * slope[None] + rounding[None])
    first = ok.to(torch.uint8).argmax(dim=0)  # the first halving that meets the condition (0 if none does)
    return torch.where(ok.any(dim=0), ts[first], torch.full_like(f0, 0.5**h))


@torch.no_grad()
def solve_z(v: torch.Tensor, lam: torch.Tensor, y: torch.Tensor, rho: float, *, tol: float = 1e-9,
            max_steps: int = MAX_NEWTON_STEPS, line_search_at_once: bool | None = None) -> tuple[torch.Tensor, int]:
    """The minimisers ``z`` (``(B, C)``, in ``v``'s dtype) and the Newton steps taken; computed in float64.

    ``y``: integer class labels (``(B,)``). Raises :class:`ConfigError` if the tolerance is not reached (it only
    happens for non-finite inputs: the objective is strongly convex). ``line_search_at_once``: try every step length
    of the line search in one computation (default: on a GPU, where it saves a host wait per halving; the step
    lengths are the same).
    """
    if rho <= 0:
        raise ConfigError(f"the z-update needs rho > 0, got {rho}")
    dtype = v.dtype
    v64, lam64 = v.detach().to(torch.float64), lam.detach().to(torch.float64)
    y = y.to(device=v.device, dtype=torch.long)
    z = v64.clone()
    if v64.numel() == 0:
        return z.to(dtype), 0
    if line_search_at_once is None:
        line_search_at_once = v.device.type != "cpu"
    line_search = _halvings_at_once if line_search_at_once else _halvings
    # one host read for the checks and the scale (a single wait on a GPU)
    finite, lam_max, v_max = torch.stack([torch.isfinite(v64).all() & torch.isfinite(lam64).all(),
                                          lam64.abs().max(), v64.abs().max()]).tolist()
    if not finite:
        raise TrainingDiverged(_DIVERGED.format(what="non-finite values"))
    scale = max(1.0, lam_max, rho * v_max)
    for step in range(max_steps + 1):
        grad, hess = _gradient_and_hessian(z, v64, lam64, y, rho)
        if float(grad.abs().max()) <= tol * scale:
            return z.to(dtype), step
        if step == max_steps:
            break
        direction = -torch.linalg.solve(hess, grad[:, :, None])[:, :, 0]
        f0 = z_objective(z, v64, lam64, y, rho)
        slope = (grad * direction).sum(dim=1)  # < 0: the Hessian is positive definite
        rounding = 8 * torch.finfo(torch.float64).eps * (1 + f0.abs())  # near the optimum f barely changes
        # each sample halves its own step until the Armijo condition holds (Newton's full step, near the optimum)
        t = line_search(z, direction, f0, slope, rounding, v64, lam64, y, rho)
        z = z + t[:, None] * direction
    raise TrainingDiverged(_DIVERGED.format(what=f"values of size {scale:.3g}") + f" (the z-update's largest gradient "
                      f"after {max_steps} Newton steps: {float(grad.abs().max()):.3g}, tolerance {tol * scale:.3g})")
