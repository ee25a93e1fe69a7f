"""`secvfl bench scale`: a federation of millions of customers on one machine. For each size (rows per party):

* **align**: ECDH-PSI (protocols.psi) between the label party and one feature party (``pair``: the figure of a
  10^6 x 10^6 alignment) and among all three parties (``federation``), each party in its own process over the
  deployment transport (gRPC with mutual TLS on loopback), reading its ids from its own file: seconds, bytes each
  party sent, each party's peak RSS (its main process, and its largest worker process), and a check that every
  party's result is exactly the true intersection;
* **openmined**: OpenMined's ``openmined-psi`` (C++, P-256, one process: the client learns the intersection, the
  server nothing) on the same two id sets, where it is installed and the size is at most ``--openmined-max``;
* **load**: a feature party's own file of ``--columns`` float columns (CSV and Parquet) read and prepared into its
  float32 block (every row, as a deployed party does for its aligned rows: secvfl.deploy.data): seconds and peak
  RSS, against the block's size;
* **epoch**: one split-NN epoch (``secvfl train``'s defaults) over the rows, 3 parties in one process, on a
  synthetic table of ``--epoch-columns`` columns per feature party: seconds.

Each measurement runs in a fresh process (its own peak RSS), ``--repeats`` times; the median is reported, with
the machine, the thread count and the load average. Data is generated (never downloaded) under ``--dir`` (default:
a temporary folder, removed afterwards). Ids: the label party holds ``C0..C(n-1)``; feature party ``k`` holds n
ids of which a fraction ``--overlap`` are the label party's, in a shuffled order.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from secvfl.bench.common import machine
from secvfl.cli.registries import BENCHES
from secvfl.errors import ConfigError

__all__ = ["ScaleBench", "make_federation_files"]

_ID_WIDTH = 10


def _ids(start: int, stop: int) -> Any:
    import pyarrow as pa

    n = stop - start
    digits = np.char.zfill(np.arange(start, stop).astype(str), _ID_WIDTH) if n else np.array([], dtype=str)
    return pa.array(np.char.add("C", digits), pa.string())


def _party_rows(n: int, overlap: float, k: int, seed: int) -> np.ndarray:
    """Feature party k's id numbers: n of them, ``overlap * n`` shared with the label party's 0..n-1 (the last
    ones, so the parties' shared parts overlap too), the rest its own; shuffled."""
    shared = int(round(overlap * n))
    own = np.arange(n + k * n, n + k * n + (n - shared))
    rows = np.concatenate([np.arange(n - shared, n), own])
    return np.random.default_rng([seed, k]).permutation(rows)


def make_federation_files(folder: Path, n: int, overlap: float, columns: int, formats: list[str], seed: int = 0,
                          chunk: int = 1 << 18) -> dict[str, dict[str, Path]]:
    """Per party, its own file in each format: the label party (id, label), feature parties (id, ``columns``
    float columns, 4 decimals). Written in chunks of rows (bounded memory); returns party -> format -> path."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    label_rows = rng.permutation(n)
    parties = {"label": label_rows, **{f"party{k}": _party_rows(n, overlap, k, seed) for k in range(2)}}
    out: dict[str, dict[str, Path]] = {}
    for party, rows in parties.items():
        out[party] = {}
        writers: dict[str, Any] = {}
        try:
            for start in range(0, len(rows), chunk):
                part = rows[start : start + chunk]
                ids = pa.array(np.char.add("C", np.char.zfill(part.astype(str), _ID_WIDTH)), pa.string())
                if party == "label":
                    cols = {"id": ids, "label": pa.array(np.where(part % 3 == 0, "yes", "no"))}
                else:
                    values = np.round(rng.normal(size=(len(part), columns)), 4)
                    cols = {"id": ids, **{f"{party}_x{j}": pa.array(values[:, j]) for j in range(columns)}}
                batch = pa.RecordBatch.from_pydict(cols)
                for fmt in formats:
                    if fmt not in writers:
                        path = folder / f"{party}.{fmt}"
                        out[party][fmt] = path
                        writers[fmt] = (pacsv.CSVWriter(str(path), batch.schema) if fmt == "csv"
                                        else pq.ParquetWriter(str(path), batch.schema))
                    writers[fmt].write_batch(batch)
        finally:
            for w in writers.values():
                w.close()
    return out


# -- measurements, each in its own process ----------------------------------------------------------------------
def _status_mb(pid: int | str, field: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def _rss() -> dict[str, float]:
    """Peak RSS of this process (VmHWM: its own, not the parent's it was started from, as ru_maxrss would be)."""
    return {"main_mb": round(_status_mb("self", "VmHWM"), 1)}


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                out += [int(child), *_descendants(int(child))]
    except OSError:
        pass
    return out


def _pss_mb(pid: int) -> float:
    """Proportional set size: pages shared between processes (a worker just forked from its party, before it
    execs) counted once in all, not once per process as RSS would."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return _status_mb(pid, "VmRSS")


class _PeakTreeRss(threading.Thread):
    """Samples the memory (PSS) of this process and all its descendants (a party's worker pool) together, every
    0.2 s."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = self.now()
        self.done = threading.Event()

    @staticmethod
    def now() -> float:
        me = os.getpid()
        return sum(_pss_mb(p) for p in [me, *_descendants(me)])

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, self.now())

    def stop(self) -> float:
        self.done.set()
        self.join(5)
        return round(max(self.peak, self.now()), 1)


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (its worker pool): the work, whatever the load."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _psi_party(fed_path: str, name: str, ids_file: str, peers: list[str], workers: int, barrier: Any,
               queue: Any) -> None:
    """One party of the PSI over the deployment transport (gRPC + mTLS), in its own process."""
    try:
        import pyarrow.parquet as pq

        from protocols.psi import Workers, align_rows_with_peers
        from secvfl.deploy.limits import startup_limits
        from secvfl.deploy.party import Timeouts, make_transport, run_names
        from secvfl.federation import load_federation
        from secvfl.transport.layers import Role
        from secvfl.transport.network import Network

        federation = load_federation(Path(fed_path))
        runs = run_names(federation)
        baseline = _PeakTreeRss.now()  # the process with its libraries (torch, grpc, pyarrow), before any id
        sampler = _PeakTreeRss()
        sampler.start()
        t0 = time.perf_counter()
        ids = pq.read_table(ids_file, columns=["id"]).column("id").combine_chunks()
        read_seconds = time.perf_counter() - t0
        transport = make_transport(federation, name, Timeouts(wait=7200.0, peer=300.0, heartbeat=2.0), lambda s: None,
                                   startup_limits(federation, ids))  # as `secvfl launch` receives the PSI
        roles = {runs[p.name]: Role.LABEL if p.name == federation.label_party else Role.FEATURE
                 for p in federation.parties if p.name in [name, *peers]}
        net = Network(roles, transport=transport)
        barrier.wait(600)
        t0, cpu0 = time.perf_counter(), _cpu_seconds()
        with Workers(workers) as pool:
            rows = align_rows_with_peers(net, runs[name], [runs[p] for p in peers], ids, workers=pool)
        seconds = time.perf_counter() - t0
        cpu = _cpu_seconds() - cpu0
        peak = sampler.stop()
        time.sleep(1.0)  # let the last frames leave before closing
        transport.close()
        queue.put({"party": name, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
                   "read_ids_seconds": round(read_seconds, 2),
                   "bytes_sent": transport.stats.bytes_total, "messages_sent": transport.stats.messages_total,
                   "shared": {p: int(len(r)) for p, r in rows.items()},
                   "baseline_mb": round(baseline, 1), "peak_mb": peak, "main_peak_mb": _rss()["main_mb"]})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the bench with it
        queue.put({"party": name, "error": f"{type(exc).__name__}: {exc}"})


def _align(folder: Path, files: dict[str, dict[str, Path]], parties: list[str], workers: int, n: int,
           overlap: float) -> dict[str, Any]:
    from secvfl.deploy.loopback import loopback_federation

    fed = loopback_federation(Path(tempfile.mkdtemp(prefix="fed-", dir=folder)), len(parties) - 1, name="scale")
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(len(parties)), ctx.Queue()
    procs = []
    for p in parties:
        peers = [q for q in parties if q != "label"] if p == "label" else ["label"]
        procs.append(ctx.Process(target=_psi_party, args=(str(fed), p, str(files[p]["parquet"]), peers, workers,
                                                          barrier, queue)))
    t0 = time.perf_counter()
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=7200) for _ in procs]
    wall = time.perf_counter() - t0
    for proc in procs:
        proc.join(60)
    errors = [f"{r['party']}: {r['error']}" for r in results if "error" in r]
    if errors:
        raise RuntimeError("PSI parties failed: " + "; ".join(errors))
    by_party = {r.pop("party"): r for r in results}
    shared = int(round(overlap * n))
    for p, r in by_party.items():  # exactly the true intersection, on every party's side
        expected = {q: shared for q in r["shared"]}
        if r["shared"] != expected:
            raise RuntimeError(f"{p}'s PSI found {r['shared']} shared ids, the true intersection has {shared}")
    seconds = max(r["seconds"] for r in by_party.values())
    return {"seconds": seconds, "cpu_seconds": round(sum(r["cpu_seconds"] for r in by_party.values()), 2),
            "wall_with_start_seconds": round(wall, 2),
            "bytes_total": sum(r["bytes_sent"] for r in by_party.values()), "parties": by_party}


