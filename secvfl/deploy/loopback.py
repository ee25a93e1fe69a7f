"""A federation of parties on this host (127.0.0.1), with fresh certificates: for trying a deployment, for the
transport benchmark and for tests."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

__all__ = ["free_loopback_ports", "loopback_federation"]


def free_loopback_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (the OS picks them; bind soon after)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
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
