"""`secvfl privacy-sweep`: train at several epsilons (and seeds) and plot utility against epsilon.

Every ``secvfl train`` flag applies (clip, accountant, epochs, ...); ``--mechanisms gradient rr rr-prior alibi`` (the
default: all label-DP mechanisms) draws one curve per mechanism; ``inf`` in ``--epsilons`` is the non-private run with
the same settings, drawn as a horizontal line. Writes ``sweep.json``, ``sweep.png`` and ``sweep.md`` (a markdown table:
mean +- std per mechanism and epsilon, the loss against the non-private run, and which mechanism ``--dp-mechanism auto``
uses for this task) into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from secvfl.errors import ConfigError
from secvfl.plotting import new_figure, save_figure_atomic

__all__ = ["register", "run", "sweep", "plot_sweep", "sweep_table"]

LABEL_MECHANISMS = ["gradient", "rr", "rr-prior", "alibi"]
# argparse dests of the sweep itself (--out is not a train option either); everything else is a train flag.
_OWN = {"epsilons", "seeds", "mechanisms", "keep_runs"}
CURVE_NAMES = {"gradient": "gradient mechanism", "rr": "randomized response", "rr-prior": "RR with prior (LP-2ST)",
               "alibi": "ALIBI"}


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
    p.add_argument("--mechanisms", nargs="+", choices=LABEL_MECHANISMS, default=None,
                   help="one curve per DP mechanism (default: all four with --dp-protect labels, gradient with features)")
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

    from protocols.dp.choice import choose_mechanism
    from protocols.dp.config import LABEL_RELEASE_MECHANISMS
    from protocols.dp.options import DPOptions
    from secvfl.cli.train import config_from_args
    from secvfl.runner import run_training

    # the DP flags given describe every private run of the sweep (each sets its own mechanism and epsilon)
    given = {k: v for k, v in vars(args).items() if k not in _OWN}
    base = config_from_args(argparse.Namespace(**{**given, "privacy": "dp"}))
    dp = base.options_for(DPOptions)
    features = dp.dp_protect == "features"
    if args.mechanisms:
        mechanisms = list(args.mechanisms)
    elif dp.dp_mechanism not in (None, "auto"):
        mechanisms = [dp.dp_mechanism]
    else:
        mechanisms = ["gradient"] if features else list(LABEL_MECHANISMS)
        if base.epochs < 2:  # two stages need two epochs; said here rather than failing half-way through the sweep
            mechanisms.remove("rr-prior")
            log("privacy-sweep: rr-prior left out: it trains in two stages and needs --epochs >= 2")
    if features and mechanisms != ["gradient"]:
        raise ConfigError("feature DP has one mechanism: use --mechanisms gradient with --dp-protect features")
    if "rr-prior" in mechanisms and base.epochs < 2:
        raise ConfigError(f"rr-prior trains in two stages and needs --epochs >= 2 (got {base.epochs}); raise --epochs "
                          "or leave rr-prior out of --mechanisms")
    metric_name: str | None = None
    n_classes: int | None = None
    n_train = 0

    def train(opts: dict[str, Any], seed: int, tag: str) -> tuple[float, dict[str, Any]]:
        nonlocal metric_name, n_classes, n_train
        cfg = replace(base, seed=seed, options=opts)
        out = args.out / "runs" / f"{tag}-seed-{seed}" if args.keep_runs else None
        log(f"privacy-sweep: {tag}, seed {seed}")
        s = run_training(cfg, out=out, progress=False, log=lambda *_: None)
        metric_name, value = _metric(s["metrics"]["test"])
        n_classes = s.get("data", {}).get("n_classes", n_classes)
        n_train = s.get("data", {}).get("n_train", n_train)
        privacy = s.get("privacy")
        return value, {"seed": seed, "test": s["metrics"]["test"], "privacy": privacy,
                       "utility_warning": (privacy or {}).get("utility_warning"), "wall_seconds": s["wall_seconds"]}

    curves = []
    for mech in mechanisms:
        points = []
        for eps in (e for e in args.epsilons if not math.isinf(e)):
            opts = {**base.options, "privacy": "dp", "epsilon": eps, "dp_mechanism": mech}
            opts.pop("noise_multiplier", None)
            if mech in LABEL_RELEASE_MECHANISMS:  # flags of the gradient mechanism do not apply to them
                for key in ("dp_clip", "dp_clip_norm", "dp_head_weight", "dp_denoise", "dp_accountant", "delta"):
                    opts.pop(key, None)
            if mech != "rr-prior":
                opts.pop("dp_stage1_fraction", None)
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
    auto = None
    if n_classes is not None:
        auto = [{"epsilon": e, "mechanism": choose_mechanism(
                    protects="features" if features else "labels", n_classes=n_classes, epochs=base.epochs,
                    epsilon=e, n_train=n_train)[0]} for e in args.epsilons if not math.isinf(e)]
    return {
        "algo": base.algo,
        "dataset": base.dataset,
        "n_classes": n_classes,
        "protects": "features" if features else "labels",
        "auto_mechanism": auto,
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
    from protocols.dp.options import DPOptions
    from secvfl.options import option_names

    return option_names(DPOptions)


def plot_sweep(result: dict[str, Any], path: Path) -> None:
    from matplotlib.ticker import NullFormatter

    fig = new_figure((6.4, 4.2), dpi=120)
    ax = fig.subplots()
    xs_all: list[float] = []
    for curve in result["curves"]:
        pts = curve["points"]
        if not pts:
            continue
        xs = [p["epsilon"] for p in pts]
        xs_all += xs
        label = CURVE_NAMES.get(curve["mechanism"], curve["mechanism"])
        ax.errorbar(xs, [p["mean"] for p in pts], yerr=[p["std"] for p in pts], marker="o", capsize=3,
                    label=f"{label} (protects {curve.get('protects') or 'labels'})")
    chosen = _auto_points(result)
    if chosen:
        ax.plot([p["epsilon"] for p in chosen], [p["mean"] for p in chosen], color="tab:gray", alpha=0.35, lw=7,
                zorder=0, label="the default (--dp-mechanism auto)")
    if xs_all:
        ax.set_xscale("log")
        ticks = sorted(set(xs_all))
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{x:g}" for x in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    if result.get("non_private"):
        m = result["non_private"]["mean"]
        ax.axhline(m, color="k", linestyle="--", label=f"non-private ({m:.3f})")
    ax.set_xlabel(f"epsilon ({'feature' if result.get('protects') == 'features' else 'label'} DP)")
    ax.set_ylabel(f"test {_metric_name(result)} (mean +- std over {len(result['seeds'])} seeds)")
    ax.set_title(f"{result['algo']} on {result['dataset']}: {result['parties']} parties, {result['epochs']} epochs, "
                 f"batch {result['batch_size']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    save_figure_atomic(fig, path)


def _auto_points(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The points of the mechanism ``--dp-mechanism auto`` uses at each epsilon (with its name)."""
    curves = {c["mechanism"]: {p["epsilon"]: p for p in c["points"]} for c in result["curves"]}
    out = []
    for choice in result.get("auto_mechanism") or []:
        p = curves.get(choice["mechanism"], {}).get(choice["epsilon"])
        if p is not None:
            out.append({**p, "mechanism": choice["mechanism"]})
    return out


