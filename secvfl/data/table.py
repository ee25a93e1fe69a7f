"""A party's table file (CSV, gzip read transparently, or Parquet) read with pyarrow, column by column.

Why pyarrow: the standard columnar library of the Python data ecosystem, with a multi-threaded C++ CSV parser and
the Parquet reader data warehouses export to; a table of 10^7 rows is read in record batches into numpy arrays,
without a Python object per cell (the hand-written reader it replaces held every cell as a ``str``).

What a column becomes (the rules of the previous reader, kept exactly):

* a column pyarrow types as numbers (integers or floats; cells in :data:`MISSING_TOKENS` are null, i.e. missing)
  is read as numbers;
* any other column is read as text, and decided on its distinct values (few for categories): a cell is missing if
  its stripped text, lower-cased, is in :data:`MISSING_TOKENS`; the column is numeric if every other stripped cell
  is a number for Python's ``float`` (``1_000`` and non-ASCII digits included), else categorical (its categories
  sorted, one-hot encoded);
* Parquet columns keep their types: numbers and booleans (0/1) are numeric, strings and dictionaries are text;
  other types (dates, timestamps, lists) are refused with the column named.

Numbers are float64 while a table holds at most :data:`EXACT_CELLS` numeric cells (then everything downstream is
bit-identical to the previous reader); a larger table keeps each numeric column as float32 *after subtracting a
reference value* (the column's first finite value, kept in float64), so a column of large values with a small
spread (timestamps, amounts) keeps its precision, and the feature block costs 4 bytes a cell (see
secvfl.data.preprocess for how statistics are computed from it).
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from secvfl.data.files import READ_ERRORS, describe_read_error
from secvfl.errors import DataError

__all__ = ["MISSING_TOKENS", "ID_NAMES", "EXACT_CELLS", "TableFile", "Column", "open_table", "read_columns",
           "is_number"]

MISSING_TOKENS = frozenset({"", "?", "na", "n/a", "nan", "null", "none", "-"})
ID_NAMES = frozenset({"id", "ids", "index", "row_id", "customer_id", "client_id"})
EXACT_CELLS = 1 << 24  # numeric cells kept in float64 (128 MB); above, float32 after a per-column shift
_BLOCK_BYTES = 16 << 20  # the CSV block whose cells decide the columns' types
_READ_BLOCK_BYTES = 4 << 20  # CSV blocks read after that
_PARQUET_READ_BYTES = 64 << 20  # decoded values of one Parquet read (a row group's slice of columns)


def _case_variants(token: str) -> list[str]:
    return sorted({"".join(c) for c in itertools.product(*[(ch.lower(), ch.upper()) for ch in token])})


_NULLS = sorted({v for t in MISSING_TOKENS for v in _case_variants(t)})  # what pyarrow reads as missing in numbers


def is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


@dataclass
class TableFile:
    """An opened table: its columns' names (a CSV's header, or ``col0``, ``col1``... without one) and format."""

    path: Path
    format: str  # "csv" | "parquet"
    names: list[str]
    has_header: bool = True
    first_rows: list[list[str]] = field(default_factory=list)  # a CSV's first two non-empty rows, as text

    def text(self) -> io.TextIOBase:
        raw = self.path.open("rb")
        stream = gzip.GzipFile(fileobj=raw) if raw.read(2) == b"\x1f\x8b" else raw
        raw.seek(0)
        return io.TextIOWrapper(stream, encoding="utf-8-sig", newline="")

    def cant_read(self, exc: BaseException) -> DataError:
        what = "Parquet" if self.format == "parquet" else "CSV (gzip is read transparently)"
        return DataError(f"cannot read {self.path} as {what}: {describe_read_error(exc)}")

    def rows_with_lines(self) -> Iterator[tuple[int, list[str]]]:
        """(line, cells) of every non-empty CSV row after the header, with Python's csv module (for errors: the line
        numbers pyarrow does not give)."""
        with self.text() as fh:
            reader = csv.reader(fh)
            if self.has_header:
                for row in reader:
                    if row:
                        break
            for row in reader:
                if row:
                    yield reader.line_num, row

    def cell(self, row: int, column: str) -> tuple[str, str]:
        """('line N', stripped text) of data row ``row`` (0-based, as read) of ``column`` in a CSV file; ('row N',
        '') in a Parquet file. Reads the file again: for error messages only."""
        if self.format == "parquet":
            return f"row {row + 1}", ""
        j = self.names.index(column)
        for i, (line, cells) in enumerate(self.rows_with_lines()):
            if i == row:
                return f"line {line}", cells[j].strip() if j < len(cells) else ""
        return f"row {row + 1}", ""  # pragma: no cover - the row exists


def _is_parquet(path: Path) -> bool:
    if path.suffix.lower() in (".parquet", ".pq"):
        return True
    with path.open("rb") as fh:
        return fh.read(4) == b"PAR1"


def open_table(path: Path, *, header: str = "yes", label: str | None = None) -> TableFile:
    """Open ``path`` and name its columns. ``header`` ("yes", "no", "auto") applies to CSV: "auto" takes the first
    row as a header if it has a non-numeric field where the second row has a number, or holds ``label`` by name."""
    path = Path(path)
    try:
        if _is_parquet(path):
            import pyarrow.parquet as pq

            names = list(pq.ParquetFile(path).schema_arrow.names)
            table = TableFile(path, "parquet", names)
        else:
            table = TableFile(path, "csv", [])
            with table.text() as fh:
                table.first_rows = [row for row in itertools.islice((r for r in csv.reader(fh) if r), 2)]
    except (*READ_ERRORS, csv.Error) as exc:
        raise TableFile(path, "csv", []).cant_read(exc) from None
    except Exception as exc:  # pyarrow's own errors for a broken Parquet file
        raise DataError(f"cannot read {path} as Parquet: {exc}") from None
    if table.format == "csv" and table.first_rows:
        first = table.first_rows[0]
        if header == "auto":
            second = table.first_rows[1] if len(table.first_rows) > 1 else first
            table.has_header = any(not is_number(a) and is_number(b) for a, b in zip(first, second, strict=False)) or (
                label is not None and not label.startswith("#") and label in first)
        else:
            table.has_header = header == "yes"
        table.names = [c.strip() for c in first] if table.has_header else [f"col{j}" for j in range(len(first))]
    seen: dict[str, int] = {}
    for j, name in enumerate(table.names):
        if name in seen:
            raise DataError(f"{path}: column name {name!r} appears twice (columns {seen[name] + 1} and {j + 1}); "
                            "every column needs its own name (the label, the ids and the features are chosen by "
                            "name): rename one of them")
        seen[name] = j
    return table


@dataclass
class Column:
    """One column of a table: ``values`` (numbers, NaN where missing; float64, or float32 minus ``shift``), or the
    text of each row as ``codes`` into ``texts`` (the column's distinct raw cells)."""

    name: str
    values: np.ndarray | None = None
    shift: float = 0.0
    codes: np.ndarray | None = None
    texts: list[str] | None = None
    arrow: Any = None  # the cells as an Arrow string array, for id columns (kept=True)

    def __len__(self) -> int:
        return len(self.values if self.values is not None else self.codes)


class _Numbers:
    """Numeric cells of several columns, batch by batch: float64 while the table is small, float32 minus a shift (the
    column's first finite value) when large. A large table's columns are written straight into one float32 array
    each, allocated for the row count (Parquet) or an estimate of it (``rows_hint``: CSV), grown if rows outnumber
    it; pages past the last row are never touched, so they cost no memory. Small chunks joined at the end would
    leave the heap they came from held by the process: the table twice."""

    def __init__(self, names: list[str], exact_cells: int, where: Path, rows: int | None = None,
                 rows_hint: int = 1 << 20) -> None:
        self.names, self.exact_cells, self.where = names, exact_cells, where
        self.index = {name: j for j, name in enumerate(names)}
        self.chunks: list[list[np.ndarray]] = [[] for _ in names]  # float64, while the table is small
        self.cells = 0
        self.filled = 0
        self.capacity = rows if rows is not None else max(1, rows_hint)
        self.shift: np.ndarray | None = None  # set when the storage turns float32 (NaN: no finite value seen yet)
        self.out: list[np.ndarray] = []
        if rows is not None and rows * len(names) > exact_cells:
            self._float32()

    def _float32(self) -> None:
        self.shift = np.full(len(self.names), np.nan)
        self.out = [np.empty(self.capacity, dtype=np.float32) for _ in self.names]
        for j, parts in enumerate(self.chunks):
            at = 0
            for part in parts:
                self._store(j, part, self.out[j][at : at + len(part)])
                at += len(part)
            parts.clear()

    def add(self, columns: list[np.ndarray]) -> None:
        """One batch of rows: a float64 array per column (NaN where missing), all of one length."""
        self.add_columns(self.names, columns)
        self.next_rows(len(columns[0]) if columns else 0)

    def add_columns(self, names: Sequence[str], columns: list[np.ndarray]) -> None:
        """The next rows of some columns (:meth:`next_rows` moves on once every column has them)."""
        k = len(columns[0]) if columns else 0
        self.cells += k * len(columns)
        if self.shift is None and self.cells > self.exact_cells:
            self.capacity = max(self.capacity, self.filled + k)
            self._float32()
        if self.shift is not None and self.filled + k > self.capacity:
            self.capacity = max(self.filled + k, self.capacity + self.capacity // 2)
            for j, old in enumerate(self.out):  # one column at a time: the table is never held twice
                self.out[j] = np.empty(self.capacity, dtype=np.float32)
                self.out[j][: self.filled] = old[: self.filled]
                del old
        for name, column in zip(names, columns, strict=True):
            j = self.index[name]
            if self.shift is None:
                self.chunks[j].append(column)
            else:
                self._store(j, column, self.out[j][self.filled : self.filled + len(column)])

    def next_rows(self, k: int) -> None:
        self.filled += k

    def _store(self, j: int, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``values - shift`` as float32 (into ``out``), in one pass. The shift is the column's first finite value; a
        chunk before it holds only NaN or infinities, which any shift leaves as they are."""
        assert self.shift is not None
        shift = self.shift[j]
        if np.isnan(shift):
            finite = np.isfinite(values)
            first = int(finite.argmax()) if len(values) else 0
            if len(values) and finite[first]:
                self.shift[j] = shift = values[first]
            else:
                shift = 0.0
        if out is None:
            out = np.empty(len(values), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            np.subtract(values, shift, out=out, casting="unsafe")  # float64 arithmetic, rounded once to float32
            if np.isinf(out).any() and (np.isinf(out) & ~np.isinf(values)).any():
                raise DataError(f"{self.where}: column {self.names[j]!r} holds values as large as "
                                f"{float(np.nanmax(np.abs(values))):.3g}, beyond what a large table keeps (float32 "
                                "after centring, up to 3e38); rescale the column in the file (divide it by a power of "
                                "ten)")
        return out

    def columns(self) -> Iterator[tuple[str, np.ndarray, float]]:
        dtype = np.float64 if self.shift is None else np.float32
        for j, name in enumerate(self.names):
            if self.shift is not None:
                values = self.out[j][: self.filled]
                self.out[j] = values[:0]
            else:
                parts, self.chunks[j] = self.chunks[j], []
                values = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
                del parts
            shift = 0.0 if self.shift is None or np.isnan(self.shift[j]) else float(self.shift[j])
            yield name, values, shift


class _Texts:
    """Text cells of one column as int32 codes into its distinct raw cells (a Python object per distinct value)."""

    def __init__(self, keep_arrow: bool) -> None:
        self.index: dict[str, int] = {}
        self.codes: list[np.ndarray] = []
        self.keep_arrow = keep_arrow
        self.chunks: list[Any] = []

    def add(self, array: Any) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        if self.keep_arrow:
            self.chunks.append(array)
            return
        encoded = pc.dictionary_encode(array)
        if isinstance(encoded, pa.ChunkedArray):
            encoded = encoded.combine_chunks()
        mapping = np.array([self.index.setdefault(v, len(self.index)) for v in encoded.dictionary.to_pylist()],
                           dtype=np.int32)
        local = encoded.indices.to_numpy(zero_copy_only=False)
        self.codes.append(mapping[local] if len(mapping) else local.astype(np.int32))

    def column(self, name: str) -> Column:
        if self.keep_arrow:
            import pyarrow as pa

            arrays = [c for chunk in self.chunks for c in (chunk.chunks if isinstance(chunk, pa.ChunkedArray)
                                                             else [chunk])]
            arrow = pa.concat_arrays(arrays) if arrays else pa.array([], pa.string())
            return Column(name, arrow=arrow)
        codes = np.concatenate(self.codes) if self.codes else np.zeros(0, dtype=np.int32)
        return Column(name, codes=codes, texts=list(self.index))


_COLUMN_ERROR = re.compile(r"In CSV column #(\d+): (?:Row #\d+: )?CSV conversion error")


def read_columns(table: TableFile, wanted: Sequence[str], *, text: Sequence[str] = (), keep_arrow: Sequence[str] = (),
                 exact_cells: int | None = None) -> dict[str, Column]:
    """Read the columns ``wanted`` of ``table``. ``text``: read as text whatever they hold (labels, ids);
    ``keep_arrow``: text columns kept as an Arrow string array (ids: no Python object per cell)."""
    missing = [c for c in wanted if c not in table.names]
    if missing:
        raise DataError(f"{table.path}: no column {missing[0]!r} (its columns: {table.names[:20]})")
    forced = set(text) | set(keep_arrow)
    limit = EXACT_CELLS if exact_cells is None else exact_cells
    if table.format == "parquet":
        return _read_parquet(table, list(wanted), forced, set(keep_arrow), limit)
    for _ in range(len(wanted) + 1):
        try:
            return _read_csv(table, list(wanted), forced, set(keep_arrow), limit)
        except _Retype as retry:  # a column typed as numbers from its first block holds text further down
            forced.add(retry.column)
    raise AssertionError("unreachable")  # pragma: no cover


class _Retype(Exception):
    def __init__(self, column: str) -> None:
        self.column = column


def _csv_options(table: TableFile, wanted: list[str], types: dict[str, Any], bad_rows: list,
                 block_size: int = _BLOCK_BYTES) -> tuple:
    import pyarrow.csv as pacsv

    def on_bad_row(row: Any) -> str:
        bad_rows.append(row.actual_columns)
        return "skip"

    read = pacsv.ReadOptions(column_names=table.names, skip_rows=1 if table.has_header else 0,
                             block_size=block_size)
    parse = pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=on_bad_row)
    convert = pacsv.ConvertOptions(include_columns=wanted, column_types=types, null_values=_NULLS,
                                   strings_can_be_null=False, true_values=[], false_values=[])
    return read, parse, convert


def _open_stream(table: TableFile) -> Any:
    import pyarrow as pa

    raw = table.path.open("rb")
    if raw.read(2) == b"\x1f\x8b":
        raw.seek(0)
        return pa.PythonFile(gzip.GzipFile(fileobj=raw), mode="r")  # Python's gzip: its errors name the problem
    raw.close()
    return pa.OSFile(str(table.path))


def _numeric_type(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t) or pa.types.is_decimal(t)


def _read_csv(table: TableFile, wanted: list[str], forced: set[str], keep_arrow: set[str], limit: int
              ) -> dict[str, Column]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    bad_rows: list[int] = []
    try:
        with _open_stream(table) as stream:  # the first block's types decide which columns are numbers
            head = stream.read(2 * _BLOCK_BYTES)  # alone: the reader would read 32 blocks ahead
            read, parse, convert = _csv_options(table, wanted, {c: pa.string() for c in forced}, bad_rows)
            schema = pacsv.open_csv(pa.BufferReader(head), read_options=read, parse_options=parse,
                                    convert_options=convert).schema
        rows_hint = 1 << 20  # the rows a file of this size holds at the head's bytes per line, with a margin
        with table.path.open("rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        if head and table.path.stat().st_size > len(head) and not gzipped:
            rows_hint = int(1.1 * table.path.stat().st_size * (head.count(b"\n") + 1) / len(head)) + 1024
        del head
        types = {c: pa.float64() if c not in forced and _numeric_type(schema.field(c).type) else pa.string()
                 for c in wanted}
        numeric = [c for c in wanted if types[c] == pa.float64()]
        numbers = _Numbers(numeric, limit, table.path, rows_hint=rows_hint)
        texts = {c: _Texts(c in keep_arrow) for c in wanted if c not in numeric}
        bad_rows.clear()
        with _open_stream(table) as stream:
            # Smaller blocks once the types are decided: pyarrow's reader reads up to 32 blocks ahead of the parser.
            read, parse, convert = _csv_options(table, wanted, types, bad_rows, min(_BLOCK_BYTES, _READ_BLOCK_BYTES))
            for batch in pacsv.open_csv(stream, read_options=read, parse_options=parse, convert_options=convert):
                _add_batch(batch, numeric, numbers, texts)
    except pa.ArrowInvalid as exc:
        match = _COLUMN_ERROR.search(str(exc))
        if match and "invalid UTF8" not in str(exc):
            raise _Retype(table.names[int(match.group(1))]) from None
        raise _utf8_or(table, exc) from None
    except (*READ_ERRORS, csv.Error) as exc:
        raise table.cant_read(exc) from None
    if bad_rows:
        _raise_ragged(table, len(bad_rows))
    return _finish(table, wanted, numbers, texts)


def _float64(column: Any) -> np.ndarray:
    """An Arrow column of numbers as float64 (NaN where null): its own buffer, unless it needs converting."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if column.type != pa.float64():
        column = pc.cast(column, pa.float64())
    return column.to_numpy(zero_copy_only=False)


def _add_batch(batch: Any, numeric: list[str], numbers: _Numbers, texts: dict[str, _Texts]) -> None:
    if numeric:
        numbers.add([_float64(batch.column(c)) for c in numeric])
    for c, acc in texts.items():
        acc.add(batch.column(c))


def _finish(table: TableFile, wanted: list[str], numbers: _Numbers, texts: dict[str, _Texts]) -> dict[str, Column]:
    import pyarrow as pa

    out = {name: Column(name, values=values, shift=shift) for name, values, shift in numbers.columns()}
    for c, acc in texts.items():
        out[c] = acc.column(c)
    pa.default_memory_pool().release_unused()  # the reader's buffers go back to the system, not to a later peak
    return {c: out[c] for c in wanted}


def _utf8_or(table: TableFile, exc: BaseException) -> DataError:
    """A text cell that is not UTF-8 gets the byte's position, as the previous reader reported it."""
    try:
        with table.text() as fh:
            while fh.read(1 << 20):
                pass
    except UnicodeDecodeError as bad:
        return table.cant_read(bad)
    except (*READ_ERRORS, csv.Error) as other:
        return table.cant_read(other)
    return DataError(f"cannot read {table.path} as CSV (gzip is read transparently): {exc}")


def _raise_ragged(table: TableFile, count: int) -> None:
    width = len(table.names)
    for line, row in table.rows_with_lines():
        if len(row) != width:
            raise DataError(f"{table.path} is ragged: line {line} has {len(row)} fields, the first line has {width} "
                            f"({count} bad line(s)); fix the file or its delimiter")
    raise DataError(f"{table.path} is ragged: {count} row(s) do not have the header's {width} fields; fix the file "
                    "or its delimiter")  # pragma: no cover - Python's reader finds the row pyarrow skipped


def _read_parquet(table: TableFile, wanted: list[str], forced: set[str], keep_arrow: set[str], limit: int
                  ) -> dict[str, Column]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        source = pq.ParquetFile(table.path)
        schema = source.schema_arrow
        kinds = {}
        for c in wanted:
            t = schema.field(c).type
            if pa.types.is_dictionary(t):
                t = t.value_type
            if c in forced or pa.types.is_string(t) or pa.types.is_large_string(t):
                kinds[c] = "text"
            elif _numeric_type(t) or pa.types.is_boolean(t):
                kinds[c] = "number"
            else:
                raise DataError(f"{table.path}: column {c!r} has Parquet type {t}; secvfl reads numbers, booleans "
                                "and strings: convert it (a date to a number of days, say) when exporting")
        numeric = [c for c in wanted if kinds[c] == "number"]
        numbers = _Numbers(numeric, limit, table.path, rows=source.metadata.num_rows)
        texts = {c: _Texts(c in keep_arrow) for c in wanted if c not in numeric}
        for group in range(source.num_row_groups):
            # A row group at a time (its columns decoded by pyarrow's threads), in slices of columns that keep the
            # decoded values under _PARQUET_READ_BYTES whatever the row group's size.
            rows = max(1, source.metadata.row_group(group).num_rows)
            step = max(1, _PARQUET_READ_BYTES // (8 * rows))
            for first in range(0, len(wanted), step):
                part = source.read_row_group(group, columns=wanted[first : first + step])
                for c in part.column_names:
                    col = part.column(c)
                    if kinds[c] == "number":
                        continue
                    if pa.types.is_dictionary(col.type):
                        col = col.cast(col.type.value_type)
                    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                        col = pc.cast(col, pa.string())
                    if col.null_count:
                        col = pc.fill_null(col, "")  # a null text cell is missing, like an empty CSV cell
                    texts[c].add(col)
                in_part = [c for c in numeric if c in part.column_names]
                if in_part:
                    numbers.add_columns(in_part, [_float64(part.column(c)) for c in in_part])
                del part
            numbers.next_rows(source.metadata.row_group(group).num_rows)
    except DataError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"cannot read {table.path} as Parquet: {exc}") from None
    return _finish(table, wanted, numbers, texts)
