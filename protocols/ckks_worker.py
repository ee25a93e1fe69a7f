"""Body of a CKKS encryption worker process (see ``protocols.ckks._EncryptionWorkers``) and the frames it speaks.

Kept apart from :mod:`protocols.ckks` so that a worker imports only numpy and TenSEAL, not torch, whose import would
be most of its start-up (BENCHMARKS.md, "Secure aggregation: CKKS and masking"), time a training run would otherwise wait for on its
first encrypted step.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any

import numpy as np
import tenseal as ts

from protocols.ckks_cipher import CKKSCipher

__all__ = ["main", "read_frame", "write_frame"]


_FRAME = struct.Struct("<II")  # header length, payload length


def write_frame(stream: Any, header: dict[str, Any], payload: bytes = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    stream.write(_FRAME.pack(len(head), len(payload)))
    stream.write(head)
    stream.write(payload)
    stream.flush()


def _read_exactly(stream: Any, n: int) -> bytes:
    data = stream.read(n) if n else b""
    if len(data) != n:
        raise EOFError(f"stream ended after {len(data)} of {n} bytes")
    return data


def read_frame(stream: Any) -> tuple[dict[str, Any], bytes]:
    head_len, payload_len = _FRAME.unpack(_read_exactly(stream, _FRAME.size))
    return json.loads(_read_exactly(stream, head_len)), _read_exactly(stream, payload_len)


def main() -> None:
    """Body of an encryption worker process: holds public contexts of the parties it serves, turns float64 bytes
    into ciphertext bytes. Frames on stdin/stdout (no pickle); anything a library prints goes to stderr."""
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # keep the frame channel clean of C-level prints
    frames_in = sys.stdin.buffer
    ciphers: dict[str, CKKSCipher] = {}
    while True:
        try:
            header, payload = read_frame(frames_in)
        except EOFError:
            return
        try:
            if header["op"] == "close":
                return
            if header["op"] == "context":
                ctx = ts.context_from(payload, n_threads=1)
                if ctx.has_secret_key():  # a worker never holds a secret key
                    raise ValueError("refusing a context that carries a secret key")
                ciphers[header["party"]] = CKKSCipher(ctx, int(header["wire_primes"]), float(header["scale"]))
                write_frame(frames_out, {"ok": True})
            elif header["op"] == "encrypt":
                values = np.frombuffer(payload, dtype="<f8")
                sizes, blobs, offset = [], [], 0
                for party, n in header["jobs"]:
                    out = ciphers[party].encrypt_values(values[offset : offset + n])
                    offset += n
                    sizes.append([len(b) for b in out])
                    blobs += out
                write_frame(frames_out, {"sizes": sizes}, b"".join(blobs))
            else:
                raise ValueError(f"unknown request {header['op']!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises a ProtocolError
            write_frame(frames_out, {"error": f"{type(exc).__name__}: {exc}"})
