"""Private set intersection for entity alignment (``secvfl align``, ``secvfl party``): which ids two parties share.

Protocol: ECDH-PSI (Meadows 1986; Huberman, Franklin, Hogg 1999) between the label party L (ids Y) and each feature
party F (ids X), over Curve25519 with X25519's x-only scalar multiplication (protocols.psi_kernel), a fresh secret
scalar ``a`` (L, one for the whole run) and ``b`` (F)::

    round 1   L -> F : X25519(a, H(y)) for every y in Y, sorted    F -> L : X25519(b, H(x)) for every x in X, sorted
    round 2   L -> F : M(X25519(a, P)) for every P F sent, same order
              F -> L : M(X25519(b, P)) for every P L sent, same order
    finish    L: y is shared  <=>  M(ab H(y)) (from F, in L's order) is among M(ab H(x)) (computed by L in round 2)
              F: x is shared  <=>  M(ab H(x)) (from L, in F's order) is among M(ab H(y)) (computed by F in round 2)

``H`` hashes an id (its UTF-8 bytes) to a point of Curve25519 itself, never of its twist (try-and-increment on SHA-256
with a Legendre-symbol test; protocols.psi_kernel says why the twist must be excluded). ``M`` is SHA-256 of the
doubly blinded u-coordinate, truncated to ``w`` bytes, the smallest whole number of bytes with
``|X| * |Y| * 2^(-8w) <= 2^-40`` (at least 8, at most 32 bytes; 11 bytes at 10^7 x 10^7): the probability that any id
is wrongly found shared (two different ids' truncated values colliding) is at most 2^-40 per pair of parties; an id
held by both is always found (equal ids give equal values). Both sides compute ``w`` from the two set sizes.

Security (semi-honest parties; DDH in the prime-order subgroup of Curve25519; H modelled as a random oracle): F sees
|Y| values X25519(a, H(y)), pseudorandom to it for y outside X, and the truncated doubly blinded values of its own
ids, so F learns its intersection with Y and the size of Y, nothing else; symmetrically L learns Y's intersection
with each X and each |X|, never an id outside its own set, and F never learns which other feature party holds what.
L uses one scalar for all feature parties: each F receives the same round-1 list, and feature parties that pool
their views learn what pooling their sets would give them anyway (the intersection of Y with each of their sets).
Sets are sent sorted by blinded value (a random order). Ids are compared as exact UTF-8 strings (no normalisation;
callers strip whitespace); repeated ids are sent once (set semantics). Every received point is checked to be the
canonical u-coordinate of a point of Curve25519 of large order (a twist or small-order value is refused: no honest
party sends one). Not protected: a malicious party can probe ids it invents (inherent in any PSI that reveals the
intersection) or lie about its set; set sizes are revealed; hashing time varies slightly with the id (the counter).

Why X25519 from ``cryptography`` (OpenSSL) rather than P-256 (the previous implementation) or ``openmined-psi``:
measured on the 2-core machine, one X25519 multiplication with its key object costs 26 us against 38 us for P-256
plus 50 us for P-256's hash to the curve (a square root per try) and 55 us per received P-256 point (decompression);
``openmined-psi`` 2.0.6 (C++, P-256) costs ~53 us per multiplication, runs on one core and gives the intersection to
one side only (both sides must learn it here). Compact on the wire: 32 bytes per id in round 1 (an u-coordinate
needs no sign bit), ``w`` (8 to 11) bytes per id in round 2.

Scale: ids live in one UTF-8 buffer with int64 offsets (a list of str, or an Arrow string array from a file: no
Python object per id for the latter); the curve work runs in a pool of worker processes of the party's own (a chunk
of 16,384 ids or points per task; ``workers``); messages are chunks of at most 16,384 points (512 KiB), each
declaring the set's total, so a receiver bounds what it accepts (``max_peer_ids``) and holds a peer's set as one
array. Memory per party: 32 bytes per own id (round 1), ``w`` bytes per own and per peer id (round 2), the
ids themselves and 8 bytes of index per id.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from protocols.psi_kernel import POINT_BYTES, NotOnCurve, blind_ids, hash_to_curve, reblind_points
from secvfl.errors import DataError, ProtocolError
from secvfl.messages import Message, register_kind
from secvfl.transport.layers import Role
from secvfl.transport.network import Network

__all__ = ["PsiParty", "Alignment", "Workers", "align", "align_with_peers", "align_rows_with_peers",
           "hash_to_curve", "match_width", "PROTOCOL", "POINTS_KIND", "REBLINDED_KIND", "CHUNK_IDS", "MAX_PEER_IDS"]

POINTS_KIND = register_kind("psi-points")  # round 1: own ids blinded with own scalar, a chunk of the sorted set
REBLINDED_KIND = register_kind("psi-reblinded")  # round 2: match values of the peer's points, same order and chunks

CHUNK_IDS = 1 << 14  # ids or points per task and per message (512 KiB of points)
MAX_PEER_IDS = 10**9  # the largest set a party accepts from a peer (32 GB of points: a bug, not a federation)
STATISTICAL_BITS = 40  # a false match anywhere in a pair of sets has probability at most 2^-40
PROTOCOL = "ECDH-PSI over Curve25519 (X25519; semi-honest, DDH)"

ProgressFn = Callable[[str], None]


def match_width(n: int, m: int) -> int:
    """Bytes of a truncated match value for sets of ``n`` and ``m`` ids: ``n * m * 2^(-8w) <= 2^-40``."""
    bits = (max(1, n * m) - 1).bit_length() + STATISTICAL_BITS  # ceil(log2(n m)) + 40
    return min(POINT_BYTES, max(8, -(-bits // 8)))


def default_workers() -> int:
    """Worker processes for the curve arithmetic: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class Workers:
    """A party's own pool of worker processes for the curve arithmetic, a chunk per task, answers in task order.

    Started on the first call with two tasks or more (a small set is computed in this process); processes are
    spawned, not forked (a party's process runs gRPC and torch threads, which a fork would copy half-held). Only
    bytes go to the workers, with the party's scalar: they are the party's own processes, not another party."""

    def __init__(self, processes: int | None = None) -> None:
        self.processes = default_workers() if processes is None else max(1, int(processes))
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def map(self, fn: Callable[..., bytes], tasks: Iterable[tuple]) -> Iterator[bytes]:
        """``fn(*task)`` for every task, in order, with at most two tasks per worker in flight (bounded memory).
        ``fn`` lives in protocols.psi_kernel, so a worker imports that module only (not torch)."""
        tasks = iter(tasks)
        first = next(tasks, None)
        if first is None:
            return
        second = next(tasks, None)
        if second is None or self.processes == 1:
            yield fn(*first)
            if second is not None:
                yield fn(*second)
                for task in tasks:
                    yield fn(*task)
            return
        if self._pool is None:
            # Workers run at a lower priority: the party's own process keeps its transport and heartbeats on time.
            self._pool = ProcessPoolExecutor(self.processes, mp_context=get_context("spawn"), initializer=os.nice,
                                             initargs=(5,))
        pending: deque[Future] = deque()
        for task in (first, second):
            pending.append(self._pool.submit(fn, *task))
        for task in tasks:
            pending.append(self._pool.submit(fn, *task))
            if len(pending) >= 2 * self.processes:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class _Progress:
    """Progress lines (at most one every ``every`` seconds, and the last) through ``report``."""

    def __init__(self, report: ProgressFn | None, what: str, total: int, every: float = 5.0) -> None:
        self.report, self.what, self.total, self.every = report, what, total, every
        self.start = self.last = time.monotonic()

    def update(self, done: int) -> None:
        if self.report is None:
            return
        now = time.monotonic()
        if done >= self.total or now - self.last >= self.every:
            self.last = now
            share = f" ({100 * done / self.total:.0f} %)" if self.total else ""
            self.report(f"{self.what}: {done:,} of {self.total:,}{share}, {now - self.start:.0f} s")


