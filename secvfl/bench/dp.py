"""`secvfl bench dp` (epoch time with / without DP) and `secvfl bench dp-audit` (empirical epsilon lower bounds).

``dp``: for each dataset, the same split-NN run is built without DP and with each DP mechanism; one warm-up epoch,
then the median of ``--repeats`` timed epochs per configuration. The ratio is DP epoch time / plain epoch time.

``dp-audit``: white-box canary audits (:mod:`protocols.dp.audit`) of the label-DP gradient mechanism (both
per-sample reductions) and of randomized response; each reports the epsilon lower bound next to the claimed one.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from secvfl.bench.common import fix_threads, machine, peak_rss_mb, timed
from secvfl.cli.registries import BENCHES
from secvfl.config import TrainConfig
from secvfl.runner import build_run

__all__ = ["DPBench", "DPAuditBench"]

MECHANISMS: dict[str, dict[str, Any]] = {
    "none": {},
    "labels-gradient": {"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "gradient"},
    "labels-gradient-jacobian": {"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "gradient", "dp_clip": "jacobian"},
    "labels-rr": {"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "rr"},
    "labels-rr-prior": {"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "rr-prior"},
    "labels-alibi": {"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "alibi"},
    "features": {"privacy": "dp", "epsilon": 3.0, "dp_protect": "features"},
}


def _epoch_seconds(cfg: TrainConfig, repeats: int) -> tuple[float, list[float], dict[str, Any] | None]:
    """Median epoch time, every timed epoch, and what the DP layer says it installed (None without DP)."""
    run = build_run(cfg)
    run.algorithm.train_epoch(0)  # warm-up (allocations, first-call overheads)
    times = []
    for epoch in range(1, repeats + 1):
        torch.manual_seed(epoch)
        times.append(timed(lambda e=epoch: run.algorithm.train_epoch(e)))
    dp = next((layer.describe() for layer in run.net.layers if layer.name == "dp"), None)
    return statistics.median(times), times, dp


@BENCHES.register("dp")
class DPBench:
    help = "epoch time with DP / without DP (split-NN; label DP gradient and rr, feature DP) on credit and MNIST"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--datasets", nargs="+", default=["credit", "mnist"], help="datasets timed (secvfl train names)")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--algo", default="splitnn", help="training algorithm")
        p.add_argument("--parties", type=int, default=4, help="number of feature parties")
        p.add_argument("--batch-size", type=int, default=256, help="training rows per batch")
        p.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), choices=list(MECHANISMS),
                       help="DP configurations timed (none: the baseline without DP)")
        p.add_argument("--repeats", type=int, default=2, help="timed epochs per configuration (median reported)")
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
        p.add_argument("--seed", type=int, default=0, help="training seed")

    def run(self, args: argparse.Namespace) -> dict:
        threads = fix_threads(args.threads)
        results: dict[str, Any] = {}
        for dataset in args.datasets:
            rows: dict[str, Any] = {}
            for mech in args.mechanisms:
                cfg = TrainConfig(algo=args.algo, dataset=dataset, data_dir=args.data_dir, parties=args.parties,
                                  batch_size=args.batch_size, epochs=args.repeats + 1, device="cpu", val_fraction=0.0,
                                  seed=args.seed, threads=threads, options=dict(MECHANISMS[mech]))
                median, times, dp = _epoch_seconds(cfg, args.repeats)
                rows[mech] = {"epoch_seconds": round(median, 4), "epochs_timed": [round(t, 4) for t in times],
                              "dp": None if dp is None else {k: dp[k] for k in ("mechanism", "protects", "epsilon")}}
            base = rows.get("none", {}).get("epoch_seconds")
            if base:
                for r in rows.values():
                    r["ratio_to_no_dp"] = round(r["epoch_seconds"] / base, 3)
            results[dataset] = rows
        return {
            "benchmark": "dp",
            "algo": args.algo,
            "parties": args.parties,
            "batch_size": args.batch_size,
            "epsilon": 3.0,
            "threads": threads,
            "results": results,
            "machine": machine(),
            "peak_rss_mb": peak_rss_mb(),
        }


@BENCHES.register("dp-audit")
class DPAuditBench:
    help = "empirical epsilon lower bounds (canary audits) next to the claimed epsilon, label DP gradient and rr"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--epsilon", type=float, default=3.0, help="the claimed epsilon that is audited")
        p.add_argument("--delta", type=float, default=1e-5, help="the claimed delta (gradient mechanism)")
        p.add_argument("--releases", type=int, default=5, help="releases per sample (epochs) in the gradient audit")
        p.add_argument("--trials", type=int, default=1000, help="training runs per world (label 0 / label 1)")
        p.add_argument("--rr-draws", type=int, default=200_000, help="randomized-response draws per label in its audit")
        p.add_argument("--clip", nargs="+", default=["residual", "jacobian"], choices=["residual", "jacobian"],
                       help="clipping rules of the gradient mechanism that are audited")
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
        p.add_argument("--seed", type=int, default=0, help="seed of the audit's trials")

    def run(self, args: argparse.Namespace) -> dict:
        from protocols.dp.audit import audit_label_gradient, audit_randomized_response

        threads = fix_threads(args.threads)
        audits = []
        for clip in args.clip:
            audits.append(audit_label_gradient(epsilon=args.epsilon, delta=args.delta, releases=args.releases,
                                               trials=args.trials, seed=args.seed, clip=clip))
        audits.append(audit_randomized_response(epsilon=args.epsilon, draws=args.rr_draws))
        return {"benchmark": "dp-audit", "threads": threads, "audits": audits, "machine": machine(),
                "peak_rss_mb": peak_rss_mb()}
