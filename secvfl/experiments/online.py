"""``secvfl reproduce online``: the nine online VFL cells of Wang et al. (ICLR 2025), Tables 1 and 2.

OGD, SLR and DLR, each under Full, Random (p = 0.5) and Event (Gamma = 0) activation, on a stationary and a
non-stationary replayed MNIST stream (4 parties, each a quarter of the flattened image; party model one linear layer
-> 64 ReLU, label-party model 256 ReLU -> 10), ``--samples`` stream samples per cell. Every cell is an ordinary
``secvfl train`` run (``--algo ogd|slr|dlr``) in ``OUT/runs/CELL-seedS`` (checkpointed: an interrupted
reproduction continues its cells), its result in ``OUT/cells/CELL-seedS.json``.

The paper's settings, and where they come from:

- p = 0.5: Table 3's p = 0.5 row is the DLR-Random cell of Table 2 (0.0561, 1465.02 MB).
- Gamma = 0: not stated. The Event cells' bytes give their activation rate (bytes = embeddings + rate x
  gradients, with Full = both and Random p = 0.5 = 0.75 x Full): DLR/SLR-Event ~0.58 (stationary), between
  Table 4's Gamma = 0.2 (rate 0.24, Table 5) and Gamma = -0.2 (0.73); 0 is the grid point between them. The rate
  depends on the features' scaling (here: standardised pixels), so ours is reported beside the paper's.
- DLR: l = 10, alpha = 0.95 (the setting of the paper's ablations, Section 5.4). SLR: l = 40 (its bytes are
  40.0 x OGD's in Tables 1 and 2, and SLR sends the window of l embeddings and gradients). Step size: 0.01 (tuned
  in the paper, value not given; ``--lr``).

Outputs in ``--out-dir``: ``results.json`` (settings, every cell and seed, the mean table, the paper's numbers and
the three claims), ``table.md`` (ours beside the paper's), ``error_stationary.png`` and
``error_nonstationary.png`` (run-time and accumulated prequential error against samples, one line per cell).
The claims are decided from the numbers (:func:`check_claims`). "MB" is the payload (tensor bytes) of the training
messages, the quantity the paper's MB matches (Full: a whole number of KiB per round); wire bytes with headers are in
the JSON too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from secvfl.cli.registries import REPRODUCTIONS
from secvfl.errors import ConfigError
from secvfl.io import write_json_atomic, write_text_atomic
from secvfl.plotting import new_figure, save_figure_atomic
from secvfl.rundir import runs_root

__all__ = ["ALGOS", "ACTIVATIONS", "STREAMS", "PAPER", "cell_name", "check_claims", "markdown_table",
           "run_cell", "run_reproduction"]

ALGOS = ("ogd", "slr", "dlr")
ACTIVATIONS = {"full": "full", "random": "random:0.5", "event": "event:0"}
STREAMS = ("stationary", "nonstationary")
WINDOWS = {"slr": {"online_window": 40}, "dlr": {"online_window": 10, "online_alpha": 0.95}}
SLR_BYTES_FACTOR = 40.0  # the paper's SLR / OGD bytes (78,125.02 / 1,953.13 MB)

# Tables 1 and 2 (2,000,000 samples): accumulated error, client compute seconds, MB; activation rate implied by MB.
PAPER: dict[str, dict[str, dict[str, float]]] = {
    "stationary": {
        "ogd-full": {"error": 0.0575, "seconds": 4339.20, "mb": 1953.13},
        "ogd-random": {"error": 0.0696, "seconds": 2652.38, "mb": 1465.04},
        "ogd-event": {"error": 0.1027, "seconds": 3182.46, "mb": 1686.86},
        "slr-full": {"error": 0.0846, "seconds": 4565.42, "mb": 78125.02},
        "slr-random": {"error": 0.1083, "seconds": 2682.47, "mb": 58599.36},
        "slr-event": {"error": 0.0945, "seconds": 2992.73, "mb": 61565.37},
        "dlr-full": {"error": 0.0618, "seconds": 4565.42, "mb": 1953.13},
        "dlr-random": {"error": 0.0649, "seconds": 2682.47, "mb": 1464.73},
        "dlr-event": {"error": 0.0718, "seconds": 2992.73, "mb": 1539.13},
    },
    "nonstationary": {
        "ogd-full": {"error": 0.0592, "seconds": 4406.14, "mb": 1953.12},
        "ogd-random": {"error": 0.0788, "seconds": 2822.29, "mb": 1464.71},
        "ogd-event": {"error": 0.1191, "seconds": 3168.34, "mb": 1543.32},
        "slr-full": {"error": 0.0481, "seconds": 3497.49, "mb": 78124.61},
        "slr-random": {"error": 0.1159, "seconds": 2172.44, "mb": 58589.34},
        "slr-event": {"error": 0.1118, "seconds": 2103.50, "mb": 61748.22},
        "dlr-full": {"error": 0.0553, "seconds": 4558.20, "mb": 1953.12},
        "dlr-random": {"error": 0.0561, "seconds": 2872.79, "mb": 1465.02},
        "dlr-event": {"error": 0.0681, "seconds": 2698.96, "mb": 1413.52},
    },
}
PAPER_SAMPLES = 2_000_000


def _paper_rate(stream: str, cell: str) -> float:
    """Mean activation rate implied by the paper's MB: (MB / MB_full - 1/2) * 2 (embeddings are half of Full)."""
    full = PAPER[stream][cell.split("-")[0] + "-full"]["mb"]
    return round((PAPER[stream][cell]["mb"] / full - 0.5) * 2, 3)


