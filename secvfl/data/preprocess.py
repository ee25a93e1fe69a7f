"""Splitting, missing-value policy and standardisation. Every statistic is fitted on the training split only."""

from __future__ import annotations

import warnings

import numpy as np

from secvfl.data.dataset import Dataset, RawData
from secvfl.errors import DataError, DataWarning

__all__ = ["NAN_POLICIES", "prepare", "stratified_split", "split_rows", "min_rows_per_class"]

NAN_POLICIES = ("mean", "drop", "error")


def stratified_split(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (keep, held_out) with ``fraction`` of every class held out, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    held = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        held.append(idx[: int(round(fraction * len(idx)))])
    held_idx = np.sort(np.concatenate(held)) if held else np.array([], dtype=np.int64)
    keep = np.setdiff1d(np.arange(len(y)), held_idx)
    return keep, held_idx


def split_rows(y: np.ndarray, *, seed: int, val_fraction: float, test_fraction: float = 0.2,
               test_split_seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices (train, validation, test) exactly as :func:`prepare` draws them for a table without a test file
    (and without ``--nan-policy drop``): the test split stratified with ``test_split_seed``, the validation split
    carved from the rest with ``seed``. The label party of a deployment draws them from its labels alone."""
    keep, held = stratified_split(y, test_fraction, test_split_seed)
    if val_fraction > 0:
        rest, val = stratified_split(y[keep], val_fraction, seed)
        return keep[rest], keep[val], held
    return keep, keep[:0], held


def min_rows_per_class(test_fraction: float, val_fraction: float) -> int:
    """Fewest rows of one class that leave every split at least one row (each split rounds its share per class)."""
    for n in range(1, 100_000):
        test = int(round(test_fraction * n))
        val = int(round(val_fraction * (n - test)))
        if test >= 1 and (val >= 1 or val_fraction == 0) and n - test - val >= 1:
            return n
    return int(np.ceil(1 / (val_fraction * (1 - test_fraction))))  # tiny fractions: the order of magnitude


def _check_finite(X: np.ndarray, names: list[str], name: str, where: str) -> None:
    bad = np.isinf(X)
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"{name}: {where}row {r + 1}, column {names[c]!r} holds {X[r, c]}; features must be finite "
                        "(mark a missing value as NaN or an empty cell)")


def _drop_empty_columns(
    X: np.ndarray, X_test: np.ndarray, names: list[str], image_shape: tuple[int, int] | None, name: str,
    notes: list[str],
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Columns with no value in the training split carry no information: drop them (images: set 0) and warn."""
    empty = np.isnan(X).all(axis=0) if len(X) else np.zeros(X.shape[1], dtype=bool)
    if not empty.any():
        return X, X_test, names
    cols = [names[j] for j in np.flatnonzero(empty)]
    shown = ", ".join(repr(c) for c in cols[:10]) + (f" and {len(cols) - 10} more" if len(cols) > 10 else "")
    if image_shape is not None:  # dropping pixels would break the image grid the parties' regions are cut from
        X, X_test = np.where(empty, 0.0, X), np.where(empty, 0.0, X_test)
        message = f"{name}: pixel column(s) {shown} have no value in any training image; set to 0 everywhere"
    elif empty.all():
        raise DataError(f"{name}: no feature column has a value in the training split; check the file's missing "
                        "value markers")
    else:
        X, X_test, names = X[:, ~empty], X_test[:, ~empty], [n for n, e in zip(names, empty, strict=True) if not e]
        message = (f"{name}: column(s) {shown} have no value in the training split; dropped them (a column "
                   "without values carries no information)")
    notes.append(message)
    warnings.warn(message, DataWarning, stacklevel=3)
    return X, X_test, names


def _drop_nan_rows(X: np.ndarray, y: np.ndarray, notes: list[str], what: str) -> tuple[np.ndarray, np.ndarray]:
    bad = np.isnan(X).any(axis=1)
    if bad.any():
        notes.append(f"nan-policy drop: removed {int(bad.sum())} {what} rows with missing values")
    return X[~bad], y[~bad]


def prepare(
    raw: RawData,
    name: str,
    *,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    test_split_seed: int = 0,
    nan_policy: str = "mean",
    rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> Dataset:
    """Split ``raw`` into train/val/test, handle missing values by ``nan_policy`` and standardise.

    The test split is stratified with ``test_split_seed`` (fixed, default 0, so every run of every method sees the
    same test rows); the validation split is carved from the training rows with the run ``seed``. ``rows`` gives
    the (train, validation, test) row indices instead, as :func:`split_rows` draws them: a deployed feature party
    prepares its own columns with the rows its label party chose, without seeing a label.
    """
    if nan_policy not in NAN_POLICIES:
        raise DataError(f"unknown nan policy {nan_policy!r}; choose one of {', '.join(NAN_POLICIES)}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"validation fraction must be in [0, 1), got {val_fraction}")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test fraction must be in (0, 1), got {test_fraction}")
    notes = list(raw.notes)
    feature_names = list(raw.feature_names)
    X, y = raw.X.astype(np.float64, copy=False), raw.y.astype(np.int64, copy=False)
    _check_finite(X, feature_names, name, "")
    if raw.X_test is not None:
        _check_finite(raw.X_test, feature_names, name, "test file ")
    n_missing = int(np.isnan(X).sum()) + (int(np.isnan(raw.X_test).sum()) if raw.X_test is not None else 0)
    if n_missing and nan_policy == "error":
        cols = [raw.feature_names[j] for j in np.flatnonzero(np.isnan(X).any(axis=0))][:5]
        raise DataError(
            f"{name}: {n_missing} missing values (e.g. in columns {cols}) but --nan-policy is 'error'; "
            "use --nan-policy mean (impute training means) or drop (remove incomplete rows)"
        )
    if rows is not None and (raw.X_test is not None or nan_policy == "drop"):
        raise DataError("rows chosen for the splits exclude a test file and --nan-policy drop")
    if raw.X_test is not None:
        X_test, y_test = raw.X_test.astype(np.float64, copy=False), raw.y_test
        notes.append(f"test split: the {len(y_test)} rows shipped as the dataset's test file")
    elif rows is not None:
        train_rows, val_rows, test_rows = (np.asarray(r, dtype=np.int64) for r in rows)
        X_test, y_test = X[test_rows], y[test_rows]
        X, y = X[np.concatenate([train_rows, val_rows])], y[np.concatenate([train_rows, val_rows])]
        notes.append(f"splits: {len(train_rows)} / {len(val_rows)} / {len(test_rows)} rows chosen by the label party")
    else:
        keep, held = stratified_split(y, test_fraction, test_split_seed)
        X_test, y_test = X[held], y[held]
        X, y = X[keep], y[keep]
        notes.append(f"test split: stratified {test_fraction:.0%} of rows, seed {test_split_seed}")
    if n_missing:
        X, X_test, feature_names = _drop_empty_columns(X, X_test, feature_names, raw.image_shape, name, notes)
        n_missing = int(np.isnan(X).sum()) + int(np.isnan(X_test).sum())
    if nan_policy == "drop":
        X, y = _drop_nan_rows(X, y, notes, "training")
        X_test, y_test = _drop_nan_rows(X_test, y_test, notes, "test")
    if rows is not None:  # training rows first, then validation rows (above)
        n_train = len(rows[0])
        keep, held = np.arange(n_train), np.arange(n_train, len(y))
        X_val, y_val, X, y = X[held], y[held], X[keep], y[keep]
    elif val_fraction > 0:
        keep, held = stratified_split(y, val_fraction, seed)
        X_val, y_val, X, y = X[held], y[held], X[keep], y[keep]
        notes.append(f"validation split: stratified {val_fraction:.0%} of training rows, seed {seed}")
    else:
        X_val, y_val = X[:0], y[:0]
    sizes = {"training": len(y), "test": len(y_test)} | ({"validation": len(y_val)} if val_fraction > 0 else {})
    empty = [split for split, n in sizes.items() if n == 0]
    if empty:
        fix = "" if raw.X_test is not None else (
            f"; with --val-fraction {val_fraction:g} a class needs at least "
            f"{min_rows_per_class(test_fraction, val_fraction)} rows to fill every split"
        )
        raise DataError(
            f"{name}: the {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} empty "
            f"({len(raw.y)} rows{', after --nan-policy drop' if nan_policy == 'drop' else ''}; each split takes a "
            f"rounded share of every class){fix}" + ("; or use --val-fraction 0" if "validation" in empty else "")
            + ("; or --nan-policy mean to keep rows with missing cells" if nan_policy == "drop" and n_missing else "")
        )
    if nan_policy == "mean" and n_missing:
        with warnings.catch_warnings():  # an image's pixel missing in every training row is 0 already (see above)
            warnings.simplefilter("ignore", RuntimeWarning)
            means = np.nan_to_num(np.nanmean(X, axis=0), nan=0.0)
        for part in (X, X_val, X_test):
            r, c = np.nonzero(np.isnan(part))
            part[r, c] = means[c]
        notes.append(f"nan-policy mean: imputed {n_missing} missing values with training-split column means")
    if raw.image_shape is not None and raw.image_channels > 1:
        # Colour images: a mean/std per channel (the usual normalisation of CIFAR-style sets), the same for every pixel
        per_channel = X.reshape(len(X), raw.image_channels, -1)
        mu_c, sd_c = per_channel.mean(axis=(0, 2)), per_channel.std(axis=(0, 2))
        pixels = X.shape[1] // raw.image_channels
        mu, sd = np.repeat(mu_c, pixels), np.repeat(np.where(sd_c < 1e-12, 1.0, sd_c), pixels)
    elif raw.image_shape is not None:
        # Images: one global mean/std keeps the pixel grid comparable across the image (and blank borders finite).
        mu, sd = float(X.mean()), float(X.std()) or 1.0
    else:
        mu, sd = X.mean(axis=0), X.std(axis=0)
        sd = np.where(sd < 1e-12, 1.0, sd)
    notes.append("standardised with training-split statistics")

    def f32(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(((a - mu) / sd).astype(np.float32))

    return Dataset(
        name=name,
        X_train=f32(X),
        y_train=y.astype(np.int64),
        X_val=f32(X_val),
        y_val=y_val.astype(np.int64),
        X_test=f32(X_test),
        y_test=np.asarray(y_test, dtype=np.int64),
        n_classes=len(raw.classes),
        feature_names=feature_names,
        classes=list(raw.classes),
        image_shape=raw.image_shape,
        image_channels=raw.image_channels,
        notes=notes,
    )
