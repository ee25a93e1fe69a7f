"""CSV tables (gzip read transparently): numeric and categorical columns, a label column, stated missing-value tokens."""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path

import numpy as np

from secvfl.data.dataset import RawData
from secvfl.data.files import READ_ERRORS, check_readable_file, describe_read_error
from secvfl.errors import DataError

__all__ = ["load_csv", "MISSING_TOKENS", "encode_column", "encode_labels", "read_csv_rows"]

MISSING_TOKENS = frozenset({"", "?", "na", "n/a", "nan", "null", "none", "-"})
_ID_NAMES = frozenset({"id", "ids", "index", "row_id", "customer_id", "client_id"})


def _open_text(path: Path) -> io.TextIOBase:
    raw = path.open("rb")
    head = raw.read(2)
    raw.seek(0)
    stream = gzip.GzipFile(fileobj=raw) if head == b"\x1f\x8b" else raw
    return io.TextIOWrapper(stream, encoding="utf-8-sig", newline="")


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def read_csv_rows(path: Path) -> tuple[list[list[str]], list[int]]:
    """The non-empty rows of a CSV file (gzip read transparently) and each row's line number in the file."""
    rows: list[list[str]] = []
    lines: list[int] = []  # blank lines are skipped
    try:
        with _open_text(path) as fh:
            reader = csv.reader(fh)
            for r in reader:
                if r:
                    rows.append(r)
                    lines.append(reader.line_num)
    except (*READ_ERRORS, csv.Error) as exc:
        raise DataError(f"cannot read {path} as CSV (gzip is read transparently): {describe_read_error(exc)}") from None
    return rows, lines


def encode_column(name: str, values: list[str], file_name: str, lines: list[int]) -> tuple[np.ndarray, list[str]]:
    """One CSV column as features: numbers (cells in :data:`MISSING_TOKENS` become NaN), or one-hot categories
    (sorted; a missing cell is NaN in every category). ``lines`` gives each value's line in the file, for errors."""
    is_missing = np.array([v.lower() in MISSING_TOKENS for v in values])
    present = [v for v, m in zip(values, is_missing, strict=True) if not m]
    if all(_is_number(v) for v in present):
        arr = np.array([float(v) if not m else np.nan for v, m in zip(values, is_missing, strict=True)])
        if np.isinf(arr).any():
            r = int(np.flatnonzero(np.isinf(arr))[0])
            raise DataError(
                f"{file_name} line {lines[r]}: column {name!r} holds {values[r]!r}, an infinite number; "
                "features must be finite (write a missing cell as empty or NA)"
            )
        return arr[:, None], [name]
    cats = sorted(set(present))
    onehot = np.zeros((len(values), len(cats)))
    index = {c: k for k, c in enumerate(cats)}
    for r, (v, m) in enumerate(zip(values, is_missing, strict=True)):
        if m:
            onehot[r, :] = np.nan
        else:
            onehot[r, index[v]] = 1.0
    return onehot, [f"{name}={c}" for c in cats]


