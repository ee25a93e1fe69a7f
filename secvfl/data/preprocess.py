"""Splitting, missing-value policy and standardisation. Every statistic is fitted on the training split only.

Two ways through, one result: a table read as float64 (every loader, and any table of at most
secvfl.data.table.EXACT_CELLS numeric cells) goes through numpy whole-array operations as it always has; a larger
table read as float32 minus a per-column shift (secvfl.data.table) is standardised in row chunks into one float32
block (its train, validation and test splits are views of it), with statistics summed in float64 per chunk. The
two agree to float32 rounding (tests/test_table.py); the second never holds the table in float64.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from secvfl.data.dataset import Dataset, RawData
from secvfl.errors import DataError, DataWarning

__all__ = ["NAN_POLICIES", "prepare", "stratified_split", "split_rows", "min_rows_per_class", "Standardisation",
           "check_class_sizes"]

NAN_POLICIES = ("mean", "drop", "error")
_CHUNK_ROWS = 1 << 14  # rows per chunk (float64 temporaries of a few MB)


@dataclass
class Standardisation:
    """The fitted preprocessing of a table's features: the columns kept (of the encoded features), the training
    means used for missing values (None: none imputed), the training mean and standard deviation, and the
    ``--nan-policy`` the table was prepared with."""

    columns: list[str]
    mean: np.ndarray
    std: np.ndarray
    impute: np.ndarray | None = None
    image: bool = False  # one mean and deviation for every pixel
    nan_policy: str = "mean"

    def to_dict(self) -> dict:
        return {"columns": list(self.columns), "mean": np.atleast_1d(self.mean).tolist(),
                "std": np.atleast_1d(self.std).tolist(), "impute": None if self.impute is None
                else self.impute.tolist(), "image": self.image, "nan_policy": self.nan_policy}

    @classmethod
    def from_dict(cls, d: dict) -> Standardisation:
        return cls([str(c) for c in d["columns"]], np.asarray(d["mean"], dtype=np.float64),
                   np.asarray(d["std"], dtype=np.float64),
                   None if d.get("impute") is None else np.asarray(d["impute"], dtype=np.float64),
                   bool(d.get("image", False)), str(d.get("nan_policy", "mean")))

    def apply(self, X: np.ndarray, names: list[str], shift: np.ndarray | None = None, *,
              missing: np.ndarray | None = None) -> np.ndarray:
        """New rows (features named ``names``, float64, or float32 minus ``shift``) as the training rows were
        prepared: the kept columns, missing cells imputed, standardised, float32; in row chunks. A missing cell is
        imputed under ``--nan-policy mean`` (with the training mean of its column, also when training had no missing
        cell to impute); under another policy it stays NaN (the row cannot be used). ``missing`` (a bool per row),
        when given, is set True where a row has a missing cell in a kept column."""
        absent = [c for c in self.columns if c not in names]
        if absent:
            raise DataError(f"the table lacks feature(s) {absent[:5]} the model was trained on; give it the same "
                            "columns")
        cols = np.array([names.index(c) for c in self.columns], dtype=np.int64)
        out = np.empty((len(X), len(cols)), dtype=np.float32)
        mu, sd = (float(self.mean[0]), float(self.std[0])) if self.image else (self.mean, self.std)
        fill = self.impute
        if fill is None and self.nan_policy == "mean" and not self.image:  # nothing was missing in training
            fill = self.mean
        for start in range(0, len(X), _CHUNK_ROWS):
            v = X[start : start + _CHUNK_ROWS][:, cols].astype(np.float64)
            if shift is not None:
                v += shift[cols]
            nan = np.isnan(v)
            if missing is not None:
                missing[start : start + len(v)] = nan.any(axis=1)
            if fill is not None:
                r, c = np.nonzero(nan)
                v[r, c] = fill[c]
            out[start : start + len(v)] = (v - mu) / sd
        return out


def check_class_sizes(y: np.ndarray, classes: list[str], name: str) -> None:
    """A stratified split puts every class in training and evaluation: a class with one row cannot be; refuse it."""
    counts = np.bincount(y, minlength=len(classes))
    single = [classes[c] for c in np.flatnonzero(counts == 1)]
    if single:
        shown = ", ".join(repr(c) for c in single[:5]) + (f" and {len(single) - 5} more" if len(single) > 5 else "")
        raise DataError(f"{name}: class {shown} has a single row; a stratified split cannot put it in both the "
                        "training and the test rows (the model could never be checked on it): remove that row, "
                        "merge the class into another, or add rows of it")


def _too_large(name: str, column: str, value: float) -> DataError:
    return DataError(f"{name}: column {column!r} holds values as large as {value:.3g}, whose spread overflows the "
                     "floating-point range when standardised; rescale the column in the file (divide it by a power "
                     "of ten) or mark such cells missing")


def _check_statistics(name: str, names: list[str], column: Callable[[int | None], np.ndarray], *stats: Any
                      ) -> None:
    """Refuse a column whose training statistics overflowed (values near 1e308), naming it, before any training.
    ``column(j)`` gives column j's values (None: all of them, for one statistic over every pixel)."""
    flags = [np.isfinite(np.atleast_1d(np.asarray(s, dtype=np.float64))) for s in stats]
    bad = ~np.logical_and.reduce(np.broadcast_arrays(*flags))
    if bad.any():
        j = int(np.flatnonzero(bad)[0]) if bad.size == len(names) else None
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            values = column(j)
            largest = float(np.nanmax(np.abs(values))) if values.size else float("inf")
        raise _too_large(name, "every pixel" if j is None else names[j], largest)


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
    if raw.shift is not None:
        return _prepare_large(raw, name, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction,
                              test_split_seed=test_split_seed, nan_policy=nan_policy, rows=rows)
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
    if raw.X_test is None and rows is None:
        check_class_sizes(raw.y.astype(np.int64), list(raw.classes), name)
    means = None
    if nan_policy == "mean" and n_missing:
        with warnings.catch_warnings(), np.errstate(over="ignore"):  # an image's pixel missing in every training
            warnings.simplefilter("ignore", RuntimeWarning)          # row is 0 already (see above)
            means = np.nan_to_num(np.nanmean(X, axis=0), nan=0.0)
        _check_statistics(name, feature_names, lambda j: X if j is None else X[:, j], means)
        for part in (X, X_val, X_test):
            r, c = np.nonzero(np.isnan(part))
            part[r, c] = means[c]
        notes.append(f"nan-policy mean: imputed {n_missing} missing values with training-split column means")
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # an overflow is refused just below, with the column
        if raw.image_shape is not None and raw.image_channels > 1:
            # Colour images: a mean/std per channel (the usual normalisation of CIFAR-style sets), the same for every
            # pixel
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
    _check_statistics(name, feature_names, lambda j: X if j is None else X[:, j], mu, sd)
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
        standardisation=Standardisation(feature_names, np.atleast_1d(mu), np.atleast_1d(sd), means,
                                        image=raw.image_shape is not None, nan_policy=nan_policy),
        encodings=raw.encodings,
    )