def _metric_name(result: dict[str, Any]) -> str:
    metric = result.get("metric") or "metric"
    return "AUC" if metric == "auc" else metric


def _cell(p: dict[str, Any] | None, base: float | None) -> str:
    if p is None:
        return "-"
    cell = f"{p['mean']:.3f} ± {p['std']:.3f}"
    if base is not None:
        cell += f" ({p['mean'] - base:+.3f})"
    collapsed = sum(1 for r in p["runs"] if r.get("utility_warning"))
    if collapsed:
        cell += f" collapsed {collapsed}/{len(p['runs'])}"
    return cell


def sweep_table(result: dict[str, Any]) -> str:
    """Markdown: one row per mechanism, one column per epsilon (mean +- std and the change against non-private)."""
    eps = sorted({p["epsilon"] for c in result["curves"] for p in c["points"]})
    base = result["non_private"]["mean"] if result.get("non_private") else None
    head = ["mechanism", *[f"epsilon {e:g}" for e in eps]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for curve in result["curves"]:
        by_eps = {p["epsilon"]: p for p in curve["points"]}
        lines.append("| " + " | ".join([curve["mechanism"], *[_cell(by_eps.get(e), base) for e in eps]]) + " |")
    chosen = {p["epsilon"]: p for p in _auto_points(result)}
    if chosen:
        cells = [_cell(chosen.get(e), base) + (f" = {chosen[e]['mechanism']}" if e in chosen else "") for e in eps]
        lines.append("| " + " | ".join(["**auto (default)**", *cells]) + " |")
    if base is not None:
        p = result["non_private"]
        lines.append(f"| non-private | {p['mean']:.3f} ± {p['std']:.3f} |" + " |" * (len(eps) - 1))
    seeds = " ".join(str(s) for s in result["seeds"])
    lines += ["", f"Test {_metric_name(result)}, mean ± std over seeds {seeds} (in brackets: the change against the "
                  f"non-private run with the same settings); {result['algo']} on {result['dataset']}, {result['parties']} parties, "
                  f"{result['epochs']} epochs, batch {result['batch_size']}, lr {result['lr']:g}. \"collapsed\": runs "
                  "whose test metric ended near chance (the run's utility warning)."]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from secvfl.io import write_json_atomic, write_text_atomic

    args.out.mkdir(parents=True, exist_ok=True)
    result = sweep(args)
    write_json_atomic(args.out / "sweep.json", result)
    plot_sweep(result, args.out / "sweep.png")
    table = sweep_table(result)
    write_text_atomic(args.out / "sweep.md", table)
    print(table, end="")
    print(f"wrote {args.out / 'sweep.json'}, {args.out / 'sweep.png'} and {args.out / 'sweep.md'}")
    return 0

