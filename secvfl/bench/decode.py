"""`secvfl bench decode`: the strict message decoder against mutated real messages of every kind.

Real messages are captured at the transport while short real runs train (every algorithm family and every protocol
layer: plain, masking with and without an aggregator, CKKS, compression, DP, secure channel, PSI alignment). Each
case mutates one of them (byte flips, truncation, insertion, deletion, a wrong header length, structural changes of
the JSON header: type swaps, huge or float numbers, NaN/Infinity, deep nesting, missing/extra/duplicate keys,
whitespace and escapes) and times one :func:`~secvfl.messages.decode` call. Every outcome must be a message whose
encoding is exactly the bytes received (nothing coerced) or a :class:`~secvfl.errors.MessageError`; anything else is
counted and reported. The same capture and mutations drive ``tests/test_messages_fuzz.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch

from secvfl.bench.common import fix_threads, machine, peak_rss_mb
from secvfl.cli.registries import BENCHES
from secvfl.errors import MessageError
from secvfl.messages import MAX_HEADER_BYTES, Message, decode, encode

__all__ = ["capture_corpus", "corpus_key", "mutate", "MUTATIONS", "Draw", "RandomDraw", "check_decode", "DecodeBench"]

T = TypeVar("T")
_PREFIX = struct.Struct("<4sBI")

# Short real runs whose traffic makes the corpus (1 epoch, 2 feature parties, bundled datasets).
_RUNS: list[dict[str, Any]] = [
    dict(algo="splitnn", dataset="wine"),
    dict(algo="fdml", dataset="wine"),
    dict(algo="local", dataset="wine"),
    dict(algo="ensemble", dataset="wine", p_miss_train="0.3", p_miss_test="0.3"),
    dict(algo="laser", dataset="breast_cancer"),
    dict(algo="eg", dataset="breast_cancer"),
    dict(algo="eg-mlp", dataset="breast_cancer"),
    dict(algo="vafl", dataset="wine", options={"secagg": "mask"}),
    dict(algo="vafl", dataset="wine", options={"he": "ckks"}),
    dict(algo="splitnn", dataset="wine", options={"compress": "topk:0.1+ef"}),
    dict(algo="splitnn", dataset="wine", options={"privacy": "dp", "epsilon": 3.0}),
    dict(algo="splitnn", dataset="wine", options={"secure_channel": True}),
    dict(algo="vimadmm", dataset="wine", options={"vim_local_steps": 2}),  # dual, head
]


def corpus_key(message: Message) -> str:
    """The kind a captured message is filed under: its wire kind, marked when a layer changed its form."""
    if set(message.blobs) == {"sealed"} and not message.tensors:
        return f"{message.kind}[sealed]"
    if "cmp" in message.meta:
        return f"{message.kind}[compressed]"
    return message.kind


@contextlib.contextmanager
def _recording(into: list[bytes]) -> Iterator[None]:
    """Record every encoded message any in-process transport carries (runs build their own networks, and
    handshakes and setup traffic happen while they are built)."""
    from secvfl.transport.inprocess import InProcessTransport

    put = InProcessTransport.put

    def recording_put(self: Any, sender: str, receiver: str, kind: str, data: bytes) -> None:
        into.append(data)
        put(self, sender, receiver, kind, data)

    InProcessTransport.put = recording_put  # type: ignore[method-assign]
    try:
        yield
    finally:
        InProcessTransport.put = put  # type: ignore[method-assign]


def _masked_sum_traffic() -> None:
    """Masking through a separate aggregator: the only route on which ``masked-sum`` messages travel."""
    from protocols.secagg import MaskedAggregation
    from secvfl.transport import Network
    from secvfl.transport.layers import Role

    net = Network({"label": Role.LABEL, "f0": Role.FEATURE, "f1": Role.FEATURE, "agg": Role.AGGREGATOR},
                  aggregation=MaskedAggregation())
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        msgs = [Message("embedding", f, "label", step, {"embedding": torch.randn(8, 4, generator=gen)})
                for f in ("f0", "f1")]
        net.aggregate(msgs, "label", "sum")


def _psi_traffic() -> None:
    from protocols.psi import align
    from secvfl.transport import Network
    from secvfl.transport.layers import Role

    ids = {"label": [f"id{i}" for i in range(40)], "p0": [f"id{i}" for i in range(10, 50)]}
    align(ids, "label", net=Network({"label": Role.LABEL, "p0": Role.FEATURE}))


def _plan_traffic() -> None:
    """The label party's rows of each split, as a deployed label party sends them to a feature party."""
    import numpy as np
    import pyarrow as pa

    from secvfl.deploy.data import RowPlan, send_plan
    from secvfl.transport import Network
    from secvfl.transport.layers import Role

    ids = tuple(pa.array([f"id{i}" for i in range(a, b)]) for a, b in ((0, 30), (30, 34), (34, 42)))
    plan = RowPlan(ids, tuple(np.zeros(len(i), dtype=np.int64) for i in ids), ["0", "1"], {})  # type: ignore[arg-type]
    send_plan(Network({"label": Role.LABEL, "p0": Role.FEATURE}), "label", "p0", plan)


