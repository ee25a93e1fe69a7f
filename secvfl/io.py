"""Atomic file writes: a crash never leaves a half-written result or checkpoint behind."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "write_bytes_atomic",
    "write_text_atomic",
    "write_json_atomic",
    "jsonable",
    "torch_save_atomic",
    "torch_bytes",
    "torch_load",
    "fsync_dir",
    "save_figure_atomic",
]


def write_bytes_atomic(path: str | Path, data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it; ``mode`` (e.g. 0o600 for a private key)
    is set before any byte is written, so the content is never readable under looser permissions."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (the new name survives a power cut, not only a killed process)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms where a directory cannot be opened have no directory fsync either
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=jsonable) + "\n")


def jsonable(o: Any) -> Any:
    """The JSON form of values ``json`` cannot write itself (numpy scalars, tuples, sets, paths)."""
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def torch_bytes(obj: Any) -> bytes:
    """``obj`` as ``torch.save`` writes it (tensors, numbers, strings, lists and dicts of them)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_save_atomic(path: str | Path, obj: Any) -> None:
    write_bytes_atomic(path, torch_bytes(obj))


def torch_load(path: str | Path) -> Any:
    # weights_only: a checkpoint is data (tensors, numbers, dicts), never code.
    return torch.load(path, map_location="cpu", weights_only=True)


def save_figure_atomic(fig: Any, path: str | Path, *, dpi: int = 120) -> Path:
    """Write a matplotlib figure as PNG atomically (a figure made with pyplot is still the caller's to close)."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=dpi)
    write_bytes_atomic(path, buf.getvalue())
    return Path(path)
