"""Tables (CSV, gzip read transparently, or Parquet): numeric and categorical columns, a label column, stated
missing-value tokens. Reading is secvfl.data.table's (pyarrow); this module turns columns into features and labels.

:class:`ColumnEncoding` is what a column became (a number, or its sorted categories one-hot): a party fits it on its
training table and applies the same to new rows (:func:`encode_columns` with ``encodings``; a served party's table,
secvfl.deploy.data.read_prepared_table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from secvfl.data.dataset import RawData
from secvfl.data.files import check_readable_file
from secvfl.data.table import (
    EXACT_CELLS,
    ID_NAMES,
    MISSING_TOKENS,
    Column,
    TableFile,
    is_number,
    open_table,
    read_columns,
)
from secvfl.errors import DataError

__all__ = ["load_csv", "MISSING_TOKENS", "ColumnEncoding", "FeatureBlock", "LazyBlock", "encode_columns",
           "encode_labels", "label_codes"]


@dataclass
class ColumnEncoding:
    """What one source column became: ``number`` (one feature) or ``categories`` (one feature per category,
    sorted; a missing cell is NaN in each).

    Applied to new rows, a category outside the fitted ones is a missing cell: NaN in each of the column's
    features, then handled by the run's ``--nan-policy`` like any missing cell (``mean``: each feature gets its
    training mean, i.e. the column's training frequencies, 0 once standardised; ``error``: the row cannot be
    scored). Why not all zeros (scikit-learn's ``handle_unknown="ignore"``): the model learned nothing about the
    new category, which is exactly what a missing cell tells it; all zeros, once standardised, is an input no
    training row had (every training row holds one of the categories, or a missing cell), so its prediction would
    be an extrapolation nobody asked for, and with ``--nan-policy error`` the user asked to be told rather than
    have a value made up. :func:`encode_columns` counts such cells (``FeatureBlock.unseen``)."""

    name: str
    kind: str  # "number" | "categories"
    categories: list[str] = field(default_factory=list)

    @property
    def output_names(self) -> list[str]:
        return [self.name] if self.kind == "number" else [f"{self.name}={c}" for c in self.categories]

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "categories": list(self.categories)}

    @classmethod
    def from_dict(cls, d: dict) -> ColumnEncoding:
        return cls(str(d["name"]), str(d["kind"]), [str(c) for c in d.get("categories", [])])


@dataclass
class FeatureBlock:
    """Encoded columns: ``X`` (rows x features; float64, or float32 minus ``shift`` for a large table), the
    features' names and each source column's encoding."""

    X: np.ndarray
    names: list[str]
    encodings: list[ColumnEncoding]
    shift: np.ndarray | None = None
    unseen: dict[str, int] = field(default_factory=dict)  # applied encodings: cells of a category not fitted


def _missing_texts(texts: list[str]) -> np.ndarray:
    return np.array([t.strip().lower() in MISSING_TOKENS for t in texts], dtype=bool)


def _fit(col: Column, rows: np.ndarray | None) -> ColumnEncoding:
    if col.values is not None:
        return ColumnEncoding(col.name, "number")
    used = np.unique(col.codes if rows is None else col.codes[rows])
    stripped = [col.texts[i].strip() for i in used.tolist()]
    present = [s for s in stripped if s.lower() not in MISSING_TOKENS]
    if all(is_number(s) for s in present):
        return ColumnEncoding(col.name, "number")
    return ColumnEncoding(col.name, "categories", sorted(set(present)))


def _numbers_of(col: Column, rows: np.ndarray | None) -> np.ndarray:
    """Float64 values of a numeric column at ``rows`` (shift added back)."""
    if col.values is not None:
        v = col.values if rows is None else col.values[rows]
        return v.astype(np.float64) + col.shift if v.dtype != np.float64 else v
    per_text = np.array([np.nan if t.strip().lower() in MISSING_TOKENS or not is_number(t.strip())
                         else float(t.strip()) for t in col.texts], dtype=np.float64)
    return per_text[col.codes if rows is None else col.codes[rows]]


def _check_finite(col: Column, rows: np.ndarray | None, table: TableFile) -> None:
    """A column of numbers must hold finite numbers: the first infinite one is named with its line."""
    if col.values is not None:
        with np.errstate(invalid="ignore"):
            bad = np.isinf(col.values if rows is None else col.values[rows])
    else:
        per_text = np.array([t.strip().lower() not in MISSING_TOKENS and is_number(t.strip())
                             and np.isinf(float(t.strip())) for t in col.texts], dtype=bool)
        if not per_text.any():
            return
        bad = per_text[col.codes if rows is None else col.codes[rows]]
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        row = r if rows is None else int(rows[r])
        where, text = table.cell(row, col.name)
        if col.texts is not None:
            text = col.texts[int(col.codes[row])].strip()
        shown = f" holds {text!r}" if text else " holds an infinite number"
        raise DataError(f"{table.path.name} {where}: column {col.name!r}{shown}, an infinite number; features must "
                        "be finite (write a missing cell as empty or NA)")


def _check_numbers(col: Column, enc: ColumnEncoding, rows: np.ndarray | None, table: TableFile) -> None:
    """New rows for a fitted encoding: a column of numbers in training must hold finite numbers (or missing cells);
    a column of categories must have been read as text. The first bad cell is named with its line."""
    if enc.kind != "number":
        if col.texts is None:
            raise DataError(f"{table.path.name}: column {col.name!r} holds categories in the model's training data, "
                            "but was read as numbers; read it as text")  # pragma: no cover - callers read it as text
        return
    if col.texts is not None:
        bad_text = np.array([t.strip().lower() not in MISSING_TOKENS and not is_number(t.strip()) for t in col.texts],
                            dtype=bool)
        bad = bad_text[col.codes if rows is None else col.codes[rows]]
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            row = r if rows is None else int(rows[r])
            where, _ = table.cell(row, col.name)
            text = col.texts[int(col.codes[row])].strip()
            raise DataError(f"{table.path.name} {where}: column {col.name!r} holds {text!r}, not a number (the column "
                            "held numbers in the model's training data); fix the cell, or leave it empty to mark it "
                            "missing")
    _check_finite(col, rows, table)


class _Feature:
    """How to produce one source column's features at any rows: numbers (float64 values, or float32 values minus a
    shift) or one-hot categories (each distinct text's category, -1 unseen, and whether it is missing)."""

    def __init__(self, col: Column, enc: ColumnEncoding, lean: bool) -> None:
        self.width = len(enc.output_names)
        self.values: np.ndarray | None = None
        self.per_text: np.ndarray | None = None
        self.codes = col.codes
        self.shift = 0.0
        if enc.kind == "number":
            if col.values is not None:
                self.values, self.shift = col.values, col.shift
            else:
                self.per_text = _numbers_of(Column(col.name, codes=np.arange(len(col.texts)), texts=col.texts), None)
            if lean and (self.values is None or self.values.dtype != np.float32):  # a shift keeps float32 precise
                v = self.values if self.values is not None else self.per_text
                with np.errstate(invalid="ignore"):
                    finite = np.flatnonzero(np.isfinite(v[: 1 << 16] if self.values is not None else v))
                    if not len(finite) and self.values is not None:
                        finite = np.flatnonzero(np.isfinite(v))
                self.shift = float(v[finite[0]]) if len(finite) else 0.0
        else:
            index = {c: i for i, c in enumerate(enc.categories)}
            texts = col.texts if col.texts is not None else []
            self.position = np.array([index.get(t.strip(), -1) for t in texts], dtype=np.int64)
            # a missing cell, or a category outside the fitted ones (the same, see ColumnEncoding): NaN
            self.unseen = (self.position < 0) & ~_missing_texts(texts)

    def unseen_cells(self, src: np.ndarray | None) -> int:
        """Cells at table rows ``src`` (None: all) holding a category outside the encoding's."""
        if self.values is not None or self.per_text is not None or not self.unseen.any():
            return 0
        return int(self.unseen[self.codes if src is None else self.codes[src]].sum())

    def fill(self, out: np.ndarray, src: np.ndarray | None, shifted: bool) -> None:
        """Write this column's features at table rows ``src`` (None: all) into ``out`` (rows x width)."""
        if self.values is not None or self.per_text is not None:
            if self.values is not None:
                v = self.values if src is None else self.values[src]
                if v.dtype == np.float32:  # stored minus its shift
                    out[:, 0] = v if shifted else v.astype(np.float64) + self.shift
                    return
            else:
                v = self.per_text[self.codes if src is None else self.codes[src]]
            out[:, 0] = v - self.shift if shifted else v
            return
        at = self.position[self.codes if src is None else self.codes[src]]
        out[:] = 0.0
        seen = np.flatnonzero(at >= 0)
        out[seen, at[seen]] = 1.0
        out[at < 0] = np.nan  # missing, or a category outside the encoding's (see ColumnEncoding)


class LazyBlock:
    """A large table's features without materialising them: ``block[rows]`` assembles those rows (float32, each
    feature minus ``shift``) from the columns as read (float32 numbers, text codes). secvfl.data.preprocess reads it
    in row chunks; ``np.asarray(block)`` materialises it all."""

    dtype = np.dtype(np.float32)

    def __init__(self, features: list[_Feature], rows: np.ndarray | None, n: int) -> None:
        self.features, self.rows = features, rows
        self.shape = (n, sum(f.width for f in features))
        self.shift = np.concatenate([np.full(f.width, f.shift) if f.per_text is not None or f.values is not None
                                     else np.zeros(f.width) for f in features]) if features else np.zeros(0)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, tuple):
            return self[key[0]][(slice(None), *key[1:])]
        idx = np.arange(*key.indices(self.shape[0])) if isinstance(key, slice) else np.asarray(key, dtype=np.int64)
        return self.take(idx, np.empty((len(idx), self.shape[1]), dtype=np.float32))

    def take(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Rows ``idx`` written into ``out`` (rows x features, float32)."""
        src = idx if self.rows is None else self.rows[idx]
        j = 0
        for f in self.features:
            f.fill(out[:, j : j + f.width], src, shifted=True)
            j += f.width
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[np.arange(self.shape[0])]
        return out if dtype is None else out.astype(dtype)


def encode_columns(columns: Sequence[Column], table: TableFile, *, rows: np.ndarray | None = None,
                   fit_rows: np.ndarray | None = None, encodings: Sequence[ColumnEncoding] | None = None,
                   lean: bool | None = None) -> FeatureBlock:
    """Columns as features at ``rows`` (all rows by default), encoded as fitted on ``fit_rows`` (default: the same
    rows) or as ``encodings`` say. ``lean`` (default: whether the table is large or read as float32) gives a
    :class:`LazyBlock` (float32 minus a per-feature shift, assembled by rows when read) instead of float64."""
    fit_rows = rows if fit_rows is None else fit_rows
    applied = encodings is not None
    if encodings is None:
        encodings = []
        for col in columns:
            _check_finite(col, fit_rows, table)
            encodings.append(_fit(col, fit_rows))
    else:
        for col, enc in zip(columns, encodings, strict=True):
            _check_numbers(col, enc, rows, table)
    n = len(columns[0]) if rows is None and columns else (0 if rows is None else len(rows))
    width = sum(len(e.output_names) for e in encodings)
    if lean is None:
        lean = any(c.values is not None and c.values.dtype == np.float32 for c in columns) or n * width > EXACT_CELLS
    features = [_Feature(col, enc, lean) for col, enc in zip(columns, encodings, strict=True)]
    names = [name for enc in encodings for name in enc.output_names]
    unseen = {e.name: k for e, f in zip(encodings, features, strict=True) if applied and (k := f.unseen_cells(rows))}
    if lean:
        block = LazyBlock(features, rows, n)
        return FeatureBlock(block, names, list(encodings), block.shift, unseen)  # type: ignore[arg-type]
    X = np.empty((n, width), dtype=np.float64)
    j = 0
    for f in features:
        f.fill(X[:, j : j + f.width], rows, shifted=False)
        j += f.width
    return FeatureBlock(X, names, list(encodings), None, unseen)


def label_codes(col: Column) -> tuple[np.ndarray, list[str]]:
    """(per row: the index of its stripped label text, or -1 where missing; the distinct stripped texts)."""
    stripped = [t.strip() for t in col.texts]
    distinct = list(dict.fromkeys(s for s in stripped if s.lower() not in MISSING_TOKENS))
    index = {s: i for i, s in enumerate(distinct)}
    per_text = np.array([index.get(s, -1) for s in stripped], dtype=np.int64)
    return per_text[col.codes], distinct


def encode_labels(values: Sequence[str] | tuple[np.ndarray, list[str]], column: str
                  ) -> tuple[np.ndarray, list[str]]:
    """Class indices of label cells (none missing): classes sorted, numbers first and by value. ``values``: the
    cells, or (codes into distinct texts, the distinct texts) as :func:`label_codes` gives them."""
    if isinstance(values, tuple):
        codes, distinct = values
    else:
        distinct = list(dict.fromkeys(values))
        index = {v: i for i, v in enumerate(distinct)}
        codes = np.array([index[v] for v in values], dtype=np.int64)
    classes = sorted(set(distinct), key=lambda v: (not is_number(v), float(v) if is_number(v) else 0.0, v))
    if len(classes) < 2:
        raise DataError(f"label column {column!r} has a single value {classes}; need at least two classes")
    if len(classes) > max(100, len(codes) // 10):
        raise DataError(
            f"label column {column!r} has {len(classes)} distinct values: it looks continuous or like an id, "
            "not a class label; choose another column with csv:PATH:LABEL"
        )
    rank = {c: k for k, c in enumerate(classes)}
    to_class = np.array([rank[v] for v in distinct], dtype=np.int64)
    return to_class[np.asarray(codes, dtype=np.int64)], classes


def _repeated_example(col: Column, table: TableFile) -> str:
    """An example of a repeated value in a text column read as Arrow or codes: 'VALUE' (lines A and B)."""
    codes = col.codes
    first: dict[int, int] = {}
    for r, c in enumerate(codes.tolist()):
        if c in first:
            (a, _), (b, _) = table.cell(first[c], col.name), table.cell(r, col.name)
            return f"{col.texts[c].strip()!r} on {a} and {b}"
        first[c] = r
    return ""  # pragma: no cover - called when a value repeats


def load_csv(
    path: str | Path,
    label: str | None = None,
    *,
    header: str = "auto",
    drop_columns: tuple[str, ...] = (),
    drop_id_columns: bool = True,
) -> RawData:
    """Read a CSV (or Parquet) file into :class:`RawData`.

    ``label`` is a column name, or ``#N`` for the N-th column (0-based); default: the last column. ``header`` is
    ``"yes"``, ``"no"`` or ``"auto"`` (a first row with a non-numeric field where the second row has a number is a
    header, as is a first row holding the label's name); a Parquet file always names its columns. Columns named like
    an id (``ID``, ``customer_id``...) whose values are all distinct are dropped; one whose values repeat is refused
    (neither a row id nor a meaningful feature). Non-numeric feature columns are one-hot encoded (categories sorted);
    cells in :data:`MISSING_TOKENS` are missing (NaN).
    """
    path = Path(path)
    check_readable_file(path, "CSV file", "csv:PATH[:LABEL]")
    if header not in ("yes", "no", "auto"):
        raise DataError(f"header must be yes, no or auto, got {header!r}")
    table = open_table(path, header=header, label=label)
    if table.format == "csv":
        if len(table.first_rows) < 2:
            raise DataError(f"{path} has {len(table.first_rows)} non-empty line(s); a CSV dataset needs a line per "
                            "sample (and optionally a header line)")
        if len(table.first_rows[1]) != len(table.first_rows[0]):
            raise DataError(f"{path} is ragged: line 2 has {len(table.first_rows[1])} fields, the first line has "
                            f"{len(table.first_rows[0])}; fix the file or its delimiter")
    names = table.names
    width = len(names)
    if width < 2:
        raise DataError(f"{path} has {width} column(s); need at least one feature and a label (comma-separated)")
    if label is None:
        li = width - 1
    elif label.startswith("#") and label[1:].isdigit():
        li = int(label[1:])
        if li >= width:
            raise DataError(f"label column {label} is out of range: {path.name} has {width} columns")
    elif label in names:
        li = names.index(label)
    else:
        raise DataError(
            f"label column {label!r} not found in {path.name}; columns are {names[:30]}"
            + (" ..." if width > 30 else "")
            + " (use a name, or #N for the N-th column)"
        )
    absent = sorted(set(drop_columns) - set(names))
    if absent:
        raise DataError(f"columns to drop not found in {path.name}: {absent}")
    label_name = names[li]
    idlike = [nm for j, nm in enumerate(names) if j != li and drop_id_columns and nm.lower() in ID_NAMES
              and nm not in drop_columns]
    features = [nm for j, nm in enumerate(names) if j != li and nm not in drop_columns]
    columns = read_columns(table, [label_name, *features], text=[label_name, *idlike])
    n = len(columns[label_name])
    if n < 2:
        raise DataError(f"{path} has {n} data row below its header; a dataset needs rows of at least two "
                        "classes (and enough of them to fill the training, validation and test splits)")
    notes = [f"csv: {n} rows x {width} columns from {path.name}"]
    dropped = [nm for nm in names if nm in drop_columns]
    for nm in idlike:
        col = columns[nm]
        stripped = [t.strip() for t in col.texts]
        if len(set(stripped)) == len(stripped) == len(col.texts) and len(col.texts) == n:
            dropped.append(nm)
            features.remove(nm)
        else:
            repeats = n - len(set(stripped[c] for c in np.unique(col.codes).tolist()))
            raise DataError(f"{path.name}: column {nm!r} is named like a row id but {repeats} of its {n} values "
                            f"repeat (e.g. {_repeated_example(col, table)}): an id is not a feature, and a repeated "
                            f"one is not a row id; make its values unique (then it is dropped as a row id), or "
                            f"rename the column if it is a real feature")
    if dropped:
        notes.append(f"csv: dropped id/excluded columns {sorted(dropped, key=names.index)}")
    if not features:
        raise DataError(f"{path.name} has no feature columns besides the label")
    codes, distinct = label_codes(columns.pop(label_name))
    missing_label = codes < 0
    if missing_label.all():
        raise DataError(f"label column {label_name!r} has no values")
    keep = np.flatnonzero(~missing_label) if missing_label.any() else None
    block = encode_columns([columns[f] for f in features], table, rows=keep, fit_rows=None if keep is None
                           else np.arange(n))
    del columns
    if keep is not None:
        notes.append(f"csv: dropped {int(missing_label.sum())} rows without a label")
        codes = codes[keep]
    y, classes = encode_labels((codes, distinct), label_name)
    return RawData(X=block.X, y=y, feature_names=block.names, classes=classes, notes=notes, shift=block.shift,
                   encodings=block.encodings)
