"""Serving a trained federation (`secvfl serve`): each party's process, the label party's HTTPS endpoint.

Fast tests cover the pieces in this process: the fitted preprocessing against the training run's own preparation,
the serving messages' checks, the audit log's chain, the batcher's bounds, the request parser, client certificates.
The slow ones train federations with `secvfl launch` (one process per party), serve them with `secvfl serve` (one
process per party, the label party on HTTPS with client certificates, all on 127.0.0.1) and check the answers
against `secvfl predict` on the same model in one process (the reference: the parties' saved states assembled into
an in-process run over the joined table, scored by the in-process algorithms). Every process started here is
stopped by its process id; every wait is bounded.
"""

from __future__ import annotations

import csv
import hashlib
import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from secvfl.errors import ConfigError, MessageError
from secvfl.messages import Message, decode, encode

# -- helpers: a federation of files, its training, its serving processes, the in-process reference ----------------


def _secvfl(*args: str) -> list[str]:
    return [sys.executable, "-m", "secvfl.cli.main", *args]


def _launch(fed: Path, out: Path, *args: str, timeout: float = 400) -> None:
    done = subprocess.run(_secvfl("launch", "--federation", str(fed), "--out", str(out), "--threads", "1",
                                  "--party-timeout", "120", "--no-progress", *args),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def _free_port() -> int:
    from secvfl.deploy.loopback import free_loopback_ports

    return free_loopback_ports(1)[0]


def _client_context(demo: Path, *, with_cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(demo / "certs" / "ca.pem"))
    if with_cert:
        ctx.load_cert_chain(str(demo / "certs" / "clients" / "app.pem"), str(demo / "certs" / "clients" / "app.key"))
    return ctx


class Served:
    """The serving processes of one trained run: every feature party (and aggregator), then the label party."""

    def __init__(self, demo: Path, run: Path, *extra: str) -> None:
        from secvfl.federation import load_federation

        self.demo, self.run = demo, run
        self.federation = load_federation(demo / "federation.toml")
        self.port = _free_port()
        self.logs: dict[str, Path] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        names = [p.name for p in self.federation.parties if p.name != self.federation.label_party]
        for name in [*names, self.federation.label_party]:
            args = ["serve", "--federation", str(demo / "federation.toml"), "--name", name, "--run", str(run / name),
                    "--party-timeout", "120", "--peer-timeout", "5"]
            if name == self.federation.label_party:
                args += ["--http", f"127.0.0.1:{self.port}", *extra]
            self.logs[name] = run / f"serve-{name}.log"
            with self.logs[name].open("w") as log:
                self.procs[name] = subprocess.Popen(_secvfl(*args), stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True)
        self.wait_ready()

    def log(self, name: str) -> str:
        return self.logs[name].read_text()

    def connection(self, *, with_cert: bool = True) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=_client_context(self.demo,
                                                                                          with_cert=with_cert),
                                           timeout=60)

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} stopped:\n{self.log(name)[-3000:]}"
            try:
                status, _ = self.get("/v2/health/ready")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"not ready in {timeout} s:\n" + "\n".join(self.log(n)[-1500:] for n in self.procs))

    def get(self, path: str) -> tuple[int, dict]:
        conn = self.connection()
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"{}")
        finally:
            conn.close()

    def post(self, path: str, body: bytes, conn: http.client.HTTPSConnection | None = None) -> tuple[int, dict]:
        own = conn is None
        conn = conn or self.connection()
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            if own:
                conn.close()

    def infer(self, ids: list[str], conn: http.client.HTTPSConnection | None = None, **params: object
              ) -> tuple[int, dict]:
        body = {"inputs": [{"name": "entity_id", "datatype": "BYTES", "shape": [len(ids)], "data": ids}]}
        if params:
            body["parameters"] = params
        return self.post("/v2/models/demo/infer", json.dumps(body).encode(), conn)

    def stop(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)

    def close(self) -> None:
        for name in [self.federation.label_party, *self.procs]:
            proc = self.procs[name]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def outputs(body: dict) -> dict[str, object]:
    out = {o["name"]: o for o in body["outputs"]}
    n = out["error"]["shape"][0]
    proba = np.asarray(out["probabilities"]["data"], dtype=np.float64).reshape(n, -1)
    return {"proba": proba, **{k: out[k]["data"] for k in ("predicted_class", "contributors", "predictors", "error")}}


