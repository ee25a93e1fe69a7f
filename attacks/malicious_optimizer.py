"""The malicious local optimizer of Fu et al.'s active model completion attack (USENIX Security 2022).

Threat model: a *malicious* feature party that deviates only inside its own training step -- nothing it sends looks
different in format. Before each update it scales every gradient entry by
r = clamp(1 + gamma * g_t / g_(t-1), r_min, r_max), accelerating its bottom model wherever its gradient keeps its
sign. Its bottom model then fits the task faster than the other parties' and carries more of the prediction, which
a later (passive) model completion turns into better label inference.
"""

from __future__ import annotations

from typing import Any

import torch

from secvfl.errors import ConfigError

__all__ = ["MaliciousOptimizer"]


class MaliciousOptimizer:
    """Wraps any ``torch.optim.Optimizer``; scales gradients element-wise before delegating ``step``.

    ``g_(t-1)`` is the previous step's *unscaled* gradient of the same parameter; on the first step (or where a
    parameter had no gradient before) nothing is scaled. ``eps`` keeps the ratio finite where g_(t-1) is zero; the
    clamp then bounds it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, gamma: float = 1.0, r_min: float = 1.0,
                 r_max: float = 5.0, eps: float = 1e-7) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"MaliciousOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if gamma < 0 or not 0 < r_min <= r_max:
            raise ConfigError(f"need gamma >= 0 and 0 < r_min <= r_max, got gamma={gamma}, [{r_min}, {r_max}]")
        self.optimizer = optimizer
        self.gamma, self.r_min, self.r_max, self.eps = gamma, r_min, r_max, eps
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
    def scale_gradients(self) -> None:
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
                g.mul_(ratio)
                total += float(ratio.sum())
                count += ratio.numel()
        self.last_mean_ratio = total / count if count else 1.0

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.scale_gradients()
            self.optimizer.step()
            return loss
        self.scale_gradients()
        return self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"MaliciousOptimizer({self.optimizer!r}, gamma={self.gamma}, r=[{self.r_min}, {self.r_max}])"
