"""The serving processes of a trained run on this host (127.0.0.1): started, watched and stopped by their process ids.

For `secvfl bench serve` and the tests: every feature party (and the aggregator) runs `secvfl serve` in its own
process (with ``--table FILE`` where ``tables`` names one for it), then the label party with ``--http
127.0.0.1:PORT``; :meth:`LocalServing.wait_ready` polls the endpoint's readiness probe with the federation's client
certificate (``certs/clients/app`` of `secvfl demo-federation`).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

from secvfl.errors import ConfigError

__all__ = ["LocalServing"]


class LocalServing:
    def __init__(self, demo: Path, run: Path, *, port: int, extra: list[str] | tuple[str, ...] = (),
                 party_flags: list[str] | tuple[str, ...] = (), client: str = "app",
                 tables: dict[str, Path] | None = None) -> None:
        from secvfl.federation import load_federation

        self.demo, self.run, self.port, self.client = Path(demo), Path(run), port, client
        self.federation = load_federation(self.demo / "federation.toml")
        label = self.federation.label_party
        self.names = [*(p.name for p in self.federation.parties if p.name != label), label]
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        for name in self.names:
            cmd = [sys.executable, "-m", "secvfl.cli.main", "serve", "--federation", str(self.demo / "federation.toml"),
                   "--name", name, "--run", str(self.run / name), *party_flags]
            if name == label:
                cmd += ["--http", f"127.0.0.1:{port}", *extra]
            elif tables and name in tables:
                cmd += ["--table", str(tables[name])]
            self.logs[name] = self.run / f"serve-{name}.log"
            with self.logs[name].open("w") as log:
                self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, name: str) -> str:
        return self.logs[name].read_text()

    def context(self, *, with_cert: bool = True) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.federation.ca))
        if with_cert:
            clients = self.federation.ca.parent / "clients"
            ctx.load_cert_chain(str(clients / f"{self.client}.pem"), str(clients / f"{self.client}.key"))
        return ctx

    def connection(self, *, with_cert: bool = True, timeout: float = 60) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context(with_cert=with_cert),
                                           timeout=timeout)

    def get(self, path: str) -> tuple[int, dict]:
        conn = self.connection()
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"{}")
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ConfigError(f"serving process {name} stopped:\n{self.log(name)[-3000:]}")
            try:
                if self.get("/v2/health/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise ConfigError(f"the served federation was not ready within {timeout:g} s:\n" +
                          "\n".join(self.log(n)[-1500:] for n in self.names))

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, every thread) of each serving process so far, from /proc."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, proc in self.procs.items():
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                out[name] = float("nan")
        return out

    def kill(self, name: str, sig: int = signal.SIGKILL, *, wait: bool = True) -> None:
        """Send ``sig`` to party ``name``'s process (and wait for it to end, unless ``wait`` is False)."""
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            if wait:
                proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM to every process, the label party first; SIGKILL to any still running 30 s later."""
        for name in reversed(self.names):
            proc = self.procs[name]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