def cell_name(algo: str, activation: str, stream: str) -> str:
    return f"{algo}-{activation}-{stream}"


def run_cell(algo: str, activation: str, stream: str, seed: int, *, dataset: str, data_dir: str | None,
             samples: int, block: int, lr: float, metric_window: int, run_dir: Path,
             activation_spec: str | None = None, window: dict[str, Any] | None = None) -> dict[str, Any]:
    """One cell, one seed: an ordinary training run (resumed when ``run_dir`` holds a checkpoint).

    ``activation_spec`` (e.g. ``random:0.25``) and ``window`` (``online_window``/``online_alpha``) replace the
    main table's ACTIVATIONS[activation] and WINDOWS[algo] for the ablations (``secvfl reproduce online-ablation``).
    """
    from secvfl.bench.common import fix_threads
    from secvfl.config import TrainConfig
    from secvfl.runner import run_training

    fix_threads(1)
    t0 = time.perf_counter()
    spec = activation_spec or ACTIVATIONS[activation]
    options = {"stream": stream, "samples": block, "activation": spec, "online_lr": lr,
               "metric_window": metric_window, **(WINDOWS.get(algo, {}) if window is None else window)}
    cfg = TrainConfig(algo=algo, dataset=dataset, data_dir=data_dir, parties=4, seed=seed, device="cpu",
                      threads=1, epochs=samples // block, options=options)
    if run_dir.exists() and not _checkpointed_run_of(run_dir, cfg):
        shutil.rmtree(run_dir)  # killed before its first checkpoint, or started with other settings: not this cell
    if (run_dir / "summary.json").is_file():  # finished, but killed before its cell file was written
        summary = json.loads((run_dir / "summary.json").read_text())
    elif run_dir.exists():
        summary = run_training(TrainConfig(), resume=run_dir, progress=False, log=lambda *a, **k: None)
    else:
        summary = run_training(cfg, run_dir, progress=False, log=lambda *a, **k: None)
    online = summary["online"]
    rates = online["activation_rate"]
    curve = online["windowed_error"] or online["block_error"]
    seen, wrong, accumulated = 0, 0.0, []
    for end, err in curve:  # windows of equal length: the accumulated error at each window's end
        wrong += err * (end - seen)
        seen = end
        accumulated.append([end, wrong / end])
    return {
        "algo": algo, "activation": activation, "activation_spec": spec, "stream": stream,
        "seed": seed, "samples": online["samples"], "accumulated_error": online["accumulated_error"],
        "payload_bytes": online["train_payload_bytes"], "wire_bytes": online["train_bytes"],
        "client_compute_seconds": online["client_compute_seconds_total"],
        "client_compute_seconds_by_party": online["client_compute_seconds"],
        "activation_rate": statistics.fmean(rates.values()) if rates else float("nan"),
        "activation_rate_by_party": rates, "runtime_error": curve, "accumulated_error_curve": accumulated,
        "test": summary.get("metrics", {}).get("test", {}), "options": options, "wall_s": time.perf_counter() - t0,
    }


def _checkpointed_run_of(run_dir: Path, cfg: Any) -> bool:
    """Whether ``run_dir`` holds a checkpoint of a run of ``cfg`` (same algorithm, data, seed, length, options): only
    such a run may be resumed as the cell (an earlier --samples or grid left others behind)."""
    from secvfl.runner import read_run_config

    if not (run_dir / "checkpoints" / "latest.json").is_file():
        return False
    try:
        saved = read_run_config(run_dir)
    except (ConfigError, OSError, ValueError):
        return False
    same = ("algo", "dataset", "parties", "seed", "epochs")
    return all(getattr(saved, k) == getattr(cfg, k) for k in same) and \
        all(saved.options.get(k) == v for k, v in cfg.options.items())


def _mean_cells(cells: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """stream -> "algo-activation" -> means over seeds (and the seeds' spread of the error)."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for stream in STREAMS:
        for algo in ALGOS:
            for act in ACTIVATIONS:
                rs = [c for c in cells if (c["algo"], c["activation"], c["stream"]) == (algo, act, stream)]
                if not rs:
                    continue
                errs = [c["accumulated_error"] for c in rs]
                table.setdefault(stream, {})[f"{algo}-{act}"] = {
                    "error": statistics.fmean(errs), "error_std": statistics.stdev(errs) if len(errs) > 1 else 0.0,
                    "payload_bytes": statistics.fmean(c["payload_bytes"] for c in rs),
                    "wire_bytes": statistics.fmean(c["wire_bytes"] for c in rs),
                    "seconds": statistics.fmean(c["client_compute_seconds"] for c in rs),
                    "rate": statistics.fmean(c["activation_rate"] for c in rs), "seeds": len(rs),
                    "samples": rs[0]["samples"]}
    return table


def check_claims(table: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """The paper's three qualitative claims, each held or not held from the numbers in ``table`` (per stream).

    1. DLR's accumulated error is below OGD's under Random and under Event activation.
    2. SLR costs about 40x OGD's bytes: every SLR / OGD payload ratio within 25 % of 40.
    3. Partial activation cuts bytes and client compute in proportion to the activation rate a: passive parties
       still send embeddings, so bytes should be (E + a G) / (E + G) of Full's (E, G: Full's embedding and gradient
       bytes, equal here), within 5 %; client compute (a passive party still computes its embedding) should fall
       below Full's, but by no more than the activation rate: a <= seconds / Full's seconds < 1.
    """
    claims = []
    for stream, cells in table.items():
        def get(cell: str, key: str, cells: dict = cells) -> float | None:
            return cells[cell][key] if cell in cells else None

        pairs = [(act, get(f"dlr-{act}", "error"), get(f"ogd-{act}", "error")) for act in ("random", "event")]
        evidence = {f"{act}: dlr {d:.4f} vs ogd {o:.4f}": d < o for act, d, o in pairs if d is not None and o is not None}
        claims.append(_claim(1, stream, "DLR-Random/Event below OGD-Random/Event in accumulated error", evidence))

        evidence = {}
        for act in ACTIVATIONS:
            s, o = get(f"slr-{act}", "payload_bytes"), get(f"ogd-{act}", "payload_bytes")
            if s is not None and o:
                ratio = s / o
                evidence[f"{act}: SLR/OGD bytes {ratio:.1f}x"] = abs(ratio / SLR_BYTES_FACTOR - 1) <= 0.25
        claims.append(_claim(2, stream, f"SLR ~{SLR_BYTES_FACTOR:.0f}x the bytes of OGD", evidence))

        evidence = {}
        for algo in ALGOS:
            full_b, full_s = get(f"{algo}-full", "payload_bytes"), get(f"{algo}-full", "seconds")
            for act in ("random", "event"):
                b, s, a = (get(f"{algo}-{act}", k) for k in ("payload_bytes", "seconds", "rate"))
                if None in (full_b, full_s, b, s, a) or not full_b or not full_s:
                    continue
                want = (1 + a) / 2  # embeddings always, gradients at rate a; equal sizes
                fb, fs = b / full_b, s / full_s
                evidence[f"{algo}-{act}: rate {a:.3f}, bytes {fb:.3f} of Full (model {want:.3f})"] = \
                    abs(fb / want - 1) <= 0.05
                evidence[f"{algo}-{act}: client compute {fs:.3f} of Full (expected in [{a:.3f}, 1))"] = a <= fs < 1
        claims.append(_claim(3, stream, "partial activation cuts client compute and bytes in proportion to the "
                                        "activation rate", evidence))
    return claims


def _claim(number: int, stream: str, text: str, evidence: dict[str, bool]) -> dict[str, Any]:
    held = bool(evidence) and all(evidence.values())
    return {"claim": number, "stream": stream, "text": text, "held": held,
            "verdict": "held" if held else ("not held" if evidence else "not checked (cells missing)"),
            "evidence": [f"{k}: {'yes' if v else 'NO'}" for k, v in evidence.items()]}


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f}"


def markdown_table(table: dict[str, dict[str, dict[str, float]]], claims: list[dict[str, Any]]) -> str:
    lines = []
    for stream, cells in table.items():
        samples = next(iter(cells.values()))["samples"]
        lines += [f"### {stream} stream: ours at {samples:,} samples per cell, the paper at {PAPER_SAMPLES:,}", "",
                  "| cell | accumulated error (ours) | (paper) | MB (ours) | MB (ours, scaled to 2M) | (paper) "
                  "| client compute s (ours) | (paper) | activation rate (ours) | (paper, from its MB) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for cell, c in cells.items():
            p = PAPER[stream][cell]
            err = f"{c['error']:.4f}" + (f" ± {c['error_std']:.4f}" if c["seeds"] > 1 else "")
            scaled = c["payload_bytes"] * PAPER_SAMPLES / max(1, c["samples"])
            lines.append(f"| {cell} | {err} | {p['error']:.4f} | {_mb(c['payload_bytes'])} | {_mb(scaled)} "
                         f"| {p['mb']:,.2f} | {c['seconds']:.1f} | {p['seconds']:,.2f} | {c['rate']:.3f} "
                         f"| {_paper_rate(stream, cell):.3f} |")
        lines.append("")
    lines += ["### The paper's claims, from these numbers", ""]
    for c in claims:
        lines.append(f"- **{c['verdict']}** ({c['stream']}): {c['text']}. " + "; ".join(c["evidence"]))
    return "\n".join(lines) + "\n"


def plot_stream(cells: list[dict[str, Any]], stream: str, path: Path) -> None:
    fig = new_figure((11.0, 4.0))
    ax_run, ax_acc = fig.subplots(1, 2)
    styles = {"full": "-", "random": "--", "event": ":"}
    colours = {"ogd": "tab:blue", "slr": "tab:orange", "dlr": "tab:green"}
    for algo in ALGOS:
        for act in ACTIVATIONS:
            rs = [c for c in cells if (c["algo"], c["activation"], c["stream"]) == (algo, act, stream)]
            if not rs:
                continue
            c = min(rs, key=lambda r: r["seed"])  # the first seed's curves
            for ax, key in ((ax_run, "runtime_error"), (ax_acc, "accumulated_error_curve")):
                pts = c[key]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[act], color=colours[algo],
                        label=f"{algo.upper()}-{act.capitalize()}")
    ax_run.set(xlabel="samples seen", ylabel="run-time error (prequential, per window)", title=f"{stream}: run-time")
    ax_acc.set(xlabel="samples seen", ylabel="accumulated error", title=f"{stream}: accumulated")
    for ax in (ax_run, ax_acc):
        ax.grid(alpha=0.3)
    ax_acc.legend(fontsize=7, ncol=3)
    save_figure_atomic(fig, path)


def run_reproduction(*, out_dir: Path, dataset: str, data_dir: str | None, samples: int, block: int | None,
                     seeds: list[int], jobs: int, lr: float, metric_window: int | None, force: bool = False,
                     algos: tuple[str, ...] = ALGOS, activations: tuple[str, ...] = tuple(ACTIVATIONS),
                     log=print) -> dict[str, Any]:  # noqa: ANN001
    if samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {samples}")
    block = block or min(samples, 10_000)
    if block < 1 or samples % block:
        raise ConfigError(f"--samples ({samples}) must be a whole number of --block ({block}) samples; "
                          f"choose --block dividing --samples")
    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    if not seeds:
        raise ConfigError("--seeds needs at least one seed")
    unknown = [a for a in algos if a not in ALGOS]
    if unknown or not algos:
        raise ConfigError(f"--algos {' '.join(unknown)}: choose from {', '.join(ALGOS)}")
    unknown = [a for a in activations if a not in ACTIVATIONS]
    if unknown or not activations:
        raise ConfigError(f"--activations {' '.join(unknown)}: choose from {', '.join(ACTIVATIONS)}")
    # the paper averages every 20,000 samples; a shorter run gets about 20 points per curve
    metric_window = metric_window or min(20_000, max(1, samples // 20))
    settings = {"dataset": dataset, "samples": samples, "block": block, "lr": lr, "metric_window": metric_window}
    todo, cells = [], []
    for stream in STREAMS:
        for algo in ALGOS:
            for act in ACTIVATIONS:
                for seed in seeds:
                    stem = f"{cell_name(algo, act, stream)}-seed{seed}"
                    f = out_dir / "cells" / f"{stem}.json"
                    if f.is_file() and not force:
                        done = json.loads(f.read_text())
                        if done.get("settings") == settings:
                            cells.append(done)  # (also those of --algos not asked for now: the table is complete)
                            continue
                    if algo not in algos or act not in activations:
                        continue
                    if force and (out_dir / "runs" / stem).exists():
                        shutil.rmtree(out_dir / "runs" / stem)
                    todo.append((algo, act, stream, seed, f, out_dir / "runs" / stem))
    # SLR (l embeddings per party per round) first, so the pool does not end on a long straggler
    todo.sort(key=lambda t: t[0] != "slr")
    kwargs = {"dataset": dataset, "data_dir": data_dir, "samples": samples, "block": block, "lr": lr,
              "metric_window": metric_window}
    t0 = time.perf_counter()

    def finish(result: dict[str, Any], path: Path) -> None:
        result["settings"] = settings
        write_json_atomic(path, result)
        cells.append(result)
        log(f"  done {cell_name(result['algo'], result['activation'], result['stream'])} seed {result['seed']}: "
            f"accumulated error {result['accumulated_error']:.4f} ({result['wall_s']:.0f} s)")

    if jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run_cell, a, act, s, seed, run_dir=rd, **kwargs): f
                       for a, act, s, seed, f, rd in todo}
            for fut in as_completed(futures):
                finish(fut.result(), futures[fut])
    else:
        for a, act, s, seed, f, rd in todo:
            finish(run_cell(a, act, s, seed, run_dir=rd, **kwargs), f)
    wall = time.perf_counter() - t0
    table = _mean_cells(cells)
    claims = check_claims(table)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown_table(table, claims)
    write_text_atomic(out_dir / "table.md", md)
    plots = []
    for stream in STREAMS:
        if any(c["stream"] == stream for c in cells):
            plot_stream(cells, stream, out_dir / f"error_{stream}.png")
            plots.append(str(out_dir / f"error_{stream}.png"))
    result = {
        "reproduction": "online", "settings": settings | {"seeds": seeds, "jobs": jobs, "parties": 4,
                                                          "activations": ACTIVATIONS, "windows": WINDOWS},
        "table": table, "paper": PAPER, "paper_samples": PAPER_SAMPLES, "claims": claims,
        "cells": sorted(cells, key=lambda c: (c["stream"], c["algo"], c["activation"], c["seed"])),
        "cells_run_now": len(todo), "wall_seconds_now": round(wall, 1), "threads_per_run": 1,
        "files": [str(out_dir / "results.json"), str(out_dir / "table.md"), *plots],
    }
    write_json_atomic(out_dir / "results.json", result)
    log(md)
    return result


@REPRODUCTIONS.register("online")
class OnlineReproduction:
    help = ("Tables 1-2 of event-driven online VFL (Wang et al.): OGD/SLR/DLR x Full/Random/Event x stationary/"
            "non-stationary MNIST streams; accumulated error, bytes, client compute, the paper's claims")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--dataset", default="mnist", help="the streamed dataset (the paper: mnist)")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--samples", type=int, default=200_000, help="stream samples per cell (the paper: 2,000,000)")
        p.add_argument("--block", type=int, default=None,
                       help="samples per checkpointed block of a cell (default min(samples, 10000))")
        p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds per cell (means reported)")
        p.add_argument("--jobs", type=int, default=1, help="cells in parallel (each on one thread)")
        p.add_argument("--lr", type=float, default=0.01, help="every party's step size")
        p.add_argument("--metric-window", type=int, default=None,
                       help="samples per run-time error point (default min(20000, samples/20))")
        p.add_argument("--out-dir", type=Path, default=None,
                       help="where results.json, table.md, the plots, cells/ and runs/ go "
                            "(default runs/reproduce-online)")
        p.add_argument("--force", action="store_true", help="rerun cells whose result file exists")
        p.add_argument("--algos", nargs="+", default=list(ALGOS), metavar="ALGO",
                       help=f"train only these algorithms' cells now ({', '.join(ALGOS)}); cells already in "
                            f"--out-dir with the same settings still enter the table")
        p.add_argument("--activations", nargs="+", default=list(ACTIVATIONS), metavar="ACTIVATION",
                       help=f"train only these activations' cells now ({', '.join(ACTIVATIONS)}); e.g. one process "
                            f"per activation to use more cores")

    def run(self, args: argparse.Namespace) -> dict:
        if not (args.lr > 0 and math.isfinite(args.lr)):
            raise ConfigError(f"--lr must be a finite number > 0, got {args.lr}")
        if args.metric_window is not None and args.metric_window < 1:
            raise ConfigError(f"--metric-window must be at least 1, got {args.metric_window}")
        out_dir = args.out_dir or runs_root() / "reproduce-online"
        result = run_reproduction(out_dir=out_dir, dataset=args.dataset,
                                  data_dir=args.data_dir or os.environ.get("SECVFL_DATA_DIR"),
                                  samples=args.samples, block=args.block, seeds=list(args.seeds), jobs=args.jobs,
                                  lr=args.lr, metric_window=args.metric_window, force=args.force,
                                  algos=tuple(args.algos), activations=tuple(args.activations))
        return {k: v for k, v in result.items() if k not in ("cells", "paper")}
