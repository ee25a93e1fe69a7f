"""Dataset specs -> :class:`Dataset`. All offline.

Specs: ``digits``, ``breast_cancer``, ``wine`` (bundled with scikit-learn), ``csv:PATH[:LABEL]``, ``idx:DIR``,
``svmlight:PATH[,TEST_PATH]``, ``cifar:PATH`` (CIFAR-10/100, :mod:`secvfl.data.cifar`), and shortcuts for real sets
in a data directory (``--data-dir`` or ``$SECVFL_DATA_DIR``): ``credit``, ``mnist``, ``a9a``, ``w8a``, ``mushrooms``,
``cifar10``, ``cifar100``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from secvfl.data.cifar import find_cifar, load_cifar
from secvfl.data.csv_loader import load_csv
from secvfl.data.dataset import Dataset, RawData
from secvfl.data.idx import load_idx_dir
from secvfl.data.preprocess import prepare
from secvfl.data.svmlight import load_svmlight
from secvfl.errors import DataError
from secvfl.registry import Registry

__all__ = ["load_dataset", "load_raw", "resolve_data_dir", "DATASETS", "dataset_names"]

# name -> loader(data_dir) for named datasets
DATASETS: Registry[Callable[[Path | None], RawData]] = Registry("dataset")


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    d = data_dir or os.environ.get("SECVFL_DATA_DIR")
    if not d:
        raise DataError(
            "this dataset is read from a data directory: pass --data-dir DIR or set SECVFL_DATA_DIR "
            "(for example the shared/data folder with credit, mnist, a9a, w8a, mushrooms)"
        )
    p = Path(d).expanduser()
    if not p.is_dir():
        what = "is a file, not a folder" if p.exists() else "does not exist"
        raise DataError(f"data directory {p} {what}; pass --data-dir DIR (or SECVFL_DATA_DIR) with the folder that "
                        "holds uci_credit_default/, mnist/, a9a/, w8a/, mushrooms/")
    return p


def _sub(data_dir: Path | None, sub: str) -> Path:
    p = resolve_data_dir(data_dir) / sub
    if not p.is_dir():
        raise DataError(f"data directory has no {sub}/ folder (looked in {p})")
    return p


def _sklearn(loader_name: str) -> Callable[[Path | None], RawData]:
    def load(_: Path | None) -> RawData:
        import sklearn.datasets as skd

        bunch = getattr(skd, loader_name)()
        y = np.asarray(bunch.target, dtype=np.int64)
        names = [str(c) for c in getattr(bunch, "target_names", np.unique(y))]
        return RawData(
            X=np.asarray(bunch.data, dtype=np.float64), y=y,
            feature_names=[str(f) for f in getattr(bunch, "feature_names", range(bunch.data.shape[1]))],
            classes=names, image_shape=(8, 8) if loader_name == "load_digits" else None,
            notes=[f"scikit-learn {loader_name}: {len(y)} rows"],
        )

    return load


DATASETS.add("digits", _sklearn("load_digits"))
DATASETS.add("breast_cancer", _sklearn("load_breast_cancer"))
DATASETS.add("wine", _sklearn("load_wine"))


@DATASETS.register("credit")
def _credit(data_dir: Path | None) -> RawData:
    """UCI default of credit card clients: 30,000 rows, ID dropped, 23 features, label 'default payment next month'."""
    path = _sub(data_dir, "uci_credit_default") / "default_of_credit_card_clients.csv.gz"
    return load_csv(path, "default payment next month", header="yes", drop_columns=("ID",))


@DATASETS.register("mnist")
def _mnist(data_dir: Path | None) -> RawData:
    return load_idx_dir(_sub(data_dir, "mnist"))


@DATASETS.register("a9a")
def _a9a(data_dir: Path | None) -> RawData:
    d = _sub(data_dir, "a9a")
    return load_svmlight(d / "a9a.gz", d / "a9a.t.gz", n_features=123)


@DATASETS.register("w8a")
def _w8a(data_dir: Path | None) -> RawData:
    return load_svmlight(_sub(data_dir, "w8a") / "w8a.gz", n_features=300)


@DATASETS.register("mushrooms")
def _mushrooms(data_dir: Path | None) -> RawData:
    """XGBoost's agaricus LIBSVM split (126 one-hot features) stands in for LIBSVM's mushrooms file."""
    d = _sub(data_dir, "mushrooms")
    return load_svmlight(d / "agaricus.txt.train.gz", d / "agaricus.txt.test.gz", n_features=126)


@DATASETS.register("cifar10")
def _cifar10(data_dir: Path | None) -> RawData:
    return load_cifar(find_cifar(resolve_data_dir(data_dir), 10), 10)


@DATASETS.register("cifar100")
def _cifar100(data_dir: Path | None) -> RawData:
    return load_cifar(find_cifar(resolve_data_dir(data_dir), 100), 100)


def load_raw(spec: str, data_dir: str | Path | None = None) -> tuple[str, RawData]:
    """Read a dataset spec without splitting; returns (display name, raw data)."""
    if not spec:
        raise DataError("empty dataset spec")
    kind, _, rest = spec.partition(":")
    if kind == "csv" and rest:
        path, label = rest, None
        # The label is after the last ':' unless that would cut a Windows drive or the path exists as given.
        head, sep, tail = rest.rpartition(":")
        if sep and head and not Path(rest).exists():
            path, label = head, tail
        return Path(path).name, load_csv(path, label)
    if kind == "idx" and rest:
        return Path(rest).name, load_idx_dir(rest)
    if kind == "svmlight" and rest:
        train, _, test = rest.partition(",")
        return Path(train).name, load_svmlight(train, test or None)
    if kind == "cifar" and rest:
        return Path(rest).name, load_cifar(rest)
    if kind in ("csv", "idx", "svmlight") or (kind == "cifar" and ":" in spec):
        raise DataError(f"dataset spec {spec!r} needs a path: {kind}:PATH")
    if spec not in DATASETS:
        raise DataError(
            f"unknown dataset {spec!r}; use one of {', '.join(DATASETS.names())}, csv:PATH[:LABEL], idx:DIR, "
            "svmlight:PATH[,TEST_PATH] or cifar:PATH"
        )
    return spec, DATASETS.get(spec)(Path(data_dir) if data_dir else None)


def load_dataset(
    spec: str,
    data_dir: str | Path | None = None,
    *,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    nan_policy: str = "mean",
) -> Dataset:
    """Load, split (stratified; the test split uses seed 0 unless the data ships one) and standardise a dataset."""
    name, raw = load_raw(spec, data_dir)
    return prepare(raw, name, seed=seed, val_fraction=val_fraction, test_fraction=test_fraction, nan_policy=nan_policy)


def dataset_names() -> list[str]:
    return DATASETS.names()
