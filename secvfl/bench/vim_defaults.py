"""`secvfl bench vim-defaults`: the VIM algorithms against VAFL at the command line's defaults, in bytes to the same
accuracy, and whether any of them diverges.

Each case is a dataset split among a number of parties (``mnist:7``: MNIST's 28 pixel rows cut into 7 strips of 4).
Every method trains with only ``--algo``, ``--dataset``, ``--parties``, ``--seed`` and ``--epochs`` set, so every other
setting is the default a user gets (``--options`` overrides some for exploring). After every epoch the run records
the test accuracy and the exact cumulative bytes of *training* messages (the network's byte counter around each
epoch's training; evaluation traffic is not counted). A run whose loss becomes non-finite, or that a party stops
with a divergence error, is recorded as diverged with the epoch and batch.

Bytes to the same accuracy, per case: the target is the lower of VAFL's and VIMADMM's best test accuracies, so both
reach it; for each method, the cumulative MB at the end of its first epoch at or above the target (not interpolated).
The ratio ``vafl / vimadmm`` above 1 means VIMADMM needed fewer bytes.

Outputs: a JSON file (every curve, the machine, the load) and a markdown table (``--out-dir``, default
``docs/vim``: ``defaults.json``, ``defaults.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import torch

from secvfl.bench.common import fix_threads, machine
from secvfl.cli.registries import BENCHES
from secvfl.config import TrainConfig
from secvfl.data import Dataset
from secvfl.errors import ConfigError, SecvflError
from secvfl.io import write_json_atomic, write_text_atomic

__all__ = ["Case", "parse_case", "run_method", "bytes_to", "summarise", "markdown", "VIMDefaultsBench"]

MB = 1e6
METHODS = ("vafl", "vimsgd", "vimadmm", "vimadmm-j")


@dataclass(frozen=True)
class Case:
    dataset: str
    parties: int

    @property
    def label(self) -> str:
        return f"{self.dataset}:{self.parties}"


def parse_case(text: str) -> Case:
    name, _, parties = text.partition(":")
    if not name or not parties.isdigit() or int(parties) < 1:
        raise ConfigError(f"case {text!r}: write DATASET:PARTIES, e.g. mnist:7")
    return Case(name, int(parties))


class _Stop(Exception):
    """Raised from the progress callback to end a bounded epoch early."""


def run_method(case: Case, algo: str, *, epochs: int, seed: int = 0, data_dir: str | None = None,
               options: dict[str, Any] | None = None, max_batches: int | None = None, data: Dataset | None = None,
               log=print) -> dict[str, Any]:  # noqa: ANN001 - a print-like callable
    """Train ``algo`` on ``case`` at the defaults; the per-epoch curve (test accuracy, cumulative training MB) and
    whether and where it diverged. ``max_batches``: stop each epoch after that many batches (divergence checks).
    ``data``: the case's dataset as ``load_dataset(case.dataset, data_dir, seed=seed)`` gives it, already loaded
    (runs on the same data share one load; it is not modified)."""
    from secvfl.data import make_partition
    from secvfl.runner import build_run

    opts = {k: v for k, v in (options or {}).items() if k not in TrainConfig.__dataclass_fields__}
    core = {k: v for k, v in (options or {}).items() if k in TrainConfig.__dataclass_fields__}
    cfg = TrainConfig(algo=algo, dataset=case.dataset, parties=case.parties, epochs=epochs, seed=seed,
                      data_dir=data_dir, device="cpu", threads=1, options=opts, **core)
    t0 = time.perf_counter()
    prepared = None
    if data is not None:
        data = dataclasses.replace(data, notes=list(data.notes))  # the run adds its own notes
        prepared = (data, make_partition(data.n_features, cfg.parties, image_shape=data.image_shape,
                                         image_split=cfg.image_split))
    run = build_run(cfg, prepared)
    algorithm, stats = run.algorithm, run.net.stats
    curve: list[dict[str, Any]] = []
    trained_bytes = 0
    status: dict[str, Any] = {"diverged": False}
    for epoch in range(epochs):
        torch.manual_seed(cfg.seed * 100_003 + epoch)  # as the runner seeds each epoch
        run.net.start_epoch(epoch)
        batches = 0

        def tick(loss: float) -> None:
            nonlocal batches
            batches += 1
            if not math.isfinite(loss):
                raise _Stop(f"the loss became {loss}")
            if max_batches is not None and batches >= max_batches:
                raise _Stop("")

        before = stats.bytes_total
        loss = math.nan
        try:
            loss = algorithm.train_epoch(epoch, tick)["loss"]
        except _Stop as stop:
            if str(stop):
                status = {"diverged": True, "epoch": epoch + 1, "batch": batches, "reason": str(stop)}
        except SecvflError as exc:  # a party's own divergence check (e.g. the ADMM z-update)
            status = {"diverged": True, "epoch": epoch + 1, "batch": batches, "reason": str(exc)}
        trained_bytes += stats.bytes_total - before
        if status["diverged"]:
            break
        test = algorithm.evaluate("test")
        point = {"epoch": epoch + 1, "batches": batches, "train_loss": loss, "test_accuracy": test["accuracy"],
                 "train_mb": round(trained_bytes / MB, 4)}
        if "auc" in test:
            point["test_auc"] = test["auc"]
        curve.append(point)
        log(f"  {case.label:10s} {algo:10s} epoch {epoch + 1}: test accuracy {test['accuracy']:.4f}, "
            f"{trained_bytes / MB:.2f} MB")
    if status["diverged"]:
        log(f"  {case.label:10s} {algo:10s} DIVERGED at epoch {status['epoch']}, batch {status['batch']}: "
            f"{status['reason'][:160]}")
    return {"case": case.label, "algo": algo, "epochs": epochs, "options": options or {},
            "batches_per_epoch": algorithm.batches_per_epoch(), "curve": curve, **status,
            "wall_s": round(time.perf_counter() - t0, 1)}


def bytes_to(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first epoch at or above ``target`` test accuracy, with its cumulative MB (None: never reached)."""
    for point in curve:
        if point["test_accuracy"] >= target - 1e-12:
            return {"epoch": point["epoch"], "mb": point["train_mb"]}
    return None