class _Ids:
    """A party's ids as UTF-8 bytes in one buffer (int64 offsets), from a list of str or an Arrow string array."""

    def __init__(self, ids: Iterable[str] | Any, party: str) -> None:
        self.arrow = None
        self.source: list[str] | None = None
        if type(ids).__module__.split(".")[0] == "pyarrow":
            import pyarrow as pa

            arr = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
            if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
                raise DataError(f"{party}'s ids must be strings (as read from a file), got Arrow type {arr.type}")
            if arr.null_count:
                raise DataError(f"{party}'s ids hold {arr.null_count} missing value(s); every row needs an id")
            buffers = arr.buffers()  # int32 offsets (string) or int64 (large_string), read where they lie
            width = np.int64 if pa.types.is_large_string(arr.type) else np.int32
            self.offsets = np.frombuffer(buffers[1], dtype=width)[arr.offset : arr.offset + len(arr) + 1]
            self.data = memoryview(buffers[2]) if buffers[2] is not None else memoryview(b"")
            self.arrow = arr
        else:
            self.source = ids if isinstance(ids, list) else list(ids)
            encoded = []
            for i in self.source:
                if not isinstance(i, str):
                    raise DataError(f"{party}'s ids must be strings (as read from a file), got a {type(i).__name__}: "
                                    "convert them with str() so that 1 and '1' cannot silently differ")
                encoded.append(i.encode("utf-8", errors="surrogatepass"))
            self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
            np.cumsum([len(e) for e in encoded], out=self.offsets[1:])
            self.data = memoryview(b"".join(encoded))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def chunk(self, start: int, stop: int) -> tuple[bytes, bytes]:
        """(offsets relative to the chunk, as int64 bytes; the chunk's UTF-8 bytes): one task for a worker."""
        offs = self.offsets[start : stop + 1].astype(np.int64)
        return (offs - offs[0]).tobytes(), bytes(self.data[offs[0] : offs[-1]])

    def take(self, rows: np.ndarray) -> Any:
        """The ids at ``rows``: a list for list input, an Arrow array for Arrow input."""
        if self.source is not None:
            return [self.source[i] for i in rows.tolist()]
        return self.arrow.take(rows)


