"""``secvfl reproduce online-ablation``: the ablations of event-driven online VFL (Wang et al., ICLR 2025).

Four one-parameter sweeps of DLR, the paper's method, each cell an ordinary training run through
:func:`secvfl.experiments.online.run_cell` (same stream, models and step size as ``secvfl reproduce online``):

- ``p``: activation probability of DLR-Random, p in {0.25, 0.5, 0.75, 1}, l = 10, alpha = 0.95, non-stationary
  stream (Section 5.4, Table 3: accumulated error, client compute, MB; per-client activation rates: Appendix D.3,
  Table 5). p = 1 activates every party every round, so its cell is DLR-Full (Table 3's p = 1.00 row is Table 2's
  DLR-Full: 0.0553, 4558.20 s, 1953.12 MB).
- ``gamma``: threshold of DLR-Event, Gamma in {-0.2, 0, 0.2, 0.4, 0.6, 0.8} (the grid Gamma was tuned from, Section
  5.1), l = 10, alpha = 0.95 (Section 5.4, Table 4 gives Gamma = -0.2, 0.2, 0.6; Table 5 their per-client rates).
  The stream is not stated for Table 4; the non-stationary one is taken, as for Table 3 in the same section. Its
  MB agree with its rates: (MB / 1953.12 - 1/2) x 2 = 0.730, 0.241, 0.042, Table 5's client means.
- ``window``: window length l of DLR-Full in {10, 50, 100, 150}, alpha = 0.95, the concept-drift (non-stationary)
  stream (Appendix D.1, Figure 5: curves only, no numbers; the text: "the DLR is stable across different window
  lengths").
- ``alpha``: attenuation alpha of DLR-Full in {0.99, 0.95, 0.9}, l = 100 (Appendix D.1, Figure 6: curves only; the
  text: "better results were obtained for alpha = 0.95 and 0.9"). The stream is not stated; non-stationary, as for l.

Cells shared between sweeps run once (DLR-Full l = 10 is p = 1 and l = 10; l = 100, alpha = 0.95 is in both D.1
sweeps): 15 distinct cells per seed. The paper has no OGD in these tables, so none is run here (OGD beside DLR under
partial activation is ``secvfl reproduce online``). Every cell is ``OUT/runs/STEM`` (checkpointed per block: an
interrupted reproduction continues its cells; a run left there with other settings is started again) and its result
``OUT/cells/STEM.json``.

Outputs in ``--out-dir``: ``results.json`` (settings, every cell, one table per sweep with the paper's numbers, the
paper's statements checked from ours), ``table.md`` (one markdown table per sweep, ours beside the paper's, the sample
counts stated) and ``ablation_<sweep>.png`` (accumulated error against the swept parameter, ours and the paper's where
it gives numbers; and our run-time error curves, like the paper's Figures 4-6). "MB" is the training messages'
payload, as in ``secvfl reproduce online``.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from secvfl.cli.registries import REPRODUCTIONS
from secvfl.errors import ConfigError
from secvfl.experiments.online import PAPER_SAMPLES, run_cell
from secvfl.io import write_json_atomic, write_text_atomic
from secvfl.plotting import new_figure, save_figure_atomic
from secvfl.rundir import runs_root

__all__ = ["ABLATIONS", "STREAM", "Ablation", "CellKey", "check_statements", "markdown_tables", "parse_grid",
           "run_ablations"]

STREAM = "nonstationary"
PARTIES = 4
DLR_WINDOW, DLR_ALPHA = 10, 0.95  # Section 5.4's DLR setting


@dataclass(frozen=True)
class CellKey:
    """What a cell runs: DLR on ``STREAM`` with this activation, window length and alpha."""

    activation: str  # an --activation spec
    window: int
    alpha: float

    @property
    def stem(self) -> str:
        act = self.activation.replace(":", "")
        return f"dlr-{STREAM}-{act}-l{self.window}-a{self.alpha:g}"


@dataclass(frozen=True)
class Ablation:
    name: str  # the --grid name
    symbol: str  # the column heading
    title: str
    setting: str
    source: str
    values: tuple[float, ...]
    paper: dict[float, dict[str, Any]]  # value -> error, seconds, mb, rates (per client; Table 5)
    says: str  # the paper's own words on the sweep

    def cell(self, value: float) -> CellKey:
        if self.name == "p":
            return CellKey("full" if value == 1 else f"random:{value:g}", DLR_WINDOW, DLR_ALPHA)
        if self.name == "gamma":
            return CellKey(f"event:{value:g}", DLR_WINDOW, DLR_ALPHA)
        if self.name == "window":
            return CellKey("full", int(value), DLR_ALPHA)
        return CellKey("full", 100, value)


_FULL_MB = 1953.12  # Table 2's DLR-Full (non-stationary)
ABLATIONS: dict[str, Ablation] = {a.name: a for a in (
    Ablation("p", "p", "Activation probability p", "DLR-Random, l = 10, alpha = 0.95",
             "Section 5.4, Table 3; rates: Appendix D.3, Table 5", (0.25, 0.5, 0.75, 1.0),
             {0.25: {"error": 0.0622, "seconds": 1903.91, "mb": 1220.75,
                     "rates": [0.249747, 0.250473, 0.250277, 0.250142]},
              0.5: {"error": 0.0561, "seconds": 2872.79, "mb": 1465.02,
                    "rates": [0.499507, 0.499811, 0.500266, 0.500179]},
              0.75: {"error": 0.0560, "seconds": 3788.07, "mb": 1709.04,
                     "rates": [0.749623, 0.750214, 0.750155, 0.750257]},
              1.0: {"error": 0.0553, "seconds": 4558.20, "mb": _FULL_MB, "rates": [1.0, 1.0, 1.0, 1.0]}},
             "a small activation probability proportionally decreases the computational cost for the client, "
             "albeit with a slight increase in the accumulated error rate"),
    Ablation("gamma", "Gamma", "Event threshold Gamma", "DLR-Event, l = 10, alpha = 0.95",
             "Section 5.4, Table 4 (Gamma = -0.2, 0.2, 0.6; grid: Section 5.1); rates: Appendix D.3, Table 5",
             (-0.2, 0.0, 0.2, 0.4, 0.6, 0.8),
             {-0.2: {"error": 0.0595, "seconds": 3752.07, "mb": 1689.42,
                     "rates": [0.355166, 0.982896, 0.985216, 0.596582]},
              0.2: {"error": 0.0738, "seconds": 1852.15, "mb": 1211.55,
                    "rates": [0.006346, 0.461186, 0.456317, 0.038649]},
              0.6: {"error": 0.1057, "seconds": 928.67, "mb": 1017.76,
                    "rates": [0.000006, 0.066729, 0.101827, 0.000204]}},
             "as the threshold increased, fewer clients were activated per round, leading to an overall increase "
             "in the framework's accumulated error rate while reducing its computational cost and communication "
             "costs"),
    Ablation("window", "l", "Window length l", "DLR-Full, alpha = 0.95", "Appendix D.1, Figure 5 (curves only)",
             (10, 50, 100, 150), {}, "the DLR is stable across different window lengths"),
    Ablation("alpha", "alpha", "Attenuation coefficient alpha", "DLR-Full, l = 100",
             "Appendix D.1, Figure 6 (curves only)", (0.99, 0.95, 0.9), {},
             "better results were obtained for alpha = 0.95 and 0.9"),
)}
WINDOW_SPREAD = 0.2  # "stable across window lengths": (max - min) / min of the accumulated error at most this
RATE_TOLERANCE = 0.02  # Random: measured mean activation rate within this of p
BYTES_TOLERANCE = 0.05  # bytes within 5 % of (1 + rate) / 2 of Full's (as for claim 3 of ``reproduce online``)


def _check_value(name: str, value: float) -> str | None:
    if name == "p" and not 0 < value <= 1:
        return "p must be in (0, 1]"
    if name == "gamma" and not math.isfinite(value):
        return "Gamma must be a finite number"
    if name == "window" and not (1 <= value <= 10_000 and value == int(value)):
        return "l must be an integer in [1, 10000]"
    if name == "alpha" and not 0 < value <= 1:
        return "alpha must be in (0, 1]"
    return None


def parse_grid(items: list[str] | None) -> dict[str, tuple[float, ...]]:
    """``NAME=V1,V2,...`` items replacing those sweeps' grids; one clear line for anything malformed."""
    grids: dict[str, tuple[float, ...]] = {}
    for item in items or []:
        name, sep, rest = item.partition("=")
        if not sep:
            raise ConfigError(f"--grid {item}: expected NAME=V1,V2,... with NAME one of {', '.join(ABLATIONS)}")
        if name not in ABLATIONS:
            raise ConfigError(f"--grid {item}: unknown sweep {name!r}; choose from {', '.join(ABLATIONS)}")
        if name in grids:
            raise ConfigError(f"--grid names {name} twice; give all its values in one NAME=V1,V2,...")
        values = []
        for text in rest.split(","):
            try:
                value = float(text)
            except ValueError:
                raise ConfigError(f"--grid {item}: {text!r} is not a number") from None
            problem = _check_value(name, value)
            if problem:
                raise ConfigError(f"--grid {item}: {problem}, got {text}")
            if value in values:
                raise ConfigError(f"--grid {item}: {text} is given twice")
            values.append(value)
        grids[name] = tuple(values)
    return grids