def _best(run: dict[str, Any]) -> float:
    return max((p["test_accuracy"] for p in run["curve"]), default=math.nan)


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: the target (the lower of VAFL's and VIMADMM's best accuracy) and every method's MB to it."""
    rows = []
    for label in dict.fromkeys(r["case"] for r in runs):
        by = {r["algo"]: r for r in runs if r["case"] == label}
        pair = [by[a] for a in ("vafl", "vimadmm") if a in by and by[a]["curve"]]
        target = min(_best(r) for r in pair) if len(pair) == 2 else None
        row: dict[str, Any] = {"case": label, "target": target, "methods": {}}
        for algo, r in by.items():
            hit = bytes_to(r["curve"], target) if target is not None else None
            last = r["curve"][-1] if r["curve"] else {}
            row["methods"][algo] = {
                "diverged": r["diverged"], "best_accuracy": _best(r), "final_accuracy": last.get("test_accuracy"),
                "mb_per_epoch": round(last["train_mb"] / last["epoch"], 4) if last else None,
                "to_target": hit, "wall_s": r["wall_s"]}
        a, b = row["methods"].get("vafl", {}).get("to_target"), row["methods"].get("vimadmm", {}).get("to_target")
        row["vafl_over_vimadmm_mb"] = round(a["mb"] / b["mb"], 3) if a and b else None
        rows.append(row)
    return rows


