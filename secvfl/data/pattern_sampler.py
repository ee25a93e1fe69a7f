"""Mini-batches grouped by observation pattern, for training with missing feature blocks.

Which parties hold which sample is known to every party after entity alignment (that is what alignment computes),
and the seed is agreed on up front. Every party builds the same :class:`PatternBatchSampler` from the same mask
and seed, so all parties walk through identical batches without exchanging indices. Each batch contains only
samples with the same observed set ``K_o``, which is what LASER-VFL (and every baseline here) needs: a party is
either present for the whole batch or absent from it.

Two modes:

* uniform (default): every usable sample exactly once per epoch; samples of one pattern are shuffled and cut into
  batches, and the batches of all patterns are shuffled together.
* class-balanced: for imbalanced labels. An epoch has as many draws as there are usable samples, split equally
  among classes. Each class is read from an endless stream of its own shuffled copies, so a minority sample is
  repeated as evenly as possible and every majority sample is reached within a few epochs (unlike sampling with
  replacement, which leaves about a third of the samples out of any given epoch). The epoch's draws are then
  grouped by pattern as in uniform mode.

Samples no party observes cannot be used by anyone and are left out (counted in ``n_unobserved``).
Every epoch is a pure function of ``(seed, epoch)``: resuming at epoch ``e`` reproduces the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from secvfl.errors import ConfigError, DataError

__all__ = ["PatternBatch", "PatternBatchSampler", "pattern_codes", "observed_parties"]

_SALT_SHUFFLE = 0x5A1  # separate random streams for batch shuffling and class-balanced draws
_SALT_CLASS = 0xC1A55


@dataclass(frozen=True)
class PatternBatch:
    """Sample indices of one batch and the parties that observe all of them (sorted)."""

    indices: np.ndarray
    observed: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.indices)


def pattern_codes(mask: np.ndarray) -> np.ndarray:
    """One integer per sample: bit ``k`` set when party ``k`` observes it."""
    mask = np.asarray(mask, dtype=bool)
    return (mask.astype(np.int64) << np.arange(mask.shape[1], dtype=np.int64)).sum(axis=1)


def observed_parties(code: int, n_parties: int) -> tuple[int, ...]:
    return tuple(k for k in range(n_parties) if code >> k & 1)


class PatternBatchSampler:
    """Batches of samples that share their observed set, identical for every party holding the same seed.

    Args:
        mask: (N, K) boolean, True where party ``k`` observes sample ``n``.
        batch_size: maximum batch size (the last batch of each pattern may be smaller).
        seed: the seed all parties agreed on.
        labels: (N,) integer labels, required for ``class_balanced``.
        class_balanced: draw an equal number of samples of every class each epoch (see module docstring).
    """

    def __init__(
        self,
        mask: np.ndarray,
        batch_size: int,
        *,
        seed: int,
        labels: np.ndarray | None = None,
        class_balanced: bool = False,
    ) -> None:
        mask = np.asarray(mask)
        if mask.ndim != 2 or mask.dtype != bool:
            raise DataError(f"the observation mask must be a boolean (N, K) array, got {mask.dtype} {mask.shape}")
        if mask.shape[1] > 62:
            raise ConfigError(f"at most 62 parties are supported by the pattern sampler, got {mask.shape[1]}")
        if int(batch_size) < 1:
            raise ConfigError(f"batch size must be at least 1, got {batch_size}")
        self.n_parties = mask.shape[1]
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.class_balanced = bool(class_balanced)
        self.codes = pattern_codes(mask)
        self.usable = np.flatnonzero(self.codes != 0)
        self.n_unobserved = int(len(mask) - len(self.usable))
        if len(self.usable) == 0:
            raise DataError("no sample is observed by any party; nothing to train on (check the missing rate)")
        if self.class_balanced:
            if labels is None:
                raise ConfigError("a class-balanced sampler needs the labels")
            labels = np.asarray(labels)
            if labels.shape != (len(mask),):
                raise DataError(f"labels {labels.shape} must have one entry per sample ({len(mask)})")
            usable_labels = labels[self.usable]
            self.classes = np.unique(usable_labels)
            self._class_members = [self.usable[usable_labels == c] for c in self.classes]
            base, extra = divmod(len(self.usable), len(self.classes))
            self._per_class = [base + (1 if i < extra else 0) for i in range(len(self.classes))]

    # -- one epoch -------------------------------------------------------------------------------------------
    def _rng(self, *salt: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *salt])

    def _class_stream(self, c: int, start: int, count: int) -> np.ndarray:
        """Positions ``start..start+count-1`` of class ``c``'s endless stream of shuffled copies."""
        members = self._class_members[c]
        m = len(members)
        out = []
        pos, end = start, start + count
        while pos < end:
            cycle, offset = divmod(pos, m)
            perm = self._rng(_SALT_CLASS, c, cycle).permutation(m)
            take = min(m - offset, end - pos)
            out.append(members[perm[offset : offset + take]])
            pos += take
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """The (unordered) sample indices drawn in ``epoch``; each usable sample once in uniform mode."""
        if epoch < 0:
            raise ConfigError(f"epoch must be non-negative, got {epoch}")
        if not self.class_balanced:
            return self.usable
        return np.concatenate(
            [self._class_stream(c, epoch * n, n) for c, n in enumerate(self._per_class)]
        )

    def epoch(self, epoch: int) -> list[PatternBatch]:
        """All batches of ``epoch``, in training order."""
        idx = self.epoch_indices(epoch)
        rng = self._rng(_SALT_SHUFFLE, int(epoch))
        idx = idx[rng.permutation(len(idx))]
        codes = self.codes[idx]
        order = np.argsort(codes, kind="stable")  # shuffled within each pattern, grouped by pattern
        idx, codes = idx[order], codes[order]
        bounds = np.flatnonzero(np.diff(codes)) + 1
        batches: list[PatternBatch] = []
        for group in np.split(idx, bounds):
            observed = observed_parties(int(self.codes[group[0]]), self.n_parties)
            for s in range(0, len(group), self.batch_size):
                batches.append(PatternBatch(group[s : s + self.batch_size], observed))
        return [batches[i] for i in rng.permutation(len(batches))]

    def __iter__(self) -> Iterator[PatternBatch]:
        return iter(self.epoch(0))

    # -- facts ------------------------------------------------------------------------------------------------
    def pattern_counts(self) -> dict[tuple[int, ...], int]:
        """Usable samples per observed set."""
        codes, counts = np.unique(self.codes[self.usable], return_counts=True)
        return {observed_parties(int(c), self.n_parties): int(n) for c, n in zip(codes, counts, strict=True)}

    def describe(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "seed": self.seed,
            "class_balanced": self.class_balanced,
            "n_usable": int(len(self.usable)),
            "n_unobserved": self.n_unobserved,
            "patterns": {",".join(map(str, k)) or "-": v for k, v in sorted(self.pattern_counts().items())},
        }
