"""The malicious local optimizer of Fu et al.'s active model completion attack (USENIX Security 2022).

Threat model: a *malicious* feature party that deviates only inside its own training step -- nothing it sends looks
different in format. At each step it scales every parameter's step element-wise by
r = clamp(1 + gamma * g_t / g_(t-1), r_min, r_max), accelerating its bottom model wherever its gradient keeps its
sign. Its bottom model then fits the task faster than the other parties' and carries more of the prediction, which
a later (passive) model completion turns into better label inference.

Fu et al. scale the gradient inside plain SGD, where that is the same as scaling the step. Under an adaptive
optimiser (Adam) a scaled gradient is largely normalised away again, so by default the wrapper scales the *update*
the inner optimiser makes (``scale="update"``); ``scale="gradient"`` scales the gradient before the step instead.
"""

from __future__ import annotations

from typing import Any

import torch

from secvfl.errors import ConfigError

__all__ = ["MaliciousOptimizer"]


class MaliciousOptimizer:
    """Wraps any ``torch.optim.Optimizer``; scales each step element-wise by the clamped gradient ratio r.

    ``g_(t-1)`` is the previous step's *unscaled* gradient of the same parameter; on the first step (or where a
    parameter had no gradient before) r = 1. ``eps`` keeps the ratio finite where g_(t-1) is zero; the clamp then
    bounds it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, gamma: float = 1.0, r_min: float = 1.0,
                 r_max: float = 5.0, eps: float = 1e-7, scale: str = "update") -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"MaliciousOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if gamma < 0 or not 0 < r_min <= r_max:
            raise ConfigError(f"need gamma >= 0 and 0 < r_min <= r_max, got gamma={gamma}, [{r_min}, {r_max}]")
        if scale not in ("update", "gradient"):
            raise ConfigError(f"scale must be 'update' or 'gradient', got {scale!r}")
        self.optimizer = optimizer
        self.gamma, self.r_min, self.r_max, self.eps, self.scale = gamma, r_min, r_max, eps, scale
        self._previous: dict[torch.Tensor, torch.Tensor] = {}
        self.last_mean_ratio: float = 1.0  # mean r of the latest step, for logs

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def ratios(self) -> dict[torch.Tensor, torch.Tensor]:
        """r for every parameter with a gradient (and a previous one), from the current gradients; updates g_(t-1)."""
        out: dict[torch.Tensor, torch.Tensor] = {}
        total, count = 0.0, 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                prev = self._previous.get(p)
                self._previous[p] = g.detach().clone()
                if prev is None or prev.shape != g.shape:
                    continue
                # Keep the sign of g_(t-1) in the denominator; eps only guards exact zeros.
                denom = torch.where(prev >= 0, prev + self.eps, prev - self.eps)
                ratio = (1.0 + self.gamma * g / denom).clamp_(self.r_min, self.r_max)
                out[p] = ratio
                total += float(ratio.sum())
                count += ratio.numel()
        self.last_mean_ratio = total / count if count else 1.0
        return out

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ratios = self.ratios()
        if self.scale == "gradient":
            with torch.no_grad():
                for p, r in ratios.items():
                    p.grad.mul_(r)
            self.optimizer.step()
            return loss
        before = {p: p.detach().clone() for p in ratios}
        self.optimizer.step()
        with torch.no_grad():
            for p, r in ratios.items():
                p.copy_(before[p] + r * (p - before[p]))
        return loss

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"MaliciousOptimizer({self.optimizer!r}, gamma={self.gamma}, r=[{self.r_min}, {self.r_max}])"
