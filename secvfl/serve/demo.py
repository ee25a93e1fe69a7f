"""A federation on this host whose parties read their own files, made from a dataset scikit-learn bundles.

For trying a deployment (training with `secvfl launch`, serving with `secvfl serve`) without real partners: the
label party's file holds an id and the class of every row; each feature party's file an id and its block of
columns, and lacks a few ids the others hold (as real partners' tables do: training uses the rows every party holds,
serving reports the ids a party lacks). Addresses are free loopback ports; certificates for the parties and for one
client application are written beside the federation file.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from secvfl.deploy.loopback import loopback_federation
from secvfl.errors import ConfigError
from secvfl.serve.clientcerts import default_client_dir, issue_client_certificates, write_client_certificates

__all__ = ["write_demo_federation", "DEMO_DATASETS"]

DEMO_DATASETS = ("breast_cancer", "digits", "wine")


def _load(dataset: str) -> tuple[np.ndarray, list[str], list[str]]:
    from sklearn import datasets

    loaders = {"breast_cancer": datasets.load_breast_cancer, "digits": datasets.load_digits,
               "wine": datasets.load_wine}
    if dataset not in loaders:
        raise ConfigError(f"--dataset {dataset}: the demo federation is made from {', '.join(DEMO_DATASETS)}")
    bunch = loaders[dataset]()
    names = [str(n).replace(" ", "_") for n in getattr(bunch, "feature_names", [])] or \
        [f"x{j}" for j in range(bunch.data.shape[1])]
    target_names = [str(t) for t in getattr(bunch, "target_names", [])]
    labels = [target_names[int(t)] if target_names else str(int(t)) for t in bunch.target]
    return bunch.data, names, labels


def write_demo_federation(out: Path, *, dataset: str = "breast_cancer", parties: int = 2, aggregator: bool = False,
                          clients: tuple[str, ...] = ("app",), lacking: float = 0.02, seed: int = 0) -> Path:
    """Write ``out/federation.toml``, ``out/<party>.csv`` and the certificates; returns the federation file."""
    X, names, labels = _load(dataset)
    if not 2 <= parties <= X.shape[1]:
        raise ConfigError(f"--parties {parties}: {dataset} has {X.shape[1]} columns; choose 2 to {X.shape[1]}")
    out = Path(out)
    if (out / "federation.toml").exists():
        raise ConfigError(f"{out / 'federation.toml'} already exists; choose a new --out folder")
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = X.shape[0]
    ids = [f"c{i:05d}" for i in range(n)]
    blocks = np.array_split(np.arange(X.shape[1]), parties)

    def write(path: Path, header: list[str], rows: list[list[str]]) -> None:
        with path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(header)
            w.writerows(rows)

    write(out / "label.csv", ["id", "label"], [[ids[i], labels[i]] for i in rng.permutation(n)])
    tables = {"label": '{ file = "label.csv", id = "id", label = "label" }'}
    for k, block in enumerate(blocks):
        gone = set(rng.choice(n, int(round(lacking * n)), replace=False).tolist())
        columns = [names[j] for j in block]
        write(out / f"party{k}.csv", ["id", *columns],
              [[ids[i], *(f"{X[i, j]:.6g}" for j in block)] for i in rng.permutation(n) if i not in gone])
        listed = ", ".join(f'"{c}"' for c in columns)
        tables[f"party{k}"] = f'{{ file = "party{k}.csv", id = "id", columns = [{listed}] }}'
    path = loopback_federation(out, parties, name="demo", aggregator=aggregator, data=tables)
    from secvfl.federation import load_federation

    federation = load_federation(path)
    write_client_certificates(issue_client_certificates(default_client_dir(federation.ca), list(clients),
                                                        federation=federation.name))
    return path