def _request_traffic() -> None:
    """Party-handle requests and answers as they travel to a party in another process (secvfl.deploy)."""
    import numpy as np
    import torch

    from secvfl.deploy.calls import call_message, result_message
    from secvfl.messages import encode
    from secvfl.transport.inprocess import InProcessTransport

    transport = InProcessTransport()
    ids = np.arange(5, dtype=np.int64)
    for step, (method, args, kwargs) in enumerate([("forward", (3, "train", ids), {"to": "label", "train": True}),
                                                   ("backward", (), {"sender": "label"}),
                                                   ("__stats__", (), {})]):
        call = call_message("label", "party0", step + 1, method, args, kwargs, reply=method == "__stats__")
        transport.put("label", "party0", call.kind, encode(call))
    answer = result_message("party0", "label", 3, {"bytes": {"party0": 17}, "scale": torch.ones(2)})
    transport.put("party0", "label", answer.kind, encode(answer))


def _identity_traffic() -> None:
    """The secure channel's identity announcements, as parties in separate processes send them (control)."""
    from protocols.channel import IDENTITY_KIND, PROTOCOL, IdentityKey
    from secvfl.messages import Message, encode
    from secvfl.transport.inprocess import InProcessTransport

    transport = InProcessTransport()
    for sender, receiver in (("party0", "label"), ("label", "party0")):
        raw = IdentityKey.generate().public_key.public_bytes_raw()
        message = Message(IDENTITY_KIND, sender, receiver, 0, blobs={"identity": raw}, meta={"protocol": PROTOCOL})
        transport.put(sender, receiver, message.kind, encode(message))


def _serve_traffic() -> None:
    """Serving (secvfl.serve): the coordinator's calls, the parties' answers and their outputs for a request."""
    import torch

    from secvfl.messages import Message, encode
    from secvfl.serve.wire import SERVE_OUTPUT, Answer, Call, Group, answer_message, call_message
    from secvfl.transport.inprocess import InProcessTransport

    transport = InProcessTransport()
    calls = [Call("embed", 4, step=4, ids=["c00001", "c00019"], budget_ms=1000.0),
             Call("predict", 5, step=5, groups=[Group(0, [0, 1], [0, 1])], budget_ms=800.0)]
    for call in calls:
        transport.put("label", "party0", "serve-call", encode(call_message("label", "party0", call)))
    answers = [(Answer("embed", 4, missing=[1]), None),
               (Answer("predict", 5, failed={"1": "party1: gone"}), {"g0": torch.full((2, 2), 0.5)})]
    for answer, tensors in answers:
        transport.put("party0", "label", "serve-answer", encode(answer_message("party0", "label", answer, tensors)))
    output = Message(SERVE_OUTPUT, "party0", "label", 4, {"embedding": torch.ones(2, 4)}, meta={"request": 4})
    transport.put("party0", "label", SERVE_OUTPUT, encode(output))