def _mean_rows(ablation: Ablation, values: tuple[float, ...], cells: dict[CellKey, list[dict[str, Any]]],
               full_bytes: float | None) -> list[dict[str, Any]]:
    rows = []
    for value in values:
        key = ablation.cell(value)
        rs = cells.get(key, [])
        if not rs:
            continue
        errs = [c["accumulated_error"] for c in rs]
        rate = statistics.fmean(c["activation_rate"] for c in rs)
        parties = sorted(rs[0]["activation_rate_by_party"])
        payload = statistics.fmean(c["payload_bytes"] for c in rs)
        rows.append({
            "value": value, "activation": key.activation, "window": key.window, "alpha": key.alpha,
            "error": statistics.fmean(errs),
            "error_std": statistics.stdev(errs) if len(errs) > 1 else 0.0, "payload_bytes": payload,
            "wire_bytes": statistics.fmean(c["wire_bytes"] for c in rs),
            "seconds": statistics.fmean(c["client_compute_seconds"] for c in rs), "rate": rate,
            "rate_by_party": [statistics.fmean(c["activation_rate_by_party"][p] for c in rs) for p in parties],
            "bytes_vs_full": payload / full_bytes if full_bytes else None, "bytes_model": (1 + rate) / 2,
            "samples": rs[0]["samples"], "seeds": len(rs)})
    return rows


