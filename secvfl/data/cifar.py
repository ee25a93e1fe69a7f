"""CIFAR-10 and CIFAR-100 (Krizhevsky 2009) from the files their authors distribute: ``cifar:PATH``, and the
``cifar10`` / ``cifar100`` shortcuts in a data directory. Nothing is downloaded: PATH is a folder or archive on disk.

Both formats are read:

* **binary** (``cifar-10-batches-bin/``: ``data_batch_1.bin`` ... ``data_batch_5.bin``, ``test_batch.bin``,
  ``batches.meta.txt``; ``cifar-100-binary/``: ``train.bin``, ``test.bin``, ``fine_label_names.txt``): fixed-size
  records, a label byte (CIFAR-100: coarse, then fine) and 3072 pixel bytes. Read with ``numpy.frombuffer``; every file
  is checked to hold whole records and labels in range.
* **python** (``cifar-10-batches-py/``: ``data_batch_1`` ... ``test_batch``, ``batches.meta``; ``cifar-100-python/``:
  ``train``, ``test``, ``meta``; what torchvision leaves on disk): each file is a Python *pickle* of a dict. A pickle
  can name any Python callable to run while it loads, so these are read with an unpickler that resolves only the
  numpy functions that rebuild an array (``_reconstruct``, ``ndarray``, ``dtype``, ``_frombuffer``) and latin-1 text
  encoding (how Python 3 writes bytes at protocol 2) and refuses every other name: the file can build numpy arrays, bytes, strings, numbers, lists and dicts, and nothing that runs code.
  The arrays are then checked like the binary records (uint8 pixels of the right shape, labels in range). Read it
  only as the local file format it is: nothing that crosses a party boundary is ever unpickled. (The binary version
  holds the same images; prefer it when you download.)

A folder may be the batches folder itself or one that holds it under its standard name; an archive is the
``.tar.gz`` as distributed (its members are read in memory, nothing is extracted). The images are 32 x 32 with three
channels; the columns are channel-major (the 1024 red pixels row by row, then green, then blue: the files' own
order), so a party's image region holds its pixels in all three channels (:func:`secvfl.data.partition.partition_image`).
CIFAR-100 trains on its 100 fine labels.
"""

from __future__ import annotations

import io
import pickle
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from secvfl.data.dataset import RawData
from secvfl.data.files import READ_ERRORS, describe_read_error
from secvfl.errors import DataError

__all__ = ["load_cifar", "CIFAR_FOLDERS", "read_cifar_pickle"]

SIDE, CHANNELS = 32, 3
PIXELS = CHANNELS * SIDE * SIDE
_SPEC = "cifar:PATH (a CIFAR-10/100 folder or .tar.gz, binary or python version)"


@dataclass(frozen=True)
class _Layout:
    """One of the four distributed layouts: its folder name, files and how to read a file."""

    folder: str
    version: str  # "binary" or "python"
    classes: int
    train: tuple[str, ...] | str  # file names, or a pattern of numbered batches
    test: str
    meta: str


_LAYOUTS = (
    _Layout("cifar-10-batches-bin", "binary", 10, r"data_batch_(\d+)\.bin", "test_batch.bin", "batches.meta.txt"),
    _Layout("cifar-100-binary", "binary", 100, ("train.bin",), "test.bin", "fine_label_names.txt"),
    _Layout("cifar-10-batches-py", "python", 10, r"data_batch_(\d+)", "test_batch", "batches.meta"),
    _Layout("cifar-100-python", "python", 100, ("train",), "test", "meta"),
)
CIFAR_FOLDERS = {10: ("cifar-10-batches-bin", "cifar-10-batches-py"), 100: ("cifar-100-binary", "cifar-100-python")}
_ARCHIVES = {10: ("cifar-10-binary.tar.gz", "cifar-10-python.tar.gz"),
             100: ("cifar-100-binary.tar.gz", "cifar-100-python.tar.gz")}


# -- the files, from a folder or an archive -----------------------------------------------------------------------
class _Files:
    """The names and contents of the files of one layout, from a folder or from an archive's members."""

    def __init__(self, names: list[str], read: Callable[[str], bytes], where: str) -> None:
        self.names, self._read, self.where = names, read, where

    def read(self, name: str) -> bytes:
        try:
            return self._read(name)
        except READ_ERRORS + (tarfile.TarError,) as exc:
            raise DataError(f"cannot read {name} in {self.where}: {describe_read_error(exc)}") from None


def _layout_of(names: list[str]) -> _Layout | None:
    for layout in _LAYOUTS:
        trains = _train_files(layout, names)
        if trains and layout.test in names:
            return layout
    return None


