"""Randomized response with a learned prior in two stages (LP-2ST; Ghazi, Golowich, Kumar, Manurangsi & Zhang, "Deep
Learning with Label Differential Privacy", NeurIPS 2021, Alg. 3 with two stages).

Threat model: as randomized response (:mod:`protocols.dp.rr`): pure ``epsilon``-label-DP against anyone who sees
anything derived from the training labels, under "one sample's label replaced".

Schedule
    The training rows are split at random into two parts, from the run's seed and independently of the labels (the
    split is public). Stage 1 (the first ``stage2_epoch`` epochs): every label of part 1 is replaced once by ``K``-ary
    randomized response, and the model trains on part 1's randomised labels only (part 2's rows take part in the
    batches with no target, so their labels enter nothing). Stage 2 (from epoch ``stage2_epoch`` on): the stage-1
    model predicts a class distribution for every row of part 2; that distribution is the row's *prior*, and each
    label of part 2 is replaced once by :func:`protocols.dp.rr.rr_with_prior`; training continues on both parts'
    randomised labels.

Training on randomised labels
    The label party knows how each label was randomised (epsilon, and for part 2 the prior's top-k set), so it trains
    on the likelihood of what was reported, ``-log sum_y p(y | x) P(reported | y)`` (forward correction): the model
    then estimates the true labels' distribution, not the randomised one, which makes the stage-1 prior sharper
    where it is right; it beat plain cross-entropy on the randomised labels (measured on MNIST: BENCHMARKS.md,
    "Label-DP mechanisms and the default").

Why the guarantee is pure ``epsilon``
    A part-2 prior is a function of the row's features and of the stage-1 model, which is itself a function of the
    features and of part 1's randomised labels: it does not depend on any part-2 label, so RRWithPrior is
    ``epsilon``-DP for each part-2 label. Each label is released exactly once (part 1 by RR, part 2 by RRWithPrior)
    and never used again; the two parts are disjoint, so by parallel and adaptive composition the whole transcript
    and the trained model are ``epsilon``-label-DP. The true labels of part 2 are dropped once they are released.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.dp.rng import NoiseSource
from protocols.dp.rr import (
    randomized_response,
    rr_keep_probability,
    rr_other_probability,
    rr_with_prior,
    rr_with_prior_set_sizes,
)
from secvfl.errors import ConfigError, DataError, ProtocolError

__all__ = ["TwoStageRR", "stage_split", "stage2_epoch_for"]


def stage_split(n_rows: int, stage1_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the part-1 rows: a uniformly random, label-independent subset of ``round(f * n)`` rows."""
    if not 0 < stage1_fraction < 1:
        raise ConfigError(f"the stage-1 fraction must be strictly between 0 and 1, got {stage1_fraction}")
    n1 = min(max(int(round(stage1_fraction * n_rows)), 1), n_rows - 1)
    mask = np.zeros(n_rows, dtype=bool)
    mask[np.random.default_rng([seed, 0x1AB]).permutation(n_rows)[:n1]] = True
    return mask


def stage2_epoch_for(epochs: int) -> int:
    """The epoch (0-based) at which stage 2 starts: half-way, rounded up, so both stages train at least once."""
    if epochs < 2:
        raise ConfigError(f"randomized response with a prior trains in two stages and needs --epochs >= 2, got {epochs}")
    return (epochs + 1) // 2


