"""ExtraGradient on the Lagrangian of the linear VFL problem (Beznosikov et al., "Exploring New Frontiers in
Vertical Federated Learning: the Role of Saddle Point Reformulation"); ``--algo eg``.

``w+ = w - G F(w)``, ``w <- w - G F(w+)``, with ``F`` the monotone operator of the saddle form (see
:mod:`secvfl.algorithms.saddle`) and ``G`` the step sizes of the ``x``, ``z`` and ``lambda`` blocks. Each iteration is
two communication rounds, each one "feature parties send ``A_k x_k`` (through the aggregation: plain, or CKKS/masking
for the sum), the label party sends ``lambda`` to every (participating) feature party".

Step sizes (``step=``):

* ``"theory"``: one step for all blocks, ``gamma = 1/2 min{1, 1/sqrt(lambda_max(A^T A)), 1/L_r, 1/L_l}``
  (``lambda_max`` by a power iteration that runs over the network,
  :func:`~secvfl.algorithms.saddle.federation.power_lambda_max`; no party shares ``A_k``). With the *mean* loss,
  ``L_l = O(1/N)`` and the coupling is ``O(sqrt(N))``, so this step is safe but very slow: the ``z``/``lambda``
  blocks live on scales ``1`` and ``1/N``.
* ``"scaled"`` (default): block steps ``gamma_x = c_x / (L_r + L_l lambda_max)``, ``gamma_z = c_z / L_l``,
  ``gamma_lambda = c_lambda L_l``. A positive block-diagonal step is the same ExtraGradient on the same saddle
  problem in rescaled variables (``z / sqrt(gamma_z)``, ``lambda / sqrt(gamma_lambda)``), chosen so the ``z``-
  ``lambda`` pair is well conditioned; the convergence theory is unchanged.
* ``"tuned"``: a short pilot run per multiplier of the ``"scaled"`` steps; the best one is kept (see
  :func:`~secvfl.algorithms.saddle.methods.tune_multiplier`; the pilots' traffic is reported separately).

Extensions: compression of both directions comes from the protocol stack (a compression layer, e.g.
``randk:0.1+ef`` or ``randk:0.1+vr``; messages carry ``meta["persistent"]`` because each link carries the same
quantity every round, which error feedback needs); partial participation (``participation=p``: each feature party
takes part in an iteration with probability ``p``; the label party reuses the last ``A_k x_k`` of the others, which
only it can do when it receives them individually, i.e. with the plain aggregation); stochastic mini-batch EG
(``batch_size=``: batch-sized messages, ``z`` and ``lambda`` updated on the batch, an unbiased
``(N/b) A_kB^T lambda_B`` for the ``x`` blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from secvfl.algorithms.saddle.base import LinearAlgorithm
from secvfl.algorithms.saddle.federation import LinearFeatureHandle, LinearFederation
from secvfl.errors import ConfigError, UnsupportedError

__all__ = ["StepSizes", "ExtraGradient"]

Array = np.ndarray


@dataclass(frozen=True)
class StepSizes:
    """ExtraGradient step sizes of the x, z and lambda blocks."""

    x: float
    z: float
    lam: float

    @classmethod
    def theory(cls, lambda_max: float, L_r: float, L_l: float) -> StepSizes:
        inv = [1.0, 1.0 / math.sqrt(lambda_max) if lambda_max > 0 else math.inf]
        inv += [1.0 / L_r if L_r > 0 else math.inf, 1.0 / L_l if L_l > 0 else math.inf]
        g = 0.5 * min(inv)
        return cls(g, g, g)

    @classmethod
    def scaled(cls, lambda_max: float, L_r: float, L_l: float, multiplier: float = 1.0,
               c: tuple[float, float, float] = (1.0, 1.0, 0.5)) -> StepSizes:
        return cls(multiplier * c[0] / (L_r + L_l * lambda_max), multiplier * c[1] / L_l, multiplier * c[2] * L_l)

    def scale(self, m: float) -> StepSizes:
        return StepSizes(self.x * m, self.z * m, self.lam * m)


class ExtraGradient(LinearAlgorithm):
    """ExtraGradient on the Lagrangian (see the module docstring); ``--algo eg``.

    ``participation``: probability that a feature party takes part in an iteration (1: always).
    ``batch_size``: rows per iteration for stochastic mini-batch EG (None: full batch).
    """

    method = "eg"

    def __init__(
        self,
        fed: LinearFederation,
        steps: StepSizes,
        *,
        participation: float = 1.0,
        batch_size: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(fed, seed=seed)
        if not 0.0 < participation <= 1.0:
            raise ConfigError(f"participation probability must be in (0, 1], got {participation}")
        if batch_size is not None and not 1 <= batch_size <= fed.n:
            raise ConfigError(f"batch size must be in 1..{fed.n}, got {batch_size}")
        if participation < 1.0 and not fed.individual_messages:
            raise UnsupportedError(
                "partial participation reuses each absent party's last A_k x_k, which the label party only has with "
                f"the plain aggregation; {fed.net.aggregation.name} delivers only the sum"
            )
        if participation < 1.0 and batch_size is not None:
            raise UnsupportedError("partial participation and mini-batches are not combined here; choose one")
        self.steps = steps
        self.p = participation
        self.batch_size = batch_size
        self._avg_count = 0
        for h in fed.feature_handles:
            h.keep("x_avg", "zeros")

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"steps": {"x": self.steps.x, "z": self.steps.z, "lambda": self.steps.lam},
                  "participation": self.p, "batch_size": self.batch_size})
        return d

    def averaged(self) -> list[Array] | None:
        return [p.vars["x_avg"] for p in self.fed.features] if self._avg_count else None

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "avg_count": self._avg_count}

    def set_counters(self, counters: dict[str, int]) -> None:
        super().set_counters(counters)
        self._avg_count = int(counters.get("avg_count", 0))

    def _draw(self) -> np.random.Generator:
        """This iteration's public randomness (who participates, which rows): a function of (seed, t) only."""
        return np.random.default_rng([self.seed, 11, self.t])

    def iterate(self) -> None:
        if self.batch_size is not None:
            self._iterate_batch()
        else:
            self._iterate_full()
        self.t += 1

    def _participants(self) -> list[LinearFeatureHandle]:
        if self.p >= 1.0:
            return self.fed.feature_handles
        mask = self._draw().random(len(self.fed.feature_handles)) < self.p
        if not any(k.startswith("last:") for k in self.fed.label.vars):
            mask[:] = True  # everyone's first message (also after a resume) exists before anyone can reuse it
        return [h for h, m in zip(self.fed.feature_handles, mask, strict=True) if m]

    def _round(self, parts: list[LinearFeatureHandle], point: str, lam: Array, rows: Array | None = None) -> Array:
        """One communication round: outputs ``A_k point`` forward (the sum is returned), ``lam`` backward."""
        S = self.send_forward(parts, point=point, rows=rows, reuse_absent=self.p < 1.0)
        self.send_backward(lam, [h.name for h in parts], rows=rows)
        self.round += 1
        return S

    def _iterate_full(self) -> None:
        g, lab = self.steps, self.fed.label
        parts = self._participants()
        # F at w^t
        S = self._round(parts, "x", lab.lam)
        for h in parts:
            h.operator_step("xh", start="x", at="x", gamma=g.x)
        Fz, Fl = lab.operator(lab.z, lab.lam, S)
        zh, lh = lab.z - g.z * Fz, lab.lam - g.lam * Fl
        # F at w^{t+1/2}
        Sh = self._round(parts, "xh", lh)
        for h in parts:
            h.operator_step("x", start="x", at="xh", gamma=g.x)
        Fz, Fl = lab.operator(zh, lh, Sh)
        lab.z, lab.lam = lab.z - g.z * Fz, lab.lam - g.lam * Fl
        # running average of the half-step iterates (the ergodic EG iterate); absent parties average their x
        self._avg_count += 1
        w = 1.0 / self._avg_count
        for h in self.fed.feature_handles:
            h.average("x_avg", "xh" if h in parts else "x", w)

    def _iterate_batch(self) -> None:
        g, lab, fed = self.steps, self.fed.label, self.fed
        b = self.batch_size
        assert b is not None
        rows = np.sort(self._draw().choice(fed.n, size=b, replace=False))
        scale = fed.n / b
        parts = fed.feature_handles
        z, lam = lab.z[rows], lab.lam[rows]
        S = self._round(parts, "x", lam, rows)
        for h in parts:
            h.operator_step("xh", start="x", at="x", gamma=g.x, rows=rows, scale=scale)
        Fz, Fl = lab.operator(z, lam, S, rows=rows)
        zh, lh = z - g.z * Fz, lam - g.lam * Fl
        Sh = self._round(parts, "xh", lh, rows)
        for h in parts:
            h.operator_step("x", start="x", at="xh", gamma=g.x, rows=rows, scale=scale)
        Fz, Fl = lab.operator(zh, lh, Sh, rows=rows)
        lab.z[rows], lab.lam[rows] = z - g.z * Fz, lam - g.lam * Fl
        self._avg_count += 1
        w = 1.0 / self._avg_count
        for h in parts:
            h.average("x_avg", "xh", w)
