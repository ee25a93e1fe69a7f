"""`secvfl bench vim`: the training epoch time of VIMADMM (``tau`` local steps) against VAFL, and where VIMADMM's
round spends its time.

Both run as ``secvfl reproduce vim`` builds them (MNIST: 14 parties of 2 image rows, two-layer bottoms, ``d_f`` 60,
batch 1024, one thread). An epoch of each is timed (wall and process CPU: on one thread the CPU time is the work
done, whatever else shares the machine). VIMADMM's rounds are then split into their phases by timing each request
the coordinator makes: the parties' forward passes and sending the embeddings (``forward``), the label party's
round (``label``: receive, z-update, dual update, head step, residuals, send), inside it the z-update alone
(``z_solve``, timed by wrapping the solver), and the parties' local steps (``local_steps``: receive the dual and head,
``tau`` SGD steps). Message encoding and decoding happen inside ``forward``, ``label`` and ``local_steps``; their
total is timed by wrapping the message codec (``messages``).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from secvfl.algorithms.vim import parties as vim_parties
from secvfl.bench.common import fix_threads, machine, peak_rss_mb
from secvfl.cli.registries import BENCHES
from secvfl.errors import ConfigError
from secvfl.experiments.vim import METHODS, SETTINGS, build
from secvfl.transport import network as network_module

__all__ = ["VIMBench", "phase_times"]


@contextmanager
def _wrapped(owner: Any, name: str, totals: dict[str, float], key: str) -> Iterator[None]:
    """Time every call of ``owner.name`` into ``totals[key]`` while the context is open."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] += time.process_time() - t0

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _epoch(algo: Any, epoch: int) -> tuple[float, float]:
    torch.manual_seed(epoch)
    w0, c0 = time.perf_counter(), time.process_time()
    algo.train_epoch(epoch)
    return time.perf_counter() - w0, time.process_time() - c0


def phase_times(algo: Any, epoch: int) -> dict[str, float]:
    """CPU seconds per phase of one VIMADMM epoch (see the module docstring), and the epoch's total."""
    totals: dict[str, float] = defaultdict(float)
    label = algo.label_handle
    wraps: list[tuple[Any, str, str]] = [(label, "admm_step", "label"), (vim_parties, "solve_z", "z_solve"),
                                         (network_module, "encode", "messages"), (network_module, "decode", "messages")]
    wraps += [(h, "forward", "forward") for h in algo.feature_handles]
    wraps += [(h, "local_update", "local_steps") for h in algo.feature_handles]
    stack = [_wrapped(o, n, totals, k) for o, n, k in wraps]
    for s in stack:
        s.__enter__()
    try:
        _, cpu = _epoch(algo, epoch)
    finally:
        for s in reversed(stack):
            s.__exit__(None, None, None)
    return {**{k: round(v, 3) for k, v in totals.items()}, "epoch": round(cpu, 3)}


@BENCHES.register("vim")
class VIMBench:
    help = "epoch time of VIMADMM (tau local steps) vs VAFL on MNIST (14 parties, batch 1024), one thread; phases"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--dataset", default="mnist", choices=sorted(SETTINGS), help="the reproduction's setting")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--epochs", type=int, default=1, help="timed epochs of each method (after one warm-up epoch)")

    def run(self, args: argparse.Namespace) -> dict:
        if args.epochs < 1:
            raise ConfigError(f"--epochs must be at least 1, got {args.epochs}")
        threads = fix_threads(1)
        setting = SETTINGS[args.dataset]
        out: dict[str, Any] = {"dataset": args.dataset, "parties": setting.parties, "batch_size": setting.batch_size,
                               "local_steps": METHODS["vimadmm"][2]["vim_local_steps"], "torch_threads": threads, "machine": machine()}
        timings: dict[str, dict[str, float]] = {}
        for method in ("vafl", "vimadmm"):
            lr = METHODS[method][1]
            algo = build(setting, method, 0, lr, args.epochs + 1, args.data_dir)
            _epoch(algo, 0)  # warm-up: allocations, first-call overheads
            runs = [_epoch(algo, e) for e in range(1, args.epochs + 1)]
            timings[method] = {"epoch_wall_s": round(sum(w for w, _ in runs) / len(runs), 3),
                               "epoch_cpu_s": round(sum(c for _, c in runs) / len(runs), 3),
                               "rounds_per_epoch": algo.batches_per_epoch()}
            if method == "vimadmm":
                phases = phase_times(algo, args.epochs + 1)
                share = {k: round(v / phases["epoch"], 4) for k, v in phases.items() if k != "epoch"}
                timings[method] |= {"phases_cpu_s": phases, "phase_share": share}
        out["timings"] = timings
        out["ratio_cpu_vimadmm_over_vafl"] = round(timings["vimadmm"]["epoch_cpu_s"] / timings["vafl"]["epoch_cpu_s"], 2)
        out["z_solve_share_of_round"] = timings["vimadmm"]["phase_share"].get("z_solve", 0.0)
        out["peak_rss_mb"] = peak_rss_mb()
        return out
