"""A dataset replayed as an endless stream, and the per-party feeds it (or a live source) fills.

:class:`StreamReplay` is the environment of a simulated run, not a party: each round it draws a class (equally
likely, or from probabilities redrawn from U(0,1) and normalised every 50 rounds for a non-stationary stream), a
source row of that class uniformly, and, for images, a small random affine deformation (rotation, scale, shear,
translation, with border padding; torch only), so a long stream does not repeat its source rows. It then puts each
party's columns of the sample in that party's :class:`Feed` and the label in the label party's feed. A party holds
only its own feed, which holds only its own columns: the replay plays the role of the world around the parties.

Everything random comes from one numpy generator seeded by (seed, "stream"); its state, the class probabilities in
force and the round count are the replay's state (checkpointed), so a resumed run sees the same samples.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

__all__ = ["Feed", "StreamReplay", "NONSTATIONARY_PERIOD"]

NONSTATIONARY_PERIOD = 50  # rounds between redraws of the class probabilities (the paper's synthetic drift)
_MAX_ROTATION = np.deg2rad(10.0)
_MAX_SCALE = 0.1
_MAX_SHEAR = 0.1
_MAX_SHIFT = 0.08  # of the half-width (about 1 pixel of 28)


class Feed:
    """One party's inbox of (entity id, payload) events, in arrival order and bounded (``maxlen``): a producer
    faster than its consumer loses the oldest events, counted in ``dropped``."""

    def __init__(self, maxlen: int = 1024) -> None:
        self._events: deque[tuple[int, Any]] = deque()
        self.maxlen = int(maxlen)
        self.dropped = 0

    def put(self, entity: int, payload: Any) -> None:
        if len(self._events) >= self.maxlen:
            self._events.popleft()
            self.dropped += 1
        self._events.append((int(entity), payload))

    def take(self) -> tuple[int, Any]:
        if not self._events:
            raise LookupError("no event in the feed")
        return self._events.popleft()

    def __len__(self) -> int:
        return len(self._events)


class StreamReplay:
    def __init__(self, X: np.ndarray, y: np.ndarray, n_classes: int, columns: list[np.ndarray], *, seed: int,
                 nonstationary: bool = False, image_shape: tuple[int, int] | None = None, deform: bool = False,
                 observed: np.ndarray | None = None) -> None:
        self._X = np.asarray(X, dtype=np.float32)
        self._y = np.asarray(y, dtype=np.int64)
        self._columns = [np.asarray(c) for c in columns]
        # which blocks each source row holds (missing blocks): a party missing its block gets no features (None)
        self._observed = None if observed is None or np.all(observed) else np.asarray(observed, dtype=bool)
        self.n_classes = max(int(n_classes), int(self._y.max()) + 1 if len(self._y) else 1)
        self._by_class = [np.flatnonzero(self._y == c) for c in range(self.n_classes)]
        self._present = np.array([len(r) > 0 for r in self._by_class])
        self.nonstationary = bool(nonstationary)
        self.image_shape = tuple(image_shape) if image_shape is not None and deform else None
        self._rng = np.random.default_rng([seed, 0x57AE])
        self.round = 0
        self._probs = self._uniform()
        self._cdf: np.ndarray | None = None
        self._cdf_of: np.ndarray | None = None  # the probabilities _cdf was built from

    def _uniform(self) -> np.ndarray:
        return self._present / self._present.sum()

    def _class_probs(self) -> np.ndarray:
        if self.nonstationary and self.round % NONSTATIONARY_PERIOD == 0:
            raw = self._rng.uniform(0.0, 1.0, self.n_classes) * self._present
            self._probs = raw / raw.sum() if raw.sum() > 0 else self._uniform()
        return self._probs

    def draw(self) -> tuple[np.ndarray, int, int]:
        """The next sample (full feature row, label, source row); advances the stream by one round."""
        # Generator.choice(n, p=probs) draws exactly this (one uniform, searched in the cdf); the cdf is kept
        # while the probabilities last instead of being rebuilt every round
        probs = self._class_probs()
        if self._cdf is None or self._cdf_of is not probs:
            self._cdf, self._cdf_of = probs.cumsum(), probs
            self._cdf /= self._cdf[-1]
        c = int(self._cdf.searchsorted(self._rng.random(), side="right"))
        rows = self._by_class[c]
        row = int(rows[int(self._rng.integers(len(rows)))])
        x = self._X[row]
        if self.image_shape is not None:
            x = self._deform(x)
        self.round += 1
        return x, c, row

    def _deform(self, x: np.ndarray) -> np.ndarray:
        angle, scale, shear = self._rng.uniform(-1, 1, 3) * (_MAX_ROTATION, _MAX_SCALE, _MAX_SHEAR)
        tx, ty = self._rng.uniform(-_MAX_SHIFT, _MAX_SHIFT, 2)
        c, s = np.cos(angle), np.sin(angle)
        theta = np.array([[c * (1 + scale), -s + shear, tx], [s, c * (1 + scale), ty]], dtype=np.float32)
        h, w = self.image_shape
        img = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).view(1, 1, h, w)
        grid = torch.nn.functional.affine_grid(torch.from_numpy(theta)[None], [1, 1, h, w], align_corners=False)
        out = torch.nn.functional.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=False)
        return out.reshape(-1).numpy()

    def emit(self, entity: int, feeds: list[Feed], label_feed: Feed) -> None:
        """Draw a sample and deliver its columns to each party's feed and its label to the label party's."""
        x, y, row = self.draw()
        for k, (cols, feed) in enumerate(zip(self._columns, feeds, strict=True)):
            held = self._observed is None or self._observed[row, k]
            feed.put(entity, x[cols] if held else None)  # (an index array: a copy)
        label_feed.put(entity, y)

    def state_dict(self) -> dict:
        return {"rng": self._rng.bit_generator.state, "round": self.round, "probs": self._probs.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["rng"]
        self.round = int(state["round"])
        self._probs = np.asarray(state["probs"], dtype=np.float64)
