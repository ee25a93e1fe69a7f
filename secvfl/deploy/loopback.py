"""A federation of parties on this host (127.0.0.1), with fresh certificates: for trying a deployment, for the
transport benchmark and for tests."""

from __future__ import annotations

import random
import socket
from collections.abc import Mapping
from pathlib import Path

__all__ = ["free_loopback_ports", "loopback_federation"]


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out as the source ports of outgoing connections (Linux; its default elsewhere)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_loopback_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (bind soon after).

    They are drawn at random from below the kernel's ephemeral range, each checked by binding it: a port the kernel
    picks for ``bind(0)`` comes from the range it also gives every outgoing connection as its source port, so in the
    moment between choosing a port and a party binding it, any client on the host (another federation's gRPC
    channel) could take it. Below that range only another process choosing the same port at random could."""
    low, _ = _ephemeral_range()
    start = max(1024, low - 12000)
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(200 * n):  # bounded: a crowded range falls back to the kernel's choice below
        if len(ports) == n:
            return ports
        port = rng.randrange(start, low) if low > start else 0
        if port == 0 or port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    socks = [socket.socket() for _ in range(n - len(ports))]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return ports + [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def loopback_federation(folder: Path, features: int, *, name: str = "demo", aggregator: bool = False,
                        data: Mapping[str, str] | None = None) -> Path:
    """Write ``folder/federation.toml`` (a label party ``label``, feature parties ``party0``... and, with
    ``aggregator``, a CKKS aggregator ``adder``, all on free loopback ports) and its certificates; returns the file.
    ``data``: party -> its data table as TOML (``{ file = "x.csv", columns = ["a"], id = "id" }``)."""
    from secvfl.certs import issue_certificates, write_certificates
    from secvfl.federation import load_federation

    folder.mkdir(parents=True, exist_ok=True)
    names = ["label", *[f"party{i}" for i in range(features)], *(["adder"] if aggregator else [])]
    text = f'[federation]\nname = "{name}"\nlabel_party = "label"\n' + ('aggregator = "adder"\n' if aggregator else "")
    for party, port in zip(names, free_loopback_ports(len(names)), strict=True):
        text += f'[parties.{party}]\naddress = "127.0.0.1:{port}"\n'
        if data and party in data:
            text += f"data = {data[party]}\n"
    path = folder / "federation.toml"
    path.write_text(text)
    write_certificates(issue_certificates(load_federation(path)))
    return path
