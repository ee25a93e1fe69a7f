"""Helpers of scripts/gpu-check.sh: the lines it adds to summary.txt, and the profile of a CUDA epoch.

    python scripts/gpu_check_report.py device DEVICE_JSON      # the device bench's table and goals
    python scripts/gpu_check_report.py transport TRANSPORT_JSON
    python scripts/gpu_check_report.py profile                 # torch profiler: a split-NN MNIST epoch on CUDA
"""

from __future__ import annotations

import json
import sys


def device(path: str) -> None:
    result = json.load(open(path))
    print(result["table"])
    for row in result["cases"]:
        goal = f"; goal <= {row['goal']:.2f}: {'met' if row['met'] else 'NOT met'}" if "goal" in row else ""
        print(f"  {row['case']}: CUDA / best CPU ({row['best_cpu']}) = {row.get('ratio_cuda_over_best_cpu')}{goal}")


def transport(path: str) -> None:
    for name, r in json.load(open(path))["datasets"].items():
        print(f"  transport, {name}: gRPC epoch {r['grpc_epoch_seconds']} s / in one process "
              f"{r['in_process_epoch_seconds']} s = {r['ratio']}x; busy cores {r.get('grpc_busy_cores')}; "
              f"coordinator waiting {r.get('grpc_coordinator_wait_seconds_per_epoch')} s per epoch")


def profile(device: str = "cuda", rows: int = 12_800, batch: int = 64) -> None:
    """One split-NN MNIST epoch on ``device`` (``rows`` training rows) under the torch profiler, after a warm-up
    epoch: the host waits per step, then the operators by host time and (CUDA) by device time."""
    import dataclasses

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from secvfl.config import TrainConfig
    from secvfl.data import load_dataset, make_partition
    from secvfl.runner import build_run

    rows, batch = int(rows), int(batch)
    data = load_dataset("mnist", seed=0, val_fraction=0.0)
    data = dataclasses.replace(data, X_train=data.X_train[:rows], y_train=data.y_train[:rows])
    cfg = TrainConfig(algo="splitnn", dataset="mnist", parties=4, batch_size=batch, device=device, val_fraction=0.0)
    run = build_run(cfg, prepared=(data, make_partition(data.n_features, 4, image_shape=data.image_shape)))
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run.algorithm.train_epoch(0)
    sync()
    with torch_profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        run.algorithm.train_epoch(1)
        sync()
    steps = run.algorithm.batches_per_epoch()
    events = prof.key_averages()
    waits = {e.key: e.count for e in events
             if "Synchronize" in e.key or "Memcpy" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")}
    where = torch.cuda.get_device_name(device) if cuda else f"the CPU, {torch.get_num_threads()} threads"
    print(f"split-NN MNIST, 4 parties, batch {batch}, {steps} steps on {where}")
    print("per step: " + ", ".join(f"{k} {v / steps:.2f}" for k, v in sorted(waits.items())))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    for key in ("self_device_time_total", "self_cuda_time_total") if cuda else ():  # newer and older torch's names
        try:
            print(events.table(sort_by=key, row_limit=15))
            break
        except (KeyError, AttributeError, ValueError):
            continue


if __name__ == "__main__":
    what, *rest = sys.argv[1:]
    {"device": device, "transport": transport, "profile": profile}[what](*rest)
