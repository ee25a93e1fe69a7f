"""Losses of the saddle-point family on ``z`` (N x C), averaged over rows: logistic, squared, softmax.

Each loss also gives what the methods need besides its value and gradient: a curvature bound (the smoothness ``L_l``
that sets step sizes), the per-row Hessian and the per-row proximal operator (ADMM's ``z``-update).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from secvfl.errors import ConfigError
from secvfl.registry import Registry

__all__ = ["LOSSES", "Loss", "LogisticLoss", "SquaredLoss", "SoftmaxLoss", "make_loss"]

Array = np.ndarray


class Loss(ABC):
    name: ClassVar[str]

    @abstractmethod
    def outputs(self, n_classes: int) -> int:
        """Columns C of z for a task with ``n_classes`` classes."""

    @abstractmethod
    def targets(self, y: Array, n_classes: int) -> Array:
        """What the label party keeps from the int labels (0..C-1)."""

    @abstractmethod
    def value(self, z: Array, t: Array) -> float:
        """Mean loss over rows."""

    @abstractmethod
    def grad(self, z: Array, t: Array) -> Array:
        """Gradient of the mean loss with respect to z (so rows are scaled by 1/N)."""

    @abstractmethod
    def curvature(self) -> float:
        """Bound on the per-row Hessian norm of ``loss`` (``L_l = curvature / N`` for the mean)."""

    @abstractmethod
    def predict(self, z: Array) -> Array:
        """Class predictions (int) from z."""

    @abstractmethod
    def proba(self, z: Array) -> Array:
        """Class scores in [0, 1] per row, (N, classes), for metrics such as AUC."""

    @abstractmethod
    def hess_diag(self, z: Array, t: Array) -> Array:
        """Per-row Hessian of ``loss`` (not divided by N): (N, C) for diagonal losses, (N, C, C) for softmax."""

    def prox(self, c: Array, t: Array, tau: float, iters: int = 50) -> Array:
        """``argmin_w  loss(w_n, t_n) + (1/(2 tau)) ||w_n - c_n||^2`` for every row (Newton, safeguarded)."""
        w = c.copy()
        for _ in range(iters):
            g = self._row_grad(w, t) + (w - c) / tau
            h = self.hess_diag(w, t)
            if h.ndim == 3:
                eye = np.eye(h.shape[1])[None] / tau
                step = np.linalg.solve(h + eye, g[..., None])[..., 0]
            else:
                step = g / (h + 1.0 / tau)
            w -= step
            if float(np.max(np.abs(step), initial=0.0)) < 1e-13 * (1.0 + float(np.max(np.abs(w), initial=0.0))):
                break
        return w

    def _row_grad(self, z: Array, t: Array) -> Array:
        return self.grad(z, t) * z.shape[0]


def _sigmoid(z: Array) -> Array:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


LOSSES: Registry[type[Loss]] = Registry("loss")


@LOSSES.register("logistic")
class LogisticLoss(Loss):
    """Binary cross-entropy on one logit; labels 0/1."""

    name = "logistic"

    def outputs(self, n_classes: int) -> int:
        if n_classes != 2:
            raise ConfigError(f"logistic loss is for 2 classes, the data has {n_classes}; use softmax")
        return 1

    def targets(self, y: Array, n_classes: int) -> Array:
        return y.astype(np.float64).reshape(-1, 1)

    def value(self, z: Array, t: Array) -> float:
        return float(np.mean(np.logaddexp(0.0, z) - t * z))

    def grad(self, z: Array, t: Array) -> Array:
        return (_sigmoid(z) - t) / z.shape[0]

    def curvature(self) -> float:
        return 0.25

    def predict(self, z: Array) -> Array:
        return (z[:, 0] > 0).astype(np.int64)

    def proba(self, z: Array) -> Array:
        p = _sigmoid(z[:, 0])
        return np.stack([1.0 - p, p], axis=1)

    def hess_diag(self, z: Array, t: Array) -> Array:
        s = _sigmoid(z)
        return s * (1.0 - s)


@LOSSES.register("squared")
class SquaredLoss(Loss):
    """``(z - t)^2 / 2`` with targets +-1 (binary) or one-hot (multi-class)."""

    name = "squared"

    def outputs(self, n_classes: int) -> int:
        return 1 if n_classes == 2 else n_classes

    def targets(self, y: Array, n_classes: int) -> Array:
        if n_classes == 2:
            return (2.0 * y - 1.0).reshape(-1, 1)
        return np.eye(n_classes)[y]

    def value(self, z: Array, t: Array) -> float:
        return float(0.5 * np.mean(np.sum((z - t) ** 2, axis=1)))

    def grad(self, z: Array, t: Array) -> Array:
        return (z - t) / z.shape[0]

    def curvature(self) -> float:
        return 1.0

    def predict(self, z: Array) -> Array:
        return (z[:, 0] > 0).astype(np.int64) if z.shape[1] == 1 else np.argmax(z, axis=1)

    def proba(self, z: Array) -> Array:
        if z.shape[1] == 1:
            p = np.clip((z[:, 0] + 1.0) / 2.0, 0.0, 1.0)
            return np.stack([1.0 - p, p], axis=1)
        return SoftmaxLoss._softmax(z)

    def hess_diag(self, z: Array, t: Array) -> Array:
        return np.ones_like(z)

    def prox(self, c: Array, t: Array, tau: float, iters: int = 50) -> Array:
        return (c + tau * t) / (1.0 + tau)


@LOSSES.register("softmax")
class SoftmaxLoss(Loss):
    """Softmax cross-entropy on C logits; labels 0..C-1."""

    name = "softmax"

    def outputs(self, n_classes: int) -> int:
        return n_classes

    def targets(self, y: Array, n_classes: int) -> Array:
        return np.eye(n_classes)[y]

    @staticmethod
    def _softmax(z: Array) -> Array:
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def value(self, z: Array, t: Array) -> float:
        m = z.max(axis=1, keepdims=True)
        lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
        return float(np.mean(lse - np.sum(t * z, axis=1)))

    def grad(self, z: Array, t: Array) -> Array:
        return (self._softmax(z) - t) / z.shape[0]

    def curvature(self) -> float:
        return 0.5  # ||diag(p) - p p^T|| <= 1/2

    def predict(self, z: Array) -> Array:
        return np.argmax(z, axis=1)

    def proba(self, z: Array) -> Array:
        return self._softmax(z)

    def hess_diag(self, z: Array, t: Array) -> Array:
        p = self._softmax(z)
        return p[:, :, None] * np.eye(z.shape[1])[None] - p[:, :, None] * p[:, None, :]


def make_loss(name: str) -> Loss:
    return LOSSES.get(name)()