def _train_files(layout: _Layout, names: list[str]) -> list[str]:
    if isinstance(layout.train, tuple):
        return [n for n in layout.train if n in names]
    numbered = [(int(m.group(1)), n) for n in names if (m := re.fullmatch(layout.train, n))]
    return [n for _, n in sorted(numbered)]


def _from_folder(folder: Path) -> tuple[_Layout, _Files]:
    candidates = [folder] + [folder / f for names in CIFAR_FOLDERS.values() for f in names]
    for cand in candidates:
        if cand.is_dir():
            names = sorted(p.name for p in cand.iterdir() if p.is_file())
            layout = _layout_of(names)
            if layout is not None:
                return layout, _Files(names, lambda n, d=cand: (d / n).read_bytes(), str(cand))
    expected = ", ".join(f"{lay.folder}/ ({lay.test}, ...)" for lay in _LAYOUTS)
    raise DataError(f"{folder} holds no CIFAR files; {_SPEC} names one of {expected} (or the folder that holds it)")


def _from_archive(path: Path) -> tuple[_Layout, _Files]:
    try:
        with tarfile.open(path, "r:*") as tar:
            members = {m.name: m for m in tar.getmembers() if m.isfile()}
            by_folder: dict[str, dict[str, tarfile.TarInfo]] = {}
            for name, member in members.items():
                folder, _, base = name.rpartition("/")
                by_folder.setdefault(folder.rpartition("/")[2], {})[base] = member
            for files in by_folder.values():
                layout = _layout_of(sorted(files))
                if layout is None:
                    continue
                wanted = [*_train_files(layout, sorted(files)), layout.test, layout.meta]
                data = {}
                for n in wanted:
                    if n in files:
                        fh = tar.extractfile(files[n])
                        data[n] = fh.read() if fh is not None else b""
                return layout, _Files(sorted(files), data.__getitem__, str(path))
    except READ_ERRORS + (tarfile.TarError,) as exc:
        raise DataError(f"cannot read the archive {path}: {describe_read_error(exc)}") from None
    raise DataError(f"the archive {path} holds no CIFAR files; {_SPEC}")


# -- the binary version ------------------------------------------------------------------------------------------
def _binary(data: bytes, name: str, layout: _Layout) -> tuple[np.ndarray, np.ndarray]:
    head = 1 if layout.classes == 10 else 2  # CIFAR-100: coarse label, then fine label
    record = head + PIXELS
    if not data or len(data) % record:
        raise DataError(f"{name}: {len(data)} bytes is not a whole number of {record}-byte CIFAR-{layout.classes} "
                        "records (a truncated file, or the other CIFAR's file)")
    rows = np.frombuffer(data, np.uint8).reshape(-1, record)
    return rows[:, head:], rows[:, head - 1].astype(np.int64)


