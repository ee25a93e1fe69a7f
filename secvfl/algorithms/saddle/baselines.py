"""Baselines for the saddle-point VFL problem, on the same parties and network, and the centralised optimum.

* :class:`GradientDescent` and :class:`Nesterov` on the minimisation form ``l(sum_k A_k x_k) + sum_k r_k(x_k)``:
  each iteration the feature parties send ``A_k x_k`` (at the extrapolated point for Nesterov), the label party
  sends ``grad l(z)`` back, and every party steps ``x_k -= (grad r_k(x_k) + A_k^T grad l(z)) / L`` with
  ``L = L_r + L_l lambda_max(A^T A)``. One communication round per iteration (EG needs two).
* :class:`ADMM` for the sharing problem (Boyd et al., "Distributed Optimization and Statistical Learning via the
  ADMM", Section 7.3), scaled form with ``K`` agents and ``xbar = (1/K) sum_k A_k x_k``::

      x_k  <- argmin r_k(x_k) + rho/2 ||A_k x_k - A_k x_k^t + xbar^t - zbar^t + u^t||^2   (local ridge solve)
      zbar <- argmin l(K zbar) + K rho/2 ||zbar - u^t - xbar^{t+1}||^2                 (label party, per row)
      u    <- u + xbar^{t+1} - zbar^{t+1}

  The label party sends ``v = xbar - zbar + u`` to every feature party; they send ``A_k x_k`` back. Only the sum
  is needed, so it also runs under CKKS/masking.
* :func:`centralised_optimum`: the same objective on the pooled data, L-BFGS then Newton (or Newton-CG) to a
  gradient norm ~1e-12; the reference ``f*`` for suboptimality.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import scipy.optimize as so
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from secvfl.algorithms.saddle.base import LinearAlgorithm
from secvfl.algorithms.saddle.federation import LinearFederation
from secvfl.algorithms.saddle.losses import Loss, make_loss
from secvfl.errors import ConfigError

__all__ = ["GradientDescent", "Nesterov", "ADMM", "centralised_optimum", "smoothness"]


def smoothness(fed: LinearFederation, lambda_max: float) -> float:
    """``L`` of the minimisation objective: ``mu + L_l lambda_max(A^T A)``."""
    return fed.mu + fed.label.smoothness * lambda_max


class GradientDescent(LinearAlgorithm):
    """Gradient descent with step ``1/L`` (``--algo gd``)."""

    method = "gd"

    def __init__(self, fed: LinearFederation, L: float, *, step_multiplier: float = 1.0, seed: int = 0) -> None:
        super().__init__(fed, seed=seed)
        if not L > 0:
            raise ConfigError(f"smoothness L must be positive, got {L}")
        self.L = L
        self.step = step_multiplier / L

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "L": self.L, "step": self.step}

    def _gradient_step(self, point: str) -> None:
        """Gradient of f at every party's ``point`` (one round); each party keeps ``point - step * grad_k`` as
        ``new``."""
        fed = self.fed
        S = self.send_forward(fed.feature_handles, point=point)
        self.send_backward(fed.label.loss_grad(S), [h.name for h in fed.feature_handles])
        self.round += 1
        for h in fed.feature_handles:
            h.operator_step("new", start=point, at=point, gamma=self.step)

    def iterate(self) -> None:
        self._gradient_step("x")
        for h in self.fed.feature_handles:
            h.assign("x", "new")
        self.t += 1


class Nesterov(GradientDescent):
    """Nesterov's accelerated gradient for strongly convex objectives (constant momentum, ``--algo nesterov``).

    ``y = x^t + beta (x^t - x^{t-1})``, ``x^{t+1} = y - grad f(y) / L``, ``beta = (sqrt(kappa)-1)/(sqrt(kappa)+1)``
    with ``kappa = L / mu``; with ``mu = 0`` the ``t/(t+3)`` schedule.
    """

    method = "nesterov"

    def __init__(self, fed: LinearFederation, L: float, *, step_multiplier: float = 1.0, seed: int = 0) -> None:
        super().__init__(fed, L, step_multiplier=step_multiplier, seed=seed)
        self.kappa = L / fed.mu if fed.mu > 0 else math.inf
        for h in fed.feature_handles:
            h.keep("x_prev", "x")

    def _beta(self) -> float:
        if math.isfinite(self.kappa):
            q = math.sqrt(self.kappa)
            return (q - 1.0) / (q + 1.0)
        return self.t / (self.t + 3.0)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "momentum": self._beta() if math.isfinite(self.kappa) else "t/(t+3)"}

    def iterate(self) -> None:
        beta = self._beta()
        for h in self.fed.feature_handles:
            h.extrapolate("y", beta)
        self._gradient_step("y")
        for h in self.fed.feature_handles:
            h.assign("x", "new", previous="x_prev")
        self.t += 1


class ADMM(LinearAlgorithm):
    """ADMM for the sharing problem (Boyd et al. 2011, Section 7.3), ``--algo admm``; ``rho`` is the penalty."""

    method = "admm"

    def __init__(self, fed: LinearFederation, rho: float, *, seed: int = 0) -> None:
        super().__init__(fed, seed=seed)
        if not rho > 0:
            raise ConfigError(f"ADMM penalty rho must be positive, got {rho}")
        self.rho = float(rho)
        K = len(fed.feature_handles)
        lab = fed.label
        lab.vars.setdefault("zbar", np.zeros_like(lab.z))
        lab.vars.setdefault("u", np.zeros_like(lab.z))
        lab.vars.setdefault("xbar", np.zeros_like(lab.z))
        self.K = K
        for h in fed.feature_handles:
            h.keep("Ax", "zero-output")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "rho": self.rho}

    def iterate(self) -> None:
        fed, lab, K, rho = self.fed, self.fed.label, self.K, self.rho
        v = lab.vars["xbar"] - lab.vars["zbar"] + lab.vars["u"]
        names = [h.name for h in fed.feature_handles]
        self.send_backward(v, names)
        for h in fed.feature_handles:
            h.admm_step(self.round, self.meta(None), rho=rho)  # the party's x-update; it sends its new A_k x_k
        S = self.receive_forward(names)
        self.round += 1
        xbar = S / K
        # zbar-update: w = K zbar minimises (1/N) loss(w) + (rho / (2K)) ||w - K (u + xbar)||^2, row by row
        c = K * (lab.vars["u"] + xbar)
        tau = K / (rho * lab.n)  # prox of loss (per row, not divided by N) with weight 1/(2 tau)
        w = lab.prox(c, tau)
        zbar = w / K
        lab.vars["u"] = lab.vars["u"] + xbar - zbar
        lab.vars["zbar"], lab.vars["xbar"] = zbar, xbar
        self.t += 1


# ---------------------------------------------------------------------------------------------------------------
# Centralised reference solution
# ---------------------------------------------------------------------------------------------------------------
def centralised_optimum(
    X: Any, y: np.ndarray, loss: str | Loss, mu: float, *, n_classes: int | None = None, gtol: float = 1e-12
) -> tuple[np.ndarray, float, dict[str, Any]]:
    """``argmin_x l(X x) + (mu/2)||x||^2`` on pooled data: returns (x* (d x C), f*, facts).

    L-BFGS to get close, then Newton steps (explicit Hessian when ``d C <= 3000``, else Newton-CG with Hessian-vector
    products) until the gradient norm is below ``gtol``. For the experimenter only: in VFL no party holds ``X``.
    """
    loss_obj = make_loss(loss) if isinstance(loss, str) else loss
    y = np.asarray(y, dtype=np.int64)
    C_cls = max(2, int(n_classes if n_classes is not None else y.max() + 1))
    t = loss_obj.targets(y, C_cls)
    C = loss_obj.outputs(C_cls)
    A = sp.csr_matrix(X, dtype=np.float64) if sp.issparse(X) else np.asarray(X, dtype=np.float64)
    n, d = A.shape

    def fg(w: np.ndarray) -> tuple[float, np.ndarray]:
        x = w.reshape(d, C)
        z = np.asarray(A @ x)
        f = loss_obj.value(z, t) + 0.5 * mu * float(np.sum(x * x))
        g = np.asarray(A.T @ loss_obj.grad(z, t)) + mu * x
        return f, g.reshape(-1)

    def hessp(w: np.ndarray, v: np.ndarray) -> np.ndarray:
        x, vv = w.reshape(d, C), v.reshape(d, C)
        z = np.asarray(A @ x)
        h = loss_obj.hess_diag(z, t)
        Av = np.asarray(A @ vv)
        hv = np.einsum("nij,nj->ni", h, Av) if h.ndim == 3 else h * Av
        return (np.asarray(A.T @ hv) / n + mu * vv).reshape(-1)

    w = np.zeros(d * C)
    res = so.minimize(fg, w, jac=True, method="L-BFGS-B",
                      options={"maxiter": 20000, "gtol": 1e-10, "ftol": 1e-15, "maxcor": 30})
    w = res.x
    newton_steps = 0
    for _ in range(100):
        f, g = fg(w)
        gn = float(np.linalg.norm(g))
        if gn <= gtol:
            break
        if C == 1 and d <= 3000:
            h = loss_obj.hess_diag(np.asarray(A @ w.reshape(d, 1)), t)[:, 0] / n
            AH = A.multiply(h[:, None]).tocsr() if sp.issparse(A) else A * h[:, None]
            H = np.asarray((A.T @ AH).toarray() if sp.issparse(AH) else A.T @ AH) + mu * np.eye(d)
            step = np.linalg.solve(H, g)
        elif d * C <= 3000:
            H = np.stack([hessp(w, e) for e in np.eye(d * C)], axis=1)
            step = np.linalg.solve(0.5 * (H + H.T), g)
        else:
            op = spla.LinearOperator((d * C, d * C), matvec=lambda v, w=w: hessp(w, v))
            step, _ = spla.cg(op, g, rtol=1e-12, maxiter=500)
        # backtracking on f keeps Newton safe far from the optimum
        a = 1.0
        while a > 1e-8:
            f_new, _ = fg(w - a * step)
            if f_new <= f - 1e-4 * a * float(g @ step) or a < 1e-3:
                break
            a *= 0.5
        w = w - a * step
        newton_steps += 1
    f, g = fg(w)
    return w.reshape(d, C), float(f), {"grad_norm": float(np.linalg.norm(g)), "lbfgs_iters": int(res.nit),
                                       "newton_steps": newton_steps}
