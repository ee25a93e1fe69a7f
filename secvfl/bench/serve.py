"""`secvfl bench serve`: latency and throughput of a served federation on loopback, beside the in-process forward.

A federation of 3 processes (the label party and 2 feature parties, each reading its own file of a dataset
scikit-learn bundles: `secvfl demo-federation`) is trained with `secvfl launch` and served with `secvfl serve`
(HTTPS with client certificates, gRPC with mutual TLS between the parties). A load generator in this process opens
one TLS connection per client and sends, for each client count (1 / 8 / 64 by default), a bounded number of
inference requests back to back (each client waits for its answer before it sends again). Reported per client count:
p50 / p99 latency, requests/s, ids/s, and the batches the label party formed (mean ids per batch). Beside them, the
limit: the same model's forward in one process (every party's model and the head, no messages), per batch of 1 id
and of 64 ids. The load average of the machine is reported with the figures (a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from secvfl.bench.common import fix_threads, machine
from secvfl.cli.registries import BENCHES
from secvfl.errors import ConfigError

__all__ = ["ServeBench", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(np.ceil(q / 100 * len(ordered))) - 1))
    return ordered[k]


async def _client(port: int, ctx: ssl.SSLContext, bodies: list[bytes], n: int, out: list[tuple[float, int]]) -> None:
    import h11

    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    conn = h11.Connection(h11.CLIENT)
    try:
        for k in range(n):
            body = bodies[k % len(bodies)]
            t0 = time.perf_counter()
            writer.write(conn.send(h11.Request(method="POST", target="/v2/models/demo/infer",
                                               headers=[("Host", "127.0.0.1"), ("Content-Type", "application/json"),
                                                        ("Content-Length", str(len(body)))]))
                         + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            await writer.drain()
            status = 0
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(1 << 16))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    break
            out.append((time.perf_counter() - t0, status))
            conn.start_next_cycle()
    finally:
        writer.close()


def _load(port: int, ctx: ssl.SSLContext, bodies: list[bytes], clients: int, per_client: int
          ) -> tuple[list[tuple[float, int]], float]:
    out: list[tuple[float, int]] = []

    async def main() -> None:
        await asyncio.gather(*[_client(port, ctx, bodies[c::clients] or bodies, per_client, out)
                               for c in range(clients)])

    t0 = time.perf_counter()
    asyncio.run(main())
    return out, time.perf_counter() - t0


def _in_process_forward(demo: Path, run: Path, ids: list[str], repeats: int) -> dict[str, float]:
    """Every party's model and the head in this process on batches of 1 and 64 ids (their preprocessed rows)."""
    from secvfl.checkpoint import read_party_states
    from secvfl.deploy.data import load_run_layout
    from secvfl.deploy.remote import load_party_state
    from secvfl.federation import load_federation
    from secvfl.parties import probabilities
    from secvfl.runner import read_run_config
    from secvfl.serve.model import build_served_run, own_party
    from secvfl.serve.party import load_served_table

    federation = load_federation(demo / "federation.toml")
    cfg = read_run_config(run / "label")
    classes, widths = load_run_layout(run / "label")
    _, states = read_party_states(run / "label")
    built = build_served_run(cfg, widths, len(classes), classes, "label")
    head = own_party(built, "label")
    head.load_state_dict(states["label"])
    head.head.eval()
    bottoms, tables = [], []
    for p in federation.feature_parties:
        party = own_party(build_served_run(cfg, widths, len(classes), classes, p.name), p.name)
        party.load_state_dict(load_party_state(run / p.name, p.name, states[p.name])["party"])
        party.model.eval()
        bottoms.append(party.model)
        tables.append(load_served_table(federation, p.name, run / p.name, None, log=lambda _: None)[1])
    out = {}
    for size in (1, 64):
        batch = (ids * (size // len(ids) + 1))[:size]
        xs = [torch.as_tensor(t.X[t.rows(batch)]) for t in tables]  # ids every party holds
        times = []
        with torch.no_grad():
            for _ in range(repeats):
                t0 = time.perf_counter()
                probabilities(head.head([m(x) for m, x in zip(bottoms, xs, strict=True)]), len(classes))
                times.append(time.perf_counter() - t0)
        out[f"forward_ms_batch_{size}"] = round(statistics.median(times) * 1000, 4)
        out[f"ids_per_second_batch_{size}"] = round(size / statistics.median(times), 1)
    return out


@BENCHES.register("serve")
class ServeBench:
    help = "a served federation on loopback (3 processes): p50/p99 latency and requests/s at 1/8/64 clients"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--dataset", default="breast_cancer", choices=["breast_cancer", "digits", "wine"])
        p.add_argument("--algo", default="splitnn", choices=["splitnn", "vafl", "laser"])
        p.add_argument("--epochs", type=int, default=2, help="training epochs before serving")
        p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64], help="concurrent clients")
        p.add_argument("--requests", type=int, default=1000,
                       help="requests per client count (split evenly over the clients; at least 8 per client)")
        p.add_argument("--ids-per-request", type=int, default=1, help="entity ids in each request")
        p.add_argument("--batch-wait-ms", type=float, default=2.0, help="the label party's --batch-wait-ms")
        p.add_argument("--repeats", type=int, default=200, help="repeats of the in-process forward")

    def run(self, args: argparse.Namespace) -> dict:
        threads = fix_threads(1)
        if args.requests < 1 or not all(1 <= c <= 512 for c in args.clients) or args.ids_per_request < 1:
            raise ConfigError("--requests, --ids-per-request must be at least 1 and --clients from 1 to 512")
        from secvfl.deploy.loopback import free_loopback_ports
        from secvfl.serve.demo import write_demo_federation
        from secvfl.serve.local import LocalServing

        result: dict[str, Any] = {"machine": machine(), "torch_threads": threads, "algo": args.algo,
                                  "dataset": args.dataset, "ids_per_request": args.ids_per_request,
                                  "batch_wait_ms": args.batch_wait_ms, "load_average_before": os.getloadavg()}
        with tempfile.TemporaryDirectory(prefix="secvfl-bench-serve-") as tmp:
            demo = Path(tmp) / "demo"
            write_demo_federation(demo, dataset=args.dataset, parties=2)
            run = demo / "run"
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "secvfl.cli.main", "launch", "--federation",
                                   str(demo / "federation.toml"), "--out", str(run), "--algo", args.algo,
                                   "--parties", "2", "--epochs", str(args.epochs), "--threads", "1", "--no-progress"],
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise ConfigError(f"training the federation failed: {done.stderr.strip().splitlines()[-1:]}")
            result["train_seconds"] = round(time.perf_counter() - t0, 1)
            ids = [line.split(",")[0] for line in (demo / "label.csv").read_text().splitlines()[1:]]
            held = set.intersection(*[{line.split(",")[0] for line in (demo / f"party{k}.csv").read_text()
                                       .splitlines()[1:]} for k in range(2)])
            ids = [i for i in ids if i in held]
            n = args.ids_per_request
            bodies = [json.dumps({"inputs": [{"name": "entity_id", "datatype": "BYTES", "shape": [n],
                                              "data": [ids[(s + j) % len(ids)] for j in range(n)]}]}).encode()
                      for s in range(0, len(ids), n)]
            port = free_loopback_ports(1)[0]
            served = LocalServing(demo, run, port=port, extra=["--batch-wait-ms", str(args.batch_wait_ms),
                                                               "--max-queue", "1024", "--deadline-ms", "10000"])
            try:
                served.wait_ready()
                ctx = served.context()
                _load(port, ctx, bodies, 1, 20)  # warm-up: connections, first batches
                runs = {}
                for clients in args.clients:
                    per_client = max(8, args.requests // clients)
                    before = served.get("/v2/models/demo/stats")[1]
                    cpu0, own0 = served.cpu_seconds(), time.process_time()
                    got, wall = _load(port, ctx, bodies, clients, per_client)
                    cpu1, own1 = served.cpu_seconds(), time.process_time()
                    after = served.get("/v2/models/demo/stats")[1]
                    latencies = [t for t, status in got if status == 200]
                    batches = after["batches"] - before["batches"]
                    runs[str(clients)] = {
                        "requests": len(got), "failed": sum(1 for _, s in got if s != 200),
                        "p50_ms": round(percentile(latencies, 50) * 1000, 2),
                        "p99_ms": round(percentile(latencies, 99) * 1000, 2),
                        "requests_per_second": round(len(latencies) / wall, 1),
                        "ids_per_second": round(len(latencies) * n / wall, 1),
                        "mean_batch_ids": round((after["ids"] - before["ids"]) / batches, 2) if batches else 0.0,
                        "mean_score_ms": round((after["score_seconds"] - before["score_seconds"]) / batches * 1000, 2)
                        if batches else 0.0,
                        "seconds": round(wall, 2),
                        # CPU per request of each process (the load generator is this process): with 2 cores, their
                        # sum bounds requests/s at 2 / sum whatever the batching
                        "cpu_ms_per_request": {**{k: round((cpu1[k] - cpu0[k]) / len(got) * 1000, 3) for k in cpu0},
                                               "load-generator": round((own1 - own0) / len(got) * 1000, 3)},
                    }
                result["served"] = runs
            finally:
                served.stop()
            result["in_process"] = _in_process_forward(demo, run, ids, args.repeats) if args.algo != "laser" else {}
        result["load_average_after"] = os.getloadavg()
        return result
