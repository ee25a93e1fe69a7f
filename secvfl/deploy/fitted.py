"""Fitted preprocessing of a party's own columns: saved by the training run, applied to a new table when serving.

When the parties of a federation read their own files (secvfl.deploy.data), each feature party turns its raw cells
into model inputs with facts fitted on its training rows: the categories of each categorical column (one-hot
encoded), the columns dropped because no training row had a value, the means that fill missing cells and the
standardisation statistics. :func:`fit_preprocessing` derives exactly those facts from the same rows the training
run prepared (``prepare_own_block``), :func:`save_fitted` writes them to the party's own run directory
(``preprocessing.json``; nothing in it leaves the party), and :func:`apply_fitted` applies them to a table keyed by
entity id -- the party's training file or a file of new customers with the same columns -- so that a served row is
exactly the row the model saw in training (tested: the test rows come out bit for bit as training prepared them).

What the applied preprocessing does with cells training never saw:

* a category outside the training categories is treated as a missing cell (every one-hot column of that column
  missing), then filled like any missing cell; the count is reported when the table is loaded;
* with ``--nan-policy mean`` a missing cell gets its column's training mean; with ``error`` a row with a missing cell
  cannot be scored (the party reports the id as unusable, with the reason);
* a numeric column holding a non-number, or an infinite number, refuses the table with its file and line.

:func:`read_party_table` is the one call that reads the party's table; the file reader behind it can be swapped
(CSV today) without touching the rest. The label party keeps the facts a served answer needs beside its run
(:func:`save_run_layout`: the class names and each party's width after encoding).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from secvfl.data.csv_loader import MISSING_TOKENS, encode_column
from secvfl.errors import ConfigError, DataError
from secvfl.federation import DataSpec
from secvfl.io import write_text_atomic

__all__ = ["FittedColumn", "FittedPreprocessing", "PartyTable", "fit_preprocessing", "save_fitted", "load_fitted",
           "apply_fitted", "read_party_table", "save_run_layout", "load_run_layout", "FITTED_FILE", "LAYOUT_FILE"]

FITTED_FILE = "preprocessing.json"
LAYOUT_FILE = "serving.json"
_VERSION = 1


@dataclass(frozen=True)
class FittedColumn:
    """One raw column: a number, or categories one-hot encoded in this (sorted) order."""

    name: str
    kind: str  # "number" | "category"
    categories: tuple[str, ...] = ()

    def encoded_names(self) -> list[str]:
        return [self.name] if self.kind == "number" else [f"{self.name}={c}" for c in self.categories]


@dataclass(frozen=True)
class FittedPreprocessing:
    """What a feature party's training run fitted on its own training rows (see the module docstring)."""

    party: str
    id_column: str
    columns: tuple[FittedColumn, ...]
    kept: tuple[str, ...]  # encoded columns the model reads, in order (columns empty in training are dropped)
    fill: tuple[float, ...]  # per kept column: the training mean that fills a missing cell
    mean: tuple[float, ...]  # per kept column: standardisation
    scale: tuple[float, ...]
    nan_policy: str

    @property
    def width(self) -> int:
        return len(self.kept)

    def to_dict(self) -> dict[str, Any]:
        return {"version": _VERSION, "party": self.party, "id_column": self.id_column,
                "columns": [{"name": c.name, "kind": c.kind, "categories": list(c.categories)} for c in self.columns],
                "kept": list(self.kept), "fill": list(self.fill), "mean": list(self.mean), "scale": list(self.scale),
                "nan_policy": self.nan_policy}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> FittedPreprocessing:
        try:
            if d["version"] != _VERSION:
                raise ConfigError(f"{where} is of format version {d['version']}; this secvfl reads version "
                                  f"{_VERSION} (retrain, or serve with the secvfl that trained)")
            columns = tuple(FittedColumn(str(c["name"]), str(c["kind"]), tuple(str(x) for x in c["categories"]))
                            for c in d["columns"])
            fitted = cls(str(d["party"]), str(d["id_column"]), columns, tuple(str(k) for k in d["kept"]),
                         tuple(float(v) for v in d["fill"]), tuple(float(v) for v in d["mean"]),
                         tuple(float(v) for v in d["scale"]), str(d["nan_policy"]))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{where} is damaged ({type(exc).__name__}: {exc}); retrain the run, or restore the "
                              "file from a backup") from None
        encoded = {n for c in fitted.columns for n in c.encoded_names()}
        lengths = {len(fitted.kept), len(fitted.fill), len(fitted.mean), len(fitted.scale)}
        if (len(lengths) != 1 or not set(fitted.kept) <= encoded or any(c.kind not in ("number", "category")
                                                                         for c in fitted.columns)
                or not all(math.isfinite(v) for v in (*fitted.fill, *fitted.mean, *fitted.scale))
                or any(v <= 0 for v in fitted.scale)):
            raise ConfigError(f"{where} is damaged (its columns and statistics do not fit together); retrain the run, "
                              "or restore the file from a backup")
        return fitted


