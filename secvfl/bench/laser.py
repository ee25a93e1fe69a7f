"""`secvfl bench laser`: epoch time of LASER-VFL, Standard VFL and Combinatorial as the number of parties grows.

Every method runs as a federation of isolated parties whose messages are serialised and counted, on the credit
data (first 20 feature columns, split into K contiguous blocks), with the paper's credit models and batch size, on
one thread. Combinatorial's cost grows with the 2^K - 1 predictors; for large K it is timed on a prefix of the epoch
and extrapolated (reported as such).

For calibration on a shared machine the bench also times, in the same process, a reference loop in the style of
the authors' code (one process, one optimiser, all models in one autograd graph, one head call per sampled subset,
no messages) on the same data. Wall time and process CPU time are both reported; CPU time is the robust number when
other jobs compete for the cores.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from secvfl.bench.common import fix_threads, machine, peak_rss_mb
from secvfl.cli.registries import BENCHES

__all__ = ["LaserBench", "reference_laser_epoch"]


def _time_epoch(algo, epoch: int, max_batches: int | None) -> dict:  # noqa: ANN001
    batches = algo.epoch_batches(epoch)
    total = len(batches)
    if max_batches is not None:
        batches = batches[:max_batches]
    w0, c0 = time.perf_counter(), time.process_time()
    for b in batches:
        algo.train_batch(b)
        algo.step += 1
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    scale = total / max(1, len(batches))
    return {"wall_s": wall * scale, "cpu_s": cpu * scale, "batches_timed": len(batches), "batches_per_epoch": total,
            "extrapolated": len(batches) < total}


def reference_laser_epoch(X: torch.Tensor, y: torch.Tensor, blocks: list[np.ndarray], batch_size: int, seed: int,
                          hidden: int = 10, emb: int = 10, authors_pipeline: bool = False) -> tuple[float, float]:
    """One epoch of LASER-VFL written as one monolithic program (the authors' style), fully observed batches.

    Returns (wall seconds, CPU seconds). Written for timing calibration only: same layer sizes, batch size, loss
    weights and optimiser as the federated implementation, but no parties and no messages. With
    ``authors_pipeline`` the batches come as in the authors' code -- a per-sample ``Dataset`` (features, label,
    observation mask), a class-balanced ``WeightedRandomSampler`` and a ``DataLoader`` that stacks the samples --
    and every step keeps their per-subset running loss/accuracy (``.item()`` per subset); otherwise batches are
    sliced from tensors. (A re-creation of the cost structure from the paper's description and the public code's
    design, not the authors' code.)
    """
    torch.manual_seed(seed)
    rnd = random.Random(seed)
    K = len(blocks)
    fs = nn.ModuleList([nn.Sequential(nn.Linear(len(b), hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                      nn.Linear(hidden, emb)) for b in blocks])
    gs = nn.ModuleList([nn.Linear(emb, 2) for _ in range(K)])
    opt = torch.optim.Adam([*fs.parameters(), *gs.parameters()], lr=1e-4, weight_decay=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    cols = [torch.as_tensor(b) for b in blocks]
    subsets = [c for r in range(1, K + 1) for c in itertools.combinations(range(K), r)]
    running = {c: [0.0, 0.0] for c in subsets}

    if authors_pipeline:
        from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

        mask = torch.ones(K, dtype=torch.bool)

        class Rows(Dataset):
            def __len__(self) -> int:
                return len(y)

            def __getitem__(self, i: int):  # noqa: ANN204
                return X[i], y[i], mask

        def collate(items):  # noqa: ANN001, ANN202
            xs, ys, ms = zip(*items, strict=True)
            return torch.stack(xs), torch.stack(ys), ms[0]

        counts = torch.bincount(y).double()
        weights = (1.0 / counts)[y]
        loader = DataLoader(Rows(), batch_size=batch_size, collate_fn=collate,
                            sampler=WeightedRandomSampler(weights, len(y), replacement=True))
        batches = iter(loader)
    else:
        perm = torch.randperm(len(y))
        batches = ((X[perm[s : s + batch_size]], y[perm[s : s + batch_size]], None)
                   for s in range(0, len(y), batch_size))
    w0, c0 = time.perf_counter(), time.process_time()
    for xb, yb, _ in batches:
        opt.zero_grad()
        reps = [fs[k](xb[:, cols[k]]) for k in range(K)]
        total = 0.0
        for k in range(K):
            for j in range(1, K + 1):
                J = rnd.choice([c for c in subsets if k in c and len(c) == j])
                out = gs[k](torch.stack([reps[i] for i in J]).mean(0))
                loss = loss_fn(out, yb) * math.comb(K - 1, j - 1) / j
                total = total + loss
                if authors_pipeline:
                    running[J][0] += loss.item()
                    running[J][1] += (out.argmax(1) == yb).float().sum().item()
        total.backward()
        opt.step()
    return time.perf_counter() - w0, time.process_time() - c0


@BENCHES.register("laser")
class LaserBench:
    help = "epoch time of LASER-VFL, Standard VFL and Combinatorial vs number of parties (credit, one thread)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--parties", type=int, nargs="+", default=[2, 4, 6, 8], help="numbers of parties K timed")
        p.add_argument("--methods", nargs="+", default=["laser", "svfl", "combinatorial"],
                       choices=["laser", "svfl", "combinatorial", "local", "plugvfl"], help="methods timed")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--p-miss-train", type=float, default=0.0, help="per-block missing probability in training")
        p.add_argument("--repeats", type=int, default=3, help="epochs timed per method and K (median reported)")
        p.add_argument("--max-combinatorial-batches", type=int, default=40,
                       help="for K > 4, time this many Combinatorial batches and extrapolate to the epoch")
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
        p.add_argument("--no-reference", action="store_true", help="skip the authors'-style reference loop")

    def run(self, args: argparse.Namespace) -> dict:
        from secvfl.experiments.laser import SETTINGS, build_algorithm, prepare_data

        threads = fix_threads(args.threads)
        base = SETTINGS["credit"]
        data = prepare_data(base, args.data_dir)
        rows = []
        for K in args.parties:
            setting = replace(base, parties=K)
            row: dict = {"parties": K}
            algos, caps = {}, {}
            for method in args.methods:
                algos[method] = build_algorithm(method, setting, data, args.p_miss_train, seed=0)
                caps[method] = args.max_combinatorial_batches if (method == "combinatorial" and K > 4) else None
                _time_epoch(algos[method], 0, min(caps[method] or 10, 10))  # warm-up (allocator, lazy inits)
            X, y = torch.as_tensor(data.X_train), torch.as_tensor(data.y_train)
            blocks = list(algos[args.methods[0]].ctx.partition.blocks)
            timings: dict[str, list[dict]] = {m: [] for m in args.methods}
            ref: list[tuple[float, float]] = []
            ref_dl: list[tuple[float, float]] = []
            # Interleaved repeats: load changes on a shared machine hit every method alike.
            for r in range(args.repeats):
                for method, algo in algos.items():
                    timings[method].append(_time_epoch(algo, r + 1, caps[method]))
                if not args.no_reference:
                    ref.append(reference_laser_epoch(X, y, blocks, base.batch_size, seed=r))
                    ref_dl.append(reference_laser_epoch(X, y, blocks, base.batch_size, seed=r, authors_pipeline=True))
            for method, algo in algos.items():
                ts, stats = timings[method], algo.net.stats
                row[method] = {
                    "epoch_wall_s": statistics.median(t["wall_s"] for t in ts),
                    "epoch_cpu_s": statistics.median(t["cpu_s"] for t in ts),
                    "batches_per_epoch": ts[0]["batches_per_epoch"],
                    "batches_timed": ts[0]["batches_timed"],
                    "extrapolated": ts[0]["extrapolated"],
                    "messages_per_batch": round(stats.messages_total / max(1, algo.step), 1),
                    "bytes_per_batch": round(stats.bytes_total / max(1, algo.step)),
                }
            if "laser" in row and "svfl" in row:
                row["laser_over_svfl_cpu"] = round(row["laser"]["epoch_cpu_s"] / row["svfl"]["epoch_cpu_s"], 3)
                row["laser_over_svfl_wall"] = round(row["laser"]["epoch_wall_s"] / row["svfl"]["epoch_wall_s"], 3)
            if ref:
                row["reference_laser_monolithic"] = {"epoch_wall_s": statistics.median(w for w, _ in ref),
                                                     "epoch_cpu_s": statistics.median(c for _, c in ref)}
                row["reference_laser_authors_pipeline"] = {"epoch_wall_s": statistics.median(w for w, _ in ref_dl),
                                                           "epoch_cpu_s": statistics.median(c for _, c in ref_dl)}
                if "laser" in row:
                    for key, name in (("reference_laser_monolithic", "laser_over_reference_cpu"),
                                      ("reference_laser_authors_pipeline", "laser_over_authors_pipeline_cpu")):
                        row[name] = round(row["laser"]["epoch_cpu_s"] / row[key]["epoch_cpu_s"], 3)
            rows.append(row)
            print(f"K={K}: " + ", ".join(f"{m} {row[m]['epoch_cpu_s']:.3f} s cpu" for m in args.methods), flush=True)
        return {
            "benchmark": "laser",
            "dataset": "credit (first 20 columns, stratified 80/20 split seed 0, class-balanced batches of 128)",
            "p_miss_train": args.p_miss_train,
            "threads": threads,
            "results": rows,
            "machine": machine(),
            "peak_rss_mb": peak_rss_mb(),
            "authors_code_reference": "LASER-VFL about 0.8 s/epoch, Standard VFL about 0.5 s/epoch on one CPU thread",
        }
