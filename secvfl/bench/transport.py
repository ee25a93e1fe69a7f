"""`secvfl bench transport`: split-NN over loopback gRPC with mutual TLS (one process per party, `secvfl launch`)
against the same run in one process, on the same settings and seed.

Each repeat runs both sides back to back (interleaved, so both see the same machine load) with one torch thread per
process. Reported per dataset: the median epoch time of each side and their ratio, the time per training step,
the counted message bytes (identical on both sides: checked), the frame bytes the gRPC transport handed to gRPC,
the party-handle requests (control), every process's CPU time and how many cores they kept busy (the sum near the
machine's core count: the run waited for cores, not for messages), and the bytes that crossed the loopback
interface during the run (TLS, HTTP/2 and TCP/IP framing included, and anything else on loopback at the time: read
it as an upper bound).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from secvfl.bench.common import fix_threads, machine
from secvfl.cli.registries import BENCHES
from secvfl.deploy.loopback import loopback_federation
from secvfl.errors import ConfigError

__all__ = ["TransportBench"]


def _loopback_bytes() -> int | None:
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])  # bytes received on lo (= bytes sent on it)
    except OSError:
        return None
    return None


@BENCHES.register("transport")
class TransportBench:
    help = "split-NN epoch over loopback gRPC + mTLS (one process per party) / in one process"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--datasets", nargs="+", default=["credit", "mnist"], help="datasets (secvfl train names)")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--parties", type=int, default=4, help="number of feature parties")
        p.add_argument("--epochs", type=int, default=2, help="epochs per run")
        p.add_argument("--batch-size", type=int, default=None, help="rows per batch (default: secvfl train's)")
        p.add_argument("--repeats", type=int, default=3, help="runs per side and dataset (the median is reported)")
        p.add_argument("--device", default="cpu", help="the device every process trains on (the transport is "
                                                      "measured on the CPU; cuda puts five processes on one GPU)")

    def run(self, args: argparse.Namespace) -> dict:
        threads = fix_threads(1)
        if args.repeats < 1 or args.epochs < 1:
            raise ConfigError("--repeats and --epochs must be at least 1")
        results = {}
        with tempfile.TemporaryDirectory(prefix="secvfl-bench-transport-") as tmp:
            fed = loopback_federation(Path(tmp), args.parties, name="bench")
            for dataset in args.datasets:
                flags = ["--algo", "splitnn", "--dataset", dataset, "--parties", str(args.parties), "--epochs",
                         str(args.epochs), "--seed", "0", "--threads", "1", "--device", args.device]
                if args.data_dir:
                    flags += ["--data-dir", str(args.data_dir)]
                if args.batch_size:
                    flags += ["--batch-size", str(args.batch_size)]
                results[dataset] = self._dataset(Path(tmp) / dataset, fed, flags, args)
        return {"benchmark": "transport", "datasets": results, "threads_per_process": threads,
                "config": {"parties": args.parties, "epochs": args.epochs, "repeats": args.repeats,
                           "batch_size": args.batch_size, "device": args.device},
                "machine": machine()}

    def _dataset(self, folder: Path, fed: Path, flags: list[str], args: argparse.Namespace) -> dict:
        local, remote, loopback, launched_wall = [], [], [], []
        for r in range(args.repeats):
            inproc = folder / f"inproc-{r}"
            cmd = [sys.executable, "-m", "secvfl.cli.main", "train", "--out", str(inproc), "--no-progress", *flags]
            _run(cmd)
            local.append(json.loads((inproc / "summary.json").read_text()))
            launch = folder / f"grpc-{r}"
            before, t0 = _loopback_bytes(), time.perf_counter()
            _run([sys.executable, "-m", "secvfl.cli.main", "launch", "--federation", str(fed), "--out", str(launch),
                  *flags])
            launched_wall.append(time.perf_counter() - t0)
            after = _loopback_bytes()
            loopback.append(None if before is None or after is None else after - before)
            remote.append(json.loads((launch / "label" / "summary.json").read_text()))
        if any(s["comm"] != local[0]["comm"] for s in local + remote):
            raise ConfigError("the counted message bytes differ between the runs; the transports are not equivalent")
        epochs = args.epochs
        local_epoch = statistics.median(s["wall_seconds"] / epochs for s in local)
        remote_epoch = statistics.median(s["wall_seconds"] / epochs for s in remote)
        steps = remote[0]["comm"]["messages_by_kind"].get("gradient", 0) // args.parties // epochs or None
        counted = local[0]["comm"]["bytes_total"]
        measured = [b for b in loopback if b is not None]
        return {
            "in_process_epoch_seconds": round(local_epoch, 4),
            "grpc_epoch_seconds": round(remote_epoch, 4),
            "ratio": round(remote_epoch / local_epoch, 3),
            "in_process_epoch_seconds_all": [round(s["wall_seconds"] / epochs, 4) for s in local],
            "grpc_epoch_seconds_all": [round(s["wall_seconds"] / epochs, 4) for s in remote],
            "training_steps_per_epoch": steps,
            "grpc_ms_per_step": round(1000 * remote_epoch / steps, 3) if steps else None,
            "in_process_ms_per_step": round(1000 * local_epoch / steps, 3) if steps else None,
            "launch_wall_seconds_median": round(statistics.median(launched_wall), 2),
            "counted_message_bytes": counted,
            "control_bytes": remote[0]["control"]["bytes_total"],
            "control_messages": remote[0]["control"]["messages_total"],
            "loopback_bytes_median": int(statistics.median(measured)) if measured else None,
            "loopback_over_counted": round(statistics.median(measured) / counted, 3) if measured else None,
            # the coordinator's (label party's) time blocked on the feature parties' messages and answers, per epoch
            "grpc_coordinator_wait_seconds_per_epoch": _median_wait(remote, epochs),
            **_cpu(remote, epochs),
            "test_metrics": remote[0]["metrics"]["test"],
        }


def _median_wait(summaries: list[dict], epochs: int) -> float | None:
    waits = [s.get("deployment", {}).get("coordinator_wait_seconds") for s in summaries]
    waits = [w / epochs for w in waits if w is not None]
    return round(statistics.median(waits), 4) if waits else None


def _cpu(summaries: list[dict], epochs: int) -> dict:
    """CPU seconds per epoch of every process of the launched run (the median run by total), and how many cores
    they kept busy on average: near the machine's core count, the run waited for cores, not for messages."""
    runs = [(s.get("deployment", {}).get("cpu_seconds"), s["wall_seconds"]) for s in summaries
            if s.get("deployment", {}).get("measured_since", "start") == "start"]  # a resumed run's CPU is partial
    runs = sorted(((sum(c.values()), c, w) for c, w in runs if c), key=lambda r: r[0])
    if not runs:
        return {}
    total, per_process, wall = runs[len(runs) // 2]
    return {"grpc_cpu_seconds_per_epoch_all_processes": round(total / epochs, 3),
            "grpc_cpu_seconds_per_epoch_by_process": {p: round(c / epochs, 3) for p, c in per_process.items()},
            "grpc_busy_cores": round(total / wall, 2)}


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-3:]
        raise ConfigError(f"`{' '.join(cmd[3:6])} ...` failed: {' | '.join(tail)}")