def _prefix64(values: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each row of a (n, w) uint8 array as big-endian integers (sorting them sorts the rows)."""
    return np.ascontiguousarray(values[:, :8]).view(">u8").ravel().astype(np.uint64)


def _sorted_distinct(points: np.ndarray) -> np.ndarray:
    """Indices of ``points`` (n, 32) sorted by value, each distinct value once (its first row): repeated ids blind
    to equal values, so this also keeps each id once."""
    prefix = _prefix64(points)
    order = np.argsort(prefix, kind="stable")
    keys = prefix[order]
    del prefix
    ties = np.flatnonzero(keys[1:] == keys[:-1])  # t: sorted rows t and t + 1 share their first 8 bytes
    del keys
    if not ties.size:
        return order
    breaks = np.flatnonzero(np.diff(ties) != 1)
    starts = np.concatenate([ties[:1], ties[breaks + 1]])
    ends = np.concatenate([ties[breaks], ties[-1:]]) + 1
    keep = np.ones(len(order), dtype=bool)
    for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):  # repeated ids (or a 2^-64 coincidence)
        members = sorted(order[lo : hi + 1].tolist(), key=lambda i: (points[i].tobytes(), i))
        order[lo : hi + 1] = members
        values = [points[i].tobytes() for i in members]
        keep[lo + 1 : hi + 1] = [a != b for a, b in zip(values[1:], values[:-1], strict=True)]
    return order[keep]


def _members(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """For each row of ``mine`` (n, w), whether it equals some row of ``theirs`` (m, w): both sorted by their first
    8 bytes, then binary search (sorted queries keep it cache-friendly), then the full rows compared."""
    hit = np.zeros(len(mine), dtype=bool)
    if not len(mine) or not len(theirs):
        return hit
    t_keys = _prefix64(theirs)
    t_order = np.argsort(t_keys, kind="stable")
    t_keys = t_keys[t_order]
    queries = _prefix64(mine)
    m_order = np.argsort(queries, kind="stable")
    queries = queries[m_order]
    left = np.searchsorted(t_keys, queries, "left")
    right = np.searchsorted(t_keys, queries, "right")
    del queries
    width = right - left
    del right
    one = np.flatnonzero(width == 1)
    rows_m, rows_t = m_order[one], t_order[left[one]]
    for start in range(0, len(one), CHUNK_IDS * 16):  # compare full values a slice at a time (bounded temporaries)
        a, b = rows_m[start : start + CHUNK_IDS * 16], rows_t[start : start + CHUNK_IDS * 16]
        hit[a] = (mine[a] == theirs[b]).all(axis=1)
    for j in np.flatnonzero(width > 1).tolist():  # an equal 64-bit prefix in theirs: compare every candidate
        i = m_order[j]
        hit[i] = bool((theirs[t_order[left[j] : left[j] + width[j]]] == mine[i]).all(axis=1).any())
    return hit


def _new_key() -> bytes:
    return X25519PrivateKey.generate().private_bytes_raw()  # 32 bytes from OpenSSL's CSPRNG (clamped when used)


class PsiParty:
    """One party's side of ECDH-PSI: its own ids and one secret scalar for the run. Holds nothing of any other party.

    Rounds are streams of chunk messages: :meth:`points_for` (round 1), :meth:`reblind` (round 2, from the peer's
    round-1 chunks), :meth:`finish` (the peer's round-2 chunks -> own rows shared with that peer)."""

    def __init__(self, name: str, ids: Iterable[str] | Any, *, workers: Workers | None = None,
                 progress: ProgressFn | None = None, max_peer_ids: int = MAX_PEER_IDS) -> None:
        self.name = name
        self._ids = _Ids(ids, name)
        self._workers = workers or Workers(1)
        self._progress = progress
        self.max_peer_ids = int(max_peer_ids)
        self._key = _new_key()
        self._points: np.ndarray | None = None  # (n, 32): own blinded ids, in input order
        self._order: np.ndarray | None = None  # input row of each sent point (sorted by value, distinct)
        self._theirs: dict[str, np.ndarray] = {}  # peer -> (m, w) match values of the peer's ids
        self.shared_rows: dict[str, np.ndarray] = {}  # peer -> own input rows (first of repeats) the peer holds

    def __repr__(self) -> str:
        return f"PsiParty({self.name!r}, {len(self._ids)} ids)"

    @property
    def distinct_rows(self) -> np.ndarray:
        """Input row of each distinct id (its first occurrence), in input order."""
        self._blind_own()
        return np.sort(self._order)

    @property
    def n_distinct(self) -> int:
        self._blind_own()
        return len(self._order)

    def ids_at(self, rows: np.ndarray) -> list[str]:
        return self._ids.take(np.asarray(rows, dtype=np.int64))

    def _blind_own(self) -> None:
        if self._order is not None:
            return
        n = len(self._ids)
        points = np.empty((n, POINT_BYTES), dtype=np.uint8)
        progress = _Progress(self._progress, f"{self.name}: PSI round 1, ids blinded", n)
        tasks = ((self._key, *self._ids.chunk(s, min(n, s + CHUNK_IDS))) for s in range(0, n, CHUNK_IDS))
        start = 0
        for out in self._workers.map(blind_ids, tasks):
            block = np.frombuffer(out, dtype=np.uint8).reshape(-1, POINT_BYTES)
            points[start : start + len(block)] = block
            start += len(block)
            progress.update(start)
        self._order = _sorted_distinct(points)
        self._points = points  # sent in sorted order chunk by chunk (no sorted copy of the whole set)

    def points_for(self, peer: str, step: int = 0) -> Iterator[Message]:
        """Round 1: own distinct ids blinded with the run's scalar, sorted by value, in chunks; the first declares
        the total (an empty set sends one empty chunk)."""
        self._blind_own()
        total = len(self._order)
        for start in range(0, max(total, 1), CHUNK_IDS):
            stop = min(total, start + CHUNK_IDS)
            chunk = self._points[self._order[start:stop]].tobytes()
            yield Message(POINTS_KIND, self.name, peer, step, blobs={"points": chunk},
                          meta={"total": total, "offset": start, "count": stop - start})

    def release_points(self) -> None:
        """Drop the round-1 points once every peer has them (only the input order of each is kept)."""
        self._points = None

    def reblind(self, peer: str, chunks: Iterable[Message], step: int = 0) -> Iterator[Message]:
        """Round 2: the match value of every point the peer sent, in its order and chunks; keeps them to compare."""
        n = self.n_distinct
        stream = _ChunkStream(chunks, POINTS_KIND, peer, self.name, POINT_BYTES, self.max_peer_ids)
        progress: _Progress | None = None
        theirs: np.ndarray | None = None
        width = 0

        def tasks() -> Iterator[tuple]:
            nonlocal progress, theirs, width
            for blob in stream:
                if theirs is None:
                    width = match_width(n, stream.total)
                    theirs = np.empty((stream.total, width), dtype=np.uint8)
                    progress = _Progress(self._progress, f"{self.name}: PSI round 2, {peer}'s ids reblinded",
                                         stream.total)
                yield self._key, blob, width

        done = 0
        try:
            for out in self._workers.map(reblind_points, tasks()):
                block = np.frombuffer(out, dtype=np.uint8).reshape(-1, width)
                theirs[done : done + len(block)] = block
                yield Message(REBLINDED_KIND, self.name, peer, step, blobs={"values": out},
                              meta={"total": stream.total, "offset": done, "count": len(block), "width": width})
                done += len(block)
                progress.update(done)
        except NotOnCurve as exc:
            raise ProtocolError(f"{peer} sent a value that is not a point of Curve25519 (its point "
                                f"{done + exc.args[0]}): no honest party sends one; refusing the PSI run") from None
        if theirs is None:  # the peer's set is empty: one empty chunk each way
            width = match_width(n, 0)
            theirs = np.empty((0, width), dtype=np.uint8)
            yield Message(REBLINDED_KIND, self.name, peer, step, blobs={"values": b""},
                          meta={"total": 0, "offset": 0, "count": 0, "width": width})
        self._theirs[peer] = theirs

    def finish(self, peer: str, chunks: Iterable[Message]) -> np.ndarray:
        """Own input rows whose doubly blinded value is among the peer's (the peer's reblinding of own points)."""
        if peer not in self._theirs:
            raise ProtocolError(f"{self.name} got {peer}'s round-2 values before reblinding {peer}'s points")
        theirs = self._theirs.pop(peer)
        n = self.n_distinct
        width = match_width(n, len(theirs))
        stream = _ChunkStream(chunks, REBLINDED_KIND, peer, self.name, width, n, expect_total=n, width=width)
        mine = np.empty((n, width), dtype=np.uint8)
        done = 0
        for blob in stream:
            block = np.frombuffer(blob, dtype=np.uint8).reshape(-1, width)
            mine[done : done + len(block)] = block
            done += len(block)
        hit = _members(mine, theirs)
        rows = np.sort(self._order[hit])
        self.shared_rows[peer] = rows
        return rows

    def learned(self, peer: str) -> list[str]:
        """Own ids shared with ``peer``, in own input order (after :meth:`finish`)."""
        return self.ids_at(self.shared_rows[peer])


class _ChunkStream:
    """The blobs of one peer's chunk messages of one kind, checked: kind, sender and receiver, a declared total
    (at most ``limit``, or exactly ``expect_total``), contiguous offsets, sizes that match the counts."""

    def __init__(self, chunks: Iterable[Message], kind: str, peer: str, me: str, item_bytes: int, limit: int, *,
                 expect_total: int | None = None, width: int | None = None) -> None:
        self.chunks, self.kind, self.peer, self.me = iter(chunks), kind, peer, me
        self.item_bytes, self.limit, self.expect_total, self.width = item_bytes, limit, expect_total, width
        self.total = -1

    def _bad(self, what: str) -> ProtocolError:
        return ProtocolError(f"{self.kind} message from {self.peer} is malformed ({what}); refusing the PSI run")

    def __iter__(self) -> Iterator[bytes]:
        offset = 0
        while True:
            msg = next(self.chunks, None)
            if msg is None:
                raise ProtocolError(f"{self.peer}'s {self.kind} messages ended after {offset} of {self.total} values")
            if (msg.kind, msg.sender, msg.receiver) != (self.kind, self.peer, self.me):
                raise ProtocolError(f"{self.me} expected {self.kind} from {self.peer}, got {msg.kind} from "
                                    f"{msg.sender} for {msg.receiver}")
            meta = msg.meta
            total, at, count = meta.get("total"), meta.get("offset"), meta.get("count")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (total, at, count)):
                raise self._bad(f"total/offset/count {total!r}/{at!r}/{count!r}")
            if self.total < 0:
                if total > self.limit:
                    raise ProtocolError(f"{self.peer} declares {total:,} ids, over this party's limit of "
                                        f"{self.limit:,}; refusing the PSI run")
                if self.expect_total is not None and total != self.expect_total:
                    raise self._bad(f"{total} values for the {self.expect_total} points sent")
                self.total = total
            if total != self.total or at != offset or count > CHUNK_IDS or offset + count > total:
                raise self._bad(f"chunk at {at} of {count} values, expected offset {offset} of {self.total}")
            if self.width is not None and meta.get("width") != self.width:
                raise self._bad(f"width {meta.get('width')!r}, expected {self.width} bytes for these set sizes")
            blob = msg.blobs.get("points" if self.kind == POINTS_KIND else "values", b"")
            if len(blob) != count * self.item_bytes:
                raise self._bad(f"{len(blob)} bytes for {count} values of {self.item_bytes} bytes")
            if count:
                yield blob
            offset += count
            if offset == total:
                return


def _incoming(net: Network, me: str, peer: str, kind: str) -> Iterator[Message]:
    while True:
        yield net.receive(me, kind=kind, sender=peer)


@dataclass
class Alignment:
    """Result of aligning the parties' ids. ``held[i, j]``: whether feature party ``j`` holds the label party's
    ``i``-th distinct id (what the label party learns); ``own_rows[f]``: all feature party ``f`` learns (its own
    input rows whose ids the label party also holds)."""

    label_party: str
    feature_parties: list[str]
    label_ids: list[str]  # the label party's distinct ids, in its input order
    held: np.ndarray  # bool [len(label_ids), len(feature_parties)]
    own_rows: dict[str, np.ndarray] = field(default_factory=dict)
    set_sizes: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict, repr=False)  # f -> its ids (to name its learned rows)

    @property
    def learned(self) -> dict[str, Any]:
        """Feature party -> its own ids shared with the label party, in its input order (a list, or an Arrow
        array for Arrow input)."""
        return {f: _Ids(self.inputs[f], f).take(rows) for f, rows in self.own_rows.items() if f in self.inputs}

    @property
    def parties(self) -> list[str]:
        return [self.label_party, *self.feature_parties]

    @property
    def holders(self) -> dict[str, list[str]]:
        """Label id -> parties holding it (label party first); one dict entry per id: for small outputs."""
        ids = self.label_ids if isinstance(self.label_ids, list) else self.label_ids.to_pylist()
        return {ident: [self.label_party, *[f for f, h in zip(self.feature_parties, row, strict=True) if h]]
                for ident, row in zip(ids, self.held.tolist(), strict=True)}

    def pattern(self) -> np.ndarray:
        """Observed-block mask: ``bool[len(label_ids), len(parties)]``, True where the party holds the row."""
        return np.hstack([np.ones((len(self.held), 1), dtype=bool), self.held])

    def counts(self) -> dict[str, Any]:
        pattern = self.pattern()
        codes = pattern.astype(np.int64) @ (1 << np.arange(pattern.shape[1], dtype=np.int64))
        values, numbers = np.unique(codes, return_counts=True)
        per_pattern = {"+".join(p for j, p in enumerate(self.parties) if (int(v) >> j) & 1): int(c)
                       for v, c in zip(values, numbers, strict=True)}
        return {
            "label_ids": len(self.label_ids),
            "set_sizes": dict(self.set_sizes),
            "shared_with_label": {p: int(len(self.own_rows.get(p, []))) for p in self.feature_parties},
            "held_by_all": int(self.held.all(axis=1).sum()) if len(self.held) else 0,
            "held_by_label_only": int((~self.held).all(axis=1).sum()) if len(self.held) else 0,
            "patterns": dict(sorted(per_pattern.items(), key=lambda kv: -kv[1])),
        }


