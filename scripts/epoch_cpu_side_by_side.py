"""CPU time of an in-process split-NN epoch, two checkouts side by side (e.g. before and after a transport change).

    SECVFL_DATA_DIR=... python scripts/epoch_cpu_side_by_side.py REF_CHECKOUT NEW_CHECKOUT [--rounds 6] [--epochs 6]

Each round runs one process per checkout (the order alternating between rounds, so both see the same machine load),
with the checkout on PYTHONPATH and this interpreter. A process builds the run of
``secvfl train --algo splitnn --dataset credit --parties 4 --threads 1 --device cpu`` once, trains one epoch to
warm up, then times ``--epochs`` epochs by its own CPU time (``time.process_time``: the time other programs take on a
shared machine is not counted). Printed: each round's median epoch of each side, the medians over all epochs, their
ratio, and the difference per message (the epoch's messages counted by the network).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(epochs: int, dataset: str) -> dict:
    import torch

    from secvfl.config import TrainConfig
    from secvfl.runner import build_run

    cfg = TrainConfig(algo="splitnn", dataset=dataset, parties=4, epochs=epochs + 1, seed=0, threads=1, device="cpu")
    run = build_run(cfg)
    cpu = []
    for epoch in range(epochs + 1):
        torch.manual_seed(epoch)
        run.net.start_epoch(epoch)
        before = sum(run.net.stats.messages_sent.values())
        start = time.process_time()
        run.algorithm.train_epoch(epoch, lambda *_: None)
        if epoch:  # (the first one warms up)
            cpu.append(time.process_time() - start)
        messages = sum(run.net.stats.messages_sent.values()) - before
    return {"cpu": cpu, "messages": messages}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkouts", nargs="*", help="REF NEW: the two source trees to compare")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--epochs", type=int, default=6, help="timed epochs per process (after one to warm up)")
    p.add_argument("--dataset", default="credit")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a measuring process)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.epochs, args.dataset)))
        return
    if len(args.checkouts) != 2:
        p.error("give two checkouts: REF NEW")
    ref, new = (os.path.abspath(c) for c in args.checkouts)
    cpu: dict[str, list[float]] = {ref: [], new: []}
    rounds = []
    for r in range(args.rounds):
        got = {}
        for src in (ref, new) if r % 2 == 0 else (new, ref):
            env = dict(os.environ, PYTHONPATH=src)
            out = subprocess.run([sys.executable, __file__, "--one", "--epochs", str(args.epochs), "--dataset",
                                  args.dataset], env=env, capture_output=True, text=True, check=True, timeout=1800)
            d = json.loads(out.stdout.strip().splitlines()[-1])
            cpu[src] += d["cpu"]
            got[src] = statistics.median(d["cpu"])
        rounds.append(round(got[new] / got[ref], 4))
        print(f"round {r}: ref {got[ref]:.4f} s  new {got[new]:.4f} s  ratio {rounds[-1]:.4f}", flush=True)
    a, b = statistics.median(cpu[ref]), statistics.median(cpu[new])
    print(json.dumps({"ref_cpu_seconds_per_epoch": round(a, 4), "new_cpu_seconds_per_epoch": round(b, 4),
                      "ratio": round(b / a, 4), "ratio_per_round": rounds, "median_round_ratio": statistics.median(rounds),
                      "messages_per_epoch": d["messages"], "difference_us_per_message": round((b - a) / d["messages"] * 1e6, 2),
                      "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
