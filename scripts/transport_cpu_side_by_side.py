"""CPU per message of the deployment transport (gRPC + mutual TLS on loopback), two checkouts side by side.

    python scripts/transport_cpu_side_by_side.py REF_CHECKOUT NEW_CHECKOUT [--rounds 6] [--exchanges 3000]

Each round runs, for each checkout (the order alternating between rounds, so both see the same machine load), two
party processes with the checkout on PYTHONPATH: a feature party sends an embedding (``--rows`` x ``--cols``
float32, split-NN's shape) to the label party, which answers with a gradient of the same shape, ``--exchanges``
times after a warm-up. Each process reports its CPU time (``time.process_time``: other programs on a shared machine
are not counted) over the timed exchanges. Messages go through :class:`secvfl.transport.network.Network` (``send`` /
``receive``: encoding, the receiver's checks where the checkout has them, the transport); ``--raw`` puts and takes
the encoded bytes on the transport alone. Printed: each round's CPU microseconds per message (both processes),
the medians, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(fed_path: str, name: str, exchanges: int, warmup: int, rows: int, cols: int, raw: bool) -> dict:
    import torch

    from secvfl.deploy.party import Timeouts, make_transport, run_names
    from secvfl.federation import load_federation
    from secvfl.messages import Message, decode, encode
    from secvfl.transport.layers import AlgorithmTraits, Role
    from secvfl.transport.network import Network

    torch.set_num_threads(1)
    federation = load_federation(Path(fed_path))
    runs = run_names(federation)
    me, peer = runs[name], runs["party0" if name == "label" else "label"]
    transport = make_transport(federation, name, Timeouts(wait=120.0, peer=60.0, heartbeat=1.0), lambda s: None)
    roles = {runs["label"]: Role.LABEL, runs["party0"]: Role.FEATURE}
    try:
        traits = AlgorithmTraits(name="splitnn", aggregation="concat")
    except TypeError:  # a checkout whose traits take other arguments
        traits = None
    net = Network(roles, transport=transport, traits=traits, local=me)
    guard = getattr(net, "guard", None)
    if guard is not None and hasattr(guard, "declare_widths"):
        guard.declare_widths({"embedding": cols})
    values = torch.randn(rows, cols)
    batch = list(range(rows))
    feature = name != "label"

    def exchange(step: int) -> None:
        if guard is not None and hasattr(guard, "enter"):
            guard.enter(step, None, batch)  # the round a served request would name
        out_kind, in_kind = ("embedding", "gradient") if feature else ("gradient", "embedding")
        message = Message(out_kind, me, peer, step, {"t": values})
        if feature:
            send(message)
            receive(in_kind)
        else:
            receive(in_kind)
            send(message)

    if raw:
        def send(m: Message) -> None:
            transport.put(m.sender, m.receiver, m.kind, encode(m))

        def receive(kind: str) -> None:
            decode(transport.take(me, kind=kind, sender=peer))
    else:
        def send(m: Message) -> None:
            net.send(m)

        def receive(kind: str) -> None:
            net.receive(me, kind=kind, sender=peer)

    for step in range(warmup):
        exchange(step)
    cpu0, wall0, main0 = time.process_time(), time.perf_counter(), time.thread_time()
    for step in range(warmup, warmup + exchanges):
        exchange(step)
    cpu, wall, main = time.process_time() - cpu0, time.perf_counter() - wall0, time.thread_time() - main0
    time.sleep(0.5)  # the last frames leave before the link closes
    transport.close()
    return {"cpu": cpu, "wall": wall, "main_thread_cpu": main}


def measure(src: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    with tempfile.TemporaryDirectory(prefix="transport-cpu-") as tmp:
        make = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from secvfl.deploy.loopback import loopback_federation as f; "
                               "print(f(Path(sys.argv[1]), 1, name='cpu'))", tmp], env=env, capture_output=True,
                              text=True, check=True, timeout=120)
        fed = make.stdout.strip().splitlines()[-1]
        common = [sys.executable, __file__, "--one", fed, "--exchanges", str(args.exchanges), "--warmup",
                  str(args.warmup), "--rows", str(args.rows), "--cols", str(args.cols), *(["--raw"] if args.raw else [])]
        procs = [subprocess.Popen([*common, "--name", n], env=env, stdout=subprocess.PIPE, text=True)
                 for n in ("label", "party0")]
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a party process of {src} failed")
    got = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    messages = 2 * args.exchanges
    return {"us_per_message": sum(g["cpu"] for g in got) / messages * 1e6,
            "wall_us_per_exchange": max(g["wall"] for g in got) / args.exchanges * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkouts", nargs="*", help="REF NEW: the two source trees to compare")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--exchanges", type=int, default=3000, help="timed exchanges (two messages each) per process")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--cols", type=int, default=16)
    p.add_argument("--raw", action="store_true", help="the transport alone: encoded bytes put and taken")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a party process: its federation file)
    p.add_argument("--name", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.name, args.exchanges, args.warmup, args.rows, args.cols, args.raw)))
        return
    if len(args.checkouts) != 2:
        p.error("give two checkouts: REF NEW")
    ref, new = (os.path.abspath(c) for c in args.checkouts)
    per: dict[str, list[float]] = {ref: [], new: []}
    ratios = []
    for r in range(args.rounds):
        got = {}
        for src in (ref, new) if r % 2 == 0 else (new, ref):
            got[src] = measure(src, args)
            per[src].append(got[src]["us_per_message"])
        ratios.append(round(got[new]["us_per_message"] / got[ref]["us_per_message"], 4))
        print(f"round {r}: ref {got[ref]['us_per_message']:.1f} us  new {got[new]['us_per_message']:.1f} us per "
              f"message (CPU, both processes)  ratio {ratios[-1]:.4f}", flush=True)
    a, b = statistics.median(per[ref]), statistics.median(per[new])
    print(json.dumps({"ref_cpu_us_per_message": round(a, 2), "new_cpu_us_per_message": round(b, 2),
                      "ratio": round(b / a, 4), "ratio_per_round": ratios, "median_round_ratio": statistics.median(ratios),
                      "raw_transport": args.raw, "shape": [args.rows, args.cols], "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
