"""`secvfl bench device`: the same training through CUDA and through the CPU, side by side on one machine.

Each case is a `secvfl train` configuration (split-NN on MNIST with MLP and CNN bottoms at several batch sizes,
LASER-VFL, VIMADMM, vafl under CKKS). It is trained once on the CUDA device and once on the CPU per thread count
(``--cpu-threads``, default 1 and every core), one after the other in this process, on the same data (loaded once)
and seed. The first epoch of each run warms up (allocations, kernel selection) and is reported apart; the median of
the following ``--epochs`` is the epoch time. Each run also reports its test metrics and counted bytes: the devices
must send the same bytes (``bytes_equal``; under CKKS a few bytes differ from run to run, as SEAL compresses random
ciphertexts) and reach the same metrics within float rounding (``test_difference``).

The ratio per case is CUDA epoch / best CPU epoch; the cases the GPU is meant for carry a goal (``goal``, ``met``).
Without CUDA the command says so in one line and times the CPU side only. ``--train-rows N`` trains on the first N
training rows (the per-step cost and the ratios stay; the run is shorter).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from secvfl.bench.common import fix_threads, machine
from secvfl.cli.registries import BENCHES
from secvfl.config import TrainConfig
from secvfl.data import Dataset, load_dataset, make_partition
from secvfl.errors import ConfigError
from secvfl.runner import build_run, run_training

__all__ = ["DeviceBench", "CASES"]


@dataclass(frozen=True)
class Case:
    name: str
    flags: dict[str, Any]
    goal: float | None = None  # CUDA epoch / best CPU epoch at most this
    options: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        shown = {**self.flags, **self.options}
        return " ".join(f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, tuple) else v}"
                        for k, v in shown.items())


CASES = {c.name: c for c in (
    Case("splitnn-mlp-b64", {"algo": "splitnn", "batch_size": 64}, goal=1.0),
    Case("splitnn-mlp-b1024-h1024", {"algo": "splitnn", "batch_size": 1024, "hidden": (1024,)}, goal=0.3),
    Case("splitnn-cnn-b64", {"algo": "splitnn", "bottom": "cnn", "batch_size": 64}),
    Case("splitnn-cnn-b256", {"algo": "splitnn", "bottom": "cnn", "batch_size": 256}, goal=0.2),
    Case("splitnn-cnn-b1024", {"algo": "splitnn", "bottom": "cnn", "batch_size": 1024}),
    Case("laser", {"algo": "laser", "batch_size": 64}),
    Case("vimadmm", {"algo": "vimadmm", "batch_size": 64}, goal=1 / 3),
    Case("vafl-ckks", {"algo": "vafl", "batch_size": 64}, options={"he": "ckks"}),
)}


def _quiet(*_: Any, **__: Any) -> None:
    pass


@BENCHES.register("device")
class DeviceBench:
    help = "the same training on CUDA and on the CPU (threads stated), side by side: epoch times, ratios, goals"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE",
                       help=f"which configurations ({', '.join(CASES)})")
        p.add_argument("--dataset", default="mnist", help="dataset (a secvfl train name)")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--parties", type=int, default=4, help="number of feature parties")
        p.add_argument("--epochs", type=int, default=2, help="epochs timed per run, after one warm-up epoch (median)")
        p.add_argument("--train-rows", type=int, default=None, metavar="N",
                       help="train on the first N training rows only (default: all)")
        p.add_argument("--cpu-threads", type=int, nargs="+", default=None, metavar="N",
                       help="torch threads of the CPU runs (default: 1 and every core)")
        p.add_argument("--cuda", default="cuda", help="the CUDA device to time (e.g. cuda:1)")

    def run(self, args: argparse.Namespace) -> dict:
        if args.epochs < 1 or (args.train_rows is not None and args.train_rows < 1):
            raise ConfigError("--epochs and --train-rows must be at least 1")
        threads = sorted(set(args.cpu_threads or [1, os.cpu_count() or 1]))
        if threads[0] < 1:
            raise ConfigError("--cpu-threads must be at least 1")
        cuda = torch.cuda.is_available()
        if not cuda:
            print(f"secvfl bench device: no CUDA device here (torch {torch.__version__} finds none); timing the CPU "
                  "side only", file=sys.stderr)
        data = load_dataset(args.dataset, args.data_dir, seed=0, val_fraction=0.0)
        if args.train_rows is not None:
            data = dataclasses.replace(data, X_train=data.X_train[: args.train_rows],
                                       y_train=data.y_train[: args.train_rows], notes=list(data.notes))
        rows = []
        for name in args.cases:
            case = CASES[name]
            sides: dict[str, dict] = {}
            for n in threads:
                sides[f"cpu-{n}"] = self._time(case, data, args, "cpu", n)
            if cuda:
                sides["cuda"] = self._time(case, data, args, args.cuda, max(threads))
            rows.append(self._row(case, sides))
        result = {
            "benchmark": "device", "cuda_device": torch.cuda.get_device_name(args.cuda) if cuda else None,
            "cpu_threads": threads, "dataset": args.dataset, "parties": args.parties,
            "train_rows": int(len(data.y_train)), "epochs_timed": args.epochs, "cases": rows, "machine": machine(),
        }
        result["table"] = table(result)
        print(result["table"])
        return result

    def _time(self, case: Case, data: Dataset, args: argparse.Namespace, device: str, threads: int) -> dict:
        fix_threads(threads)
        cfg = TrainConfig(dataset=args.dataset, data_dir=args.data_dir, parties=args.parties, seed=0,
                          epochs=1 + args.epochs, val_fraction=0.0, device=device, threads=threads,
                          **case.flags, options=case.options)
        part = make_partition(data.n_features, cfg.parties, image_shape=data.image_shape,
                              image_split=cfg.image_split, channels=data.image_channels)
        epochs: list[float] = []
        on_cuda = device.startswith("cuda")

        def timed(run) -> None:  # noqa: ANN001 - the runner's Run
            train = run.algorithm.train_epoch

            def epoch(*a: Any, **k: Any) -> dict:
                t0 = time.perf_counter()
                out = train(*a, **k)
                if on_cuda:
                    torch.cuda.synchronize()
                epochs.append(time.perf_counter() - t0)
                return out

            run.algorithm.train_epoch = epoch

        copy = dataclasses.replace(data, notes=list(data.notes))  # the run may record notes (and drop rows) in it
        summary = run_training(cfg, progress=False, log=_quiet, on_build=timed,
                               build=lambda c: build_run(c, prepared=(copy, part)))
        steps = -(-len(data.y_train) // cfg.batch_size)
        epoch_s = statistics.median(epochs[1:])
        return {"device": summary["device"], "threads": torch.get_num_threads(),
                "epoch_seconds": round(epoch_s, 4), "warmup_epoch_seconds": round(epochs[0], 4),
                "epoch_seconds_all": [round(t, 4) for t in epochs], "ms_per_step": round(1000 * epoch_s / steps, 3),
                "test": summary["metrics"]["test"], "bytes_total": summary["comm"]["bytes_total"]}

    @staticmethod
    def _row(case: Case, sides: dict[str, dict]) -> dict:
        cpu = {k: v for k, v in sides.items() if k.startswith("cpu")}
        best = min(cpu, key=lambda k: cpu[k]["epoch_seconds"])
        row: dict[str, Any] = {"case": case.name, "flags": case.describe(), "sides": sides, "best_cpu": best}
        # the same training sends the same bytes on every device (CKKS ciphertexts excepted: SEAL compresses each
        # serialised ciphertext, whose random bits compress a few bytes differently from run to run)
        row["bytes_equal"] = len({v["bytes_total"] for v in sides.values()}) == 1
        if "cuda" in sides:
            ratio = sides["cuda"]["epoch_seconds"] / cpu[best]["epoch_seconds"]
            row["ratio_cuda_over_best_cpu"] = round(ratio, 3)
            metric = "accuracy" if "accuracy" in sides["cuda"]["test"] else next(iter(sides["cuda"]["test"]), None)
            if metric is not None:
                row["test_difference"] = round(abs(sides["cuda"]["test"][metric] - cpu[best]["test"][metric]), 4)
            if case.goal is not None:
                row["goal"] = round(case.goal, 3)
                row["met"] = ratio <= case.goal
        return row


def table(result: dict) -> str:
    """A markdown table of the result: one row per case, epoch seconds per side, the ratio and the goal."""
    sides = [f"cpu-{n}" for n in result["cpu_threads"]] + (["cuda"] if result["cuda_device"] else [])
    head = ["case", *[f"{s} epoch s" for s in sides], "CUDA / best CPU", "goal", "test diff", "same bytes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["cases"]:
        cells = [f"`{row['case']}`", *[f"{row['sides'][s]['epoch_seconds']:.3f}" for s in sides]]
        ratio = row.get("ratio_cuda_over_best_cpu")
        goal = row.get("goal")
        cells.append("-" if ratio is None else f"{ratio:.3f}")
        cells.append("-" if goal is None else f"<= {goal:.2f} ({'met' if row['met'] else 'not met'})")
        cells.append(f"{row['test_difference']:.4f}" if "test_difference" in row else "-")
        cells.append("yes" if row["bytes_equal"] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    where = result["cuda_device"] or "no CUDA device"
    lines.append(f"\n{result['dataset']}, {result['parties']} parties, {result['train_rows']} training rows; "
                 f"median of {result['epochs_timed']} epochs after a warm-up; {where}; CPU threads "
                 f"{', '.join(map(str, result['cpu_threads']))}")
    return "\n".join(lines)
