"""`secvfl predict`: predict with a trained run using any subset of its parties (e.g. after a party has left).

Every listed party (``--observed 1,3``) computes its representation of each row and, for LASER-VFL, predicts with
its own predictor for exactly that set of parties; baselines use their own rule (Combinatorial: the predictor of the
set; Ensemble: the vote; Standard VFL / PlugVFL: random guesses when a needed party is absent). Parties that are not
listed take no part and receive nothing.

Rows come from ``--data`` (default: the run's dataset) and ``--split``, loaded and preprocessed exactly as in
training (same loader, same seed, so the same split and the same training-split standardisation).
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from secvfl.errors import ConfigError, UnsupportedError

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


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("predict", help="predict with a trained run and any subset of its parties",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="run directory written by `secvfl train --out DIR`")
    p.add_argument("--observed", required=True, help="parties taking part, e.g. 1,3 (0-based indices)")
    p.add_argument("--data", default=None, help="dataset spec (default: the run's dataset)")
    p.add_argument("--data-dir", default=None, help="folder of the named datasets (default: the run's, or $SECVFL_DATA_DIR)")
    p.add_argument("--split", default="test", choices=["train", "val", "test"])
    p.add_argument("--out", type=Path, default=None, help="write per-row predictions as CSV here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from secvfl.algorithms.missing_base import MissingAlgorithm
    from secvfl.algorithms.missing_eval import evaluate_predictions
    from secvfl.config import TrainConfig
    from secvfl.runner import _load_checkpoint, build_run, load_config_file

    cfg_file = args.run / "config.toml"
    if not cfg_file.is_file():
        raise ConfigError(f"--run {args.run}: no config.toml there; pass a directory written by `secvfl train --out`")
    cfg = TrainConfig.from_dict(load_config_file(cfg_file))
    changes = {"p_miss_train": "0", "p_miss_test": "0"}  # every row present; the subset is chosen below
    if args.data is not None:
        changes["dataset"] = args.data
    if args.data_dir is not None:
        changes["data_dir"] = args.data_dir
    cfg = replace(cfg, **changes)
    built = build_run(cfg)
    algo = built.algorithm
    if not isinstance(algo, MissingAlgorithm):
        raise UnsupportedError(
            f"{cfg.algo} cannot predict with a subset of its parties; train with --algo laser (or ensemble, "
            "combinatorial, svfl, plugvfl, local-missing) to use secvfl predict --observed"
        )
    _load_checkpoint(args.run, built)
    K = algo.K
    observed = parse_observed(args.observed, K)
    n = built.ctx.rows(args.split)
    if n == 0:
        raise ConfigError(f"the {args.split} split of {cfg.dataset} is empty; choose another --split")
    mask = np.zeros((n, K), dtype=bool)
    mask[:, observed] = True
    bytes_before = built.net.stats.bytes_total  # the checkpoint restored the training counters
    preds = algo.predict_parties(args.split, mask)
    y = np.asarray(getattr(built.ctx.data, f"y_{args.split}"))
    metrics = evaluate_predictions(preds, y, mask, n_classes=built.ctx.data.n_classes)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["row", "label", *[f"party{k}" for k in observed]])
            for i in range(n):
                w.writerow([i, int(y[i]), *[int(preds[i, k]) for k in observed]])
    report = {
        "run": str(args.run), "algo": cfg.algo, "dataset": cfg.dataset, "split": args.split, "rows": n,
        "observed": observed, "absent": [k for k in range(K) if k not in observed],
        "accuracy": metrics.accuracy, "f1_positive": metrics.f1,
        "accuracy_per_party": {f"party{k}": metrics.accuracy_per_party[k] for k in observed},
        "prediction_bytes": built.net.stats.bytes_total - bytes_before,
    }
    print(json.dumps(report, indent=2))
    return 0
