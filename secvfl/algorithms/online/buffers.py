"""The exponentially weighted sliding window of DLR (Wang et al., eqs. 4 and 5), as a ring of flat gradients.

``push(g)`` enqueues this round's gradient (a passive party enqueues zeros: ``push(None)``), dropping the one of
round t-l; ``average()`` is (1/W) sum_{i<l} alpha^i g^{t-i} with W = sum_{i<l} alpha^i. Before l rounds have passed
the missing entries are zeros (the window starts empty), so early steps are shorter, never rescaled. The sum is
recomputed from the ring each round (one (l,) x (l, P) product), not kept as a running sum, so no rounding error
accumulates over an unbounded stream and a resumed run continues bit for bit. OGD is the window l = 1.

Per round nothing is allocated: the weights in ring order for each position of the newest entry are a table built
once, a gradient given in parts (one tensor per parameter, as autograd returns them) is concatenated straight into
its ring row, a closed-form gradient is written into views of its ring row shaped like the parameters (built once
per row: slicing a row every round costs about as much as writing a small layer's gradient), and
``average(out=...)`` writes into the caller's buffer (the online bench measures why: per-sample rounds make these
small costs a large share).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["GradientWindow", "split_views", "window_weights"]


def window_weights(length: int, alpha: float) -> list[float]:
    """alpha^i / W for i = 0..l-1 (newest first)."""
    raw = [alpha**i for i in range(length)]
    total = sum(raw)
    return [w / total for w in raw]


def split_views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> tuple[torch.Tensor, ...]:
    """Views of the flat vector ``flat`` shaped like consecutive parameters of ``shapes`` (their flat order)."""
    views, offset = [], 0
    for shape in shapes:
        n = shape.numel()
        views.append(flat[offset : offset + n].view(shape))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"parameters of {offset} values for a vector of {flat.numel()}")
    return tuple(views)


class GradientWindow:
    def __init__(self, length: int, alpha: float, size: int, *, dtype: torch.dtype = torch.float32,
                 shapes: Sequence[torch.Size] | None = None) -> None:
        """``shapes``: the parameters' shapes in flat order, for :meth:`push_slot_parts`."""
        self.length = int(length)
        self.alpha = float(alpha)
        self._ring = torch.zeros(self.length, size, dtype=dtype)
        self._row_parts = None if shapes is None else [split_views(row, shapes) for row in self._ring]
        self._newest = -1  # ring index of round t's entry
        weights = torch.tensor(window_weights(self.length, self.alpha), dtype=dtype)
        # row r: the weights in ring order when the newest entry sits at index r (round t-i at (r - i) mod l)
        self._rolled = torch.empty(self.length, self.length, dtype=dtype)
        for r in range(self.length):
            self._rolled[r, [(r - i) % self.length for i in range(self.length)]] = weights

    def push(self, grad: torch.Tensor | None) -> None:
        self._newest = (self._newest + 1) % self.length
        if grad is None:
            self._ring[self._newest].zero_()
        else:
            self._ring[self._newest].copy_(grad.reshape(-1))

    def push_slot(self) -> torch.Tensor:
        """Enqueue a gradient the caller writes into the returned ring row (flat, the window's size) at once."""
        self._newest = (self._newest + 1) % self.length
        return self._ring[self._newest]

    def push_slot_parts(self) -> tuple[torch.Tensor, ...]:
        """:meth:`push_slot`, as views of the new row shaped like the parameters (the window built with ``shapes``)."""
        if self._row_parts is None:
            raise ValueError("this window was built without the parameters' shapes")
        self._newest = (self._newest + 1) % self.length
        return self._row_parts[self._newest]

    def push_parts(self, parts: Sequence[torch.Tensor]) -> None:
        """Enqueue the gradient whose flat form is the concatenation of ``parts`` (written into the ring directly)."""
        self._newest = (self._newest + 1) % self.length
        torch.cat([p.reshape(-1) for p in parts], out=self._ring[self._newest])

    def average(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """(1/W) sum_i alpha^i g^{t-i}; into ``out`` (a flat tensor of the window's size) when given."""
        return torch.mv(self._ring.t(), self._rolled[self._newest], out=out)

    def state_dict(self) -> dict:
        return {"ring": self._ring.clone(), "newest": self._newest}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["ring"].shape) != tuple(self._ring.shape):
            raise ValueError(f"window of shape {tuple(state['ring'].shape)} for {tuple(self._ring.shape)}")
        self._ring.copy_(state["ring"])
        self._newest = int(state["newest"])