def _statement(text: str, evidence: dict[str, bool]) -> dict[str, Any]:
    held = bool(evidence) and all(evidence.values())
    return {"text": text, "held": held,
            "verdict": "held" if held else ("not held" if evidence else "not checked (cells missing)"),
            "evidence": [f"{k}: {'yes' if v else 'NO'}" for k, v in evidence.items()]}


def check_statements(name: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The paper's statements on sweep ``name``, each held or not from ``rows`` (sorted by the swept value).

    p: the measured rate is p (within RATE_TOLERANCE); client compute rises with p; the smallest p has the largest
    accumulated error ("a slight increase"). Gamma: the rate, client compute and bytes fall as Gamma rises and the
    error rises. p and Gamma: bytes are (1 + rate) / 2 of Full's (embeddings always, gradients at the rate), within
    BYTES_TOLERANCE. l: the error's spread (max - min) / min is at most WINDOW_SPREAD. alpha: 0.99 has a larger error
    than 0.95 and 0.9.
    """
    rows = sorted(rows, key=lambda r: r["value"])
    out = []

    def rising(key: str) -> dict[str, bool]:
        return {f"{key} {a[key]:.4g} -> {b[key]:.4g} ({a['value']:g} -> {b['value']:g})": b[key] > a[key]
                for a, b in zip(rows, rows[1:], strict=False)}

    if name in ("p", "gamma"):
        if name == "p":
            out.append(_statement("the activation rate is p", {
                f"p {r['value']:g}: rate {r['rate']:.4f}": abs(r["rate"] - r["value"]) <= RATE_TOLERANCE
                for r in rows}))
            out.append(_statement("client compute rises with p", rising("seconds")))
            if len(rows) > 1:
                lowest = rows[0]
                out.append(_statement("the smallest p has the largest accumulated error", {
                    f"p {lowest['value']:g}: {lowest['error']:.4f} vs p {r['value']:g}: {r['error']:.4f}":
                        lowest["error"] > r["error"] for r in rows[1:]}))
            else:
                out.append(_statement("the smallest p has the largest accumulated error", {}))
        else:
            out.append(_statement("fewer parties are activated as Gamma rises",
                                  {k: not v for k, v in rising("rate").items()}))
            out.append(_statement("the accumulated error rises with Gamma", rising("error")))
            out.append(_statement("client compute and bytes fall as Gamma rises", {
                **{k: not v for k, v in rising("seconds").items()},
                **{k: not v for k, v in rising("payload_bytes").items()}}))
        out.append(_statement("bytes are (1 + rate) / 2 of Full's", {
            f"{r['value']:g}: {r['bytes_vs_full']:.3f} of Full (model {r['bytes_model']:.3f})":
                abs(r["bytes_vs_full"] / r["bytes_model"] - 1) <= BYTES_TOLERANCE
            for r in rows if r["bytes_vs_full"] is not None}))
    elif name == "window":
        evidence = {}
        if len(rows) > 1:
            lo, hi = min(r["error"] for r in rows), max(r["error"] for r in rows)
            evidence[f"errors {lo:.4f} .. {hi:.4f}, spread {(hi - lo) / lo:.2f} (at most {WINDOW_SPREAD})"
                     if lo else "errors all 0"] = lo > 0 and (hi - lo) / lo <= WINDOW_SPREAD
        out.append(_statement("DLR is stable across window lengths", evidence))
    else:
        by = {r["value"]: r["error"] for r in rows}
        evidence = {f"alpha 0.99: {by[0.99]:.4f} vs alpha {a:g}: {by[a]:.4f}": by[0.99] > by[a]
                    for a in (0.95, 0.9) if 0.99 in by and a in by}
        out.append(_statement("alpha = 0.95 and 0.9 do better than 0.99", evidence))
    return out


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f}"


def _paper_rate(paper: dict[str, Any]) -> float:
    return statistics.fmean(paper["rates"])


def markdown_tables(sweeps: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, sweep in sweeps.items():
        ab = ABLATIONS[name]
        rows = sweep["rows"]
        samples = f"{rows[0]['samples']:,}" if rows else "no"
        seeds = rows[0]["seeds"] if rows else 0
        lines += [f"### {ab.title}: {ab.setting}, {STREAM} stream ({ab.source})", "",
                  f"Ours at {samples} samples per cell ({seeds} seed{'s' if seeds != 1 else ''}), the paper at "
                  f"{PAPER_SAMPLES:,}. Our Full round is 2,048 payload bytes (4 x 64 float32 each way), twice the "
                  f"paper's 1,024 (its MB / 2,000,000): compare bytes as fractions of Full.", "",
                  f"| {ab.symbol} | accumulated error (ours) | (paper) | MB (ours) | MB (ours, scaled to 2M) | (paper) "
                  "| bytes / Full (ours) | (1 + rate) / 2 | client compute s (ours) | (paper) "
                  "| activation rate (ours) | (paper) | per party (ours) | (paper, Table 5) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            p = ab.paper.get(r["value"])
            err = f"{r['error']:.4f}" + (f" ± {r['error_std']:.4f}" if r["seeds"] > 1 else "")
            scaled = r["payload_bytes"] * PAPER_SAMPLES / max(1, r["samples"])
            ratio = "–" if r["bytes_vs_full"] is None else f"{r['bytes_vs_full']:.3f}"
            ours_parties = " / ".join(f"{v:.3f}" for v in r["rate_by_party"])
            if p:
                paper = (f"{p['error']:.4f}", f"{p['mb']:,.2f}", f"{p['seconds']:,.2f}", f"{_paper_rate(p):.3f}",
                         " / ".join(f"{v:.3f}" for v in p["rates"]))
            else:
                paper = ("–",) * 5
            lines.append(f"| {r['value']:g} | {err} | {paper[0]} | {_mb(r['payload_bytes'])} | {_mb(scaled)} "
                         f"| {paper[1]} | {ratio} | {r['bytes_model']:.3f} | {r['seconds']:.1f} | {paper[2]} "
                         f"| {r['rate']:.3f} | {paper[3]} | {ours_parties} | {paper[4]} |")
        lines += ["", f"The paper: \"{ab.says}\".", ""]
        for s in sweep["statements"]:
            lines.append(f"- **{s['verdict']}**: {s['text']}. " + "; ".join(s["evidence"]))
        lines.append("")
    return "\n".join(lines)


def plot_sweep(name: str, sweep: dict[str, Any], cells: dict[CellKey, list[dict[str, Any]]], path: Path) -> None:
    ab = ABLATIONS[name]
    rows = sorted(sweep["rows"], key=lambda r: r["value"])
    fig = new_figure((11.0, 4.0))
    ax_sweep, ax_run = fig.subplots(1, 2)
    ax_sweep.errorbar([r["value"] for r in rows], [r["error"] for r in rows], yerr=[r["error_std"] for r in rows],
                      marker="o", capsize=3, label=f"ours ({rows[0]['samples']:,} samples)" if rows else "ours")
    paper = sorted((v, p["error"]) for v, p in ab.paper.items() if v in sweep["values"])
    if paper:
        ax_sweep.plot([v for v, _ in paper], [e for _, e in paper], "s--", color="tab:red",
                      label=f"paper ({PAPER_SAMPLES:,} samples)")
    ax_sweep.set(xlabel=ab.symbol, ylabel="accumulated error",
                 title=f"{ab.title}" + ("" if ab.paper else f" (paper: {ab.source.split(', ')[1]})"))
    for r in rows:
        c = min(cells[ab.cell(r["value"])], key=lambda c: c["seed"])  # the first seed's curve
        pts = c["runtime_error"]
        ax_run.plot([q[0] for q in pts], [q[1] for q in pts], label=f"{ab.symbol} = {r['value']:g}")
    ax_run.set(xlabel="samples seen", ylabel="run-time error (prequential, per window)",
               title=f"{ab.setting}, {STREAM}")
    for ax in (ax_sweep, ax_run):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure_atomic(fig, path)


def run_ablations(*, out_dir: Path, dataset: str, data_dir: str | None, samples: int, block: int | None,
                  seeds: list[int], jobs: int, lr: float, metric_window: int | None,
                  grids: dict[str, tuple[float, ...]] | None = None, sweeps: tuple[str, ...] = tuple(ABLATIONS),
                  force: bool = False, log=print) -> dict[str, Any]:  # noqa: ANN001
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
    if len(set(seeds)) < len(seeds):
        raise ConfigError(f"--seeds {' '.join(map(str, seeds))}: give each seed once")
    grids = grids or {}
    unused = sorted(set(grids) - set(sweeps))
    if unused:
        raise ConfigError(f"--grid {unused[0]}=...: that sweep is not in --ablations {' '.join(sweeps)}")
    metric_window = metric_window or min(20_000, max(1, samples // 20))
    common = {"dataset": dataset, "samples": samples, "block": block, "lr": lr, "metric_window": metric_window,
              "stream": STREAM}
    values = {name: grids.get(name, ABLATIONS[name].values) for name in sweeps}
    keys = list(dict.fromkeys(ABLATIONS[n].cell(v) for n in sweeps for v in values[n]))

    todo, cells = [], []
    for key in keys:
        settings = common | {"activation": key.activation, "online_window": key.window, "online_alpha": key.alpha}
        for seed in seeds:
            stem = f"{key.stem}-seed{seed}"
            cell_file, run_dir = out_dir / "cells" / f"{stem}.json", out_dir / "runs" / stem
            if cell_file.is_file() and not force:
                done = json.loads(cell_file.read_text())
                if done.get("settings") == settings:
                    cells.append(done)
                    continue
            if force:
                shutil.rmtree(run_dir, ignore_errors=True)
            todo.append((key, seed, settings, cell_file, run_dir))
    todo.sort(key=lambda t: -t[0].window)  # the longest windows cost the most per sample: start them first
    kwargs = {"dataset": dataset, "data_dir": data_dir, "samples": samples, "block": block, "lr": lr,
              "metric_window": metric_window}
    t0 = time.perf_counter()

    def finish(result: dict[str, Any], settings: dict[str, Any], path: Path) -> None:
        result["cell"], result["settings"] = path.stem, settings
        write_json_atomic(path, result)
        cells.append(result)
        log(f"  done {path.stem}: accumulated error {result['accumulated_error']:.4f}, activation rate "
            f"{result['activation_rate']:.3f} ({result['wall_s']:.0f} s)")

    def cell_args(key: CellKey, seed: int, run_dir: Path) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (("dlr", key.activation.split(":")[0], STREAM, seed),
                {**kwargs, "run_dir": run_dir, "activation_spec": key.activation,
                 "window": {"online_window": key.window, "online_alpha": key.alpha}})

    if jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {}
            for key, seed, settings, f, rd in todo:
                args, kw = cell_args(key, seed, rd)
                futures[pool.submit(run_cell, *args, **kw)] = (settings, f)
            for fut in as_completed(futures):
                finish(fut.result(), *futures[fut])
    else:
        for key, seed, settings, f, rd in todo:
            args, kw = cell_args(key, seed, rd)
            finish(run_cell(*args, **kw), settings, f)
    wall = time.perf_counter() - t0

    by_key: dict[CellKey, list[dict[str, Any]]] = {}
    for c in cells:
        s = c["settings"]
        by_key.setdefault(CellKey(s["activation"], s["online_window"], s["online_alpha"]), []).append(c)
    full = [c["payload_bytes"] for c in cells if c["settings"]["activation"] == "full"]
    full_bytes = statistics.fmean(full) if full else None  # DLR-Full sends the same messages whatever l and alpha
    results: dict[str, dict[str, Any]] = {}
    for name in sweeps:
        ab = ABLATIONS[name]
        rows = _mean_rows(ab, values[name], by_key, full_bytes)
        results[name] = {"parameter": ab.symbol, "setting": ab.setting, "stream": STREAM, "source": ab.source,
                         "values": list(values[name]), "rows": rows,
                         "paper": [{"value": v, **p} for v, p in ab.paper.items() if v in values[name]],
                         "paper_says": ab.says, "statements": check_statements(name, rows)}
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown_tables(results)
    write_text_atomic(out_dir / "table.md", md)
    plots = []
    for name, sweep in results.items():
        if sweep["rows"]:
            plot_sweep(name, sweep, by_key, out_dir / f"ablation_{name}.png")
            plots.append(str(out_dir / f"ablation_{name}.png"))
    result = {
        "reproduction": "online-ablation",
        "settings": common | {"seeds": seeds, "jobs": jobs, "parties": PARTIES, "algo": "dlr"},
        "ablations": results, "paper_samples": PAPER_SAMPLES,
        "cells": sorted(cells, key=lambda c: c["cell"]),
        "cells_run_now": len(todo), "wall_seconds_now": round(wall, 1), "threads_per_run": 1,
        "files": [str(out_dir / "results.json"), str(out_dir / "table.md"), *plots],
    }
    write_json_atomic(out_dir / "results.json", result)
    log(md)
    return result


@REPRODUCTIONS.register("online-ablation")
class OnlineAblationReproduction:
    help = ("Ablations of event-driven online VFL (Wang et al., Section 5.4 and Appendix D): DLR's activation "
            "probability p, event threshold Gamma, window length l and alpha on the non-stationary MNIST stream, "
            "beside the paper's Tables 3-5")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--dataset", default="mnist", help="the streamed dataset (the paper: mnist)")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--samples", type=int, default=50_000,
                       help="stream samples per cell (the paper's: 2,000,000)")
        p.add_argument("--block", type=int, default=None,
                       help="samples per checkpointed block of a cell (default min(samples, 10000))")
        p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds per cell (means reported)")
        p.add_argument("--jobs", type=int, default=1, help="cells in parallel (each on one thread)")
        p.add_argument("--lr", type=float, default=0.01, help="every party's step size")
        p.add_argument("--metric-window", type=int, default=None,
                       help="samples per run-time error point (default min(20000, samples/20))")
        p.add_argument("--ablations", nargs="+", choices=list(ABLATIONS), default=list(ABLATIONS), metavar="NAME",
                       help=f"the sweeps to run: {', '.join(ABLATIONS)}")
        p.add_argument("--grid", nargs="+", default=None, metavar="NAME=V1,V2",
                       help="replace a sweep's values, e.g. p=0.25,1 gamma=-0.2,0.6 (defaults: the paper's "
                            + "; ".join(f"{n} {','.join(f'{v:g}' for v in a.values)}" for n, a in ABLATIONS.items())
                            + ")")
        p.add_argument("--out-dir", type=Path, default=None,
                       help="where results.json, table.md, the plots, cells/ and runs/ go "
                            "(default runs/reproduce-online-ablation)")
        p.add_argument("--force", action="store_true", help="rerun cells whose result file exists")

    def run(self, args: argparse.Namespace) -> dict:
        if not (args.lr > 0 and math.isfinite(args.lr)):
            raise ConfigError(f"--lr must be a finite number > 0, got {args.lr}")
        if args.metric_window is not None and args.metric_window < 1:
            raise ConfigError(f"--metric-window must be at least 1, got {args.metric_window}")
        grids = parse_grid(args.grid)
        out_dir = args.out_dir or runs_root() / "reproduce-online-ablation"
        result = run_ablations(out_dir=out_dir, dataset=args.dataset,
                               data_dir=args.data_dir or os.environ.get("SECVFL_DATA_DIR"), samples=args.samples,
                               block=args.block, seeds=list(args.seeds), jobs=args.jobs, lr=args.lr,
                               metric_window=args.metric_window, grids=grids,
                               sweeps=tuple(dict.fromkeys(args.ablations)), force=args.force)
        return {k: v for k, v in result.items() if k != "cells"}
