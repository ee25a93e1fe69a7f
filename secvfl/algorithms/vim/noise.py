"""Party-side Gaussian noise on a party's own features, for VIM's client-level explainability.

Two uses (paper, Section 4 and Appendix B.3): *denoising* (``--vim-noise-party K --vim-noise-std S``: party K's
features are noisy in every split, training and test, as a poor data source would be; its head's norm should fall)
and *noise validation* (``--vim-validate-noise S``: after training, each party in turn adds noise to its test
features, the label party scores the test split, the party restores its clean features; the accuracy drop says how
much the model relies on that party, to compare with its head's norm).

The noise is a transform a party applies to the features it holds, at the coordinator's request and with the public
run seed: the coordinator never reads or writes a party's data. The party draws the noise from its own generator,
seeded by ``(seed, split)``, so a run is deterministic with ``--seed``.
"""

from __future__ import annotations

import numpy as np
import torch

from secvfl.handles import FeatureHandle, request
from secvfl.parties import FeatureParty

__all__ = ["NoisyFeatureParty", "NoisyFeatureHandle", "SPLIT_CODES"]

SPLIT_CODES = {"train": 0, "val": 1, "test": 2}


class NoisyFeatureParty(FeatureParty):
    """A feature party that can add ``N(0, std^2)`` noise to its own features of one split and undo it."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - FeatureParty's
        super().__init__(*args, **kwargs)
        self._before_noise: dict[str, list[torch.Tensor]] = {}  # per split, the features before each noise added

    def add_feature_noise(self, split: str, std: float, seed: int) -> None:
        before = self._x[split]
        self._before_noise.setdefault(split, []).append(before)
        rng = np.random.default_rng([int(seed), SPLIT_CODES[split]])
        noise = torch.as_tensor(rng.normal(0.0, std, size=tuple(before.shape)), dtype=before.dtype,
                                device=before.device)
        self._x[split] = before + noise

    def restore_features(self, split: str) -> None:
        """Back to the features before the last :meth:`add_feature_noise` on ``split`` (no-op if none)."""
        stack = self._before_noise.get(split)
        if stack:
            self._x[split] = stack.pop()


class NoisyFeatureHandle(FeatureHandle):
    """A :class:`NoisyFeatureParty`: the requests of every feature party plus the two noise requests."""

    _party: NoisyFeatureParty

    @request
    def add_feature_noise(self, split: str, std: float, seed: int) -> None:
        """The party adds ``N(0, std^2)`` noise (its generator, seeded by ``seed`` and the split) to its ``split``
        features."""
        self._party.add_feature_noise(split, std, seed)

    @request
    def restore_features(self, split: str) -> None:
        """The party goes back to its features of ``split`` before the noise."""
        self._party.restore_features(split)
