"""`secvfl bench overhead`: split-NN epoch with isolated parties and serialised messages vs one monolithic model.

Both train the same layers (the monolithic model is built from copies of the parties' initial weights) on the same
batches in the same order with the same optimiser, in one process with a fixed thread count. The ratio is the cost
of party isolation: encoding and decoding every message, counting bytes, per-party optimisers.

A third side, the **bare split**, trains the same layers once more in plain torch with the parties kept apart and
nothing else: one graph, one backward and one Adam per party, the head fed detached leaves. Its ratio to the
monolithic epoch is the floor under the first ratio (what isolation costs before any secvfl code runs); the split
epoch over the bare one is what secvfl adds. The three end with the same weights (reported, as a check that they
did the same work).
"""

from __future__ import annotations

import argparse
import copy
import statistics

import numpy as np
import torch
from torch import nn

from secvfl.algorithms.base import batch_ids
from secvfl.bench.common import fix_threads, machine, peak_rss_mb, timed_wall_cpu
from secvfl.cli.registries import BENCHES
from secvfl.config import TrainConfig
from secvfl.parties import task_loss
from secvfl.runner import build_run

__all__ = ["OverheadBench", "MonolithicSplitModel"]


class MonolithicSplitModel(nn.Module):
    """The split network as one module: the same bottoms on the same column blocks, then the same head."""

    def __init__(self, bottoms: list[nn.Module], head: nn.Module, blocks: list[np.ndarray]) -> None:
        super().__init__()
        self.bottoms = nn.ModuleList(bottoms)
        self.head = head
        self.blocks = [torch.as_tensor(b) for b in blocks]

    def forward(self, x_blocks: list[torch.Tensor]) -> torch.Tensor:
        return self.head([f(x) for f, x in zip(self.bottoms, x_blocks, strict=True)])


class BareSplit:
    """The split computation with the parties kept apart, in plain torch: each bottom's own graph, backward and
    Adam; the head trained on detached copies of the bottoms' outputs, whose gradients go back to each bottom."""

    def __init__(self, bottoms: list[nn.Module], head: nn.Module, lr: float) -> None:
        self.bottoms, self.head = bottoms, head
        self.bottom_opts = [torch.optim.Adam(m.parameters(), lr=lr) for m in bottoms]
        self.head_opt = torch.optim.Adam(head.parameters(), lr=lr)

    def step(self, xs: list[torch.Tensor], y: torch.Tensor, loss_fn) -> None:  # noqa: ANN001
        outs = [m(x) for m, x in zip(self.bottoms, xs, strict=True)]
        leaves = [o.detach().requires_grad_(True) for o in outs]
        self.head_opt.zero_grad(set_to_none=True)
        loss_fn(self.head(leaves), y).backward()
        self.head_opt.step()
        for model, out, leaf, opt in zip(self.bottoms, outs, leaves, self.bottom_opts, strict=True):
            params = list(model.parameters())
            for p, g in zip(params, torch.autograd.grad(out, params, leaf.grad), strict=True):
                p.grad = g
            opt.step()


@torch.no_grad()
def _max_param_diff(a: list[nn.Module], b: list[nn.Module]) -> float:
    return max(float((p - q).abs().max()) for x, y in zip(a, b, strict=True)
               for p, q in zip(x.parameters(), y.parameters(), strict=True))


