"""`secvfl privacy-sweep`: train at several epsilons (and seeds) and plot utility against epsilon.

Every ``secvfl train`` flag applies (clip, accountant, epochs, ...); ``--mechanisms gradient rr`` draws one curve per
mechanism; ``inf`` in ``--epsilons`` is the non-private run with the same settings, drawn as a horizontal line.
Writes ``sweep.json`` and ``sweep.png`` into ``--out``.
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
    p.add_argument("--mechanisms", nargs="+", choices=["gradient", "rr"], default=None,
                   help="one curve per label-DP mechanism (default: --dp-mechanism, i.e. gradient)")
    p.add_argument("--out", type=Path, required=True, help="folder for sweep.json, sweep.png and the runs")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's directory (summary, PRIVACY.md)")
    add_train_arguments(p)
    p.set_defaults(func=run)


def _metric(test: dict[str, float]) -> tuple[str, float]:
    for key in ("auc", "accuracy"):
        if key in test:
            return key, float(test[key])
    raise ConfigError(f"the run reported no AUC or accuracy (got {sorted(test)})")


def _point(eps: float, values: list[float], metric: str | None, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "epsilon": None if math.isinf(eps) else eps,
        "private": not math.isinf(eps),
        "metric": metric,
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
        "runs": runs,
    }


def sweep(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Train every (mechanism, epsilon, seed), and the non-private run once per seed; returns the JSON-able result."""
    from dataclasses import replace

    from secvfl.cli.train import config_from_args
    from secvfl.runner import run_training

    base = config_from_args(args)
    mechanisms = list(args.mechanisms or [base.option("dp_mechanism") or "gradient"])
    metric_name: str | None = None

    def train(opts: dict[str, Any], seed: int, tag: str) -> tuple[float, dict[str, Any]]:
        nonlocal metric_name
        cfg = replace(base, seed=seed, options=opts)
        out = args.out / "runs" / f"{tag}-seed-{seed}" if args.keep_runs else None
        log(f"privacy-sweep: {tag}, seed {seed}")
        s = run_training(cfg, out=out, progress=False, log=lambda *_: None)
        metric_name, value = _metric(s["metrics"]["test"])
        return value, {"seed": seed, "test": s["metrics"]["test"], "privacy": s.get("privacy"),
                       "wall_seconds": s["wall_seconds"]}

    curves = []
    for mech in mechanisms:
        points = []
        for eps in (e for e in args.epsilons if not math.isinf(e)):
            opts = {**base.options, "privacy": "dp", "epsilon": eps, "dp_mechanism": mech}
            opts.pop("noise_multiplier", None)
            if mech == "rr":  # flags of the gradient mechanism do not apply to randomized response
                for key in ("dp_clip", "dp_clip_norm", "dp_head_weight", "dp_denoise", "dp_accountant", "delta"):
                    opts.pop(key, None)
            done = [train(opts, seed, f"{mech}-eps-{eps:g}") for seed in args.seeds]
            points.append(_point(eps, [v for v, _ in done], metric_name, [r for _, r in done]))
        first = next((r["privacy"] for p in points for r in p["runs"] if r["privacy"]), None) or {}
        curves.append({"mechanism": mech, "protects": first.get("protects"), "accountant": first.get("accountant"),
                       "points": points})
    non_private = None
    if any(math.isinf(e) for e in args.epsilons):
        opts = {k: v for k, v in base.options.items() if k not in _dp_option_names()}
        opts["privacy"] = "none"
        done = [train(opts, seed, "non-private") for seed in args.seeds]
        non_private = _point(math.inf, [v for v, _ in done], metric_name, [r for _, r in done])
    return {
        "algo": base.algo,
        "dataset": base.dataset,
        "parties": base.parties,
        "epochs": base.epochs,
        "batch_size": base.batch_size,
        "lr": base.lr,
        "metric": metric_name,
        "seeds": list(args.seeds),
        "non_private": non_private,
        "curves": curves,
        "command": "secvfl " + " ".join(sys.argv[1:]),
    }


def _dp_option_names() -> set[str]:
    from protocols.dp.plugin import DP_FLAGS

    return set(DP_FLAGS) | {"privacy"}


def plot_sweep(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    xs_all: list[float] = []
    for curve in result["curves"]:
        pts = curve["points"]
        if not pts:
            continue
        xs = [p["epsilon"] for p in pts]
        xs_all += xs
        label = {"gradient": "gradient mechanism", "rr": "randomized response"}.get(curve["mechanism"], curve["mechanism"])
        ax.errorbar(xs, [p["mean"] for p in pts], yerr=[p["std"] for p in pts], marker="o", capsize=3,
                    label=f"{label} (protects {curve.get('protects') or 'labels'})")
    if xs_all:
        ax.set_xscale("log")
        ticks = sorted(set(xs_all))
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{x:g}" for x in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    if result.get("non_private"):
        m = result["non_private"]["mean"]
        ax.axhline(m, color="k", linestyle="--", label=f"non-private ({m:.3f})")
    ax.set_xlabel("epsilon (label DP)")
    ax.set_ylabel(f"test {result.get('metric') or 'metric'} (mean +- std over {len(result['seeds'])} seeds)")
    ax.set_title(f"{result['algo']} on {result['dataset']}: {result['parties']} parties, {result['epochs']} epochs, "
                 f"batch {result['batch_size']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
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
    for curve in result["curves"]:
        for p in curve["points"]:
            print(f"{curve['mechanism']:>8} epsilon {p['epsilon']:>5g}: test {p['metric']} {p['mean']:.4f} +- {p['std']:.4f}")
    if result["non_private"]:
        p = result["non_private"]
        print(f"non-private: test {p['metric']} {p['mean']:.4f} +- {p['std']:.4f}")
    print(f"wrote {args.out / 'sweep.json'} and {args.out / 'sweep.png'}")
    return 0

