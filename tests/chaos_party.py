"""Party processes for the chaos tests: the real ``secvfl party``, and a misbehaving feature party.

The misbehaving party is the real feature party (``secvfl party``: serve_party, its handle, its network) whose
transport rewrites what it sends as one row of the attack table says: non-finite or misshapen embeddings, steps out
of turn, replayed or duplicated messages, floods, malformed frames, forged answers (a lost party, byte counters,
deep or malformed JSON, an absurd width), an error text with terminal escapes; or that opens idle streams beside its
honest traffic. It speaks the protocol (TLS with its own valid certificate, hello, requests), so what it does is
what a partner with a bug, or a hostile one, could do.

Processes are forked from a server that has imported torch and secvfl once (multiprocessing's forkserver), so a
federation starts in a second instead of a process start per party; each runs ``secvfl.cli.main.main(argv)`` as
``secvfl launch`` would start it, with its output in a file, and reports its exit code and peak resident memory.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

import numpy as np  # noqa: F401 - preloaded in the fork server
import sklearn.datasets  # noqa: F401 - preloaded in the fork server
import torch

import protocols.ckks  # noqa: F401 - everything a party imports to build its run, preloaded in the fork server
import protocols.compression  # noqa: F401
import protocols.dp  # noqa: F401
import protocols.psi  # noqa: F401
import protocols.secagg  # noqa: F401
import protocols.secure_plugins  # noqa: F401
import secvfl.algorithms.local  # noqa: F401
import secvfl.algorithms.online.algorithms  # noqa: F401
import secvfl.algorithms.saddle.methods  # noqa: F401
import secvfl.algorithms.split  # noqa: F401
import secvfl.algorithms.vim.vimadmm  # noqa: F401
import secvfl.cli.main  # noqa: F401
import secvfl.deploy.party as deploy_party
import secvfl.runner  # noqa: F401
from secvfl.deploy.calls import CALL_KIND, RESULT_KIND, read_call, read_result, result_message
from secvfl.messages import decode, encode
from secvfl.transport import grpc_link as g
from secvfl.transport.grpc_link import GrpcTransport

__all__ = ["run_party", "ROWS"]

_MIB = 1 << 20

# row -> what the misbehaving party does (its first misstep is at its third training embedding, step 2, unless
# the row concerns an answer)
ROWS = ("nan-inf", "extra-column", "one-row-short", "overflowing-header", "int64", "step-plus-1000", "replay",
        "duplicate", "unknown-kind-flood", "declared-4-billion-chunks", "oversize-chunk", "million-empty-messages",
        "kind-not-utf8", "kind-past-frame", "count-zero", "idle-streams", "party-lost", "stats", "deep-json",
        "fields-as-list", "error-escape", "plan-width")


def _raw(kind: bytes, ftype: int, count: int, payload: bytes, *, index: int = 0, kind_length: int | None = None
         ) -> bytes:
    return g._FRAME.pack(g._VERSION, ftype, len(kind) if kind_length is None else kind_length, 1, index, count) \
        + kind + payload


class Misbehaving(GrpcTransport):
    """A feature party's transport that misbehaves as ``row`` says."""

    row = ""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.first: bytes | None = None
        self.method, self.split, self.idle = None, None, []

    # what the party is asked (the row's trigger)
    def take(self, receiver: str, **kwargs) -> bytes:  # noqa: ANN003
        data = super().take(receiver, **kwargs)
        if kwargs.get("kind") == CALL_KIND:
            self.method, args, kw, _ = read_call(decode(data))
            if self.method in ("forward", "represent"):
                self.split = args[1] if len(args) > 1 else kw.get("split")
            if self.row == "error-escape" and self.method == "forward":
                self.put_control(self.local.name, receiver_of(self), g.ERROR_KIND,
                                 b"forward failed\n[label] \x1b[2J\x1b[1;1Hepoch 1/1 loss 0.0000 val accuracy 1.0000")
                self.flush()
                time.sleep(0.5)
                os._exit(1)
        return data

    def _raw_frames(self, receiver: str, frames: list[bytes]) -> None:
        link = self._link(receiver)
        for frame in frames:
            link.hold(frame)
            link.flush(time.monotonic() + 10)
            link.wake()

    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        row = self.row
        if row == "idle-streams" and not self.idle:  # 2,000 streams on its connection that never send a frame
            link = self._link(receiver)
            self.idle = [link.channel.stream_unary(f"/{g._SERVICE}/Stream", request_serializer=None,
                                                   response_deserializer=None)() for _ in range(2000)]
        if kind != "embedding" or receiver != "label" or row == "idle-streams":
            return super().put(sender, receiver, kind, data)
        message = decode(data)
        self.first = self.first or data
        if message.step != 2 or self.split != "train":
            return super().put(sender, receiver, kind, data)
        t = message.tensor("embedding")
        rewrite = {
            "nan-inf": lambda: _with(message, torch.where(torch.arange(t.numel()).reshape(t.shape) == 0,
                                                          float("nan"), t)),
            "extra-column": lambda: _with(message, torch.cat([t, torch.zeros(len(t), 1)], 1)),
            "one-row-short": lambda: _with(message, t[:-1]),
            "int64": lambda: _with(message, t.to(torch.int64)),
            "step-plus-1000": lambda: encode(message.replace(step=message.step + 1000)),
            "overflowing-header": lambda: _overflowing(message),
            "replay": lambda: self.first,
        }
        if row in rewrite:
            return super().put(sender, receiver, kind, rewrite[row]())
        if row == "duplicate":
            super().put(sender, receiver, kind, data)
            return super().put(sender, receiver, kind, data)
        if row == "unknown-kind-flood":  # 512 complete messages of 2 MiB of a kind nobody registered
            for _ in range(512):
                super().put(sender, receiver, "junk", b"\0" * 2 * _MIB)
                self.flush()
        elif row == "million-empty-messages":  # of a kind the label party never asks party1 for (a tenth of the
            for _ in range(100_000):  # million of tests/test_receive_limits.py: past the buffer all the same)
                super().put(sender, receiver, "control", b"")
        elif row == "declared-4-billion-chunks":
            self._raw_frames(receiver, [_raw(b"embedding", g._DATA, 2**32 - 1, b"\0" * g.CHUNK_BYTES, index=i)
                                        for i in range(1024)])
        elif row == "oversize-chunk":
            self._raw_frames(receiver, [_raw(b"embedding", g._DATA, 1, b"\0" * (2_101_219 - 29))])
        elif row == "kind-not-utf8":
            self._raw_frames(receiver, [_raw(b"\xff\xfe", g._DATA, 1, data)])
        elif row == "kind-past-frame":
            self._raw_frames(receiver, [_raw(b"embedding", g._DATA, 1, b"", kind_length=4000)])
        elif row == "count-zero":
            self._raw_frames(receiver, [_raw(b"embedding", g._DATA, 0, data)])
        return super().put(sender, receiver, kind, data)

    def put_control(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        if kind == RESULT_KIND:
            data = self._answer(decode(data)) or data
        return super().put_control(sender, receiver, kind, data)

    def _answer(self, answer) -> bytes | None:  # noqa: ANN001
        row, method = self.row, self.method
        if row == "party-lost" and method == "predict" and self.split == "test":  # LASER-VFL's test evaluation
            value = {"__party_lost__": "party0", "reason": "party party0 is gone: its stream ended"}
            return encode(result_message(answer.sender, answer.receiver, answer.step, value))
        if row == "stats" and method == "__stats__":
            value = read_result(answer)
            for field in ("bytes_sent", "bytes_by_link", "bytes_by_kind"):  # consistent with itself, not with
                for key in value["sent"][field]:  # what the label party received
                    value["sent"][field][key] += 10**18
            return encode(result_message(answer.sender, answer.receiver, answer.step, value))
        if row in ("deep-json", "fields-as-list") and method == "__hello__":
            text = ("[" * 100_000 + "]" * 100_000 if row == "deep-json" else
                    '{"__dataclass__":"PredictorSpec","fields":[[0,1],1]}').encode()
            return encode(answer.replace(blobs={"args": text}))
        if row == "plan-width" and method == "__plan__":
            value = read_result(answer)
            value["width"] = 2_000_000
            return encode(result_message(answer.sender, answer.receiver, answer.step, value))
        return None


def receiver_of(transport: GrpcTransport) -> str:
    return "label"


def _with(message, t: torch.Tensor) -> bytes:  # noqa: ANN001
    return encode(message.replace(tensors={"embedding": t}))


def _overflowing(message) -> bytes:  # noqa: ANN001
    import json
    import struct

    head = json.dumps({"kind": "embedding", "sender": message.sender, "receiver": message.receiver,
                       "step": message.step, "meta": {}, "tensors": [["embedding", "float32",
                                                                       [0, 2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1]]],
                       "blobs": []}, separators=(",", ":")).encode()
    return struct.pack("<4sBI", b"SVFL", 1, len(head)) + head


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_party(argv: list[str], log: str, row: str = "", nofile: int = 0) -> None:
    """(In a forked process.) ``secvfl <argv>``, its output to ``log``; with ``row``, its transport misbehaves.
    ``nofile``: its file-descriptor limit."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ["PYTHONUNBUFFERED"] = "1"
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    if row:
        Misbehaving.row = row
        deploy_party.GrpcTransport = Misbehaving  # make_transport builds this party's transport with it
    from secvfl.cli.main import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    print(f"chaos: exit {code} peak_rss {_peak_rss()}", flush=True)
    os._exit(code)
