"""Parties in separate processes over gRPC with mutual TLS (issue 18).

Fast tests run two transports in this process on 127.0.0.1 (chunking, counting, refusals, failure detection,
the request codec); the slow ones start real party processes with ``secvfl launch`` and check that a run gives the
in-process run's metrics and byte counts, and that a party killed mid-run stops the others with a clear error and
the run resumes to the uninterrupted result. Every server listens on 127.0.0.1 only, every wait is bounded, and
every process started here is stopped by its process id.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.algorithms.missing.baselines import PredictorSpec
from secvfl.certs import issue_certificates, write_certificates
from secvfl.config import TrainConfig
from secvfl.deploy.calls import call_message, read_call, read_result, result_message
from secvfl.deploy.loopback import loopback_federation
from secvfl.deploy.party import Timeouts, check_across_processes, coordinate, run_names
from secvfl.deploy.remote import LEAVE_AT_ENV
from secvfl.errors import MessageError, ProtocolError, UnsupportedError
from secvfl.federation import load_federation, verify_peer_certificate
from secvfl.messages import Message, decode, encode
from secvfl.runner import build_run
from secvfl.transport.grpc_link import CHUNK_BYTES, GrpcTransport, PartyLost, PeerAddress, TlsFiles
from secvfl.transport.layers import Role


def _federation(folder: Path, features: int = 2, *, aggregator: bool = False) -> Path:
    return loopback_federation(folder, features, aggregator=aggregator)


def _transport(fed_path: Path, name: str, *, as_name: str | None = None, tls_of: str | None = None,
               peer_timeout: float = 3.0, timeout: float = 10.0, heartbeat: float = 0.2) -> GrpcTransport:
    """Party ``name``'s transport; ``as_name``: the certificate name it claims, ``tls_of``: whose files it uses."""
    fed = load_federation(fed_path)
    runs = run_names(fed)
    addresses = {p.name: PeerAddress(runs[p.name], p.name, str(p.address)) for p in fed.parties}
    me = addresses[name]
    if as_name is not None:
        me = PeerAddress(runs[as_name], as_name, me.address)
    spec = fed.party(tls_of or name)
    peers = {a.name: a for n, a in addresses.items() if n != (as_name or name)}
    return GrpcTransport(me, peers, TlsFiles(fed.ca, spec.cert, spec.key),
                         verify=lambda cert_name, pem: verify_peer_certificate(fed, cert_name, pem),
                         timeout=timeout, heartbeat=heartbeat, peer_timeout=peer_timeout)