def _cell(v: Any, fmt: str = ".4f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return format(v, fmt)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# VIM against VAFL at the command line's defaults",
        "",
        f"`{result['command']}` on {result['machine']['processor']} ({result['machine']['cpu_count']} cores, "
        f"one torch thread per run, load average {result['load_before']} before / {result['load_after']} after), "
        f"{result['date']}; seed {result['seed']}, {result['epochs']} epochs, every other setting the CLI's default.",
        "",
        "Target: the lower of VAFL's and VIMADMM's best test accuracy. MB: training messages only (10^6 bytes, "
        "headers included), cumulative at the end of the first epoch at or above the target. Ratio > 1: VIMADMM "
        "needs fewer bytes than VAFL. '—': not reached.",
        "",
        "| case | target | method | best acc. | MB / epoch | epoch reached | MB to target | diverged |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["summary"]:
        for algo, m in row["methods"].items():
            hit = m["to_target"]
            lines.append(f"| {row['case']} | {_cell(row['target'])} | {algo} | {_cell(m['best_accuracy'])} | "
                         f"{_cell(m['mb_per_epoch'], '.2f')} | {hit['epoch'] if hit else '—'} | "
                         f"{_cell(hit['mb'] if hit else None, '.2f')} | {'yes' if m['diverged'] else 'no'} |")
    lines += ["", "VAFL MB / VIMADMM MB to the target:", ""]
    lines += [f"- {row['case']}: {_cell(row['vafl_over_vimadmm_mb'], '.2f')}" for row in result["summary"]]
    return "\n".join(lines) + "\n"


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


@BENCHES.register("vim-defaults")
class VIMDefaultsBench:
    help = ("VIM (vimsgd, vimadmm, vimadmm-j) against VAFL at the CLI's defaults: MB of training messages to the "
            "same test accuracy, and divergence, on image and tabular cases (DATASET:PARTIES)")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--cases", nargs="+", default=["mnist:7", "digits:4", "credit:4"],
                       help="DATASET:PARTIES cases (image sets are cut into strips of pixel rows)")
        p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
        p.add_argument("--epochs", type=int, default=5, help="epochs per run")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-batches", type=int, default=None,
                       help="stop every epoch after this many batches (a divergence check, not a bytes table)")
        p.add_argument("--options", default=None,
                       help='JSON of settings to override for every VIM method, e.g. {"vim_lr": 0.02}')
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--out-dir", type=Path, default=None,
                       help="where defaults.json and defaults.md go (default: written nowhere)")

    def run(self, args: argparse.Namespace) -> dict:
        if args.epochs < 1:
            raise ConfigError(f"--epochs must be at least 1, got {args.epochs}")
        try:
            options = json.loads(args.options) if args.options else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--options is not JSON ({exc.msg}); e.g. --options '{{\"vim_lr\": 0.02}}'") from None
        cases = [parse_case(c) for c in args.cases]
        data_dir = args.data_dir or os.environ.get("SECVFL_DATA_DIR")
        threads = fix_threads(1)
        load_before = _load()
        runs = []
        for case in cases:
            for algo in args.methods:
                extra = options if algo.startswith("vim") else {}
                runs.append(run_method(case, algo, epochs=args.epochs, seed=args.seed, data_dir=data_dir,
                                       options=extra, max_batches=args.max_batches))
        command = "secvfl bench vim-defaults --cases " + " ".join(args.cases) + f" --epochs {args.epochs}"
        if args.max_batches:
            command += f" --max-batches {args.max_batches}"
        if options:
            command += f" --options '{json.dumps(options)}'"
        result = {"command": command, "date": date.today().isoformat(), "machine": machine(), "torch_threads": threads,
                  "load_before": load_before, "load_after": _load(), "seed": args.seed, "epochs": args.epochs,
                  "summary": summarise(runs), "runs": runs}
        if args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.out_dir / "defaults.json", result)
            write_text_atomic(args.out_dir / "defaults.md", markdown(result))
        return {k: v for k, v in result.items() if k != "runs"}
