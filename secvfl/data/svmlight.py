"""svmlight / LIBSVM text files (gzip read transparently)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from secvfl.data.dataset import RawData
from secvfl.data.files import READ_ERRORS, check_readable_file, describe_read_error
from secvfl.errors import DataError

__all__ = ["load_svmlight", "read_svmlight"]


def read_svmlight(path: Path, n_features: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_svmlight_file

    check_readable_file(path, "svmlight file", "svmlight:PATH[,TEST_PATH]")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            X, y = load_svmlight_file(fh, n_features=n_features)
    except READ_ERRORS as exc:
        raise DataError(f"cannot read {path} as svmlight/LIBSVM: {describe_read_error(exc)}") from None
    except ValueError as exc:
        raise DataError(_first_bad_line(path) or f"{path} is not a valid svmlight/LIBSVM file: {exc}") from None
    if X.shape[0] == 0:
        raise DataError(f"{path} has no data lines; svmlight lines read LABEL INDEX:VALUE ..., e.g. {_EXAMPLE}")
    return np.asarray(X.todense(), dtype=np.float64), y


_EXAMPLE = "'1 3:0.5 7:1'"


def _line_problem(line: str) -> str | None:
    tokens = line.split("#", 1)[0].split()
    if not tokens:
        return None
    label, *pairs = tokens
    try:
        float(label)
    except ValueError:
        return f"the label {label!r} is not a number"
    last = -1
    for token in pairs:
        key, sep, value = token.partition(":")
        if key == "qid" and sep and value.isdigit():
            continue
        if not (sep and key.isdigit()):
            return f"{token!r} is not INDEX:VALUE"
        try:
            float(value)
        except ValueError:
            return f"the value in {token!r} is not a number"
        if int(key) <= last:
            return f"feature indices must increase along a line, {token!r} does not"
        last = int(key)
    return None


def _first_bad_line(path: Path) -> str | None:
    """'PATH line N: problem' for the first malformed line (sklearn's parser does not say where), or None."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, start=1):
            if (problem := _line_problem(line)) is not None:
                return (f"{path} line {number}: {problem}; svmlight lines read LABEL INDEX:VALUE ..., "
                        f"e.g. {_EXAMPLE}")
    return None


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