def _row_chunks(rows: np.ndarray) -> list[np.ndarray]:
    return [rows[i : i + _CHUNK_ROWS] for i in range(0, len(rows), _CHUNK_ROWS)]


class _Moments:
    """Count, mean and sum of squared deviations of each column's present (non-NaN) values, merged chunk by chunk in
    float64 (Chan, Golub and LeVeque's pairwise update: no cancellation whatever the column's offset)."""

    def __init__(self, d: int) -> None:
        self.count, self.mean, self.m2 = np.zeros(d), np.zeros(d), np.zeros(d)

    def add(self, part: np.ndarray) -> bool:
        """Add a chunk of rows; True if it holds a missing (NaN) or an infinite cell."""
        v = part.astype(np.float64)
        nan = np.isnan(v)
        if nan.any():
            count = (~nan).sum(axis=0).astype(np.float64)
            v[nan] = 0.0
            mean = np.divide(v.sum(axis=0), count, out=np.zeros_like(count), where=count > 0)
            v -= mean
            v[nan] = 0.0
        else:
            count = np.full(v.shape[1], float(len(v)))
            mean = v.sum(axis=0) / max(len(v), 1)
            if not np.isfinite(mean).all():
                return True  # an infinite cell: refused by the caller
            v -= mean
        m2 = np.einsum("ij,ij->j", v, v)
        total = self.count + count
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(total > 0, count / np.maximum(total, 1), 0.0)
        delta = mean - self.mean
        self.mean += delta * share
        self.m2 += m2 + delta * delta * self.count * share
        self.count = total
        return bool(nan.any()) or not np.isfinite(self.m2).all()


def _take(X: Any, idx: np.ndarray, out: np.ndarray) -> None:
    """Rows ``idx`` of ``X`` (a float32 array, or a LazyBlock of secvfl.data.csv_loader) into ``out``."""
    if isinstance(X, np.ndarray):
        np.take(X, idx, axis=0, out=out)
    else:
        X.take(idx, out)


