"""Splitting, missing-value policy and standardisation. Every statistic is fitted on the training split only."""

from __future__ import annotations

import warnings

import numpy as np

from secvfl.data.dataset import Dataset, RawData
from secvfl.errors import DataError

__all__ = ["NAN_POLICIES", "prepare", "stratified_split"]

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
) -> Dataset:
    """Split ``raw`` into train/val/test, handle missing values by ``nan_policy`` and standardise.

    The test split is stratified with ``test_split_seed`` (fixed, default 0, so every run of every method sees the
    same test rows); the validation split is carved from the training rows with the run ``seed``.
    """
    if nan_policy not in NAN_POLICIES:
        raise DataError(f"unknown nan policy {nan_policy!r}; choose one of {', '.join(NAN_POLICIES)}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"validation fraction must be in [0, 1), got {val_fraction}")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test fraction must be in (0, 1), got {test_fraction}")
    notes = list(raw.notes)
    X, y = raw.X.astype(np.float64, copy=False), raw.y.astype(np.int64, copy=False)
    n_missing = int(np.isnan(X).sum()) + (int(np.isnan(raw.X_test).sum()) if raw.X_test is not None else 0)
    if n_missing and nan_policy == "error":
        cols = [raw.feature_names[j] for j in np.flatnonzero(np.isnan(X).any(axis=0))][:5]
        raise DataError(
            f"{name}: {n_missing} missing values (e.g. in columns {cols}) but --nan-policy is 'error'; "
            "use --nan-policy mean (impute training means) or drop (remove incomplete rows)"
        )
    if raw.X_test is not None:
        X_test, y_test = raw.X_test.astype(np.float64, copy=False), raw.y_test
        notes.append(f"test split: the {len(y_test)} rows shipped as the dataset's test file")
    else:
        keep, held = stratified_split(y, test_fraction, test_split_seed)
        X_test, y_test = X[held], y[held]
        X, y = X[keep], y[keep]
        notes.append(f"test split: stratified {test_fraction:.0%} of rows, seed {test_split_seed}")
    if nan_policy == "drop":
        X, y = _drop_nan_rows(X, y, notes, "training")
        X_test, y_test = _drop_nan_rows(X_test, y_test, notes, "test")
    if val_fraction > 0:
        keep, held = stratified_split(y, val_fraction, seed)
        X_val, y_val, X, y = X[held], y[held], X[keep], y[keep]
        notes.append(f"validation split: stratified {val_fraction:.0%} of training rows, seed {seed}")
    else:
        X_val, y_val = X[:0], y[:0]
    if len(y) == 0:
        raise DataError(f"{name}: no training rows left after splitting and missing-value handling")
    if nan_policy == "mean" and n_missing:
        with warnings.catch_warnings():  # a column missing in every training row gets 0 (its standardised mean)
            warnings.simplefilter("ignore", RuntimeWarning)
            means = np.nan_to_num(np.nanmean(X, axis=0), nan=0.0)
        for part in (X, X_val, X_test):
            r, c = np.nonzero(np.isnan(part))
            part[r, c] = means[c]
        notes.append(f"nan-policy mean: imputed {n_missing} missing values with training-split column means")
    if raw.image_shape is not None:
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
        feature_names=list(raw.feature_names),
        classes=list(raw.classes),
        image_shape=raw.image_shape,
        notes=notes,
    )
