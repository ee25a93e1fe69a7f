"""`secvfl privacy-sweep`: train at several epsilons (and seeds) and plot utility against epsilon.

Every ``secvfl train`` flag applies (mechanism, clip norm, epochs, ...); ``inf`` in ``--epsilons`` is the non-private
run with the same settings, drawn as a horizontal line. Writes ``sweep.json`` and ``sweep.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from secvfl.errors import ConfigError

__all__ = ["register", "run", "sweep", "plot_sweep"]


def _eps(text: str) -> float:
    if text.lower() in ("inf", "infinity", "none"):
        return math.inf
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--epsilons takes numbers or inf, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"every epsilon must be > 0 (or inf), got {v}")
    return v


def register(subparsers: argparse._SubParsersAction) -> None:
    from secvfl.cli.train import add_train_arguments

    p = subparsers.add_parser("privacy-sweep", help="utility against epsilon (JSON + PNG)", description=__doc__)
    p.add_argument("--epsilons", type=_eps, nargs="+", default=[0.5, 1, 2, 3, 5, 8, math.inf],
                   help="epsilons to train at; inf = the non-private run (default 0.5 1 2 3 5 8 inf)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds per epsilon (mean and spread reported)")
    p.add_argument("--out", type=Path, required=True, help="folder for sweep.json, sweep.png and the runs")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's directory (summary, PRIVACY.md)")
    add_train_arguments(p)
    p.set_defaults(func=run)


def _metric(test: dict[str, float]) -> tuple[str, float]:
    for key in ("auc", "accuracy"):
        if key in test:
            return key, float(test[key])
    raise ConfigError(f"the run reported no AUC or accuracy (got {sorted(test)})")


def sweep(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Train every (epsilon, seed); returns the JSON-able result."""
    from dataclasses import replace

    from secvfl.cli.train import config_from_args
    from secvfl.runner import run_training

    base = config_from_args(args)
    privacy = base.option("privacy") or "none"
    if privacy == "none":
        base = replace(base, options={**base.options, "privacy": "dp"})
    points = []
    metric_name = None
    for eps in args.epsilons:
        values, runs = [], []
        for seed in args.seeds:
            opts = dict(base.options)
            if math.isinf(eps):
                opts = {"privacy": "none"}
                opts.update({k: v for k, v in base.options.items() if k not in _dp_option_names()})
            else:
                opts["epsilon"] = eps
                opts.pop("noise_multiplier", None)
            cfg = replace(base, seed=seed, options=opts)
            tag = f"eps-{'inf' if math.isinf(eps) else f'{eps:g}'}-seed-{seed}"
            out = args.out / "runs" / tag if args.keep_runs else None
            log(f"privacy-sweep: epsilon {eps:g}, seed {seed}")
            s = run_training(cfg, out=out, progress=False, log=lambda *_: None)
            metric_name, value = _metric(s["metrics"]["test"])
            values.append(value)
            runs.append({"seed": seed, "test": s["metrics"]["test"], "privacy": s.get("privacy"),
                         "wall_seconds": s["wall_seconds"]})
        points.append({
            "epsilon": None if math.isinf(eps) else eps,
            "private": not math.isinf(eps),
            "metric": metric_name,
            "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values,
            "runs": runs,
        })
    non_private = next((p for p in points if not p["private"]), None)
    first_priv = next((r["privacy"] for p in points if p["private"] for r in p["runs"]), None) or {}
    return {
        "algo": base.algo,
        "dataset": base.dataset,
        "parties": base.parties,
        "epochs": base.epochs,
        "batch_size": base.batch_size,
        "metric": metric_name,
        "mechanism": first_priv.get("mechanism"),
        "protects": first_priv.get("protects"),
        "accountant": first_priv.get("accountant"),
        "seeds": list(args.seeds),
        "non_private": None if non_private is None else {"mean": non_private["mean"], "std": non_private["std"]},
        "points": points,
        "command": "secvfl " + " ".join(sys.argv[1:]),
    }


def _dp_option_names() -> set[str]:
    from protocols.dp.plugin import DP_FLAGS

    return set(DP_FLAGS) | {"privacy"}


def plot_sweep(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    priv = [p for p in result["points"] if p["private"]]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    if priv:
        xs = [p["epsilon"] for p in priv]
        ax.errorbar(xs, [p["mean"] for p in priv], yerr=[p["std"] for p in priv], marker="o", capsize=3,
                    label=f"DP ({result.get('mechanism')}, protects {result.get('protects')})")
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
    if result.get("non_private"):
        m = result["non_private"]["mean"]
        ax.axhline(m, color="k", linestyle="--", label=f"non-private ({m:.3f})")
    ax.set_xlabel("epsilon")
    ax.set_ylabel(f"test {result.get('metric') or 'metric'}")
    ax.set_title(f"{result['algo']} on {result['dataset']}, {result['parties']} parties, {result['epochs']} epochs")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from secvfl.io import write_json_atomic

    args.out.mkdir(parents=True, exist_ok=True)
    result = sweep(args)
    write_json_atomic(args.out / "sweep.json", result)
    plot_sweep(result, args.out / "sweep.png")
    for p in result["points"]:
        eps = "inf" if p["epsilon"] is None else f"{p['epsilon']:g}"
        print(f"epsilon {eps:>5}: test {p['metric']} {p['mean']:.4f} +- {p['std']:.4f}")
    print(f"wrote {args.out / 'sweep.json'} and {args.out / 'sweep.png'}")
    return 0

