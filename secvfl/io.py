"""Atomic file writes: a crash never leaves a half-written result or checkpoint behind."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["write_bytes_atomic", "write_text_atomic", "write_json_atomic", "torch_save_atomic", "torch_load"]


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def torch_save_atomic(path: str | Path, obj: Any) -> None:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    write_bytes_atomic(path, buf.getvalue())


def torch_load(path: str | Path) -> Any:
    # weights_only: a checkpoint is data (tensors, numbers, dicts), never code.
    return torch.load(path, map_location="cpu", weights_only=True)