def capture_corpus(per_kind: int = 6) -> dict[str, list[bytes]]:
    """Encoded messages of every kind, captured at the transport during short real runs: ``corpus_key -> bytes``.

    At most ``per_kind`` distinct messages per key, spread over the run (training and evaluation traffic alike)."""
    from secvfl.algorithms import settings_for
    from secvfl.config import TrainConfig
    from secvfl.runner import run_training

    captured: list[bytes] = []
    with _recording(captured):
        for kw in _RUNS:
            base = {"parties": 2, "epochs": 1, "seed": 0, "threads": 1, "device": "cpu", **settings_for(kw["algo"], {"batch_size": 32})}
            cfg = TrainConfig(**{**base, **kw})
            run_training(cfg, progress=False, log=lambda *a, **k: None)
        _masked_sum_traffic()
        _psi_traffic()
        _plan_traffic()
        _request_traffic()
        _identity_traffic()
        _serve_traffic()
    by_key: dict[str, list[bytes]] = {}
    for data in dict.fromkeys(captured):  # distinct, in capture order
        by_key.setdefault(corpus_key(decode(data)), []).append(data)
    corpus = {}
    for key in sorted(by_key):
        found = by_key[key]
        picks = sorted({round(i * (len(found) - 1) / max(1, per_kind - 1)) for i in range(per_kind)})
        corpus[key] = [found[i] for i in picks]
    return corpus


# -- mutations ------------------------------------------------------------------------------------------------
class Draw(Protocol):
    """Where a mutation takes its choices from: a seeded RNG (the bench) or hypothesis (the fuzz test)."""

    def integer(self, lo: int, hi: int) -> int: ...  # inclusive

    def choice(self, options: Sequence[T]) -> T: ...


class RandomDraw:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]


