"""Feature reconstruction at prediction time (Luo et al., "Feature Inference Attack on Model Predictions in Vertical
Federated Learning", ICDE 2021).

Threat model (both attacks), following the paper: the attacker is the active (label) party at prediction time. It
holds the *whole* trained model -- every bottom model's parameters as well as the head (white-box; e.g. the model is
released to it after training, or it is a linear model whose weights it keeps) -- its own features ``x_adv`` for the
rows it predicts, and the prediction scores the federation returns for those rows. It wants the target party's
features ``x_target``. In a split network where bottom models never leave their owners this is a stronger attacker
than the protocol allows; the attack then bounds what a model owner could learn.

- :class:`GenerativeRegressionNetwork`: trains a generator G(x_adv, z) -> x_target in [0, 1] so that the frozen model's
  output on (x_adv, G) matches the observed scores, over all the predictions the attacker has collected. G never
  sees the scores of the row it reconstructs, so what it learns is the relation between x_adv and x_target that
  the model's outputs reveal: it succeeds where the parties' features are correlated (real data) and falls back to
  the conditional mean where they are independent. ``GRNConfig.condition_on_scores`` lifts that limit.
- :func:`solve_linear_features` / :class:`EquationSolving`: for a logistic-regression-type model the scores give
  ``classes - 1`` linear equations per row (``classes`` with logits); with that many unknowns or fewer they are solved
  exactly.

Reconstruction is scored by MSE per feature with features scaled to [0, 1], against the exact expected MSE of a
uniform random guess (the issue's baseline) and, for reference, of always guessing 0.5 and of guessing each feature's
mean -- the last is the bar that shows an attack learned something from the scores rather than from the prior.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from attacks.base import ATTACKS, FEATURE_RECONSTRUCTION, Attack, AttackResult, RunOutline
from attacks.metrics import feature_mse, random_guess_mse
from secvfl.errors import ConfigError, DataError, UnsupportedError

__all__ = [
    "GRNConfig",
    "train_generator",
    "solve_linear_features",
    "LinearSolution",
    "GenerativeRegressionNetwork",
    "EquationSolving",
    "score_reconstruction",
]

Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Why equation solving refuses a model (before training, from the configuration, and after, by probing the model).
NOT_LINEAR = ("equation solving needs a logistic-regression-type (linear) model; this {algo} model is not linear. "
              "Train with --hidden '' --head-hidden '' (linear MLP bottoms and head), or use --attack grn")


def _bounds(truth: np.ndarray, bounds: tuple[Any, Any] | None) -> tuple[np.ndarray, np.ndarray]:
    if bounds is None:
        lo, hi = truth.min(axis=0), truth.max(axis=0)
    else:
        lo = np.broadcast_to(np.asarray(bounds[0], np.float64), truth.shape[1:]).copy()
        hi = np.broadcast_to(np.asarray(bounds[1], np.float64), truth.shape[1:]).copy()
    if np.any(hi < lo):
        raise DataError("feature bounds must satisfy low <= high")
    return lo, np.where(hi > lo, hi - lo, 1.0)


def score_reconstruction(reconstructed: Any, truth: Any, bounds: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """MSE per feature in [0, 1] scaling (``bounds`` = (low, high) per feature; default: the truth's range).

    ``ap`` = 1 - mean MSE and ``chance`` = 1 - mean MSE of a uniform random guess, so that larger is more leakage
    and the DCS formula applies unchanged.
    """
    truth = np.asarray(truth, np.float64)
    rec = np.asarray(reconstructed, np.float64)
    if truth.ndim != 2 or rec.shape != truth.shape:
        raise DataError(f"reconstruction shape {rec.shape} does not match the truth's {truth.shape}")
    lo, span = _bounds(truth, bounds)
    t01 = np.clip((truth - lo) / span, 0.0, 1.0)
    r01 = (rec - lo) / span
    mse = feature_mse(r01, t01)
    rand = random_guess_mse(t01)
    half = feature_mse(np.full_like(t01, 0.5), t01)
    # A much stronger trivial baseline: guessing each feature's mean (here the oracle mean of the scored rows).
    # On skewed features (amounts, counts) it is tiny, and an attack must beat it to show it used the scores.
    mean_guess = t01.var(axis=0)
    return {
        "ap": 1.0 - float(mse.mean()),
        "chance": 1.0 - float(rand.mean()),
        "mse": float(mse.mean()),
        "mse_per_feature": [float(v) for v in mse],
        "random_guess_mse": float(rand.mean()),
        "random_guess_mse_per_feature": [float(v) for v in rand],
        "constant_half_mse": float(half.mean()),
        "mean_guess_mse": float(mean_guess.mean()),
        "mean_guess_mse_per_feature": [float(v) for v in mean_guess],
        "max_abs_error_01": float(np.abs(r01 - t01).max()) if t01.size else 0.0,
    }


# --- generative regression network ------------------------------------------------------------------------------------


@dataclass
class GRNConfig:
    epochs: int = 100
    batch_size: int = 128
    lr: float = 1e-3
    hidden: tuple[int, ...] = (128, 64)
    noise_dim: int = 0  # 0: as many noise inputs as target features (Luo et al.)
    draws: int = 8  # reconstructions averaged over this many noise draws
    # Extension beyond Luo et al.: also feed the observed scores to G. Same threat model (the attacker has them),
    # but G no longer has to rely on correlations between x_adv and x_target -- it can invert per row.
    condition_on_scores: bool = False
    # Luo et al. regularise G; here: weight of the generated features' variance over the batch (in [0, 1] units),
    # which pulls G towards the least spread reconstruction that still explains the scores. On credit a weight of 0.1
    # lowered the MSE clearly and larger ones little more (BENCHMARKS.md, "Attacks and defences").
    variance_penalty: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0 or self.draws < 1 or self.variance_penalty < 0:
            raise ConfigError("GRN needs epochs >= 1, batch_size >= 1, lr > 0, draws >= 1 and variance_penalty >= 0")


class _Generator(nn.Module):
    def __init__(self, d_cond: int, d_noise: int, d_target: int, hidden: Sequence[int]) -> None:
        super().__init__()
        dims = [d_cond + d_noise, *hidden]
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:], strict=True):
            layers += [nn.Linear(a, b), nn.LeakyReLU(0.2)]
        layers += [nn.Linear(dims[-1], d_target), nn.Sigmoid()]  # features live in [0, 1]
        self.net = nn.Sequential(*layers)

    def forward(self, cond: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([cond, z], dim=1))


def train_generator(model: Model, x_adv: Any, scores: Any, d_target: int, *, bounds: tuple[Any, Any] | None = None,
                    config: GRNConfig | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Train G on (x_adv, observed scores) and return the reconstruction in the model's feature scale.

    ``model(x_adv, x_target) -> scores`` is the frozen white-box model (differentiable in ``x_target``); ``bounds``
    (low, high) maps G's [0, 1] output to the model's input scale (default: the model takes [0, 1] features).
    """
    cfg = config or GRNConfig()
    xa = torch.as_tensor(np.asarray(x_adv), dtype=torch.float32)
    v = torch.as_tensor(np.asarray(scores), dtype=torch.float32)
    if v.ndim == 1:
        v = v[:, None]
    if xa.ndim != 2 or xa.shape[0] != v.shape[0] or xa.shape[0] == 0:
        raise DataError(f"need one score row per attacker feature row; got {tuple(xa.shape)} and {tuple(v.shape)}")
    if d_target < 1:
        raise ConfigError("nothing to reconstruct: the target party has no features")
    if bounds is None:
        lo, span = torch.zeros(d_target), torch.ones(d_target)
    else:
        lo_np = np.broadcast_to(np.asarray(bounds[0], np.float64), (d_target,)).copy()
        hi_np = np.broadcast_to(np.asarray(bounds[1], np.float64), (d_target,)).copy()
        lo = torch.as_tensor(lo_np, dtype=torch.float32)
        span = torch.as_tensor(np.where(hi_np > lo_np, hi_np - lo_np, 1.0), dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    d_noise = cfg.noise_dim or d_target
    cond = torch.cat([xa, v], dim=1) if cfg.condition_on_scores else xa
    g = _Generator(cond.shape[1], d_noise, d_target, cfg.hidden)
    opt = torch.optim.Adam(g.parameters(), lr=cfg.lr)
    frozen = [p for p in model.parameters() if p.requires_grad] if isinstance(model, nn.Module) else []
    for p in frozen:  # the attack must not touch (or accumulate gradients in) the model it attacks
        p.requires_grad_(False)
    n = xa.shape[0]
    losses: list[float] = []
    try:
        for _ in range(cfg.epochs):
            perm = torch.randperm(n, generator=gen)
            total = 0.0
            for i in range(0, n, cfg.batch_size):
                idx = perm[i : i + cfg.batch_size]
                z = torch.randn(len(idx), d_noise, generator=gen)
                gen01 = g(cond[idx], z)
                out = model(xa[idx], lo + gen01 * span)
                loss = ((out.reshape(len(idx), -1) - v[idx]) ** 2).sum(dim=1).mean()
                if cfg.variance_penalty and len(idx) > 1:
                    loss = loss + cfg.variance_penalty * gen01.var(dim=0).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(idx)
            losses.append(total / n)
        with torch.no_grad():
            draws = [g(cond, torch.randn(n, d_noise, generator=gen)) for _ in range(cfg.draws)]
            rec = lo + torch.stack(draws).mean(dim=0) * span
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return rec.numpy().astype(np.float64), {"final_loss": losses[-1], "first_loss": losses[0], "config": asdict(cfg)}


# --- equation solving -------------------------------------------------------------------------------------------------


@dataclass
class LinearSolution:
    x_target: np.ndarray  # (n, d_target), the model's feature scale
    exact: bool  # the system determines the unknowns (rank == number of unknowns)
    equations: int
    unknowns: int
    rank: int


def solve_linear_features(weight: Any, bias: Any, x_adv: Any, scores: Any, adv_columns: Sequence[int],
                          target_columns: Sequence[int], *, scores_are: str = "probabilities",
                          eps: float = 1e-300) -> LinearSolution:
    """Recover the target features of a (multinomial) logistic-regression model from its outputs.

    ``weight`` (C, d) and ``bias`` (C,) act on the full feature vector whose columns ``adv_columns`` the attacker
    holds and ``target_columns`` it wants. Scores as probabilities: C = 1 is a sigmoid (logit(p) = w.x + b: one
    equation), C >= 2 a softmax (log p_k - log p_C = (w_k - w_C).x + b_k - b_C: C - 1 equations). As logits: C
    equations. Least squares over all rows at once; exact when the unknowns do not outnumber independent equations.
    """
    if scores_are not in ("probabilities", "logits"):
        raise ConfigError(f"scores_are must be 'probabilities' or 'logits', got {scores_are!r}")
    w = np.atleast_2d(np.asarray(weight, np.float64))
    b = np.asarray(bias, np.float64).reshape(-1)
    xa = np.asarray(x_adv, np.float64)
    s = np.asarray(scores, np.float64)
    s = s[:, None] if s.ndim == 1 else s
    adv, tgt = list(adv_columns), list(target_columns)
    if b.shape[0] != w.shape[0] or s.shape[1] != w.shape[0]:
        raise DataError(f"weight has {w.shape[0]} outputs, bias {b.shape[0]}, scores {s.shape[1]}; they must agree")
    if len(adv) + len(tgt) != w.shape[1] or len(set(adv) | set(tgt)) != w.shape[1]:
        raise DataError(f"adv_columns and target_columns must partition the model's {w.shape[1]} input columns")
    if xa.shape != (s.shape[0], len(adv)):
        raise DataError(f"x_adv has shape {xa.shape}, expected ({s.shape[0]}, {len(adv)})")
    if scores_are == "logits":
        lhs, rhs = w, s - b
    elif w.shape[0] == 1:
        p = np.clip(s[:, 0], eps, 1 - 1e-16)
        lhs, rhs = w, (np.log(p) - np.log1p(-p) - b[0])[:, None]
    else:
        logp = np.log(np.clip(s, eps, None))
        lhs = w[:-1] - w[-1]
        rhs = (logp[:, :-1] - logp[:, -1:]) - (b[:-1] - b[-1])
    rhs = rhs - xa @ lhs[:, adv].T
    a = lhs[:, tgt]
    solution, *_ = np.linalg.lstsq(a, rhs.T, rcond=None)
    rank = int(np.linalg.matrix_rank(a))
    return LinearSolution(solution.T, rank == len(tgt), a.shape[0], len(tgt), rank)


# --- attacks ----------------------------------------------------------------------------------------------------------

_ACTIVE_PARTY = (
    "attacker: the label (active) party at prediction time; white-box: holds the whole trained model (head and every "
    "bottom model, as in Luo et al.), its own features for the predicted rows and the returned prediction scores; "
    "wants a target party's features."
)


@ATTACKS.register("grn")
class GenerativeRegressionNetwork(Attack):
    name = "grn"
    family = FEATURE_RECONSTRUCTION
    metric = "1-mse"
    threat_model = _ACTIVE_PARTY
    reads = "it inverts the whole trained model"

    def __init__(self, config: GRNConfig | None = None) -> None:
        self.config = config or GRNConfig()

    def run(self, *, model: Model, x_adv: Any, scores: Any, target_features: Any,
            bounds: tuple[Any, Any] | None = None, **_: Any) -> AttackResult:
        """``target_features``: the truth in the model's scale (scoring only; its width is public)."""
        truth = np.asarray(target_features, np.float64)
        if truth.ndim != 2:
            raise DataError(f"target_features must be (rows, features), got shape {truth.shape}")
        rec, info = train_generator(model, x_adv, scores, truth.shape[1], bounds=bounds, config=self.config)
        scored = score_reconstruction(rec, truth, bounds)
        ap, chance = scored.pop("ap"), scored.pop("chance")
        return self.result(ap, chance, **scored, **info, rows=int(truth.shape[0]))


@ATTACKS.register("equation")
class EquationSolving(Attack):
    name = "equation"
    family = FEATURE_RECONSTRUCTION
    metric = "1-mse"
    threat_model = _ACTIVE_PARTY + " The model is logistic-regression-type (one linear layer, sigmoid or softmax)."
    reads = "it inverts the whole trained model"

    @classmethod
    def check(cls, run: RunOutline, **options: Any) -> None:
        super().check(run, **options)
        if not run.linear:
            raise UnsupportedError(NOT_LINEAR.format(algo=run.algo))

    def run(self, *, weight: Any, bias: Any, x_adv: Any, scores: Any, adv_columns: Sequence[int],
            target_columns: Sequence[int], target_features: Any, scores_are: str = "probabilities",
            bounds: tuple[Any, Any] | None = None, **_: Any) -> AttackResult:
        sol = solve_linear_features(weight, bias, x_adv, scores, adv_columns, target_columns, scores_are=scores_are)
        truth = np.asarray(target_features, np.float64)
        scored = score_reconstruction(sol.x_target, truth, bounds)
        ap, chance = scored.pop("ap"), scored.pop("chance")
        return self.result(ap, chance, **scored, exact=sol.exact, equations=sol.equations, unknowns=sol.unknowns,
                           rank=sol.rank, max_abs_error=float(np.abs(sol.x_target - truth).max()))