def _compact_columns(block: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``block[:, cols]`` in the block's own memory (rows moved forward in chunks: a row's new place never lies past
    its old one, so no row is overwritten before it is read)."""
    n, width = len(block), len(cols)
    flat = block.reshape(-1)
    for start in range(0, n, _CHUNK_ROWS):
        part = block[start : start + _CHUNK_ROWS][:, cols]  # a copy
        flat[start * width : start * width + part.size] = part.reshape(-1)
    return flat[: n * width].reshape(n, width)


def _prepare_large(raw: RawData, name: str, *, seed: int, val_fraction: float, test_fraction: float,
                   test_split_seed: int, nan_policy: str, rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None
                   ) -> Dataset:
    """:func:`prepare` for a table held as float32 minus ``raw.shift`` (see the module doc): the same splits, policy,
    checks and notes, computed in row chunks into one float32 block, in two passes over the data: the rows of every
    split gathered into the block (checks, missing cells and the training statistics on the way), then the block
    standardised in place."""
    if raw.X_test is not None or raw.image_shape is not None:
        raise DataError("a table read as float32 has no test file and no image grid")  # pragma: no cover
    X, shift, y = raw.X, np.asarray(raw.shift, dtype=np.float64), raw.y.astype(np.int64, copy=False)
    # X: float32 values minus shift, or a LazyBlock (secvfl.data.csv_loader) that assembles rows when indexed
    names = list(raw.feature_names)
    notes = list(raw.notes)
    n, d = X.shape

    def values(idx: np.ndarray, cols: np.ndarray | slice = slice(None)) -> np.ndarray:
        v = X[idx][:, cols].astype(np.float64)
        v += shift[cols]
        return v

    def refuse_infinite(idx: np.ndarray, part: np.ndarray) -> None:
        bad = np.isinf(part)
        if bad.any():
            r, c = (int(i) for i in np.argwhere(bad)[0])
            raise _too_large(name, names[c], float(np.nanmax(np.abs(values(idx[r : r + 1])))))

    def refuse_missing(count: int, per_column: np.ndarray) -> None:
        cols = [names[j] for j in np.flatnonzero(per_column)][:5]
        raise DataError(f"{name}: {count} missing values (e.g. in columns {cols}) but --nan-policy is 'error'; "
                        "use --nan-policy mean (impute training means) or drop (remove incomplete rows)")

    cols = np.arange(d)
    dropped_columns: str | None = None
    split_note: str
    if rows is not None and nan_policy == "drop":
        raise DataError("rows chosen for the splits exclude a test file and --nan-policy drop")
    if rows is not None:
        train, val, test = (np.asarray(r, dtype=np.int64) for r in rows)
        split_note = f"splits: {len(train)} / {len(val)} / {len(test)} rows chosen by the label party"
        pool = train[:0]  # not needed: the splits are given
    else:
        keep, test = stratified_split(y, test_fraction, test_split_seed)
        split_note = f"test split: stratified {test_fraction:.0%} of rows, seed {test_split_seed}"
        pool = keep
    drop_notes = []
    if nan_policy == "drop":  # which rows are complete decides the splits: one pass over every row first
        nan_rows = np.zeros(n, dtype=bool)
        seen = np.zeros(d, dtype=bool)
        in_pool = np.zeros(n, dtype=bool)
        in_pool[pool] = True
        for idx in _row_chunks(np.arange(n)):
            part = X[idx]
            refuse_infinite(idx, part)
            missing = np.isnan(part)
            nan_rows[idx] = missing.any(axis=1)
            seen |= ~missing[in_pool[idx]].all(axis=0)
        if nan_rows.any() and not seen.all():
            cols, dropped_columns = _empty_columns(seen, names, name)
            nan_rows[:] = False
            for idx in _row_chunks(np.arange(n)):
                nan_rows[idx] = np.isnan(X[idx][:, cols]).any(axis=1)
        for what, part in (("training", pool), ("test", test)):
            if nan_rows[part].any():
                drop_notes.append(f"nan-policy drop: removed {int(nan_rows[part].sum())} {what} rows with missing "
                                  "values")
        pool, test = pool[~nan_rows[pool]], test[~nan_rows[test]]
    val_note = None
    if rows is not None:
        pool_size = len(train) + len(val)
    elif val_fraction > 0:
        rest, held = stratified_split(y[pool], val_fraction, seed)
        train, val = pool[rest], pool[held]
        val_note = f"validation split: stratified {val_fraction:.0%} of training rows, seed {seed}"
    else:
        train, val = pool, pool[:0]
    if rows is None:
        pool_size = len(pool)

    # Pass 1: every split's rows into the block (float32 minus shift, as read), in split order.
    block = np.empty((len(train) + len(val) + len(test), d), dtype=np.float32)
    missing_per_split = np.zeros((3, d), dtype=np.int64)
    moments = _Moments(d)
    start = 0
    for k, part_rows in enumerate((train, val, test)):
        for idx in _row_chunks(part_rows):
            part = block[start : start + len(idx)]
            _take(X, idx, part)
            start += len(idx)
            # a float64 sum of float32 cells is finite unless the chunk holds a NaN or an infinity
            suspect = moments.add(part) if k == 0 else not np.isfinite(part.sum(axis=0, dtype=np.float64)).all()
            if suspect:
                refuse_infinite(idx, part)
                missing_per_split[k] += np.isnan(part).sum(axis=0)
    n_missing = int(missing_per_split.sum())
    if n_missing and nan_policy == "error":
        refuse_missing(n_missing, missing_per_split.sum(axis=0))
    if n_missing and nan_policy != "drop":
        seen = missing_per_split[:2].sum(axis=0) < pool_size
        if not seen.all():
            cols, dropped_columns = _empty_columns(seen, names, name)
        n_missing = int(missing_per_split[:, cols].sum())
    if len(cols) < d:
        block = _compact_columns(block, cols)
        names = [names[j] for j in cols]
    notes.append(split_note)
    if dropped_columns is not None:
        notes.append(dropped_columns)
        warnings.warn(dropped_columns, DataWarning, stacklevel=3)
    notes.extend(drop_notes)
    if val_note is not None:
        notes.append(val_note)
    sizes = {"training": len(train), "test": len(test)} | ({"validation": len(val)} if val_fraction > 0 else {})
    empty_splits = [split for split, k in sizes.items() if k == 0]
    if empty_splits:
        raise DataError(
            f"{name}: the {' and '.join(empty_splits)} split{'s are' if len(empty_splits) > 1 else ' is'} empty "
            f"({len(y)} rows{', after --nan-policy drop' if nan_policy == 'drop' else ''}; each split takes a rounded "
            f"share of every class); with --val-fraction {val_fraction:g} a class needs at least "
            f"{min_rows_per_class(test_fraction, val_fraction)} rows to fill every split"
            + ("; or use --val-fraction 0" if "validation" in empty_splits else ""))
    if rows is None:
        check_class_sizes(y, list(raw.classes), name)
    count, mean, m2 = moments.count[cols], moments.mean[cols], moments.m2[cols]
    shift = shift[cols]
    with np.errstate(invalid="ignore", over="ignore"):
        mu = np.where(count > 0, shift + mean, 0.0)  # with imputation, the mean of imputed rows
        sd = np.sqrt(m2 / max(len(train), 1))
    means = mu.copy() if nan_policy == "mean" and n_missing else None
    if means is not None:
        notes.append(f"nan-policy mean: imputed {n_missing} missing values with training-split column means")

    def column(j: int | None) -> np.ndarray:  # column j's values, in chunks (for the message only)
        return np.concatenate([values(idx, cols[j : j + 1])[:, 0] for idx in _row_chunks(np.arange(n))]
                              or [np.zeros(0)])

    _check_statistics(name, names, column, mu, sd)
    sd = np.where(sd < 1e-12, 1.0, sd)
    notes.append("standardised with training-split statistics")
    # Pass 2: the block standardised in place, with Standardisation.apply's arithmetic (served rows equal these).
    for begin in range(0, len(block), _CHUNK_ROWS):
        v = block[begin : begin + _CHUNK_ROWS].astype(np.float64)
        v += shift
        if means is not None:
            r, c = np.nonzero(np.isnan(v))
            v[r, c] = means[c]
        v -= mu
        v /= sd
        block[begin : begin + len(v)] = v
    a, b = len(train), len(train) + len(val)
    return Dataset(
        name=name, X_train=block[:a], y_train=y[train], X_val=block[a:b], y_val=y[val], X_test=block[b:],
        y_test=y[test], n_classes=len(raw.classes), feature_names=names, classes=list(raw.classes), notes=notes,
        standardisation=Standardisation(names, mu, sd, means, nan_policy=nan_policy), encodings=raw.encodings)


def _empty_columns(seen: np.ndarray, names: list[str], name: str) -> tuple[np.ndarray, str]:
    """The columns with a value in the training split, and the note saying which were dropped (none: refused)."""
    empty = ~seen
    shown_cols = [names[j] for j in np.flatnonzero(empty)]
    shown = ", ".join(repr(c) for c in shown_cols[:10]) + (
        f" and {len(shown_cols) - 10} more" if len(shown_cols) > 10 else "")
    if empty.all():
        raise DataError(f"{name}: no feature column has a value in the training split; check the file's missing "
                        "value markers")
    return np.flatnonzero(seen), (f"{name}: column(s) {shown} have no value in the training split; dropped them (a "
                                  "column without values carries no information)")