def _openmined(files: dict[str, dict[str, Path]], queue: Any) -> None:
    try:
        import private_set_intersection.python as omp
        import pyarrow.parquet as pq

        client_ids = pq.read_table(files["label"]["parquet"], columns=["id"]).column("id").to_pylist()
        server_ids = pq.read_table(files["party0"]["parquet"], columns=["id"]).column("id").to_pylist()
        t0, cpu0 = time.perf_counter(), _cpu_seconds()
        client = omp.client.CreateWithNewKey(True)
        server = omp.server.CreateWithNewKey(True)
        setup = server.CreateSetupMessage(1e-9, len(client_ids), server_ids, omp.DataStructure.RAW)
        request = client.CreateRequest(client_ids)
        response = server.ProcessRequest(request)
        found = client.GetIntersection(setup, response)
        seconds = time.perf_counter() - t0
        sent = sum(len(m.SerializeToString()) for m in (setup, request, response))
        queue.put({"seconds": round(seconds, 2), "cpu_seconds": round(_cpu_seconds() - cpu0, 2), "bytes_total": sent,
                   "shared": len(found), **_rss(),
                   "note": "one process, one core; the client (label party) learns the intersection, the server "
                           "nothing; P-256, false-positive rate 1e-9"})
    except BaseException as exc:  # noqa: BLE001
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def _load(path: str, n_shared: int, queue: Any) -> None:
    """A deployed feature party: read its own file, prepare its columns (every row, split 80/10/10) into its float32
    block as it does for its aligned rows. ``n_shared`` is reported only."""
    try:
        import pyarrow.compute
        import pyarrow.csv
        import pyarrow.parquet  # noqa: F401 - imported before the clock starts

        from secvfl.config import TrainConfig
        from secvfl.data.table import open_table
        from secvfl.deploy.data import prepare_own_block, read_own_file
        from secvfl.federation import DataSpec

        baseline = _rss()["main_mb"]  # the process with its libraries, before reading
        t0 = time.perf_counter()
        source = Path(path)
        spec = DataSpec(file=source, id="id", columns=tuple(c for c in open_table(source).names if c != "id"))
        own = read_own_file(spec, "party0")
        read_seconds = time.perf_counter() - t0
        learned = np.arange(len(own.ids))  # every row: the whole file becomes the party's float32 block
        ids = own.ids
        a, b = int(0.8 * len(ids)), int(0.9 * len(ids))
        splits = (ids.slice(0, a), ids.slice(a, b - a), ids.slice(b))
        (train, val, test), names, _, _ = prepare_own_block(own, splits, learned, TrainConfig())
        seconds = time.perf_counter() - t0
        block = train.nbytes + val.nbytes + test.nbytes
        rss = _rss()
        queue.put({"seconds": round(seconds, 2), "read_seconds": round(read_seconds, 2), "rows": len(ids),
                   "shared_rows": n_shared,
                   "columns": len(names), "block_mb": round(block / 2**20, 1), **rss,
                   "baseline_mb": baseline, "rss_over_block": round(rss["main_mb"] / (block / 2**20), 2),
                   "dtype": str(train.dtype), "one_block": bool(train.base is not None and train.base is test.base)})
    except BaseException as exc:  # noqa: BLE001
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def _epoch(n: int, columns: int, queue: Any) -> None:
    """One split-NN epoch, 3 parties in one process, secvfl train's defaults, on a synthetic table."""
    try:
        import torch

        from secvfl.config import TrainConfig
        from secvfl.data.dataset import Dataset
        from secvfl.data.partition import partition_columns
        from secvfl.runner import build_run

        torch.set_num_threads(1)
        rng = np.random.default_rng(0)
        d = 2 * columns
        X = np.empty((n, d), dtype=np.float32)
        for start in range(0, n, 1 << 18):
            X[start : start + (1 << 18)] = rng.standard_normal((min(n - start, 1 << 18), d), dtype=np.float32)
        y = (X[:, 0] + X[:, columns] > 0).astype(np.int64)
        n_eval = max(1, n // 100)
        data = Dataset("synthetic", X, y, X[:n_eval], y[:n_eval], X[:n_eval], y[:n_eval], 2,
                       [f"x{j}" for j in range(d)], ["0", "1"])
        cfg = TrainConfig(algo="splitnn", parties=2, epochs=1, threads=1)
        run = build_run(cfg, (data, partition_columns(d, 2)))
        t0 = time.perf_counter()
        loss = run.algorithm.train_epoch(0)["loss"]
        seconds = time.perf_counter() - t0
        steps = -(-n // cfg.batch_size)
        t0 = time.perf_counter()
        run.algorithm.evaluate("val")
        queue.put({"seconds": round(seconds, 2), "steps": steps, "ms_per_step": round(1000 * seconds / steps, 3),
                   "loss": round(float(loss), 4), "eval_rows": n_eval,
                   "eval_seconds": round(time.perf_counter() - t0, 2), "batch_size": cfg.batch_size,
                   "table_mb": round(X.nbytes / 2**20, 1), **_rss()})
    except BaseException as exc:  # noqa: BLE001
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def _kernel(count: int = 20_000) -> dict[str, Any]:
    """The floor of the alignment: CPU microseconds of each step of the curve arithmetic, in this process, one core.
    A pair of sets of n and m ids costs (n + m) hashes, 2 (n + m) multiplications and (n + m) point checks."""
    import hashlib

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    from protocols.psi_kernel import DOMAIN, blind_ids, hash_to_curve, on_curve, reblind_points

    ids = [f"C{i:010d}".encode() for i in range(count)]
    key = X25519PrivateKey.generate()
    points = [hash_to_curve(i) for i in ids]
    public = [X25519PublicKey.from_public_bytes(u) for u in points]

    def per_op(fn: Any) -> float:
        t0 = time.process_time()
        fn()
        return round(1e6 * (time.process_time() - t0) / count, 2)

    offsets = np.cumsum([0, *[len(i) for i in ids]]).astype(np.int64).tobytes()
    blinded = blind_ids(key.private_bytes_raw(), offsets, b"".join(ids))
    steps = {
        "sha256": per_op(lambda: [hashlib.sha256(DOMAIN + b"\0" + i).digest() for i in ids]),
        "hash_to_curve (sha256 + Legendre, ~2 tries)": per_op(lambda: [hash_to_curve(i) for i in ids]),
        "Legendre check of a received point": per_op(lambda: [on_curve(int.from_bytes(u, "little")) for u in points]),
        "X25519 key object from bytes": per_op(lambda: [X25519PublicKey.from_public_bytes(u) for u in points]),
        "X25519 multiplication (OpenSSL)": per_op(lambda: [key.exchange(p) for p in public]),
        "blind an id (kernel: all of the above)": per_op(lambda: blind_ids(key.private_bytes_raw(), offsets,
                                                                          b"".join(ids))),
        "reblind a point (kernel: check, multiply, match hash)": per_op(
            lambda: reblind_points(key.private_bytes_raw(), blinded, 11)),
    }
    per_id = steps["blind an id (kernel: all of the above)"] + steps[
        "reblind a point (kernel: check, multiply, match hash)"]
    return {"cpu_us_per_op": steps, "cpu_seconds_per_pair_of_1e6": round(2 * 1e6 * per_id / 1e6, 1),
            "note": "a pair of 1e6 x 1e6 ids: 2e6 ids blinded and 2e6 points reblinded; divided by the cores for "
                    "the wall-time floor"}


def _in_process(target: Any, *args: Any, timeout: float = 7200) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get(timeout=timeout)
    proc.join(60)
    if "error" in result:
        raise RuntimeError(f"{target.__name__.strip('_')} failed: {result['error']}")
    return result


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose seconds are the median (its figures stay together), and every run's seconds."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["seconds_each"] = [r["seconds"] for r in runs]
    middle["seconds_median"] = statistics.median(r["seconds"] for r in runs)
    return middle


def _size(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of rows") from None
    if value < 100 or value != int(value):
        raise argparse.ArgumentTypeError(f"a size is a whole number of rows, at least 100; got {text}")
    return int(value)


@BENCHES.register("scale")
class ScaleBench:
    help = "federations of 10^5..10^7 customers: alignment (PSI), loading a party's file, one training epoch"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--sizes", nargs="+", type=_size, default=[100_000, 1_000_000, 10_000_000],
                       help="rows (ids) per party (default: 1e5 1e6 1e7)")
        p.add_argument("--overlaps", nargs="+", type=float, default=[0.5, 0.9],
                       help="fractions of a feature party's ids the label party holds (default: 0.5 0.9)")
        p.add_argument("--parts", nargs="+", default=["kernel", "align", "openmined", "load", "epoch"],
                       choices=["kernel", "align", "openmined", "load", "epoch"], help="what to measure (default: all)")
        p.add_argument("--federation-max", type=_size, default=1_000_000,
                       help="largest size at which the three-party alignment runs too (default: 1e6)")
        p.add_argument("--openmined-max", type=_size, default=1_000_000,
                       help="largest size at which openmined-psi runs (default: 1e6; it runs on one core)")
        p.add_argument("--columns", type=int, default=50, help="float columns of a feature party's file (default 50)")
        p.add_argument("--epoch-columns", type=int, default=20,
                       help="columns per feature party of the epoch's synthetic table (default 20)")
        p.add_argument("--formats", nargs="+", default=["csv", "parquet"], choices=["csv", "parquet"],
                       help="file formats to load (default: both)")
        p.add_argument("--workers", type=int, default=None,
                       help="PSI worker processes per party (default: this machine's CPUs)")
        p.add_argument("--repeats", type=int, default=3, help="runs of each measurement (the median is reported)")
        p.add_argument("--dir", default=None, help="folder for the generated files (default: a temporary one, "
                                                   "removed afterwards; mind the disk: a 1e7 x 50 CSV is ~4 GB)")

    def run(self, args: argparse.Namespace) -> dict:
        if args.repeats < 1 or args.columns < 1 or args.epoch_columns < 1:
            raise ConfigError("--repeats, --columns and --epoch-columns must be at least 1")
        if any(not 0 < o <= 1 for o in args.overlaps):
            raise ConfigError(f"--overlaps must be fractions in (0, 1], got {args.overlaps}")
        if args.workers is not None and args.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {args.workers}")
        from protocols.psi import default_workers

        workers = args.workers or default_workers()
        base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="secvfl-bench-scale-"))
        results: dict[str, Any] = {}
        kernel = _kernel() if "kernel" in args.parts else None
        try:
            for n in args.sizes:
                results[str(n)] = self._size(base / f"n{n}", n, args, workers)
                _log(f"size {n}: done")
        finally:
            if not args.dir:
                shutil.rmtree(base, ignore_errors=True)
        return {"benchmark": "scale", "sizes": results, "workers_per_party": workers, "psi_floor": kernel,
                "config": {k: getattr(args, k) for k in ("sizes", "overlaps", "parts", "federation_max",
                                                          "openmined_max", "columns", "epoch_columns", "formats",
                                                          "repeats")},
                "load_average": os.getloadavg(), "machine": machine()}

    def _size(self, folder: Path, n: int, args: argparse.Namespace, workers: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        needs_files = {"align", "openmined", "load"} & set(args.parts)
        for overlap in args.overlaps if needs_files else []:
            where = folder / f"overlap{overlap:g}"
            first = overlap == args.overlaps[0]
            formats = sorted({"parquet", *(args.formats if first and "load" in args.parts else [])})
            t0 = time.perf_counter()
            files = make_federation_files(where, n, overlap, args.columns if first else 1, formats)
            entry: dict[str, Any] = {"generate_seconds": round(time.perf_counter() - t0, 1)}
            if "align" in args.parts:
                entry["pair"] = _median([_align(where, files, ["label", "party0"], workers, n, overlap)
                                         for _ in range(args.repeats)])
                _log(f"size {n}, overlap {overlap:g}: pair aligned in {entry['pair']['seconds_median']} s")
                if n <= args.federation_max:
                    entry["federation"] = _median([_align(where, files, ["label", "party0", "party1"], workers, n,
                                                          overlap) for _ in range(args.repeats)])
            if "openmined" in args.parts and n <= args.openmined_max:
                try:
                    import private_set_intersection.python  # noqa: F401
                except ImportError:
                    entry["openmined"] = {"skipped": "openmined-psi is not installed (pip install "
                                                     "'secvfl[bench]')"}
                else:
                    entry["openmined"] = _median([_in_process(_openmined, files) for _ in range(args.repeats)])
                    if entry["openmined"]["shared"] != int(round(overlap * n)):
                        raise RuntimeError("openmined-psi's intersection differs from the true one")
            if first and "load" in args.parts:
                entry["load"] = {fmt: _median([_in_process(_load, str(files["party0"][fmt]), int(round(overlap * n)))
                                               for _ in range(args.repeats)]) for fmt in args.formats}
            out[f"overlap {overlap:g}"] = entry
            shutil.rmtree(where, ignore_errors=True)
        if "epoch" in args.parts:
            out["epoch"] = _median([_in_process(_epoch, n, args.epoch_columns) for _ in range(args.repeats)])
        return out


def _log(text: str) -> None:
    print(f"[bench scale] {text}", file=sys.stderr, flush=True)