def align(
    ids_by_party: Mapping[str, Iterable[str] | Any],
    label_party: str,
    *,
    net: Network | None = None,
    workers: int | None = 1,
    progress: ProgressFn | None = None,
) -> Alignment:
    """Run ECDH-PSI between ``label_party`` and every other party, through ``net`` (built if not given).

    Embedded mode: every party runs in this process, as isolated :class:`PsiParty` objects that only exchange
    messages (and share one pool of ``workers`` processes for the arithmetic: compute only, no state). Returns the
    label party's view (``held``) and each feature party's own result (``own_rows``, ``learned``)."""
    if label_party not in ids_by_party:
        raise DataError(f"label party {label_party!r} is not among the parties {sorted(ids_by_party)}")
    features = [p for p in ids_by_party if p != label_party]
    if not features:
        raise DataError("alignment needs at least one feature party besides the label party")
    if net is None:
        net = Network({label_party: Role.LABEL, **{p: Role.FEATURE for p in features}})
    with Workers(workers) as pool:
        parties = {p: PsiParty(p, ids, workers=pool, progress=progress) for p, ids in ids_by_party.items()}
        label = parties[label_party]
        for f in features:
            feat = parties[f]
            net.send(*label.points_for(f))
            net.send(*feat.points_for(label_party))
            feat.release_points()
            for msg in feat.reblind(label_party, _incoming(net, f, label_party, POINTS_KIND)):
                net.send(msg)
            for msg in label.reblind(f, _incoming(net, label_party, f, POINTS_KIND)):
                net.send(msg)
            feat.finish(label_party, _incoming(net, f, label_party, REBLINDED_KIND))
            label.finish(f, _incoming(net, label_party, f, REBLINDED_KIND))
        label.release_points()
    rows = label.distinct_rows
    held = np.stack([np.isin(rows, label.shared_rows[f], assume_unique=True) for f in features], axis=1)
    return Alignment(
        label_party=label_party,
        feature_parties=features,
        label_ids=label.ids_at(rows),
        held=held.reshape(len(rows), len(features)),
        own_rows={f: parties[f].shared_rows[label_party] for f in features},
        set_sizes={p: parties[p].n_distinct for p in parties},
        inputs={f: parties[f]._ids.source if parties[f]._ids.source is not None else parties[f]._ids.arrow
                for f in features},
    )