def fit_preprocessing(party: str, spec: DataSpec, cells: dict[str, list[str]], ids: Sequence[Sequence[str]],
                      index: dict[str, int], nan_policy: str) -> FittedPreprocessing:
    """The facts ``prepare_own_block`` fits for rows ``ids`` (train, validation, test ids) of a party's own file:
    ``cells`` its raw columns, ``index`` id -> row. The same steps as secvfl.data.preprocess.prepare with the label
    party's rows: categories from every aligned row, columns with no value in the training and validation rows
    dropped, fill means and standardisation from the training rows."""
    wanted = [index[i] for split in ids for i in split]
    n_train, n_val = len(ids[0]), len(ids[1])
    blocks, columns = [], []
    lines = list(range(1, len(wanted) + 1))  # the cells were checked when training read them
    for name in spec.columns:
        values = [cells[name][r] for r in wanted]
        block, names = encode_column(name, values, spec.file.name, lines)
        blocks.append(block)
        if names == [name]:  # a category column's names are "name=category"
            columns.append(FittedColumn(name, "number"))
        else:
            columns.append(FittedColumn(name, "category", tuple(n.split("=", 1)[1] for n in names)))
    X = np.hstack(blocks).astype(np.float64, copy=False)
    encoded = [n for c in columns for n in c.encoded_names()]
    # The operations of prepare() in its order, on arrays of the same memory layout: a mean over rows sums in an
    # order that depends on the layout, and the saved statistics must reproduce the training inputs bit for bit.
    fit_rows = X[np.arange(n_train + n_val)]
    keep = np.ones(X.shape[1], dtype=bool)
    if np.isnan(X).any():  # columns without a value in the training and validation rows are dropped
        empty = np.isnan(fit_rows).all(axis=0) if len(fit_rows) else keep & False
        if empty.any():
            keep = ~empty
            fit_rows = fit_rows[:, keep]
    train = fit_rows[np.arange(n_train)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fill = np.nan_to_num(np.nanmean(train, axis=0), nan=0.0)
    if np.isnan(train).any():
        r, c = np.nonzero(np.isnan(train))
        train[r, c] = fill[c]
    mu, sd = train.mean(axis=0), train.std(axis=0)
    sd = np.where(sd < 1e-12, 1.0, sd)
    return FittedPreprocessing(party, spec.id, tuple(columns), tuple(n for n, k in zip(encoded, keep, strict=True) if k),
                               tuple(float(v) for v in fill), tuple(float(v) for v in mu), tuple(float(v) for v in sd),
                               nan_policy)


def save_fitted(directory: Path, fitted: FittedPreprocessing) -> Path:
    """Write ``directory/preprocessing.json`` atomically (the party's own run directory)."""
    path = Path(directory) / FITTED_FILE
    Path(directory).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(fitted.to_dict(), indent=1) + "\n")
    return path


def load_fitted(directory: Path) -> FittedPreprocessing:
    path = Path(directory) / FITTED_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: the party's run directory holds no fitted preprocessing (runs "
                          "trained with each party reading its own file save it; retrain with this secvfl, or pass "
                          "the directory `secvfl party --out` wrote)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}; restore it from a backup or retrain") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is damaged (not a JSON object); restore it from a backup or retrain")
    return FittedPreprocessing.from_dict(data, str(path))