def _names_from_text(data: bytes | None, classes: int) -> list[str]:
    if data is None:
        return [str(c) for c in range(classes)]
    names = [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return names if len(names) == classes else [str(c) for c in range(classes)]


# -- the python version: a restricted unpickler --------------------------------------------------------------------
def _latin1(text: str, encoding: str = "latin1", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as Python 3 pickles bytes at protocol 2 (latin-1 text), and nothing else."""
    if not isinstance(text, str) or encoding.replace("-", "").lower() != "latin1" or errors != "strict":
        raise pickle.UnpicklingError(f"it encodes {type(text).__name__} as {encoding!r}, not text as latin-1")
    return text.encode("latin1")


def _numpy_rebuilders() -> dict[tuple[str, str], Any]:
    """The only names a CIFAR pickle may resolve: what numpy's pickles of arrays call, under the module names of
    numpy 1 (``numpy.core``, in the distributed files) and numpy 2 (``numpy._core``), and the latin-1 encoding by
    which Python 3 writes bytes at protocol 2."""
    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy 1
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]
    allowed = {"_reconstruct": multiarray._reconstruct, "_frombuffer": getattr(numeric, "_frombuffer", None)}
    out: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
                                       ("_codecs", "encode"): _latin1}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric"):
        for name, fn in allowed.items():
            if fn is not None:
                out[module, name] = fn
    return out


class _ArraysOnly(pickle.Unpickler):
    """Builds numpy arrays and plain data; any other global a pickle names is refused (it never runs)."""

    _allowed = _numpy_rebuilders()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[module, name]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR file never does (only numpy "
                                         "arrays are rebuilt)") from None


def read_cifar_pickle(data: bytes, name: str) -> Any:
    """The content of one file of the python version, rebuilt by :class:`_ArraysOnly` (no code runs)."""
    try:
        return _ArraysOnly(io.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, OverflowError) as exc:
        raise DataError(f"{name} is not a CIFAR python-version file: {exc}") from None


def _field(obj: Any, keys: tuple[str, ...], name: str) -> Any:
    if not isinstance(obj, dict):
        raise DataError(f"{name} is not a CIFAR python-version file: it holds a {type(obj).__name__}, not a dict")
    for key in keys:
        for k in (key.encode(), key):
            if k in obj:
                return obj[k]
    raise DataError(f"{name} has no {keys[0]!r} entry (it has {sorted(str(k) for k in obj)[:6]})")


def _python(data: bytes, name: str, layout: _Layout) -> tuple[np.ndarray, np.ndarray]:
    obj = read_cifar_pickle(data, name)
    pixels = _field(obj, ("data",), name)
    labels = _field(obj, ("labels",) if layout.classes == 10 else ("fine_labels",), name)
    if not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 2 or \
            pixels.shape[1] != PIXELS:
        what = f"{pixels.dtype} {pixels.shape}" if isinstance(pixels, np.ndarray) else type(pixels).__name__
        raise DataError(f"{name}: 'data' must be uint8 rows of {PIXELS} pixels, got {what}")
    if not isinstance(labels, (list, np.ndarray)) or len(labels) != len(pixels) or \
            not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in labels):
        raise DataError(f"{name}: the labels must be {len(pixels)} integers, one per image")
    return pixels, np.asarray(labels, dtype=np.int64)


def _names_from_pickle(data: bytes | None, layout: _Layout, where: str) -> list[str]:
    if data is None:
        return [str(c) for c in range(layout.classes)]
    names = _field(read_cifar_pickle(data, f"{layout.meta} in {where}"),
                   ("label_names",) if layout.classes == 10 else ("fine_label_names",), layout.meta)
    if not isinstance(names, list) or len(names) != layout.classes:
        return [str(c) for c in range(layout.classes)]
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names]


# -- the dataset ---------------------------------------------------------------------------------------------------
def _locate(path: Path) -> tuple[_Layout, _Files]:
    if not path.exists():
        raise DataError(f"{path} does not exist; pass {_SPEC}")
    if path.is_dir():
        return _from_folder(path)
    if path.name.endswith((".tar.gz", ".tgz", ".tar")):
        return _from_archive(path)
    raise DataError(f"{path} is a file but not a .tar.gz archive; pass {_SPEC}")


def load_cifar(path: str | Path, classes: int | None = None) -> RawData:
    """CIFAR-10 or CIFAR-100 (whichever ``path`` holds; ``classes`` 10 or 100 insists on one) as raw data: the
    training batches and the shipped test batch, pixels scaled to [0, 1]."""
    path = Path(path).expanduser()
    layout, files = _locate(path)
    if classes is not None and layout.classes != classes:
        raise DataError(f"{files.where} holds CIFAR-{layout.classes}, not CIFAR-{classes}")
    read = _binary if layout.version == "binary" else _python
    parts = [read(files.read(n), f"{n} in {files.where}", layout) for n in _train_files(layout, files.names)]
    x_test, y_test = read(files.read(layout.test), f"{layout.test} in {files.where}", layout)
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    for what, labels in (("training", y), ("test", y_test)):
        if labels.size and (labels.min() < 0 or labels.max() >= layout.classes):
            raise DataError(f"{files.where}: a {what} label is {int(labels.max())}, outside 0..{layout.classes - 1} "
                            f"of CIFAR-{layout.classes}")
    meta = files.read(layout.meta) if layout.meta in files.names else None
    names = (_names_from_text(meta, layout.classes) if layout.version == "binary"
             else _names_from_pickle(meta, layout, files.where))
    colours = "rgb"
    return RawData(
        X=x.astype(np.float64) / 255.0, y=y,
        X_test=x_test.astype(np.float64) / 255.0, y_test=y_test,
        feature_names=[f"{colours[c]}{r}_{k}" for c in range(CHANNELS) for r in range(SIDE) for k in range(SIDE)],
        classes=names, image_shape=(SIDE, SIDE), image_channels=CHANNELS,
        notes=[f"cifar-{layout.classes} ({layout.version} version): {len(y)} training and {len(y_test)} test images "
               f"of 32x32x3 from {files.where}"],
    )


def find_cifar(data_dir: Path, classes: int) -> Path:
    """The CIFAR-``classes`` folder or archive in a data directory (``cifar10`` / ``cifar100``)."""
    for name in (*CIFAR_FOLDERS[classes], *_ARCHIVES[classes]):
        if (data_dir / name).exists():
            return data_dir / name
    looked = ", ".join((*CIFAR_FOLDERS[classes], *_ARCHIVES[classes]))
    raise DataError(f"data directory {data_dir} has no CIFAR-{classes} (looked for {looked}); put the files from "
                    f"the CIFAR page there, or pass cifar:PATH")
