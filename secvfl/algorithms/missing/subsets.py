"""Subset arithmetic of LASER-VFL: predictors indexed by sets of parties, task sampling, and batched fusion.

Party ``k`` of a LASER-VFL federation owns one representation model ``f_k`` and one fusion head ``g_k``. For every
set ``J`` of parties with ``k in J`` it has a predictor ``h_(k,J)(x_J) = g_k(mean_{i in J} f_i(x_i))``: the models
are shared across the ``2^(K-1)`` subsets, only the averaging changes. For a sample whose observed set is ``K_o``
the training objective is

    F(K_o) = sum_{k in K_o} sum_{J subset of K_o, k in J} (1/|J|) * loss(h_(k,J)).

Evaluating all ``|K_o| * 2^(|K_o|-1)`` terms per step is exponential, so each party ``k`` samples, for each size
``j = 1..|K_o|``, one subset ``S_kj`` uniformly among the ``C(|K_o|-1, j-1)`` subsets of ``K_o`` of size ``j`` that
contain ``k``, and weights its loss by ``a_j = C(|K_o|-1, j-1) / j``. Then

    E[a_j * loss(h_(k,S_kj))] = (1/j) * sum_{|J|=j, k in J} loss(h_(k,J)),

so the sampled loss (and, by linearity, its gradient) is an unbiased estimate of ``F(K_o)`` at a cost of
``|K_o|`` head evaluations per party instead of ``2^(|K_o|-1)``.

Fusion is batched: the chosen subsets become the rows of an averaging matrix ``M`` (``M[s, i] = 1/|J_s|`` when the
``i``-th observed party is in ``J_s``), and all subset means are one matrix product ``M @ R`` with ``R`` the stacked
representations. The head then runs once on all of them.

Parties are identified here by integer indices ``0..K-1``; subsets are sorted tuples of indices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from itertools import combinations

import numpy as np
import torch
import torch.nn.functional as F

from secvfl.errors import ConfigError

__all__ = [
    "Subset",
    "as_subset",
    "nonempty_subsets",
    "subsets_containing",
    "task_weight",
    "task_weights",
    "sample_tasks",
    "TaskTable",
    "averaging_matrix",
    "subset_means",
    "weighted_task_loss",
    "per_sample_loss",
    "linear_head_task_grads",
    "full_objective",
    "sampled_objective",
]

Subset = tuple[int, ...]


def as_subset(parties: Iterable[int]) -> Subset:
    """A canonical subset: sorted, unique, non-negative integer party indices."""
    out = tuple(sorted({int(p) for p in parties}))
    if out and out[0] < 0:
        raise ConfigError(f"party indices must be non-negative, got {out}")
    return out


def nonempty_subsets(parties: Iterable[int]) -> list[Subset]:
    """All non-empty subsets of ``parties``, by size then lexicographically (``2^n - 1`` of them)."""
    base = as_subset(parties)
    return [c for r in range(1, len(base) + 1) for c in combinations(base, r)]


def subsets_containing(party: int, observed: Iterable[int], size: int | None = None) -> list[Subset]:
    """Subsets of ``observed`` that contain ``party`` (of the given size, or of every size)."""
    obs = as_subset(observed)
    if party not in obs:
        raise ConfigError(f"party {party} is not in the observed set {obs}")
    others = [p for p in obs if p != party]
    sizes = range(1, len(obs) + 1) if size is None else [size]
    return [as_subset((party, *c)) for j in sizes for c in combinations(others, j - 1)]


def task_weight(n_observed: int, size: int) -> float:
    """``a_j = C(n-1, j-1) / j``: makes a uniformly drawn size-``j`` subset an unbiased estimate of its size class."""
    if not 1 <= size <= n_observed:
        raise ConfigError(f"subset size must be in 1..{n_observed}, got {size}")
    return math.comb(n_observed - 1, size - 1) / size


def task_weights(n_observed: int) -> list[float]:
    """``[a_1, ..., a_n]`` for ``n`` observed parties."""
    return [task_weight(n_observed, j) for j in range(1, n_observed + 1)]


@lru_cache(maxsize=4096)
def _tasks_by_size(party: int, observed: Subset) -> tuple[tuple[Subset, ...], ...]:
    # Index j-1 holds every size-j subset of ``observed`` that contains ``party``.
    others = [p for p in observed if p != party]
    return tuple(
        tuple(as_subset((party, *c)) for c in combinations(others, j - 1)) for j in range(1, len(observed) + 1)
    )


def sample_tasks(party: int, observed: Sequence[int], rng: np.random.Generator) -> list[Subset]:
    """For each size ``j = 1..|observed|``, one subset of ``observed`` of size ``j`` containing ``party``, uniformly.

    Each size class is enumerated once (cached) and one uniform index per class is drawn with a single generator
    call, so every size-``j`` subset containing ``party`` has probability ``1 / C(|observed|-1, j-1)``.
    """
    return TaskTable.of(party, observed).sample(rng)


# Above this many observed parties the 2^(n-1) subsets containing a party are not enumerated; tasks are drawn by
# picking companions without replacement instead (same distribution, no exponential table).
MAX_ENUMERATED = 12


class TaskTable:
    """Everything party ``party`` needs to draw its tasks for one observed set, precomputed once and cached.

    For up to :data:`MAX_ENUMERATED` observed parties, ``subsets`` lists all ``2^(n-1)`` subsets of the observed
    set that contain ``party``, grouped by size, and ``matrix`` is their averaging matrix (one row per subset,
    columns in ``observed`` order); a draw is one generator call (one uniform index per size) and one row
    gather. ``weights`` are the factors ``a_1..a_n``.
    """

    _cache: dict[tuple[int, Subset], TaskTable] = {}

    def __init__(self, party: int, observed: Sequence[int]) -> None:
        self.observed: Subset = tuple(int(p) for p in observed)
        canonical = as_subset(self.observed)
        if len(canonical) != len(self.observed):
            raise ConfigError(f"observed parties must be distinct, got {list(observed)}")
        if party not in canonical:
            raise ConfigError(f"party {party} is not in the observed set {canonical}")
        self.party = int(party)
        self.n = len(canonical)
        self.weights = torch.tensor(task_weights(self.n), dtype=torch.float32)
        self.enumerated = self.n <= MAX_ENUMERATED
        if self.enumerated:
            by_size = _tasks_by_size(self.party, canonical)
            self.counts = np.array([len(c) for c in by_size], dtype=np.int64)
            self.offsets = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
            self.subsets: list[Subset] = [s for cls in by_size for s in cls]
            self.matrix = averaging_matrix(self.subsets, self.observed)
            self._matrix_rows = self.matrix.numpy()  # same memory; numpy gathers a few rows faster than torch
        else:
            self._others = np.array([p for p in canonical if p != self.party], dtype=np.int64)

    @classmethod
    def of(cls, party: int, observed: Sequence[int]) -> TaskTable:
        key = (int(party), tuple(int(p) for p in observed))
        table = cls._cache.get(key)
        if table is None:
            table = cls._cache[key] = cls(party, observed)
        return table

    def sample_rows(self, rng: np.random.Generator) -> np.ndarray:
        """Rows of ``subsets``/``matrix``: one uniform index per size class (floor of a uniform times the class size)."""
        if not self.enumerated:
            raise ConfigError(f"{self.n} observed parties are too many to enumerate; use draw() or sample()")
        return self.offsets + np.minimum((rng.random(self.n) * self.counts).astype(np.int64), self.counts - 1)

    def sample(self, rng: np.random.Generator) -> list[Subset]:
        """One uniform subset per size ``1..n`` (each contains ``party``), in size order."""
        if self.enumerated:
            return [self.subsets[r] for r in self.sample_rows(rng)]
        return [(self.party,)] + [
            as_subset((self.party, *rng.choice(self._others, size=j - 1, replace=False).tolist()))
            for j in range(2, self.n + 1)
        ]

    def draw(self, rng: np.random.Generator) -> tuple[list[Subset], torch.Tensor]:
        """Sampled tasks and their (n, n) averaging matrix, rows in size order (to pair with ``weights``)."""
        if self.enumerated:
            rows = self.sample_rows(rng)
            return [self.subsets[r] for r in rows], torch.from_numpy(self._matrix_rows[rows])
        tasks = self.sample(rng)
        return tasks, averaging_matrix(tasks, self.observed)


def averaging_matrix(subsets: Sequence[Subset], observed: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``M`` of shape (len(subsets), len(observed)): ``M[s, i] = 1/|J_s|`` if ``observed[i]`` is in ``J_s``, else 0.

    Column ``i`` follows the order of ``observed`` (the order in which representations are stacked).
    """
    position = {p: i for i, p in enumerate(observed)}
    if len(position) != len(observed):
        raise ConfigError(f"observed parties must be distinct, got {list(observed)}")
    M = torch.zeros(len(subsets), len(observed), dtype=dtype)
    for s, subset in enumerate(subsets):
        if not subset:
            raise ConfigError("cannot average over an empty set of parties")
        missing = [p for p in subset if p not in position]
        if missing:
            raise ConfigError(f"subset {subset} uses parties {missing} that are not observed ({list(observed)})")
        for p in subset:
            M[s, position[p]] = 1.0 / len(subset)
    return M