@dataclass
class PartyTable:
    """A party's table as model inputs: ids in file order, their rows (float32), which rows can be scored."""

    ids: list[str]
    X: np.ndarray  # (n, width) float32, zeros in unusable rows
    usable: np.ndarray  # (n,) bool
    row: dict[str, int]
    notes: list[str]
    why_unusable: str = ""

    def lookup(self, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(rows, held): row index of each id (0 where not held) and whether the party can score it."""
        rows = np.fromiter((self.row.get(i, -1) for i in ids), dtype=np.int64, count=len(ids))
        held = rows >= 0
        rows = np.where(held, rows, 0)
        held &= self.usable[rows]
        return rows, held


def read_party_table(spec: DataSpec, party: str, file: Path | None = None) -> tuple[list[str], dict[str, list[str]],
                                                                                  list[int], Path]:
    """The one call that reads a party's table (its training file, or ``file`` with the same columns): ids in file
    order, the raw cells of its feature columns, each row's line in the file, and the path read. Swap the reader
    here (CSV today) to read other formats."""
    from secvfl.deploy.data import read_own_file

    own = read_own_file(replace(spec, file=Path(file)) if file is not None else spec, party)
    return own.ids, own.columns, own.lines, own.file


def apply_fitted(fitted: FittedPreprocessing, ids: list[str], cells: dict[str, list[str]], lines: list[int],
                 file: Path) -> PartyTable:
    """Model inputs for every row of a party's table, with the preprocessing its training run fitted."""
    n = len(ids)
    blocks: list[np.ndarray] = []
    notes: list[str] = []
    for column in fitted.columns:
        values = cells.get(column.name)
        if values is None:
            raise DataError(f"{file}: no column {column.name!r}, which the model was trained on; serve a table with "
                            "the training file's columns")
        missing = np.fromiter((v.lower() in MISSING_TOKENS for v in values), dtype=bool, count=n)
        if column.kind == "number":
            out = np.full(n, np.nan)
            for r in np.flatnonzero(~missing):
                try:
                    out[r] = float(values[r])
                except ValueError:
                    raise DataError(f"{file} line {lines[r]}: column {column.name!r} holds {values[r]!r}, not a "
                                    "number (it was numeric in training); fix the cell or leave it empty") from None
                if math.isinf(out[r]):
                    raise DataError(f"{file} line {lines[r]}: column {column.name!r} holds {values[r]!r}, an "
                                    "infinite number; features must be finite (leave a missing cell empty)")
            blocks.append(out[:, None])
            continue
        index = {c: k for k, c in enumerate(column.categories)}
        onehot = np.zeros((n, len(column.categories)))
        unseen = 0
        for r in range(n):
            k = None if missing[r] else index.get(values[r])
            if k is None:
                onehot[r, :] = np.nan
                unseen += int(not missing[r])
            else:
                onehot[r, k] = 1.0
        if unseen:
            notes.append(f"column {column.name!r}: {unseen} row(s) hold a category training never saw; treated as "
                         "missing")
        blocks.append(onehot)
    encoded = [name for c in fitted.columns for name in c.encoded_names()]
    X = np.hstack(blocks) if blocks else np.zeros((n, 0))
    X = X[:, [encoded.index(k) for k in fitted.kept]]
    nan = np.isnan(X)
    usable = np.ones(n, dtype=bool)
    why = ""
    if nan.any():
        if fitted.nan_policy == "mean":
            r, c = np.nonzero(nan)
            X[r, c] = np.asarray(fitted.fill)[c]
            notes.append(f"{int(nan.any(axis=1).sum())} row(s) with missing cells filled with the training means")
        else:
            usable = ~nan.any(axis=1)
            X[~usable] = 0.0
            why = f"the row has a missing cell and training ran with --nan-policy {fitted.nan_policy}"
            notes.append(f"{int((~usable).sum())} row(s) with missing cells cannot be scored (--nan-policy "
                         f"{fitted.nan_policy})")
    X = np.ascontiguousarray(((X - np.asarray(fitted.mean)) / np.asarray(fitted.scale)).astype(np.float32))
    X[~usable] = 0.0
    return PartyTable(list(ids), X, usable, {ident: r for r, ident in enumerate(ids)}, notes, why)


# -- the label party's side ----------------------------------------------------------------------------------------
def save_run_layout(directory: Path, *, classes: Sequence[str], widths: Sequence[int]) -> Path:
    """The facts a served answer needs that the run's other files do not keep: the class names (in the order of the
    model's outputs) and each feature party's width after encoding."""
    path = Path(directory) / LAYOUT_FILE
    Path(directory).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"version": _VERSION, "classes": [str(c) for c in classes],
                                        "widths": [int(w) for w in widths]}, indent=1) + "\n")
    return path


def load_run_layout(directory: Path) -> tuple[list[str], list[int]]:
    path = Path(directory) / LAYOUT_FILE
    try:
        data = json.loads(path.read_text())
        classes, widths = [str(c) for c in data["classes"]], [int(w) for w in data["widths"]]
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: {directory} is not the label party's directory of a run whose "
                          "parties read their own files (trained with this secvfl); pass the directory "
                          "`secvfl party --out` (or `secvfl launch --out RUN`: RUN/<label party>) wrote") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is damaged ({type(exc).__name__}); retrain, or restore it from a backup") from None
    if len(classes) < 2 or not widths or any(w < 1 for w in widths):
        raise ConfigError(f"{path} is damaged (classes {classes[:5]}, widths {widths}); retrain, or restore it")
    return classes, widths
