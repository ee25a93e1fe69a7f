"""Checks shared by the file loaders: one DataError naming the file for every way reading it can fail."""

from __future__ import annotations

import gzip
import os
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from secvfl.errors import DataError

__all__ = ["check_readable_file", "check_unique_ids", "describe_read_error", "READ_ERRORS"]

# What reading a (possibly gzipped) text file raises on a bad file; zlib.error is not an OSError.
READ_ERRORS = (OSError, EOFError, zlib.error, UnicodeDecodeError)


def check_readable_file(path: Path, what: str, spec: str) -> None:
    """DataError unless ``path`` is an existing, readable regular file (``spec`` shows how to name one)."""
    if not path.exists():
        raise DataError(f"{what} {path} does not exist; pass {spec} with an existing file")
    if path.is_dir():
        raise DataError(f"{what} {path} is a directory; pass {spec} with a file")
    if not path.is_file():
        raise DataError(f"{what} {path} is not a regular file; pass {spec} with a file")
    if not os.access(path, os.R_OK):
        raise DataError(f"{what} {path} is not readable (permission denied); fix its permissions or copy it")


def describe_read_error(exc: BaseException) -> str:
    """The cause of a read failure in words (a corrupt gzip stream says so instead of 'Error -3')."""
    if isinstance(exc, (zlib.error, EOFError, gzip.BadGzipFile)):
        return f"corrupt or truncated gzip data ({exc})"
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte {exc.start} is {exc.object[exc.start:exc.start + 1]!r})"
    return str(exc)


def check_unique_ids(ids: Any, path: Path, column: str) -> None:
    """DataError if an id repeats: a party's rows are aligned by id (``secvfl align``, deployed parties' files).
    ``ids``: a list of str, or an Arrow string array (counted by pyarrow, without a Python object per id)."""
    if not isinstance(ids, list):
        import pyarrow.compute as pc

        from secvfl.data.id_index import hash_ids

        hashes = np.sort(hash_ids(ids))  # distinct 64-bit hashes: distinct ids (a repeat, or a collision: counted)
        if not (hashes[1:] == hashes[:-1]).any():
            return
        counts = pc.value_counts(ids)
        many = counts.filter(pc.greater(counts.field("counts"), 1))
        repeated = many.field("values").to_pylist()
    else:
        repeated = [i for i, c in Counter(ids).items() if c > 1]
    if repeated:
        raise DataError(f"{path} repeats {len(repeated)} id(s) in {column!r} (e.g. {repeated[:3]}); "
                        "each row needs a unique id to be aligned")
