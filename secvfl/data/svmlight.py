"""svmlight / LIBSVM text files (gzip read transparently)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from secvfl.data.dataset import RawData
from secvfl.errors import DataError

__all__ = ["load_svmlight", "read_svmlight"]


def read_svmlight(path: Path, n_features: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_svmlight_file

    if not path.is_file():
        raise DataError(f"svmlight file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            X, y = load_svmlight_file(fh, n_features=n_features)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"{path} is not a valid svmlight/LIBSVM file: {exc}") from None
    return np.asarray(X.todense(), dtype=np.float64), y


def _labels(*ys: np.ndarray) -> tuple[list[np.ndarray], list[str]]:
    values = np.unique(np.concatenate(ys))
    classes = [str(int(v)) if float(v).is_integer() else str(v) for v in values]
    return [np.searchsorted(values, y).astype(np.int64) for y in ys], classes


def load_svmlight(path: str | Path, test_path: str | Path | None = None, n_features: int | None = None) -> RawData:
    path = Path(path)
    X, y = read_svmlight(path, n_features)
    if test_path is not None:
        Xt, yt = read_svmlight(Path(test_path), n_features or X.shape[1])
        if Xt.shape[1] != X.shape[1]:
            raise DataError(f"{test_path} has {Xt.shape[1]} features but {path} has {X.shape[1]}")
        (y, yt), classes = _labels(y, yt)
    else:
        Xt = yt = None
        (y,), classes = _labels(y)
    if len(classes) < 2:
        raise DataError(f"{path} has a single label value; need at least two classes")
    return RawData(
        X=X, y=y, X_test=Xt, y_test=yt, classes=classes,
        feature_names=[f"f{j + 1}" for j in range(X.shape[1])],
        notes=[f"svmlight: {X.shape[0]} rows x {X.shape[1]} features from {path.name}"],
    )