def test_messages_of_any_size_cross_in_order_and_are_counted_once(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    label, party = _transport(fed, "label"), _transport(fed, "party0", heartbeat=2.0)
    try:
        rng = np.random.default_rng(0)
        sizes = [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES + 17]
        sent = [rng.bytes(n) for n in sizes]
        # a message is held until its sender waits for a message or flushes (one gRPC message per peer, not one
        # per put), a mebibyte is held, or the sender's event loop checks the stream (every heartbeat)
        party.put("party0", "label", "control", b"x")
        with pytest.raises(PartyLost, match="waited 0.3 s"):
            label.take("label", sender="party0", timeout=0.3)
        party.flush()
        assert label.take("label", sender="party0", timeout=5) == b"x"
        party.put("party0", "label", "control", b"y")
        t0 = time.monotonic()
        assert label.take("label", sender="party0", timeout=5) == b"y"  # the sender never waited nor flushed
        assert time.monotonic() - t0 < 2.0 + 1.0
        for data in sent:
            party.put("party0", "label", "embedding", data)
        party.flush()
        got = [label.take("label", sender="party0") for _ in sizes]
        assert got == sent  # in order, byte for byte, whatever the number of chunks
        assert party.stats.bytes_total == sum(sizes) + 2 and party.stats.messages_total == len(sizes) + 2
        many = [rng.bytes(300) for _ in range(5000)]  # 1.5 MB held at once: sent in batches below gRPC's limit
        for data in many:
            party.put("party0", "label", "control", data)
        party.flush()
        assert [label.take("label", sender="party0", kind="control") for _ in many] == many
        assert label.stats.bytes_total == 0  # each message is counted once, by its sender
        chunks = 2 + sum(max(1, -(-n // CHUNK_BYTES)) for n in sizes) + len(many)
        framing = party.wire_stats.bytes_by_link["party0->label"] - sum(sizes) - 2 - 300 * len(many)
        assert 0 < framing <= chunks * 64  # a small header per chunk, nothing else added
        with pytest.raises(MessageError, match="cannot send for label"):
            party.put("label", "party0", "control", b"")
    finally:
        party.close(0.5)
        label.close(0.5)


def test_a_party_with_a_certificate_of_another_ca_is_refused(tmp_path: Path) -> None:
    fed = _federation(tmp_path / "a")
    other = tmp_path / "b"
    other.mkdir()
    (other / "federation.toml").write_text(fed.read_text())
    write_certificates(issue_certificates(load_federation(other / "federation.toml")))  # same names, another CA
    label = _transport(fed, "label")
    intruder = _transport(other / "federation.toml", "party0")
    try:
        with pytest.raises(ProtocolError, match="TLS with party label .* failed"):
            intruder.put("party0", "label", "embedding", b"x" * 100)
        assert label.pending() == 0
    finally:
        intruder.close(0.5)
        label.close(0.5)


def test_a_party_presenting_another_party_s_certificate_is_refused(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    label = _transport(fed, "label")
    # party1's own valid certificate, used to speak as party0
    impostor = _transport(fed, "party1", as_name="party0", tls_of="party1")
    try:
        with pytest.raises(ProtocolError, match="refused party0: peer 'party0': certificate belongs to party "
                                                "'party1', not 'party0'"):
            impostor.put("party0", "label", "embedding", b"x")
        assert label.pending() == 0
    finally:
        impostor.close(0.5)
        label.close(0.5)


def test_a_server_answering_with_another_party_s_certificate_is_refused(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    fake_label = _transport(fed, "label", tls_of="party1")  # listens at label's address with party1's certificate
    party = _transport(fed, "party0")
    try:
        with pytest.raises(ProtocolError, match="TLS with party label"):
            party.put("party0", "label", "embedding", b"x")
        assert fake_label.pending() == 0
    finally:
        party.close(0.5)
        fake_label.close(0.5)


_PEER_SCRIPT = """
import sys, os, time
sys.path.insert(0, {tests!r})
from test_deploy import _transport
from pathlib import Path
t = _transport(Path({fed!r}), "party0")
t.put("party0", "label", "embedding", b"hello")
t.flush()
time.sleep({sleep})
os._exit(0)  # no goodbye: as if killed
"""


@pytest.mark.parametrize("sleep", [0.3, 1.5])
def test_a_peer_that_dies_is_detected_and_named_within_the_timeout(tmp_path: Path, sleep: float) -> None:
    fed = _federation(tmp_path)
    label = _transport(fed, "label", peer_timeout=3.0, timeout=30.0)
    script = _PEER_SCRIPT.format(tests=str(Path(__file__).parent), fed=str(fed), sleep=sleep)
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        assert label.take("label", sender="party0", timeout=30) == b"hello"
        t0 = time.monotonic()
        with pytest.raises(PartyLost, match="party party0 is gone: .*restart it and continue every party with"):
            label.take("label", sender="party0", timeout=30)
        assert time.monotonic() - t0 < 3.0 + sleep + 2.0  # within the peer timeout, not the 30 s wait
    finally:
        proc.wait(timeout=30)
        label.close(0.5)


def test_waits_are_bounded(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    label = _transport(fed, "label", timeout=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(PartyLost, match="no answer at 127.0.0.1:"):
            label.put("label", "party0", "control", b"")  # party0 never started
        with pytest.raises(PartyLost, match="waited 0.3 s for a gradient message from party0"):
            label.take("label", kind="gradient", sender="party0", timeout=0.3)
        assert time.monotonic() - t0 < 10
    finally:
        label.close(0.5)


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=4) | st.integers(0, 9), inner, max_size=3),
    max_leaves=12)


def _same(a, b) -> bool:  # noqa: ANN001
    if isinstance(a, float) and np.isnan(a):
        return isinstance(b, float) and np.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=6), st.data())
def test_a_batch_frame_gives_back_its_frames_and_refuses_any_cut(frames: list[bytes], data) -> None:  # noqa: ANN001
    from secvfl.transport import grpc_link as g

    whole = g._batch(frames)
    ftype, _, _, _, count, payload = g._parse(whole)
    assert ftype == g._BATCH and [bytes(f) for f in g._unbatch(payload, count)] == frames
    cut = data.draw(st.integers(0, len(payload) - 1))  # a batch that lost its tail, or carries a byte too many
    with pytest.raises(MessageError, match="batch frame"):
        g._unbatch(payload[:cut], count)
    with pytest.raises(MessageError, match="batch frame"):
        g._unbatch(memoryview(bytes(payload) + b"x"), count)


@settings(max_examples=150, deadline=None)
@given(_VALUES)
def test_request_values_cross_as_plain_data(value) -> None:  # noqa: ANN001
    wire = encode(result_message("party0", "label", 7, value))
    assert _same(read_result(decode(wire)), value)


def test_a_request_carries_arrays_tensors_and_specs_and_nothing_else() -> None:
    ids = np.array([5, 1, 9], dtype=np.int64)
    scale = torch.tensor([0.5, 1.0], dtype=torch.float64)
    spec = PredictorSpec(members=(0, 2), holder=2)
    wire = encode(call_message("label", "party0", 3, "forward", (1, "train", ids), {"scale": scale, "spec": spec},
                               reply=False))
    method, args, kwargs, reply = read_call(decode(wire))
    assert (method, reply) == ("forward", False)
    assert args[:2] == [1, "train"] and args[2].dtype == np.int64 and args[2].tolist() == [5, 1, 9]
    assert torch.equal(kwargs["scale"], scale) and kwargs["spec"] == spec
    with pytest.raises(MessageError, match="a PosixPath cannot cross a party boundary"):
        call_message("label", "party0", 4, "x", (Path("/etc"),), {}, reply=True)
    with pytest.raises(MessageError, match="cannot cross"):
        call_message("label", "party0", 4, "x", (torch.nn.Linear(2, 2),), {}, reply=True)


def test_protocols_not_yet_verified_across_processes_are_refused_before_training(tmp_path: Path) -> None:
    fed = load_federation(_federation(tmp_path, 3))
    cfg = TrainConfig(algo="vafl", dataset="wine", parties=3, epochs=1, device="cpu",
                      options={"privacy": "dp", "epsilon": 3.0, "dp_protect": "features"})
    with pytest.raises(UnsupportedError, match="cannot run the dp layer \\(feature DP .*run it in one process"):
        coordinate(fed, cfg, out=None, resume=None, timeouts=Timeouts(wait=5), log=lambda _: None)
    channel = TrainConfig(algo="vafl", dataset="wine", parties=3, epochs=1, device="cpu",
                          options={"secure_channel": True})
    check_across_processes(build_run(channel, local="label"), fed)  # the secure channel is no longer refused
    with pytest.raises(Exception, match="--parties 2, but federation 'demo' has 3 feature parties; set --parties 3"):
        coordinate(fed, TrainConfig(dataset="wine", parties=2, epochs=1, device="cpu"), out=None, resume=None,
                   timeouts=Timeouts(wait=5), log=lambda _: None)


def _channel_processes(fed: Path, key_dir: Path | None) -> dict[str, tuple]:
    """Three parties as three 'processes' of this one (threads, each with its own transport, network and channel
    layer holding only its own party's credentials)."""
    from protocols.secure_plugins import RunChannelLayer
    from secvfl.transport.network import Network

    roles = {"label": Role.LABEL, "party0": Role.FEATURE, "party1": Role.FEATURE}
    out = {}
    for name in roles:
        own = None
        if key_dir is not None:  # as on its own host: its own private key and every party's public key, no more
            own = key_dir.parent / f"keys-of-{name}"
            own.mkdir()
            for f in [key_dir / f"{name}.key.pem", *key_dir.glob("*.pub.pem")]:
                shutil.copy2(f, own / f.name)
        layer = RunChannelLayer(own)
        out[name] = (Network(roles, transport=_transport(fed, name), layers=[layer], local=name), layer)
    return out


def _in_threads(work: dict[str, object]) -> None:
    errors: list[BaseException] = []

    def run(fn) -> None:  # noqa: ANN001
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in work.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


@pytest.mark.parametrize("with_key_files", [False, True], ids=["pins-over-mtls", "key-files"])
def test_secure_channel_handshakes_between_processes_each_holding_only_its_own_key(tmp_path: Path,
                                                                                    with_key_files: bool) -> None:
    from protocols.channel import HANDSHAKE_KIND, IDENTITY_KIND, fingerprint
    from protocols.secure_plugins import generate_channel_keys

    fed = _federation(tmp_path, 2)
    key_dir = generate_channel_keys(tmp_path / "keys", ["label", "party0", "party1"]) if with_key_files else None
    procs = _channel_processes(fed, key_dir)
    try:
        for epoch in range(2):  # every epoch starts with fresh handshakes, each process running its own side
            _in_threads({n: lambda net=net, layer=layer, e=epoch: layer.start_epoch(net, e)
                         for n, (net, layer) in procs.items()})
        fingerprints = {n: layer.describe()["identities"] for n, (_, layer) in procs.items()}
        assert all(list(ids) == [n] for n, ids in fingerprints.items())  # its own key only
        for n, (_, layer) in procs.items():
            pins = layer._party(n).credentials.pinned  # each peer pinned under the key that peer holds
            assert {p: fingerprint(pins.get(p)) for p in procs if p != n} == \
                {p: fingerprints[p][p] for p in procs if p != n}
        sent = {n: net.stats.messages_by_kind.get(HANDSHAKE_KIND, 0) for n, (net, _) in procs.items()}
        assert sum(sent.values()) == 2 * 3 * 3  # 2 epochs x 3 pairs x 3 messages, as in one process
        identities = {n: net.transport.control_stats.messages_by_kind.get(IDENTITY_KIND, 0)
                      for n, (net, _) in procs.items()}
        assert identities == ({"label": 0, "party0": 0, "party1": 0} if with_key_files else
                              {"label": 2, "party0": 2, "party1": 2})  # once per pair and direction, not counted

        label, party0 = procs["label"][0], procs["party0"][0]
        msg = Message("embedding", "party0", "label", 1, {"embedding": torch.ones(2, 3)})
        party0.send(msg)
        party0.transport.flush()  # the sending process would, at its next wait
        assert party0.stats.bytes_by_kind["embedding"] > 0
        got = label.receive("label", kind="embedding", sender="party0")
        assert torch.equal(got.tensor("embedding"), torch.ones(2, 3))
        assert procs["party0"][1].sealed == 1 and procs["label"][1].opened == 1
    finally:
        for net, _ in procs.values():
            net.transport.close(0.5)


def test_a_malformed_identity_key_from_a_peer_process_is_refused_before_any_handshake(tmp_path: Path) -> None:
    from protocols.channel import HANDSHAKE_KIND, IDENTITY_KIND, HandshakeError

    procs = _channel_processes(_federation(tmp_path, 2), None)
    try:
        (label, layer), (party0, _) = procs["label"], procs["party0"]
        party0.send_control(Message(IDENTITY_KIND, "party0", "label", 0, blobs={"identity": b"\x01" * 31},
                                    meta={"protocol": "secvfl-channel-v2"}))
        party0.transport.flush()
        with pytest.raises(HandshakeError, match="party0's identity key message to label is malformed"):
            layer.start_epoch(label, 0)
        assert not layer.has_session("label", "party0") and label.stats.messages_by_kind.get(HANDSHAKE_KIND, 0) == 0
        with pytest.raises(MessageError, match="control messages are sent by this process's own party"):
            label.send_control(Message(IDENTITY_KIND, "party0", "label", 0))
    finally:
        for net, _ in procs.values():
            net.transport.close(0.5)


# -- real party processes -----------------------------------------------------------------------------------------
def _launch(fed: Path, out: Path, *args: str, resume: bool = False, timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "secvfl.cli.main", "launch", "--federation", str(fed),
           "--resume" if resume else "--out", str(out), "--threads", "1", "--party-timeout", "60",
           *(() if resume else ("--device", "cpu")), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _in_process(tmp: Path, *args: str) -> dict:
    from secvfl.cli.main import main

    assert main(["train", "--out", str(tmp / "inproc"), "--no-progress", "--threads", "1", "--device", "cpu", *args]) == 0
    return json.loads((tmp / "inproc" / "summary.json").read_text())


# Each launch starts five processes (most of a case's time), so a protocol layer is tried on top of another case
# where the two compose: the channel cases of an algorithm also check the algorithm (vafl: two of them), the
# randk case EG. Plain split-NN: the kill/resume test below compares a launched run with the in-process one.
_EQUIVALENT = [
    pytest.param(("--algo", "splitnn", "--dataset", "digits", "--epochs", "2", "--compress", "topk:0.1+ef"),
                 id="splitnn-compress-ef"),
    pytest.param(("--algo", "eg", "--dataset", "breast_cancer", "--epochs", "2", "--compress", "randk:0.1+ef"),
                 id="eg-randk"),
    # each party process generates its own identity key; peers are pinned from their mutual-TLS links
    pytest.param(("--algo", "splitnn", "--dataset", "digits", "--epochs", "2", "--privacy", "dp", "--epsilon", "3",
                  "--dp-reproducible", "--secure-channel"), id="splitnn-label-dp-channel"),
    # feature parties seal for each other; the CKKS aggregator party opens and seals like any party
    pytest.param(("--algo", "laser", "--dataset", "digits", "--epochs", "2", "--secure-channel"), id="laser-channel"),
    pytest.param(("--algo", "vafl", "--dataset", "digits", "--epochs", "2", "--he", "ckks", "--secure-channel"),
                 id="vafl-ckks-channel"),
    # the masks' public keys are authenticated only by the channel: sealed between the parties' processes; each
    # party process reads only its own <party>.key.pem of {keys} and pins the .pub.pem files
    pytest.param(("--algo", "vafl", "--dataset", "digits", "--epochs", "2", "--secagg", "mask", "--secure-channel",
                  "--channel-keys", "{keys}"), id="vafl-mask-channel-keys"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args", _EQUIVALENT)
def test_a_launched_federation_gives_the_in_process_metrics_and_bytes(tmp_path: Path, args: tuple[str, ...]
                                                                      ) -> None:
    ckks = "ckks" in args
    fed = _federation(tmp_path / "fed", 4, aggregator=ckks)
    if "{keys}" in args:
        from protocols.secure_plugins import generate_channel_keys

        keys = generate_channel_keys(tmp_path / "keys", ["label", *[f"party{i}" for i in range(4)]])
        args = tuple(str(keys) if a == "{keys}" else a for a in args)
    common = ("--parties", "4", "--seed", "3", *args)
    done = _launch(fed, tmp_path / "run", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "run" / "label" / "summary.json").read_text())
    expected = _in_process(tmp_path, *common)
    for key, value in expected["metrics"]["test"].items():  # CKKS adds fresh encryption noise to every sum
        assert got["metrics"]["test"][key] == pytest.approx(value, rel=1e-9, abs=1e-4 if ckks else 1e-12), key
    if ckks:  # the same messages; a serialised ciphertext's size varies by a few bytes from one encryption to the next
        assert got["comm"]["messages_by_kind"] == expected["comm"]["messages_by_kind"]
        assert got["comm"]["bytes_total"] == pytest.approx(expected["comm"]["bytes_total"], rel=1e-3)
        assert got["he"]["sums_delivered"] == expected["he"]["sums_delivered"] > 0
    else:
        assert got["comm"] == expected["comm"]  # every byte and message, per party, kind and link
    assert got["control"]["bytes_total"] > 0 and got["deployment"]["transport"] == "grpc+mtls"
    cpu = got["deployment"]["cpu_seconds"]  # every process's own CPU time for the run (secvfl bench transport)
    assert set(cpu) == {"label", *(f"party{i}" for i in range(4)), *(["aggregator"] if ckks else [])}, cpu
    assert all(0 < c < 10 * got["wall_seconds"] for c in cpu.values()), cpu
    if "--secure-channel" in args:  # sealed end to end: handshakes counted as in one process, every message sealed
        pairs = {"laser": 6, "vafl": 15 if ckks else 10}.get(args[1], 10)  # every pair of the run's parties
        assert got["comm"]["messages_by_kind"]["handshake"] == 2 * pairs * 3  # 2 epochs x 3 messages per pair
        assert got["security"]["channel_keys"].startswith(
            "key files" if "--channel-keys" in args else "generated by each party's process")
    for i in range(4):  # each feature party kept its own state, in its own directory
        assert list((tmp_path / "run" / f"party{i}").glob("state-*.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("protocols", [(), ("own-files", "--secure-channel")], ids=["plain", "own-files-channel"])
def test_a_party_killed_mid_run_stops_the_run_with_its_name_and_the_run_resumes_to_the_same_result(
        tmp_path: Path, protocols: tuple[str, ...]) -> None:
    # with the channel, the restarted processes have new identity keys and no session: they handshake at the
    # resumed epoch's start, where the uninterrupted run renews its sessions, so both send the same bytes;
    # with their own files, the restarted parties align their rows again (the digest must match) before resuming
    if "own-files" in protocols:
        from test_deploy_data import _files

        fed = loopback_federation(tmp_path / "fed", 2, data=_files(tmp_path / "fed")["tables"])
        common = ("--algo", "splitnn", "--parties", "2", "--epochs", "4", "--batch-size", "8", "--seed", "1",
                  *(p for p in protocols if p != "own-files"))
    else:
        fed = _federation(tmp_path / "fed", 3)
        common = ("--algo", "splitnn", "--dataset", "digits", "--parties", "3", "--epochs", "4", "--batch-size",
                  "8", "--seed", "1", *protocols)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "secvfl.cli.main", "launch", "--federation", str(fed), "--out", str(run),
           "--threads", "1", "--party-timeout", "60", "--peer-timeout", "5", "--device", "cpu", *common]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        latest = run / "label" / "checkpoints" / "latest.json"
        while not latest.exists():  # the first epoch is checkpointed: kill party1 in the second
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.05)
        victim = subprocess.run(["pgrep", "-f", f"party --name party1 --out {run}/party1"], capture_output=True,
                                text=True, timeout=10).stdout.split()
        assert len(victim) == 1, victim
        killed_at = time.monotonic()
        os.kill(int(victim[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        stopped_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode != 0
    assert "party party1 is gone" in err, err[-3000:]
    assert stopped_after < 5 + 15  # the peer timeout and the launcher's stop, not the 60 s party timeout
    assert not (run / "label" / "summary.json").exists()

    hint = [line for line in err.splitlines() if "`secvfl launch --resume" in line][-1].split("`")[1]
    assert hint == f"secvfl launch --resume {run}"  # runs as printed: the launch directory names its federation
    resumed = subprocess.run([sys.executable, "-m", "secvfl.cli.main", *hint.split()[1:]], capture_output=True,
                             text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = json.loads((run / "label" / "summary.json").read_text())
    if "own-files" in protocols:
        uninterrupted = _launch(fed, tmp_path / "whole", *common)
        assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
        expected = json.loads((tmp_path / "whole" / "label" / "summary.json").read_text())
        assert expected["deployment"]["measured_since"] == "start"
    else:  # a launched run gives the in-process run's metrics and bytes (above): compare with that, one launch less
        expected = _in_process(tmp_path, *common)
    assert got["metrics"]["test"] == pytest.approx(expected["metrics"]["test"], rel=1e-9)
    assert got["comm"] == expected["comm"]
    # the CPU and wait figures of the resumed launch cover that launch only, and say so
    assert got["deployment"]["measured_since"] == "resume"


@pytest.mark.slow
def test_laser_inference_goes_on_without_a_party_that_leaves_during_the_test(tmp_path: Path) -> None:
    from secvfl.runner import read_run_config, run_training

    fed = _federation(tmp_path / "fed", 3)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "secvfl.cli.main", "launch", "--federation", str(fed), "--out", str(run),
           "--threads", "1", "--party-timeout", "60", "--peer-timeout", "5", "--device", "cpu", "--algo", "laser",
           "--dataset", "digits",
           "--parties", "3", "--epochs", "2", "--seed", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, LEAVE_AT_ENV: "party2:test"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "party2: leaving at its first test request" in done.stderr
    got = json.loads((run / "label" / "summary.json").read_text())
    assert list(got["departed"]) == ["party2"] and "party party2 is gone" in got["departed"]["party2"]
    # the reference: the same run in one process, scored on the test rows with party2's block missing everywhere
    built = []
    run_training(read_run_config(run / "label"), None, progress=False, log=lambda _: None, on_build=built.append)
    algorithm = built[0].algorithm
    assert algorithm.depart("party2")
    expected = algorithm.score("test")
    for key, value in expected.items():
        assert got["metrics"]["test"][key] == pytest.approx(value, rel=1e-9), key
    algorithm.departed.clear()
    assert algorithm.score("test")["accuracy"] != pytest.approx(expected["accuracy"], abs=1e-12)  # party2 mattered


def test_bench_transport_reports_the_median_run_s_cpu_and_the_cores_it_kept_busy() -> None:
    from secvfl.bench.transport import _cpu

    runs = [{"wall_seconds": 10.0, "deployment": {"cpu_seconds": {"label": 5.0, "party0": 3.0}}},   # 8 s
            {"wall_seconds": 4.0, "deployment": {"cpu_seconds": {"label": 2.0, "party0": 4.0}}},    # 6 s: median
            {"wall_seconds": 2.0, "deployment": {"cpu_seconds": {"label": 1.0, "party0": 1.0}}}]    # 2 s
    got = _cpu(runs, epochs=2)
    assert got["grpc_cpu_seconds_per_epoch_all_processes"] == pytest.approx(3.0)
    assert got["grpc_cpu_seconds_per_epoch_by_process"] == {"label": pytest.approx(1.0), "party0": pytest.approx(2.0)}
    assert got["grpc_busy_cores"] == pytest.approx(1.5)  # 6 CPU seconds in 4 wall seconds
    assert _cpu([{"wall_seconds": 1.0, "deployment": {}}], epochs=1) == {}  # a run from before the counters
    resumed = {"wall_seconds": 1.0, "deployment": {"measured_since": "resume", "cpu_seconds": {"label": 1.0}}}
    assert _cpu([resumed], epochs=1) == {}  # its CPU covers only the part after the resume