def subset_means(reps: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """All subset means in one product: ``reps`` (n, B, d) stacked representations -> (S, B, d)."""
    if reps.dim() < 2 or reps.shape[0] != matrix.shape[1]:
        raise ConfigError(
            f"representations stacked as {tuple(reps.shape)} do not match an averaging matrix of shape "
            f"{tuple(matrix.shape)}: the first dimension must be the {matrix.shape[1]} observed parties"
        )
    n, *rest = reps.shape
    return (matrix.to(reps.dtype) @ reps.reshape(n, -1)).reshape(matrix.shape[0], *rest)


def per_sample_loss(n_classes: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Unreduced loss for logits (S, B, out) and labels (B,) -> (S, B), matching :func:`secvfl.models.output_dim`:
    BCE on one logit for 2 classes, softmax cross-entropy otherwise. Labels are broadcast, not copied, per subset."""
    if n_classes == 2:

        def bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z = logits.squeeze(-1)
            return F.binary_cross_entropy_with_logits(z, y.to(z.dtype).expand_as(z), reduction="none")

        return bce
    return _cross_entropy


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    S, B, C = logits.shape
    return F.cross_entropy(logits.reshape(S * B, C), y.repeat(S), reduction="none").reshape(S, B)


def weighted_task_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    reps: torch.Tensor,
    matrix: torch.Tensor,
    weights: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_s weights[s] * mean_batch loss(head(mean of subset s), targets)`` with one head call for all subsets.

    ``loss_fn(logits (S, B, C), y (B,))`` returns per-sample losses (S, B) (default: softmax cross-entropy).
    Returns the scalar loss and the logits, shape (S, B, C).
    """
    fused = subset_means(reps, matrix)  # (S, B, d)
    S, B = fused.shape[0], fused.shape[1]
    logits = head(fused.reshape(S * B, *fused.shape[2:])).reshape(S, B, -1)
    per_sample = (loss_fn or _cross_entropy)(logits, targets)
    loss = per_sample.mean(dim=1) @ weights.to(per_sample.dtype)
    return loss, logits


def linear_head_task_grads(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    reps: torch.Tensor,
    matrix: torch.Tensor,
    weights: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`weighted_task_loss` and its gradients for a linear head, in closed form (no autograd graph).

    LASER-VFL's fusion heads are usually one linear layer, and a linear layer commutes with the subset mean:
    ``W (M R) = M (R W^T)``. So every party's representation goes through ``W`` once (``U = R W^T``, n rows of B
    logits instead of S of them over d columns), then ``Z = M U + b``, ``dZ = w_s / B * (sigmoid(Z) - y)`` (one
    logit, BCE) or ``w_s / B * (softmax(Z) - onehot(y))`` (softmax CE), ``G = M^T dZ`` (= dL/dU),
    ``dR = G W``, ``dW = G^T R``, ``db = sum dZ``: a handful of small products, no (S*B, d) intermediate.
    Returns ``(loss, dL/dreps, dL/dweight, dL/dbias)``; equal to autograd on :func:`weighted_task_loss` (tested).
    """
    n, B = reps.shape[0], reps.shape[1]
    S = matrix.shape[0]
    flat = reps.reshape(n * B, -1)  # (n*B, d)
    logits = (matrix @ (flat @ weight.t()).reshape(n, -1)).reshape(S, B, -1)  # (S, B, C), before the bias
    if bias is not None:
        logits = logits + bias
    scale = (weights.to(logits.dtype) / B).reshape(S, 1, 1)  # broadcast over rows and classes
    if weight.shape[0] == 1:  # binary: one logit, BCE
        y = targets.to(logits.dtype).reshape(1, B, 1).expand_as(logits)
        per_sample = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
        d_logits = (torch.sigmoid(logits) - y) * scale
    else:
        C = logits.shape[2]
        y = targets.repeat(S)
        per_sample = F.cross_entropy(logits.reshape(S * B, C), y, reduction="none").reshape(S, B, 1)
        d_logits = torch.softmax(logits.reshape(S * B, C), dim=1)
        d_logits[torch.arange(S * B), y] -= 1.0
        d_logits = d_logits.reshape(S, B, C) * scale
    loss = (per_sample * scale).sum()
    d_u = (matrix.t() @ d_logits.reshape(S, -1)).reshape(n * B, -1)  # (n*B, C)
    d_weight = d_u.t() @ flat
    d_bias = d_logits.sum(dim=(0, 1)) if bias is not None else None
    d_reps = (d_u @ weight).reshape(reps.shape)
    return loss, d_reps, d_weight, d_bias


def full_objective(loss_of: Callable[[int, Subset], float | torch.Tensor], observed: Sequence[int]):
    """The exact LASER-VFL objective for one observed set: ``sum_k sum_{J containing k} loss(k, J) / |J|``."""
    obs = as_subset(observed)
    return sum(loss_of(k, J) / len(J) for k in obs for J in subsets_containing(k, obs))


def sampled_objective(
    loss_of: Callable[[int, Subset], float | torch.Tensor], observed: Sequence[int], rng: np.random.Generator
):
    """One draw of the task-sampled estimate of :func:`full_objective` (what a training step minimises)."""
    obs = as_subset(observed)
    n = len(obs)
    return sum(task_weight(n, len(J)) * loss_of(k, J) for k in obs for J in sample_tasks(k, obs, rng))
