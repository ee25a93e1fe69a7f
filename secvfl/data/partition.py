"""Vertical partitioning: which feature columns each party holds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from secvfl.errors import DataError

__all__ = ["Partition", "partition_columns", "partition_image", "make_partition", "IMAGE_SPLITS"]

IMAGE_SPLITS = ("auto", "strips", "quadrants", "columns")


@dataclass(frozen=True)
class Partition:
    """Column indices per party block; ``block_shapes[k]`` is (h, w) when block k is an image region, whose
    ``channels`` colour channels it then holds (its columns channel-major: the region's pixels of channel 0, then of
    channel 1, ...)."""

    blocks: tuple[np.ndarray, ...]
    block_shapes: tuple[tuple[int, int] | None, ...]
    channels: int = 1

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def sizes(self) -> list[int]:
        return [len(b) for b in self.blocks]

    def take(self, X: np.ndarray, k: int) -> np.ndarray:
        return np.ascontiguousarray(X[:, self.blocks[k]])

    def describe(self) -> list[dict]:
        return [
            {"columns": int(len(b)), "first": int(b[0]), "last": int(b[-1]), "shape": list(s) if s else None}
            for b, s in zip(self.blocks, self.block_shapes, strict=True)
        ]


def partition_columns(n_columns: int, k: int, sizes: list[int] | None = None) -> Partition:
    """Contiguous column blocks, sizes as even as possible (the first ``n % k`` blocks one larger), or explicit."""
    if k < 1:
        raise DataError(f"number of parties must be at least 1, got {k}")
    if sizes is not None:
        if len(sizes) != k or any(s < 1 for s in sizes) or sum(sizes) != n_columns:
            raise DataError(
                f"block sizes {sizes} must be {k} positive numbers summing to the {n_columns} feature columns"
            )
    else:
        if k > n_columns:
            raise DataError(
                f"cannot split {n_columns} feature columns among {k} parties (each needs at least one column); "
                f"use --parties {n_columns} or fewer"
            )
        base, extra = divmod(n_columns, k)
        sizes = [base + (1 if i < extra else 0) for i in range(k)]
    bounds = np.cumsum([0, *sizes])
    blocks = tuple(np.arange(bounds[i], bounds[i + 1]) for i in range(k))
    return Partition(blocks, (None,) * k)


def _even_cuts(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return list(np.cumsum([0] + [base + (1 if i < extra else 0) for i in range(parts)]))


def _grid(k: int) -> tuple[int, int]:
    """Rows x columns of the quadrant grid for k parties: the most square factorisation, rows <= columns."""
    rows = int(np.floor(np.sqrt(k)))
    while k % rows:
        rows -= 1
    return rows, k // rows


def max_image_parties(h: int, w: int) -> int:
    """The largest number of parties whose quadrant grid fits an h x w image (one pixel per region at least)."""
    return max(k for k in range(1, h * w + 1) if _grid(k)[0] <= h and _grid(k)[1] <= w)


def partition_image(shape: tuple[int, int], k: int, mode: str = "auto", *, channels: int = 1) -> Partition:
    """Image regions: horizontal strips, or a grid of quadrants (k = 4, or any k = r*c with r, c as close as possible).

    The columns are the image's pixels channel-major (``channels`` planes of h x w); a party's region holds its
    pixels in every channel."""
    h, w = shape
    if mode not in IMAGE_SPLITS:
        raise DataError(f"unknown image split {mode!r}; choose one of {', '.join(IMAGE_SPLITS)}")
    if mode == "columns":
        return partition_columns(channels * h * w, k)
    if mode == "auto":
        mode = "quadrants" if k == 4 else "strips"
    grid = np.arange(h * w).reshape(h, w)
    if mode == "strips":
        rows, cols = k, 1
    else:
        rows, cols = _grid(k)
    if rows > h or cols > w:
        raise DataError(
            f"cannot cut a {h}x{w} image into {rows}x{cols} regions for {k} parties; "
            + (f"use --parties {h} or fewer (one pixel row per strip at least)" if mode == "strips"
               else f"use at most {max_image_parties(h, w)} parties, a number whose grid fits in {h}x{w}")
            + f", or --image-split columns for up to {h * w} parties"
        )
    rc, cc = _even_cuts(h, rows), _even_cuts(w, cols)
    blocks, shapes = [], []
    for i in range(rows):
        for j in range(cols):
            region = grid[rc[i] : rc[i + 1], cc[j] : cc[j + 1]].reshape(-1)
            blocks.append(np.concatenate([region + c * h * w for c in range(channels)]) if channels > 1 else region)
            shapes.append((rc[i + 1] - rc[i], cc[j + 1] - cc[j]))
    return Partition(tuple(blocks), tuple(shapes), channels)


def make_partition(
    n_columns: int, k: int, *, image_shape: tuple[int, int] | None = None, image_split: str = "auto",
    sizes: list[int] | None = None, channels: int = 1,
) -> Partition:
    if image_shape is not None and sizes is None and image_split != "columns":
        return partition_image(image_shape, k, image_split, channels=channels)
    return partition_columns(n_columns, k, sizes)
