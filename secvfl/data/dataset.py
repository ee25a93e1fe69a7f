"""The in-memory dataset every loader produces: aligned rows, split, preprocessed with training statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Dataset", "RawData"]


@dataclass
class RawData:
    """What a file loader returns before splitting: features may contain NaN (missing values)."""

    X: np.ndarray  # (n, d) float64, NaN = missing
    y: np.ndarray  # (n,) int64 in 0..C-1
    feature_names: list[str]
    classes: list[str]
    image_shape: tuple[int, int] | None = None
    X_test: np.ndarray | None = None  # a split that ships with the data (MNIST, a9a.t)
    # colour channels of an image (the columns are channel-major: all of channel 0's pixels, then channel 1's, ...)
    image_channels: int = 1
    y_test: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)
    # A large table (secvfl.data.table): X is float32 after subtracting ``shift`` per column (values = X + shift).
    shift: np.ndarray | None = None
    encodings: list[Any] | None = None  # per source column, what it became (secvfl.data.csv_loader.ColumnEncoding)


@dataclass
class Dataset:
    """Train/validation/test splits of one table, rows aligned across all future parties.

    Features are float32, standardised with statistics of the training split only; labels int64 in 0..C-1.
    ``notes`` records every preprocessing decision (dropped rows, imputation, split seeds) for the run summary.
    """

    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    X_val: np.ndarray
    y_val: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    n_classes: int
    feature_names: list[str]
    classes: list[str]
    image_shape: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)
    image_channels: int = 1  # channel-major columns (see RawData)
    # The fitted preprocessing (secvfl.data.preprocess.Standardisation), to prepare new rows the same way.
    standardisation: Any = None
    encodings: list[Any] | None = None

    @property
    def n_features(self) -> int:
        return int(self.X_train.shape[1])

    def describe(self) -> dict:
        return {
            "name": self.name,
            "n_train": int(len(self.y_train)),
            "n_val": int(len(self.y_val)),
            "n_test": int(len(self.y_test)),
            "n_features": self.n_features,
            "n_classes": self.n_classes,
            "notes": list(self.notes),
        }
