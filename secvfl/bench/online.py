"""`secvfl bench online`: stream samples per second of an online run through isolated parties, against the same
learning as one monolithic program.

The federated side is the ``dlr`` algorithm as ``secvfl train`` builds it (MNIST by default, 4 parties, the paper's
models: each party one linear layer -> 64 ReLU, the label party 256 ReLU -> 10): every round each party's
embedding and each active party's gradient is a message encoded to bytes, counted and decoded, and each party keeps
its own window and steps itself. The monolithic side (:class:`MonolithicOnline`) is the same layers as one module
with the same update rule -- one exponentially weighted window over all parameters (the parties' windows side by
side are exactly that window), the same step size, one autograd call per round, no messages -- started from copies
of the parties' initial weights. Both sides learn from the same pre-drawn stream samples (drawing and deforming the
samples is the environment, not the learner, and is left out of both), in blocks that alternate between the sides
so that both see the same machine load; the median block is reported. On one thread the process CPU time is the
work each side does (the wall ratio is also given). Since both sides compute the same model, the largest
difference between their parameters at the end is reported too: a check that the comparison is like for like.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch
from torch import nn

from secvfl.algorithms.online.buffers import GradientWindow
from secvfl.bench.common import fix_threads, machine, peak_rss_mb
from secvfl.cli.registries import BENCHES
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.handles import local_party
from secvfl.runner import build_run

__all__ = ["OnlineBench", "MonolithicOnline"]


class MonolithicOnline:
    """DLR (OGD for l = 1) on the split network as one module: bottoms on their column blocks, concatenated, the
    head; one window over the flat gradient of every parameter; plain steps of size ``lr``."""

    def __init__(self, bottoms: list[nn.Module], head: nn.Module, length: int, alpha: float, lr: float) -> None:
        self.bottoms = nn.ModuleList(bottoms)
        self.head = head
        self.params = [p for m in (*bottoms, head) for p in m.parameters()]
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        offset = 0
        for p in self.params:  # the usual flat-buffer layout, so a step is one operation (as the parties do)
            n = p.numel()
            p.data = self.flat[offset : offset + n].view_as(p)
            offset += n
        self.window = GradientWindow(length, alpha, self.flat.numel(), dtype=self.flat.dtype)
        self.direction = torch.empty_like(self.flat)
        self.lr = float(lr)

    def round(self, blocks: list[torch.Tensor], y: torch.Tensor) -> tuple[float, bool]:
        """Predict (scored before the update), then one step; returns (loss, whether the prediction was right)."""
        h = torch.cat([f(x) for f, x in zip(self.bottoms, blocks, strict=True)], dim=1)
        logits = self.head(h)
        correct = bool(int(logits[0].argmax()) == int(y[0]))
        loss = nn.functional.cross_entropy(logits, y)
        grads = torch.autograd.grad(loss, self.params)
        with torch.no_grad():
            self.window.push_parts(grads)
            self.flat.add_(self.window.average(out=self.direction), alpha=-self.lr)
        return float(loss.detach()), correct


@BENCHES.register("online")
class OnlineBench:
    help = "stream samples/s of online DLR through isolated parties / one monolithic online loop (same layers, rule)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--dataset", default="mnist", help="dataset (a secvfl train name)")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--algo", default="dlr", choices=["dlr", "ogd"], help="online algorithm (window update rule)")
        p.add_argument("--parties", type=int, default=4, help="number of feature parties")
        p.add_argument("--rounds", type=int, default=2000, help="stream samples per timed block")
        p.add_argument("--repeats", type=int, default=5, help="timed blocks per side (the median is reported)")
        p.add_argument("--warmup", type=int, default=200, help="untimed rounds per side before the blocks")
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
        p.add_argument("--profile", type=int, default=0, metavar="N",
                       help="also profile one federated block (cProfile) and report its N costliest functions")

    def run(self, args: argparse.Namespace) -> dict:
        for flag in ("rounds", "repeats", "parties"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
        if args.warmup < 0:
            raise ConfigError(f"--warmup must be at least 0, got {args.warmup}")
        threads = fix_threads(args.threads)
        cfg = TrainConfig(algo=args.algo, dataset=args.dataset, data_dir=args.data_dir, parties=args.parties,
                          device="cpu", epochs=1, threads=args.threads, options={"samples": args.rounds})
        run = build_run(cfg)
        algo = run.algorithm
        run.net.start_epoch(0)
        parties = [local_party(h) for h in algo.feature_handles]
        label = local_party(algo.label_handle)
        window = label.spec
        mono = MonolithicOnline([copy.deepcopy(p.model) for p in parties], copy.deepcopy(label.head), window.length,
                                window.alpha, algo.opts.online_lr)
        blocks = [np.asarray(b) for b in algo.stream._columns]
        total = args.warmup + args.repeats * args.rounds + (args.rounds if args.profile else 0)
        samples = [algo.stream.draw() for _ in range(total)]  # the same stream for both sides, drawn untimed
        split_in = [([x[c] for c in blocks], y) for x, y, _ in samples]
        mono_in = [([torch.from_numpy(x[c])[None] for c in blocks], torch.tensor([y])) for x, y, _ in samples]

        def split_block(start: int, n: int) -> None:
            for i in range(start, start + n):
                xs, y = split_in[i]
                for feed, x in zip(algo.feeds, xs, strict=True):
                    feed.put(i, x)
                algo.label_feed.put(i, y)
                algo.run_round()

        def mono_block(start: int, n: int) -> None:
            for i in range(start, start + n):
                mono.round(*mono_in[i])

        def timed(fn, start: int) -> tuple[float, float]:  # noqa: ANN001
            w0, c0 = time.perf_counter(), time.process_time()
            fn(start, args.rounds)
            return time.perf_counter() - w0, time.process_time() - c0

        split_block(0, args.warmup)
        mono_block(0, args.warmup)
        bytes_before = run.net.stats.bytes_total
        split, mono_t = [], []
        for r in range(args.repeats):  # interleaved, so both sides see the same machine load
            start = args.warmup + r * args.rounds
            split.append(timed(split_block, start))
            mono_t.append(timed(mono_block, start))
        bytes_per_round = (run.net.stats.bytes_total - bytes_before) / (args.repeats * args.rounds)
        diff = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(
            [p for q in parties for p in q.params] + label.params, mono.params, strict=True))
        rate = {side: {k: args.rounds / statistics.median(t[i] for t in ts) for i, k in enumerate(("wall", "cpu"))}
                for side, ts in (("split", split), ("mono", mono_t))}
        result = {
            "benchmark": "online",
            "ratio": round(rate["split"]["cpu"] / rate["mono"]["cpu"], 4),
            "ratio_wall": round(rate["split"]["wall"] / rate["mono"]["wall"], 4),
            "split_samples_per_second_cpu": round(rate["split"]["cpu"], 1),
            "monolithic_samples_per_second_cpu": round(rate["mono"]["cpu"], 1),
            "split_samples_per_second_wall": round(rate["split"]["wall"], 1),
            "monolithic_samples_per_second_wall": round(rate["mono"]["wall"], 1),
            "split_block_wall_cpu_all": [[round(w, 4), round(c, 4)] for w, c in split],
            "monolithic_block_wall_cpu_all": [[round(w, 4), round(c, 4)] for w, c in mono_t],
            "bytes_per_round": bytes_per_round,
            "max_parameter_difference": diff,
            "config": {"algo": args.algo, "dataset": args.dataset, "parties": args.parties, "rounds": args.rounds,
                       "repeats": args.repeats, "warmup": args.warmup, "window": window.length,
                       "alpha": window.alpha, "lr": algo.opts.online_lr,
                       "embedding": algo.opts.online_embedding, "head": algo.opts.online_head},
            "threads": threads,
            "peak_rss_mb": peak_rss_mb(),
            "machine": machine(),
        }
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            split_block(args.warmup + args.repeats * args.rounds, args.rounds)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.profile)
            result["profile_tottime"] = [line for line in text.getvalue().splitlines() if line.strip()][-args.profile:]
        return result
