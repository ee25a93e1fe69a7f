"""`secvfl predict`: predict with a trained run using any subset of its parties (e.g. after a party has left).

Every listed party (``--observed 1,3``) computes its representation of each row and, for LASER-VFL, predicts with
its own predictor for exactly that set of parties; baselines use their own rule (Combinatorial: the predictor of the
set; Ensemble: the vote; Standard VFL / PlugVFL: random guesses when a needed party is absent). Parties that are not
listed take no part and receive nothing. The split algorithms (``splitnn``, ``vafl``, ``fdml``) predict with every
party (``--observed`` left out, or listing them all).

``--out`` writes one CSV line per row: the row, its label, each observed party's predicted class and its class
probabilities (``party1:p_<class>``; LASER-VFL: of that party's predictor), and ``p_<class>``: the probabilities of
the federation's answer -- for LASER-VFL the mean of the observed parties' predictors, as `secvfl serve` answers.

Rows come from ``--data`` (default: the run's dataset) and ``--split``, loaded and preprocessed exactly as in
training (same loader, same seed, so the same split and the same training-split standardisation).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from secvfl.cli.paths import check_output_file, write_output_text
from secvfl.errors import ConfigError, UnsupportedError

if TYPE_CHECKING:
    from secvfl.data import Dataset

__all__ = ["register", "run", "parse_observed"]


def parse_observed(text: str, k: int) -> list[int]:
    try:
        parties = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ConfigError(f"--observed takes comma-separated party indices like 0,2, got {text!r}") from None
    if not parties:
        raise ConfigError("--observed needs at least one party index")
    bad = [p for p in parties if not 0 <= p < k]
    if bad:
        raise ConfigError(f"--observed {text}: parties {bad} do not exist; the run has parties 0..{k - 1}")
    return parties


def _trained_schema(run: Path) -> dict | None:
    """Name, feature columns and classes of the data the run trained on (its summary.json), if it finished."""
    try:
        data = json.loads((run / "summary.json").read_text())["data"]
        return {"name": str(data["name"]), "n_features": int(data["n_features"]), "n_classes": int(data["n_classes"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # an unfinished run: the checkpoint itself will tell (see run())


def _check_schema(spec: str, data: Dataset, trained: dict | None) -> None:
    if trained is None or (data.n_features, data.n_classes) == (trained["n_features"], trained["n_classes"]):
        return
    raise ConfigError(
        f"--data {spec} has {data.n_features} feature columns and {data.n_classes} classes, but the model was "
        f"trained on {trained['name']} with {trained['n_features']} feature columns and {trained['n_classes']} "
        "classes; pass data with the training columns in the same order"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("predict", help="predict with a trained run and any subset of its parties",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="run directory written by `secvfl train --out DIR`")
    p.add_argument("--observed", default=None,
                   help="parties taking part, e.g. 1,3 (0-based indices; default: every party)")
    p.add_argument("--data", default=None,
                   help="dataset spec with the training columns in the same order (default: the run's dataset)")
    p.add_argument("--data-dir", default=None, help="folder of the named datasets (default: the run's, or $SECVFL_DATA_DIR)")
    p.add_argument("--split", default="test", choices=["train", "val", "test"],
                   help="which split of the data to predict (default: test)")
    p.add_argument("--out", type=Path, default=None,
                   help="write per-row predictions as CSV here (row, label, one column per observed party)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from secvfl.algorithms import get_algorithm
    from secvfl.algorithms.missing.base import MissingAlgorithm
    from secvfl.algorithms.missing.eval import evaluate_predictions
    from secvfl.config import TrainConfig
    from secvfl.data import load_dataset
    from secvfl.device import device_here
    from secvfl.runner import _load_checkpoint, build_run, load_config_file

    cfg_file = args.run / "config.toml"
    if not cfg_file.is_file():
        raise ConfigError(f"--run {args.run}: no config.toml there; pass a directory written by `secvfl train --out`")
    cfg = TrainConfig.from_dict(load_config_file(cfg_file))
    # Everything that needs no data is checked first: a mistake costs no loading.
    subsets = issubclass(get_algorithm(cfg.algo), MissingAlgorithm)
    if not subsets and cfg.algo not in _EVERY_PARTY:
        raise UnsupportedError(
            f"{cfg.algo} cannot predict here; secvfl predict takes {', '.join(_EVERY_PARTY)} (with every party) and "
            "laser and its baselines (ensemble, combinatorial, svfl, plugvfl, local-missing: any subset of parties)"
        )
    observed = parse_observed(args.observed, cfg.parties) if args.observed is not None else list(range(cfg.parties))
    if not subsets and observed != list(range(cfg.parties)):
        raise UnsupportedError(
            f"{cfg.algo} cannot predict with a subset of its parties; leave out --observed, or train with --algo laser "
            "(or ensemble, combinatorial, svfl, plugvfl, local-missing) to use secvfl predict --observed"
        )
    if args.out is not None:
        check_output_file(args.out, "--out")
    trained = _trained_schema(args.run)
    # every row present (the subset is chosen below), on this machine's device
    changes = {"p_miss_train": "0", "p_miss_test": "0", "device": device_here(cfg.device)}
    if args.data is not None:
        changes["dataset"] = args.data
    if args.data_dir is not None:
        changes["data_dir"] = args.data_dir
    cfg = replace(cfg, **changes)
    if args.data is not None:
        _check_schema(args.data, load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, val_fraction=cfg.val_fraction,
                                              nan_policy=cfg.nan_policy), trained)
    built = build_run(cfg)
    algo = built.algorithm
    try:
        _load_checkpoint(args.run, built)
    except ConfigError as exc:
        if args.data is None:
            raise
        raise ConfigError(f"--data {args.data} does not fit the model trained in {args.run} ({exc}); pass data "
                          "with the training columns in the same order") from None
    n = built.ctx.rows(args.split)
    if n == 0:
        raise ConfigError(f"the {args.split} split of {cfg.dataset} is empty; choose another --split")
    y = np.asarray(getattr(built.ctx.data, f"y_{args.split}"))
    classes = [str(c) for c in built.ctx.data.classes]
    bytes_before = built.net.stats.bytes_total  # the checkpoint restored the training counters
    if not subsets:
        return _predict_every_party(args, cfg, built, y, classes, bytes_before)
    K = algo.K
    mask = np.zeros((n, K), dtype=bool)
    mask[:, observed] = True
    preds = algo.predict_parties(args.split, mask)
    metrics = evaluate_predictions(preds, y, mask, n_classes=built.ctx.data.n_classes)
    if args.out is not None:
        proba = _party_probabilities(algo, args.split, n, tuple(observed))
        buf = io.StringIO(newline="")
        w = csv.writer(buf)
        header = ["row", "label", *[f"party{k}" for k in observed]]
        if proba is not None:
            header += [f"party{k}:p_{c}" for k in observed for c in classes] + [f"p_{c}" for c in classes]
        w.writerow(header)
        for i in range(n):
            line = [i, int(y[i]), *[int(preds[i, k]) for k in observed]]
            if proba is not None:
                line += [_num(proba[k][i, c]) for k in observed for c in range(len(classes))]
                line += [_num(v) for v in np.mean(np.stack([proba[k][i] for k in observed]), axis=0)]
            w.writerow(line)
        write_output_text(args.out, buf.getvalue(), "--out")
    report = {
        "run": str(args.run), "algo": cfg.algo, "dataset": cfg.dataset, "split": args.split, "rows": n,
        "observed": observed, "absent": [k for k in range(K) if k not in observed],
        "accuracy": metrics.accuracy, "f1_positive": metrics.f1,
        "accuracy_per_party": {f"party{k}": metrics.accuracy_per_party[k] for k in observed},
        "prediction_bytes": built.net.stats.bytes_total - bytes_before,
    }
    print(json.dumps(report, indent=2))
    return 0


_EVERY_PARTY = ("splitnn", "vafl", "fdml")


def _num(v: float) -> str:
    return repr(float(v))


def _party_probabilities(algo, split: str, n: int, observed: tuple[int, ...]) -> dict[int, np.ndarray] | None:  # noqa: ANN001
    """Each observed party's class probabilities on every row of ``split`` (algorithms whose parties each predict
    with probabilities: LASER-VFL); None for the others."""
    if not hasattr(algo, "predict_proba_parties"):
        return None
    out: dict[int, list[np.ndarray]] = {k: [] for k in observed}
    chunk = algo.cfg.eval_batch_size
    for start in range(0, n, chunk):
        ids = np.arange(start, min(n, start + chunk))
        for k, p in algo.predict_proba_parties(split, ids, observed).items():
            out[k].append(np.asarray(p))
    return {k: np.concatenate(v) for k, v in out.items()}


def _predict_every_party(args: argparse.Namespace, cfg, built, y: np.ndarray, classes: list[str],  # noqa: ANN001
                         bytes_before: int) -> int:
    from secvfl.metrics import classification_metrics

    proba = built.algorithm.predict_proba(args.split)
    n = len(y)
    if args.out is not None:
        buf = io.StringIO(newline="")
        w = csv.writer(buf)
        w.writerow(["row", "label", "predicted", *[f"p_{c}" for c in classes]])
        for i in range(n):
            w.writerow([i, int(y[i]), int(np.argmax(proba[i])), *[_num(v) for v in proba[i]]])
        write_output_text(args.out, buf.getvalue(), "--out")
    report = {"run": str(args.run), "algo": cfg.algo, "dataset": cfg.dataset, "split": args.split, "rows": n,
              "observed": list(range(cfg.parties)), "absent": [],
              **{k: v for k, v in classification_metrics(y, proba).items()},
              "prediction_bytes": built.net.stats.bytes_total - bytes_before}
    print(json.dumps(report, indent=2, default=float))
    return 0