class TwoStageRR:
    """The label party's LP-2ST state: which labels are released, their randomised values, the stage-2 priors."""

    def __init__(
        self,
        true_labels: np.ndarray,
        n_classes: int,
        epsilon: float,
        stage1: np.ndarray,
        stage2_epoch: int,
    ) -> None:
        y = np.asarray(true_labels, dtype=np.int64)
        if y.shape != stage1.shape:
            raise DataError(f"{y.size} labels but a stage split over {stage1.size} rows")
        self.n_classes = int(n_classes)
        self.epsilon = float(epsilon)
        self.stage1 = np.asarray(stage1, dtype=bool)
        self.stage2_epoch = int(stage2_epoch)
        self._true: np.ndarray | None = y  # held only until every label is released
        self.labels = np.full(y.size, -1, dtype=np.int64)  # released (randomised) labels; -1: not released yet
        self.priors: np.ndarray | None = None  # part-2 rows' priors, once stage 2 has started
        self.set_sizes: np.ndarray | None = None

    @property
    def released(self) -> np.ndarray:
        return self.labels >= 0

    @property
    def stage2_done(self) -> bool:
        return self.priors is not None

    def release_stage1(self, rng: NoiseSource) -> None:
        if self.released.any():
            raise ProtocolError("randomized response with a prior: stage 1 was already released; refusing to release again")
        rows = np.flatnonzero(self.stage1)
        self.labels[rows] = randomized_response(self._true_labels()[rows], self.n_classes, self.epsilon, rng)

    def release_stage2(self, priors: np.ndarray, rng: NoiseSource) -> None:
        """RRWithPrior on part 2, ``priors`` (one row per training row) computed from the stage-1 model."""
        if self.stage2_done:
            raise ProtocolError("randomized response with a prior: stage 2 was already released; refusing to release again")
        if not self.released[self.stage1].all():
            raise ProtocolError("randomized response with a prior: stage 2 before stage 1")
        p = np.asarray(priors, dtype=np.float64)
        if p.shape != (self.stage1.size, self.n_classes):
            raise DataError(f"stage-2 priors of shape {p.shape}, expected {(self.stage1.size, self.n_classes)}")
        rows = np.flatnonzero(~self.stage1)
        prior = np.clip(p[rows], 0.0, None)
        prior /= prior.sum(axis=1, keepdims=True)  # exact probability vectors (float32 predictions drift)
        self.labels[rows] = rr_with_prior(self._true_labels()[rows], prior, self.epsilon, rng)
        self.priors = prior
        self.set_sizes = rr_with_prior_set_sizes(prior, self.epsilon)[1]
        self._true = None  # every label is released: the true ones are no longer needed

    def _true_labels(self) -> np.ndarray:
        if self._true is None:
            raise ProtocolError("randomized response with a prior: every label was already released")
        return self._true

    def likelihoods(self) -> np.ndarray:
        """Per released row, ``P(reported label | true label = y)`` for every class ``y`` (zero rows: not released).

        Training on ``-log sum_y p(y | x) L[y]`` (forward correction, Patrini et al. 2017) fits the model to the true
        labels' distribution under the known, public randomisation; the likelihoods depend on the released labels,
        epsilon and the priors only (post-processing).
        """
        k_all, eps = self.n_classes, self.epsilon
        out = np.zeros((self.labels.size, k_all))
        rows1 = np.flatnonzero(self.stage1 & self.released)
        out[rows1] = rr_other_probability(eps, k_all)
        out[rows1, self.labels[rows1]] = rr_keep_probability(eps, k_all)
        if self.priors is not None:
            rows2 = np.flatnonzero(~self.stage1)
            order, ks = rr_with_prior_set_sizes(self.priors, eps)
            in_set = np.arange(k_all)[None, :] < ks[:, None]  # by rank
            top = np.zeros_like(in_set)
            np.put_along_axis(top, order, in_set, axis=1)  # by class
            keep = 1.0 / (1.0 + (ks - 1.0) * np.exp(-eps))
            other = np.exp(-eps) * keep
            lik = np.where(top, other[:, None], 1.0 / ks[:, None])
            lik[np.arange(rows2.size), self.labels[rows2]] = keep
            out[rows2] = lik
        return out

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"stage1_rows": int(self.stage1.sum()), "stage2_rows": int((~self.stage1).sum()),
                             "stage2_epoch": self.stage2_epoch, "stage2_released": self.stage2_done}
        if self.set_sizes is not None:
            d["stage2_mean_set_size"] = float(np.mean(self.set_sizes)) if self.set_sizes.size else None
        return d

    # -- checkpoint state: released values only (never the true labels) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"labels": self.labels.tolist(), "stage1": self.stage1.tolist()}
        if self.priors is not None:
            state["priors"] = self.priors.tolist()
            state["stage2_epoch"] = self.stage2_epoch  # when it happened (a resumed run may plan more epochs)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stage1 = np.asarray(state["stage1"], dtype=bool)
        if not np.array_equal(stage1, self.stage1):
            raise ConfigError("the checkpoint's stage split for randomized response with a prior differs from this run's")
        self.labels = np.asarray(state["labels"], dtype=np.int64)
        if "priors" in state:
            self.priors = np.asarray(state["priors"], dtype=np.float64)
            self.stage2_epoch = int(state["stage2_epoch"])
            self.set_sizes = rr_with_prior_set_sizes(self.priors, self.epsilon)[1]
            self._true = None