def align_rows_with_peers(net: Network, me: str, peers: Sequence[str], ids: Iterable[str] | Any, *,
                          workers: Workers | None = None, progress: ProgressFn | None = None,
                          max_peer_ids: int = MAX_PEER_IDS) -> dict[str, np.ndarray]:
    """Party ``me``'s side of ECDH-PSI with each of ``peers``, each of which runs its own side in its own process
    (secvfl.deploy): the rounds of :func:`align`, through ``net``. Returns, per peer, ``me``'s input rows (sorted)
    whose ids the peer also holds. A feature party passes its one peer, the label party."""
    own_pool = workers is None
    pool = Workers() if own_pool else workers
    try:
        party = PsiParty(me, ids, workers=pool, progress=progress, max_peer_ids=max_peer_ids)
        for peer in peers:
            for msg in party.points_for(peer):
                net.send(msg)
        party.release_points()
        for peer in peers:
            for msg in party.reblind(peer, _incoming(net, me, peer, POINTS_KIND)):
                net.send(msg)
        for peer in peers:
            party.finish(peer, _incoming(net, me, peer, REBLINDED_KIND))
        return dict(party.shared_rows)
    finally:
        if own_pool:
            pool.close()


def align_with_peers(net: Network, me: str, peers: Sequence[str], ids: Iterable[str], **kwargs: Any
                     ) -> dict[str, list[str]]:
    """As :func:`align_rows_with_peers`, but returns ``me``'s shared ids themselves (in input order) per peer."""
    ids = ids if isinstance(ids, list) or type(ids).__module__.split(".")[0] == "pyarrow" else list(ids)
    rows = align_rows_with_peers(net, me, peers, ids, **kwargs)
    table = _Ids(ids, me)
    return {peer: _as_list(table.take(r)) for peer, r in rows.items()}


def _as_list(ids: Any) -> list[str]:
    return ids if isinstance(ids, list) else ids.to_pylist()