def _read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with path.open(newline="") as fh:
        rows = list(csv.reader(fh))
    return rows[0], rows[1:]


def reference(demo: Path, run: Path, tmp: Path, observed: list[int] | None = None) -> dict[str, np.ndarray]:
    """`secvfl predict` on the test split of the same model in one process: entity id -> class probabilities.

    The in-process run: the rows every party holds, in the label party's file order, joined into one CSV (feature
    columns in party order, then the label) -- what the launched run trained on (tests/test_deploy_data.py) -- and a
    checkpoint holding the label party's and every feature party's saved state (each party's own file, as the
    label party's checkpoint names it)."""
    from secvfl.checkpoint import _checksum
    from secvfl.cli.main import main
    from secvfl.data.csv_loader import encode_labels
    from secvfl.data.preprocess import split_rows
    from secvfl.deploy.remote import load_party_state
    from secvfl.federation import load_federation
    from secvfl.io import torch_bytes, torch_load
    from secvfl.runner import read_run_config

    federation = load_federation(demo / "federation.toml")
    _, label_rows = _read_csv(demo / "label.csv")
    features = []
    for p in federation.feature_parties:
        header, rows = _read_csv(p.data.file)
        features.append((header[1:], {r[0]: r[1:] for r in rows}))
    joined = [r for r in label_rows if all(r[0] in table for _, table in features)]
    tmp.mkdir(parents=True, exist_ok=True)
    with (tmp / "joined.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([c for names, _ in features for c in names] + ["label"])
        for r in joined:
            w.writerow([v for _, table in features for v in table[r[0]]] + [r[1]])
    cfg = read_run_config(run / "label")
    y, _ = encode_labels([r[1] for r in joined], "label")
    test_ids = [joined[i][0] for i in split_rows(y, seed=cfg.seed, val_fraction=cfg.val_fraction)[2]]
    inproc = tmp / "inproc"
    shutil.copytree(run / "label", inproc, ignore=shutil.ignore_patterns("audit", "*.log"))
    config = (inproc / "config.toml").read_text()
    (inproc / "config.toml").write_text(config.replace(f'dataset = "{cfg.dataset}"',
                                                       f'dataset = "csv:{tmp / "joined.csv"}"'))
    latest = json.loads((inproc / "checkpoints" / "latest.json").read_text())
    target = inproc / "checkpoints" / latest["dir"]
    meta = json.loads((target / "run.json").read_text())
    meta.pop("checksum")
    for name in [p.name for p in federation.feature_parties]:
        record = torch_load(target / f"party-{name}.pt")
        data = torch_bytes(load_party_state(run / name, name, record)["party"])
        (target / f"party-{name}.pt").write_bytes(data)
        meta["files"][f"party-{name}.pt"] = hashlib.sha256(data).hexdigest()
    (target / "run.json").write_text(json.dumps({**meta, "checksum": _checksum(meta)}))
    args = ["predict", "--run", str(inproc), "--split", "test", "--out", str(tmp / "predicted.csv")]
    if observed is not None:
        args += ["--observed", ",".join(map(str, observed))]
    assert main(args) == 0
    header, rows = _read_csv(tmp / "predicted.csv")
    columns = [j for j, h in enumerate(header) if h.startswith("p_")]
    assert len(rows) == len(test_ids)
    return {ident: np.array([float(r[j]) for j in columns]) for ident, r in zip(test_ids, rows, strict=True)}