def encode_labels(values: list[str], column: str) -> tuple[np.ndarray, list[str]]:
    """Class indices of label cells (none missing): classes sorted, numbers first and by value."""
    classes = sorted(set(values), key=lambda v: (not _is_number(v), float(v) if _is_number(v) else 0.0, v))
    if len(classes) < 2:
        raise DataError(f"label column {column!r} has a single value {classes}; need at least two classes")
    if len(classes) > max(100, len(values) // 10):
        raise DataError(
            f"label column {column!r} has {len(classes)} distinct values: it looks continuous or like an id, "
            "not a class label; choose another column with csv:PATH:LABEL"
        )
    index = {c: k for k, c in enumerate(classes)}
    return np.array([index[v] for v in values], dtype=np.int64), classes


def load_csv(
    path: str | Path,
    label: str | None = None,
    *,
    header: str = "auto",
    drop_columns: tuple[str, ...] = (),
    drop_id_columns: bool = True,
) -> RawData:
    """Read a CSV file into :class:`RawData`.

    ``label`` is a column name, or ``#N`` for the N-th column (0-based); default: the last column. ``header`` is
    ``"yes"``, ``"no"`` or ``"auto"`` (a first row with a non-numeric field where the second row has a number is a
    header, as is a first row of all-distinct strings in an all-categorical file when a label name was given).
    Columns named like an id (``ID``, ``customer_id``...) whose values are all distinct are dropped. Non-numeric
    feature columns are one-hot encoded (categories sorted); cells in :data:`MISSING_TOKENS` are missing (NaN).
    """
    path = Path(path)
    check_readable_file(path, "CSV file", "csv:PATH[:LABEL]")
    rows, lines = read_csv_rows(path)
    if len(rows) < 2:
        raise DataError(f"{path} has {len(rows)} non-empty line(s); a CSV dataset needs a line per sample (and "
                        "optionally a header line)")
    width = len(rows[0])
    ragged = [i for i, r in enumerate(rows) if len(r) != width]
    if ragged:
        i = ragged[0]
        raise DataError(
            f"{path} is ragged: line {lines[i]} has {len(rows[i])} fields, the first line has {width} "
            f"({len(ragged)} bad line(s)); fix the file or its delimiter"
        )
    if width < 2:
        raise DataError(f"{path} has {width} column(s); need at least one feature and a label (comma-separated)")
    if header not in ("yes", "no", "auto"):
        raise DataError(f"header must be yes, no or auto, got {header!r}")
    if header == "auto":
        first, second = rows[0], rows[1]
        has_header = any(
            not _is_number(a) and _is_number(b) for a, b in zip(first, second, strict=True)
        ) or (label is not None and not label.startswith("#") and label in first)
    else:
        has_header = header == "yes"
    names = [c.strip() for c in rows[0]] if has_header else [f"col{j}" for j in range(width)]
    body = rows[1:] if has_header else rows
    body_lines = lines[1:] if has_header else lines
    if len(body) < 2:
        raise DataError(f"{path} has {len(body)} data row below its header; a dataset needs rows of at least two "
                        "classes (and enough of them to fill the training, validation and test splits)")
    notes = [f"csv: {len(body)} rows x {width} columns from {path.name}"]

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
    cols = list(zip(*body, strict=True))
    y_raw = [v.strip() for v in cols[li]]
    missing_label = np.array([v.lower() in MISSING_TOKENS for v in y_raw])
    if missing_label.all():
        raise DataError(f"label column {names[li]!r} has no values")

    features: list[np.ndarray] = []
    feat_names: list[str] = []
    dropped: list[str] = []
    for j, (nm, col) in enumerate(zip(names, cols, strict=True)):
        if j == li:
            continue
        vals = [v.strip() for v in col]
        if nm in drop_columns:
            dropped.append(nm)
            continue
        if drop_id_columns and nm.lower() in _ID_NAMES and len(set(vals)) == len(vals):
            dropped.append(nm)
            continue
        block, block_names = encode_column(nm, vals, path.name, body_lines)
        features.append(block)
        feat_names.extend(block_names)
    missing_drop = set(drop_columns) - set(dropped)
    if missing_drop:
        raise DataError(f"columns to drop not found in {path.name}: {sorted(missing_drop)}")
    if dropped:
        notes.append(f"csv: dropped id/excluded columns {dropped}")
    if not features:
        raise DataError(f"{path.name} has no feature columns besides the label")
    X = np.hstack(features)
    if missing_label.any():
        notes.append(f"csv: dropped {int(missing_label.sum())} rows without a label")
        X = X[~missing_label]
        y_raw = [v for v, m in zip(y_raw, missing_label, strict=True) if not m]
    y, classes = encode_labels(y_raw, names[li])
    return RawData(X=X, y=y, feature_names=feat_names, classes=classes, notes=notes)
