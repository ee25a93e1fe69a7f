"""Output files named on the command line: checked before the work starts, written atomically after it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from secvfl.errors import ConfigError
from secvfl.io import write_text_atomic

__all__ = ["check_output_file", "write_output_text"]


def check_output_file(path: Path, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """ConfigError unless ``path`` can be written as a file: not a directory, under folders (or a place to create
    them) where this process can create files, with one of ``suffixes`` when given."""
    if suffixes and path.suffix.lower() not in suffixes:
        raise ConfigError(f"{flag} {path}: the format follows the file extension; use a name ending in "
                          f"{' or '.join(suffixes)}")
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; name a file (inside it, or anywhere else)")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{flag} {path}: {ancestor} is a file, not a folder; choose another path")
    try:  # the only reliable test: read-only mounts, /proc and friends pass os.access for root
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".secvfl-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create files in {ancestor} ({exc.strerror or exc}); "
                          "choose a writable folder") from None
    return path


def write_output_text(path: Path, text: str, flag: str) -> None:
    """Write ``text`` atomically (a reader never sees half a file), creating the folders; one line on failure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write it ({exc.strerror or exc})") from None
