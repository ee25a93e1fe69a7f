"""IDX image files in the MNIST layout (train-images-idx3-ubyte.gz, ... with optional .gz)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from secvfl.data.dataset import RawData
from secvfl.data.files import READ_ERRORS, describe_read_error
from secvfl.errors import DataError

__all__ = ["load_idx_dir", "read_idx"]

_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except READ_ERRORS as exc:
        raise DataError(f"cannot read IDX file {path}: {describe_read_error(exc)}") from None
    if len(data) < 4:
        raise DataError(f"{path} is too short to be an IDX file")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file (magic {data[:4].hex()})")
    if len(data) < 4 + 4 * ndim:
        raise DataError(f"{path} is truncated inside its IDX header")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(data) - offset != expected:
        raise DataError(f"{path}: header says {dims} ({expected} bytes) but the file has {len(data) - offset}")
    return np.frombuffer(data, np.uint8, offset=offset).reshape(dims)


def _find(directory: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx")):
        p = directory / name
        if p.is_file():
            return p
    raise DataError(f"IDX directory {directory} has no {stem}[.gz]; expected the MNIST file names {list(_FILES.values())}")


def load_idx_dir(directory: str | Path) -> RawData:
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise DataError(f"IDX directory {directory} {what}; pass idx:DIR with the MNIST-layout files")
    arrays = {k: read_idx(_find(directory, v)) for k, v in _FILES.items()}
    xtr, ytr, xte, yte = (arrays[k] for k in ("train_images", "train_labels", "test_images", "test_labels"))
    if xtr.ndim != 3 or xte.shape[1:] != xtr.shape[1:] or len(xtr) != len(ytr) or len(xte) != len(yte):
        raise DataError(f"IDX files in {directory} do not fit together: {xtr.shape}, {ytr.shape}, {xte.shape}, {yte.shape}")
    if len(xtr) == 0 or len(xte) == 0:
        raise DataError(f"IDX files in {directory} hold {len(xtr)} training and {len(xte)} test images; need both")
    h, w = xtr.shape[1:]
    classes = [str(c) for c in range(int(max(ytr.max(), yte.max())) + 1)]
    return RawData(
        X=xtr.reshape(len(xtr), -1).astype(np.float64) / 255.0,
        y=ytr.astype(np.int64),
        X_test=xte.reshape(len(xte), -1).astype(np.float64) / 255.0,
        y_test=yte.astype(np.int64),
        feature_names=[f"px{r}_{c}" for r in range(h) for c in range(w)],
        classes=classes,
        image_shape=(h, w),
        notes=[f"idx: {len(xtr)} training and {len(xte)} test images of {h}x{w} from {directory}"],
    )