def _split(data: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(prefix less length, header, payload) of a well-framed message, else None."""
    if len(data) < _PREFIX.size:
        return None
    hlen = _PREFIX.unpack_from(data)[2]
    if _PREFIX.size + hlen > len(data):
        return None
    return data[:5], data[_PREFIX.size : _PREFIX.size + hlen], data[_PREFIX.size + hlen :]


def _frame(head5: bytes, header: bytes, payload: bytes) -> bytes:
    return head5 + struct.pack("<I", len(header)) + header + payload


def _flip(data: bytes, d: Draw) -> bytes:
    parts = _split(data)
    end = len(data) if parts is None or d.choice((False, True)) else _PREFIX.size + len(parts[1])
    pos = d.integer(0, end - 1)
    return data[:pos] + bytes([data[pos] ^ d.integer(1, 255)]) + data[pos + 1 :]


def _truncate(data: bytes, d: Draw) -> bytes:
    return data[: d.integer(0, len(data) - 1)]


_JSON_BYTES = (b'"', b"[", b"]", b"{", b"}", b",", b":", b" ", b"\\", b"0", b"-", b"e", b".", b"\xff", b"\x00", b"null")


def _insert(data: bytes, d: Draw) -> bytes:
    pos = d.integer(0, len(data))
    if d.choice((False, True)):
        chunk = d.choice(_JSON_BYTES)
    else:
        chunk = bytes(d.integer(0, 255) for _ in range(d.integer(1, 8)))
    return data[:pos] + chunk + data[pos:]


def _delete(data: bytes, d: Draw) -> bytes:
    pos = d.integer(0, len(data) - 1)
    return data[:pos] + data[pos + d.integer(1, 16) :]


def _header_length(data: bytes, d: Draw) -> bytes:
    if len(data) < _PREFIX.size:
        return data
    hlen = _PREFIX.unpack_from(data)[2]
    new = d.choice((0, 1, hlen - 1, hlen + 1, hlen + d.integer(2, 64), len(data), MAX_HEADER_BYTES + 1, 2**32 - 1,
                    d.integer(0, 2**32 - 1)))
    return data[:5] + struct.pack("<I", max(0, min(new, 2**32 - 1))) + data[_PREFIX.size :]


class _Raw(str):
    """A token written into the header text as it is (numbers JSON cannot express from Python, deep nesting)."""


_DEEP = 100_000
_HOSTILE: tuple[Any, ...] = (
    True, False, None, 0, 1, -1, 2.9, 2.0, -0.0, 0.5, "7", "", "x" * 300, [], {}, [None], {"": 0}, [1, 2],
    2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**4000, [10**4000] * 3, float("inf"),
    float("-inf"), float("nan"), "complex64", "float32", "int32", "bool", "uint8", "embedding", "gradient",
    "handshake", "telepathy", _Raw("1e400"), _Raw("-0"), _Raw("1.0e0"), _Raw("1E2"), _Raw("Infinity"),
    _Raw("NaN"), _Raw("[" * 5 + "]" * 5), _Raw("[" * 64 + "]" * 64), _Raw("[" * _DEEP + "]" * _DEEP),
    _Raw('{"a":' * 64 + "0" + "}" * 64), _Raw('"\\ud800"'), _Raw('"\\u0000"'), _Raw('"\\u0061"'),
)


def _nodes(tree: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every value in a JSON tree (the root included)."""
    out = [path]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.extend(_nodes(v, (*path, k)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.extend(_nodes(v, (*path, i)))
    return out


def _get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _dump(tree: Any) -> bytes:
    raws: list[str] = []

    def mark(value: Any) -> Any:
        if isinstance(value, _Raw):
            raws.append(str(value))
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(tree), separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00", ensure_ascii=False), raw)
    return text.encode("utf-8", "surrogatepass")


def _structural(data: bytes, d: Draw) -> bytes:
    """Change the parsed header: one value swapped for a hostile one, a key dropped/added, an element
    dropped/duplicated, keys reordered; written back as compact JSON in front of the unchanged payload."""
    parts = _split(data)
    if parts is None:
        return _flip(data, d)
    head5, header, payload = parts
    try:
        tree = json.loads(header)
    except (ValueError, RecursionError):  # an earlier mutation broke the header already
        return _flip(data, d)
    paths = _nodes(tree)
    path = d.choice(paths)
    op = d.choice(("replace", "replace", "replace", "drop", "add", "duplicate", "reorder", "wrap"))
    node = _get(tree, path)
    if op == "replace" and path:
        _get(tree, path[:-1])[path[-1]] = d.choice(_HOSTILE)
    elif op == "replace":
        tree = d.choice(_HOSTILE)
    elif op == "drop" and isinstance(node, (dict, list)) and node:
        key = d.choice(list(node.keys()) if isinstance(node, dict) else list(range(len(node))))
        del node[key]
    elif op == "add" and isinstance(node, dict):
        node[d.choice(("zz", "step", "", "x" * 300))] = d.choice(_HOSTILE)
    elif op == "add" and isinstance(node, list):
        node.append(d.choice(_HOSTILE))
    elif op == "duplicate" and isinstance(node, list) and node:
        node.append(node[d.integer(0, len(node) - 1)])
    elif op == "reorder" and isinstance(node, dict) and len(node) > 1:
        items = list(node.items())
        node.clear()
        node.update(items[1:] + items[:1])
    elif op == "wrap" and path:
        _get(tree, path[:-1])[path[-1]] = [node]
    else:  # nothing of that sort at this node: a hostile value at the root's first key instead
        if isinstance(tree, dict) and tree:
            tree[next(iter(tree))] = d.choice(_HOSTILE)
    return _frame(head5, _dump(tree), payload)


_NUMBER = re.compile(rb'(?<=[:,\[])-?[0-9]+(?=[,\]}])')  # an integer token outside strings


def _textual(data: bytes, d: Draw) -> bytes:
    """Rewrites of the header text that keep (or nearly keep) its JSON meaning: whitespace, escapes, a duplicated
    key, a number respelled. The decoder accepts one spelling per message: these must be refused, not normalised."""
    parts = _split(data)
    if parts is None or len(parts[1]) < 2:
        return _insert(data, d)
    head5, header, payload = parts
    op = d.choice(("space", "escape", "duplicate-key", "respell"))
    if op == "space":
        pos = d.integer(0, len(header))
        header = header[:pos] + d.choice((b" ", b"\n", b"\t", b"\r")) + header[pos:]
    elif op == "escape":
        letters = [i for i, c in enumerate(header) if chr(c).isalpha()]
        if letters:
            i = d.choice(letters)
            header = header[:i] + b"\\u%04x" % header[i] + header[i + 1 :]
    elif op == "duplicate-key":
        header = b'{"step":0,' + header[1:]
    else:
        numbers = list(_NUMBER.finditer(header))
        if numbers:
            m = d.choice(numbers)
            n = m.group()
            spelled = d.choice((b"0" + n, n + b".0", n + b"e0", n + b"E+0", b"-" + n if n != b"0" else b"-0"))
            header = header[: m.start()] + spelled + header[m.end() :]
    return _frame(head5, header, payload)


MUTATIONS: dict[str, Callable[[bytes, Draw], bytes]] = {
    "flip": _flip,
    "truncate": _truncate,
    "insert": _insert,
    "delete": _delete,
    "header-length": _header_length,
    "structural": _structural,
    "textual": _textual,
}
_WEIGHTED = ("flip", "flip", "truncate", "insert", "delete", "header-length", "structural", "structural",
             "structural", "structural", "textual", "textual")


def mutate(data: bytes, d: Draw) -> tuple[bytes, list[str]]:
    """One to three stacked mutations of ``data``; returns the bytes and the names of the mutations applied."""
    names = [d.choice(_WEIGHTED) for _ in range(d.integer(1, 3))]
    for name in names:
        if data:
            data = MUTATIONS[name](data, d)
    return data, names


def check_decode(data: bytes) -> tuple[str, Message | None, BaseException | None, tuple[float, float]]:
    """Decode ``data`` and classify the outcome: ``accepted`` (the message re-encodes to exactly ``data``),
    ``refused`` (MessageError), ``coerced`` (accepted but re-encodes differently) or ``crash`` (another
    exception); the last item is the (wall, thread CPU) seconds of the decode call alone."""
    w0, c0 = time.perf_counter(), time.thread_time()
    message, exc = None, None
    try:
        message = decode(data)
    except Exception as e:  # noqa: BLE001 -- classified below; what the bench exists to count
        exc = e
    seconds = (time.perf_counter() - w0, time.thread_time() - c0)
    if exc is not None:
        return ("refused" if isinstance(exc, MessageError) else "crash"), None, exc, seconds
    try:
        same = encode(message) == data
    except Exception as e:  # noqa: BLE001 -- accepted something the encoder would never write
        return "coerced", message, e, seconds
    return ("accepted" if same else "coerced"), message, None, seconds


# -- the benchmark --------------------------------------------------------------------------------------------
def _quantiles(us: list[float]) -> dict[str, float]:
    us = sorted(us)
    return {"median_us": round(statistics.median(us), 1), "p99_us": round(us[min(len(us) - 1, int(0.99 * len(us)))], 1),
            "max_us": round(us[-1], 1)}


def _typical_roundtrip_us(repeats: int) -> dict[str, float]:
    """encode/decode of a typical embedding message (batch 256 x 64 float32): per call, the best of ``repeats``
    batches of 1000 calls, in thread CPU time (the work, whatever else shares the cores) and wall time."""
    msg = Message("embedding", "party0", "label", 123, {"embedding": torch.randn(256, 64)})
    data = encode(msg)
    out: dict[str, float] = {}
    for name, fn in (("encode", lambda: encode(msg)), ("decode", lambda: decode(data))):
        cpu = wall = float("inf")
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(1000):
                fn()
            cpu, wall = min(cpu, time.thread_time() - c0), min(wall, time.perf_counter() - w0)
        out[f"{name}_cpu_us"], out[f"{name}_wall_us"] = round(cpu * 1e3, 2), round(wall * 1e3, 2)
    out["bytes"] = len(data)
    out["payload_bytes"] = 256 * 64 * 4
    return out


@BENCHES.register("decode")
class DecodeBench:
    help = "decode time and outcomes for mutated real messages of every kind (0 crashes, 0 coercions expected)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--cases", type=int, default=10_000, help="mutated messages per kind")
        p.add_argument("--per-kind", type=int, default=6, help="captured originals per kind")
        p.add_argument("--seed", type=int, default=0, help="seed of the mutations")
        p.add_argument("--repeats", type=int, default=5, help="repeats of the typical encode/decode micro-benchmark")
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")

    def run(self, args: argparse.Namespace) -> dict:
        if args.cases < 1 or args.per_kind < 1:
            from secvfl.errors import ConfigError

            raise ConfigError(f"--cases and --per-kind must be at least 1, got {args.cases} and {args.per_kind}")
        threads = fix_threads(args.threads)
        t0 = time.perf_counter()
        corpus = capture_corpus(args.per_kind)
        capture_s = time.perf_counter() - t0
        draw = RandomDraw(args.seed)
        kinds, all_us, all_cpu_us, failures, slowest = {}, [], [], [], None
        for key, originals in corpus.items():
            us, cpu_us, outcomes = [], [], {"accepted": 0, "refused": 0, "coerced": 0, "crash": 0}
            for i in range(args.cases):
                data, names = mutate(originals[i % len(originals)], draw)
                outcome, _, exc, (wall, cpu) = check_decode(data)
                us.append(wall * 1e6)
                cpu_us.append(cpu * 1e6)
                outcomes[outcome] += 1
                if outcome in ("crash", "coerced") and len(failures) < 20:
                    failures.append({"kind": key, "mutations": names, "outcome": outcome,
                                     "error": f"{type(exc).__name__}: {exc}"[:300] if exc else None,
                                     "bytes_hex_head": data[:120].hex()})
                if slowest is None or cpu > slowest["cpu_us"] / 1e6:
                    slowest = {"kind": key, "mutations": names, "outcome": outcome, "bytes": len(data),
                               "cpu_us": round(cpu * 1e6, 1), "wall_us": round(wall * 1e6, 1)}
            all_us.extend(us)
            all_cpu_us.extend(cpu_us)
            kinds[key] = {"cases": args.cases, **outcomes, **_quantiles(us),
                          "cpu": _quantiles(cpu_us), "over_50ms": sum(u > 50_000 for u in us),
                          "original_bytes_max": max(map(len, originals))}
        total = {k: sum(v[k] for v in kinds.values()) for k in ("cases", "accepted", "refused", "coerced", "crash",
                                                                 "over_50ms")}
        return {
            "benchmark": "decode",
            # wall time per case, and the thread's CPU time (the decoder's work, whatever else shares the cores)
            "total": {**total, **_quantiles(all_us), "cpu": _quantiles(all_cpu_us)},
            "slowest_case_by_cpu": slowest,
            "kinds": kinds,
            "failures": failures,
            "typical_embedding": _typical_roundtrip_us(args.repeats),
            "capture_seconds": round(capture_s, 2),
            "config": {"cases_per_kind": args.cases, "originals_per_kind": args.per_kind, "seed": args.seed},
            "threads": threads,
            "peak_rss_mb": peak_rss_mb(),
            "machine": machine(),
        }