@BENCHES.register("overhead")
class OverheadBench:
    help = "epoch time of split-NN through isolated parties / monolithic model (same layers, same data order)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--dataset", default="mnist", help="dataset (a secvfl train name)")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--parties", type=int, default=4, help="number of feature parties")
        p.add_argument("--batch-size", type=int, default=256, help="training rows per batch")
        p.add_argument("--hidden", type=int, default=256, help="hidden width of the bottom models and the head")
        p.add_argument("--embedding-dim", type=int, default=64, help="width of each party's embedding")
        p.add_argument("--repeats", type=int, default=5, help="epochs timed per side (the median is reported)")
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")

    def run(self, args: argparse.Namespace) -> dict:
        threads = fix_threads(args.threads)
        cfg = TrainConfig(algo="splitnn", dataset=args.dataset, data_dir=args.data_dir, parties=args.parties,
                          batch_size=args.batch_size, hidden=(args.hidden,), embedding_dim=args.embedding_dim,
                          head_hidden=(args.hidden,), device="cpu", val_fraction=0.0, epochs=1)
        run = build_run(cfg)
        algo = run.algorithm
        # Monolithic twin from the parties' *initial* weights, before the split side trains.
        bottoms = [copy.deepcopy(fp.model) for fp in algo.feature_parties]
        head = copy.deepcopy(algo.label_party.head)
        mono = MonolithicSplitModel(bottoms, head, list(run.ctx.partition.blocks))
        opt = torch.optim.Adam(mono.parameters(), lr=cfg.lr)
        bare = BareSplit([copy.deepcopy(b) for b in bottoms], copy.deepcopy(head), cfg.lr)
        X = torch.as_tensor(run.ctx.data.X_train)
        xb = [X[:, b].contiguous() for b in mono.blocks]
        y = torch.as_tensor(run.ctx.data.y_train)
        loss_fn = task_loss(run.ctx.data.n_classes)
        rows = algo.train_rows()

        def mono_epoch(epoch: int) -> None:
            for ids in batch_ids(rows, cfg.batch_size, cfg.seed, epoch):
                idx = torch.as_tensor(ids)
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(mono([x[idx] for x in xb]), y[idx])
                loss.backward()
                opt.step()

        def bare_epoch(epoch: int) -> None:
            for ids in batch_ids(rows, cfg.batch_size, cfg.seed, epoch):
                idx = torch.as_tensor(ids)
                bare.step([x[idx] for x in xb], y[idx], loss_fn)

        split, mono_, bare_ = [], [], []
        for epoch in range(args.repeats):  # interleaved, so every side sees the same machine load
            split.append(timed_wall_cpu(lambda e=epoch: algo.train_epoch(e)))
            mono_.append(timed_wall_cpu(lambda e=epoch: mono_epoch(e)))
            bare_.append(timed_wall_cpu(lambda e=epoch: bare_epoch(e)))
        split_wall, mono_wall, bare_wall = (statistics.median(t[0] for t in ts) for ts in (split, mono_, bare_))
        split_cpu, mono_cpu, bare_cpu = (statistics.median(t[1] for t in ts) for ts in (split, mono_, bare_))
        trained = [*(fp.model for fp in algo.feature_parties), algo.label_party.head]
        return {
            "benchmark": "overhead",
            # CPU time on one thread is the work each side does; the wall ratio is also given (it equals the CPU
            # ratio on an idle machine and is noisier on a shared one).
            "ratio": round(split_cpu / mono_cpu, 4),
            "ratio_wall": round(split_wall / mono_wall, 4),
            "split_epoch_cpu_seconds": round(split_cpu, 4),
            "monolithic_epoch_cpu_seconds": round(mono_cpu, 4),
            "split_epoch_seconds": round(split_wall, 4),
            "monolithic_epoch_seconds": round(mono_wall, 4),
            "split_epoch_wall_cpu_all": [[round(w, 4), round(c, 4)] for w, c in split],
            "monolithic_epoch_wall_cpu_all": [[round(w, 4), round(c, 4)] for w, c in mono_],
            # the floor: plain torch with the parties kept apart (CPU), and what secvfl adds over it
            "bare_split_epoch_cpu_seconds": round(bare_cpu, 4),
            "bare_split_epoch_seconds": round(bare_wall, 4),
            "bare_split_epoch_wall_cpu_all": [[round(w, 4), round(c, 4)] for w, c in bare_],
            "floor_ratio": round(bare_cpu / mono_cpu, 4),
            "split_over_bare_split": round(split_cpu / bare_cpu, 4),
            # the three sides did the same work: their weights after the last epoch (float32 rounding apart)
            "max_abs_weight_difference": {
                "monolithic_vs_split": _max_param_diff([*mono.bottoms, mono.head], trained),
                "bare_split_vs_split": _max_param_diff([*bare.bottoms, bare.head], trained)},
            "bytes_per_epoch": run.net.stats.bytes_total // max(1, args.repeats),
            "batches_per_epoch": algo.batches_per_epoch(),
            "config": {"dataset": args.dataset, "parties": args.parties, "batch_size": args.batch_size,
                       "hidden": args.hidden, "embedding_dim": args.embedding_dim},
            "threads": threads,
            "peak_rss_mb": peak_rss_mb(),
            "machine": machine(),
        }
