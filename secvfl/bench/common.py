"""Shared benchmark conventions: fixed thread count, wall time, peak RSS, machine description."""

from __future__ import annotations

import os
import platform
import resource
import time
from collections.abc import Callable

import torch

__all__ = ["fix_threads", "machine", "timed", "timed_wall_cpu", "peak_rss_mb"]


def fix_threads(n: int) -> int:
    """Benchmarks fix the intra-op thread count (shared machines make >1 thread noisy) and report it."""
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    threadpool_limits(limits=n)  # numpy/scipy BLAS too: the linear algorithms spend their time there
    os.environ["OMP_NUM_THREADS"] = str(n)
    return torch.get_num_threads()


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed_wall_cpu(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``fn()``.

    With one intra-op thread the CPU time is the work done, whatever else shares the cores; wall time also counts
    the time spent waiting for a core, which on a shared machine can dominate. Benchmarks report both.
    """
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0
