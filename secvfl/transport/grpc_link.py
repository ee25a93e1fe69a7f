"""gRPC transport with mutual TLS: the parties of one run in separate processes, on one host or many.

Each party process runs one :class:`GrpcTransport`. It listens on its own address (a gRPC server) and opens one
long-lived stream to each peer it sends to; a message is the same encoded bytes the in-process transport carries
(no new serialisation, no pickle), cut into chunks of at most :data:`CHUNK_BYTES` so that ciphertexts of any size
pass gRPC's message limit, and a stream delivers in order. HTTP/2 flow control and a bounded send queue per peer
push back on a sender that outruns its receiver.

How a message travels: the streams and the server are ``grpc.aio`` objects driven by one event loop in a thread of
the party's process. ``put`` holds a message; when the party next waits for a message (or calls ``flush``), what it
holds for each peer goes to the loop as one gRPC message (a batch frame), with one wake-up of the loop for all
peers. The loop also sends anything left held at each heartbeat check, so nothing stays held for long, whatever
the party does. Why: each gRPC message costs hand-offs between threads and a wake-up at the receiver, whatever its
size, and a training step sends one peer several messages without waiting in between (a gradient, the backward
request, the next forward request). Measured on MNIST split-NN with 4 feature parties (``secvfl bench transport``,
BENCHMARKS.md, "Parties in separate processes"): against the synchronous grpcio streams this replaced, 15 % less CPU in all processes
and 28 % less in the label party's.

Who is at the other end: every connection is mutual TLS with the federation's CA as the only root (grpcio's TLS
checks the chain and the dates), and both ends apply the same certificate check,
:func:`secvfl.federation.verify_peer_certificate` (chain to the CA, dates, both TLS usages, the party's name as CN
and DNS subject alternative name): a server checks the certificate its client presented in TLS; a client checks
the certificate its server proves it holds, in the answer to the client's hello (grpcio gives a client no access
to the server's TLS certificate): the certificate and its key's signature over the client's fresh nonce and the
digest of the client certificate the server saw in TLS -- so a server that passed TLS with another certificate
(relaying for the real party) cannot answer. A peer that fails either check is refused before any message is read.

What a peer can make this party hold is bounded (:class:`~secvfl.transport.inbox.ReceiveLimits`, per peer): the
size of one message (checked at its first chunk, from the number of chunks it declares, before anything is
buffered), the bytes and the number of messages received and not yet taken (beyond them the peer's stream is not
read, so HTTP/2 flow control holds the sender), the streams it holds open, and for everyone the number of
incoming connections and the time a TLS handshake may take. Frames are parsed strictly (a chunk over
:data:`CHUNK_BYTES`, a count of zero, a kind that is not UTF-8 or not a registered kind, a length past the frame:
refused). A peer that breaks a limit or sends a malformed frame has its stream closed and everything it had
buffered dropped, and the run stops with :class:`~secvfl.transport.base.PeerViolation` naming it and the limit.
Received messages are indexed by sender and kind (:class:`~secvfl.transport.inbox.Inbox`): a take costs the same
whatever else is buffered.

Failures: every wait has a deadline. A peer whose stream to us ends without a goodbye (process killed, host gone),
whose stream from us fails, or that sent nothing -- not even the heartbeat each stream carries every
``heartbeat`` seconds -- for ``peer_timeout`` seconds is gone; waiting on it raises :class:`PartyLost` naming it.

Why gRPC and not Flower (measured for issue 18): Flower 1.42's SuperLink/SuperNode engine on loopback with TLS took
a median 10.8 s per training step with a label party and three feature parties exchanging one forward and one
backward message per batch (256 x 64 float32): every message starts a fresh ``flwr-clientapp`` process (1.1 s) and
nodes poll for work (3 s idle poll). A bare grpcio unary call with TLS carrying the same payload took 0.7 ms. Per-batch
VFL needs long-lived party processes that keep their model in memory; this transport is that, on grpcio directly.

Counting: ``stats`` counts what this process sent (each message once, at its sender), exactly as the in-process
transport counts it; ``control_stats`` counts the party-handle requests and replies, which the in-process run makes
as direct calls; ``wire_stats`` counts frame bytes handed to gRPC (chunk headers included; HTTP/2 and TLS framing
come on top and are measured by ``secvfl bench transport``).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature

from secvfl.errors import ConfigError, MessageError, ProtocolError, SecvflError
from secvfl.messages import KINDS
from secvfl.transport.base import CommStats, PeerViolation, Transport, peer_text
from secvfl.transport.inbox import ENTRY_COST, Inbox, ReceiveLimits

__all__ = ["GrpcTransport", "PeerAddress", "TlsFiles", "PartyLost", "PeerViolation", "ReceiveLimits", "CHUNK_BYTES",
           "ERROR_KIND", "transport_kind"]

CHUNK_BYTES = 1 << 20  # well under gRPC's default 4 MiB message limit
_VERSION = 2  # 2: the server proves its certificate in its hello answer
_HELLO, _DATA, _HEARTBEAT, _GOODBYE, _BATCH = 0, 1, 2, 3, 4
_LENGTH = struct.Struct(">I")  # each frame inside a batch frame is preceded by its length
_FRAME = struct.Struct(">BBHQII")  # version, frame type, kind length, message sequence, chunk index, chunk count
_SERVICE = "secvfl.Link"
_QUEUE_FRAMES = 64  # gRPC messages waiting per outgoing stream before put() waits for gRPC to take them
# What a party accepts besides messages of a registered kind (secvfl.messages.KINDS): plain signals of the
# deployment, which carry no message (transport_kind adds one).
_SIGNAL_KINDS: set[str] = set()


def transport_kind(kind: str) -> str:
    """Declare a kind whose frames carry raw bytes, not a message (a deployment's signals)."""
    _SIGNAL_KINDS.add(kind)
    return kind


# A party that fails sends this (UTF-8 text) before it stops: every party waiting on the run stops with it.
ERROR_KIND = transport_kind("party-error")
_MAX_ERROR_BYTES = 64 << 10  # a party's own error text: more is refused
_NONCE_BYTES = 32
_HELLO_STATEMENT = b"secvfl hello v2\x00"  # what a server signs: this, the client's nonce, the client certificate's
# SHA-256 as the server saw it in TLS, and the server's certificate name


class PartyLost(SecvflError):
    """A peer process stopped (or never answered) while this party needed it."""

    def __init__(self, party: str, reason: str) -> None:
        super().__init__(f"party {party} is gone: {reason}; restart it and continue every party with --resume")
        self.party = party


@dataclass(frozen=True)
class PeerAddress:
    """A party this process may talk to: its run name (``party0``, ``label``), its certificate name, host:port."""

    name: str
    cert_name: str
    address: str


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        """The CA certificate, the party's certificate and its private key, once each has been checked to be what
        it claims: a damaged or swapped file is named here, not later as a TLS failure that gRPC reports as "cannot
        listen" or a refused handshake. A key that group or others may read is refused (as channel identity keys
        are): whoever reads it can speak as this party."""
        out = []
        for what, path in (("the CA certificate", self.ca), ("the party certificate", self.cert),
                           ("the party key", self.key)):
            try:
                if path is self.key and os.name == "posix":
                    mode = stat.S_IMODE(Path(path).stat().st_mode)
                    if mode & 0o077:
                        raise ConfigError(f"the party key {path} is accessible by group or others (mode {mode:04o}); "
                                          f"run `chmod 600 {path}`")
                out.append(Path(path).read_bytes())
            except OSError as exc:
                raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}; make the certificates with "
                                  "`secvfl certs --federation FILE`") from None
        _check_tls_files(self, *out)
        return out[0], out[1], out[2]


def _check_tls_files(files: TlsFiles, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> None:
    """ConfigError naming the file unless the CA and the party certificate are PEM certificates, the key a PEM
    private key that belongs to the certificate, and the certificate issued by that CA (grpc takes PEM only)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    fix = "make the certificates again with `secvfl certs --federation FILE` (or restore the file)"
    certs = {}
    for what, path, data in (("the CA certificate", files.ca, ca_pem), ("the party certificate", files.cert, cert_pem)):
        try:
            certs[what] = x509.load_pem_x509_certificate(data)
        except ValueError:
            raise ConfigError(f"{what} {path} is not a PEM certificate (damaged, or another kind of file); {fix}"
                              ) from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"the party key {files.key} is not an unencrypted PEM private key (damaged, or another kind "
                          f"of file); {fix}") from None
    cert, ca = certs["the party certificate"], certs["the CA certificate"]
    raw = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*raw) != cert.public_key().public_bytes(*raw):
        raise ConfigError(f"the party key {files.key} does not belong to the certificate {files.cert}; give each party "
                          f"its own pair of files; {fix}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError(f"the party certificate {files.cert} was not issued by the CA certificate {files.ca} (they "
                          f"come from different runs of `secvfl certs`); {fix}") from None


def check_port_free(address: str, party: str) -> None:
    """One clear line, at once, when ``address`` (host:port, [v6]:port) cannot be listened on by this process."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # as gRPC binds: connections of an earlier run left in TIME_WAIT do not block it, a listener does
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as exc:
            why = {errno.EADDRINUSE: "the port is in use by another process",
                   errno.EADDRNOTAVAIL: "that address is not one of this host's",
                   errno.EACCES: "this process may not use that port"}.get(exc.errno, exc.strerror or str(exc))
            raise ConfigError(f"party {party} cannot listen on {address}: {why}; free the port or change its "
                              "address in the federation file") from None


def _frame(kind_or_name: str, ftype: int, seq: int = 0, index: int = 0, count: int = 1, payload: bytes = b""
           ) -> bytes:
    label = kind_or_name.encode()
    return _FRAME.pack(_VERSION, ftype, len(label), seq, index, count) + label + payload


def _parse(frame: bytes | memoryview) -> tuple[int, str, int, int, int, memoryview]:
    """(frame type, kind or name, message sequence, chunk index, chunk count, payload) of one frame; anything else
    than what :func:`_frame` writes raises :class:`MessageError` (the one error type of every parser here)."""
    if len(frame) < _FRAME.size:
        raise MessageError(f"a frame of {len(frame)} bytes is shorter than its {_FRAME.size}-byte header")
    version, ftype, n, seq, index, count = _FRAME.unpack_from(frame)
    if version != _VERSION:
        raise MessageError(f"frame version {version}; this secvfl speaks version {_VERSION} (upgrade every party)")
    if ftype > _BATCH:
        raise MessageError(f"unknown frame type {ftype}")
    end = _FRAME.size + n
    if end > len(frame):
        raise MessageError(f"a frame's kind of {n} bytes runs past the frame's {len(frame)} bytes")
    if count == 0:
        raise MessageError("a frame declares a count of 0 (every message has at least one chunk)")
    if index >= count:
        raise MessageError(f"a frame is chunk {index} of {count}")
    view = memoryview(frame)
    try:
        label = bytes(view[_FRAME.size:end]).decode()
    except UnicodeDecodeError:
        raise MessageError(f"a frame's kind is not UTF-8 text (bytes {bytes(view[_FRAME.size:end])[:32].hex()})"
                           ) from None
    return ftype, label, seq, index, count, view[end:]


def _batch(frames: list[bytes]) -> bytes:
    """One gRPC message carrying ``frames`` in order (what a party sent one peer since it last waited)."""
    return b"".join([_frame("", _BATCH, count=len(frames)), *(_LENGTH.pack(len(f)) + f for f in frames)])


def _batch_frames(payload: memoryview, count: int) -> Iterator[memoryview]:
    """The ``count`` frames of a batch frame's payload, one at a time (a malformed batch raises MessageError where
    it is found)."""
    at = 0
    for _ in range(count):
        if at + _LENGTH.size > len(payload):
            raise MessageError("a batch frame ends inside a frame's length")
        (n,) = _LENGTH.unpack_from(payload, at)
        at += _LENGTH.size
        if at + n > len(payload):
            raise MessageError("a batch frame ends inside one of its frames")
        yield payload[at:at + n]
        at += n
    if at != len(payload):
        raise MessageError(f"a batch frame carries {len(payload) - at} bytes after its {count} frames")


def _unbatch(payload: memoryview, count: int) -> list[memoryview]:
    return list(_batch_frames(payload, count))


class _Unread:
    """The frames of the last gRPC message read from a peer that are not delivered yet: one frame, or a batch
    parsed one frame at a time as it is delivered (a batch of tiny frames is never held as thousands of parsed
    frames while the peer's buffer is full)."""

    __slots__ = ("head", "rest")

    def __init__(self) -> None:
        self.head: tuple | None = None
        self.rest: Iterator[memoryview] | None = None

    def load(self, frame: bytes) -> None:
        parsed = _parse(frame)
        if parsed[0] == _BATCH:
            self.rest = _batch_frames(parsed[5], parsed[4])
        else:
            self.head = parsed

    def peek(self) -> tuple | None:
        """The next frame, left in place (MessageError: the batch is malformed there)."""
        if self.head is None and self.rest is not None:
            following = next(self.rest, None)
            if following is None:
                self.rest = None
            else:
                self.head = _parse(following)
        return self.head

    def __bool__(self) -> bool:
        return self.peek() is not None


def _wake_all(links: list[_Outgoing]) -> None:
    for link in links:
        link.wake()


class _EventLoop:
    """One asyncio event loop in a daemon thread: every gRPC object of this process lives there.

    Why: synchronous grpcio hands each message between Python threads several times (a consumer thread per
    outgoing stream, a polling thread per channel, a server thread per incoming stream). With grpc.aio one loop
    drives every stream, so a message costs one hand-off from the party's thread to the loop when it is sent and
    one from the loop to the party's thread when it arrives (a ping-pong prototype took 1.6-2x less CPU per message).
    """

    def __init__(self, name: str, log: Callable[[str], None]) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._unhandled)
        self.closing = False
        self._log = log
        self._thread = threading.Thread(target=self._run, name=f"secvfl-grpc-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro, timeout: float):
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except futures.TimeoutError:
            future.cancel()
            raise

    def _unhandled(self, loop, context: dict) -> None:
        # gRPC's own tasks fail when a peer vanishes mid-call and when the server stops under open streams; the
        # transport already reports the peer as lost (PartyLost), so those are not news. Anything else is.
        exc = context.get("exception")
        if self.closing or type(exc).__module__.startswith("grpc") or "Task was destroyed" in context.get(
                "message", ""):
            return
        self._log(f"gRPC event loop: {context.get('message')}: {exc!r}")

    async def cancel_the_rest(self, wait: float) -> None:
        """(On the loop.) Cancel every task still running (gRPC's, after the server stopped) and let them end."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=wait)

    def soon(self, callback, *args) -> None:
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self, wait: float) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(wait)
        if not self._thread.is_alive():
            self.loop.close()


class _Outgoing:
    """One long-lived stream from this party to a peer, written by the event loop.

    The party's thread holds the frames it sends (:meth:`hold`) and hands them over as one gRPC message when it
    flushes (:meth:`flush`: before it waits for a message, see ``GrpcTransport.flush``). The event loop also
    flushes frames left held at each heartbeat check, so a frame is never held for much longer than a heartbeat
    whatever the party does. At most :data:`_QUEUE_FRAMES` messages wait for gRPC at a time (HTTP/2 flow control
    holds a write until the peer has room), so a sender that outruns its peer waits. A heartbeat goes out whenever
    the stream was quiet for ``heartbeat`` seconds.
    """

    def __init__(self, peer: PeerAddress, loop: _EventLoop, heartbeat: float, count: Callable[[int], None]
                 ) -> None:
        self.peer = peer
        self.error: str | None = None
        self._count = count  # counts the bytes of each gRPC message handed over (wire_stats)
        self.seq = 0
        self._loop = loop
        self._space = threading.Semaphore(_QUEUE_FRAMES)
        self._heartbeat = heartbeat
        self._closed = False
        self._last_write = time.monotonic()
        # Both threads append to ``_ready`` under ``_lock``, so messages leave in the order they were flushed.
        self._lock = threading.Lock()
        self._held: list[bytes] = []
        self.held_bytes = 0
        self._ready: deque[tuple[bytes, bool] | None] = deque()

    @property
    def holds(self) -> bool:
        return bool(self._held)

    def hold(self, frame: bytes) -> None:
        with self._lock:
            self._held.append(frame)
            self.held_bytes += _LENGTH.size + len(frame)  # its size inside a batch frame

    def _queue_held(self, holds_space: bool) -> bool:
        """Move the held frames, as one message, to the frames the loop writes (in order, under the lock)."""
        with self._lock:
            if not self._held:
                return False
            message = self._held[0] if len(self._held) == 1 else _batch(self._held)
            self._held, self.held_bytes = [], 0
            self._ready.append((message, holds_space))
        self._count(len(message))
        return True

    def flush(self, deadline: float, *, wake: bool = True) -> bool:
        """(From the party's thread.) Hand the held frames to gRPC as one message; returns whether there were any.
        Without ``wake`` the caller wakes the loop (:meth:`wake`), once for several links."""
        if not self._held:
            return False
        self._wait_for_space(deadline)
        if not self._queue_held(holds_space=True):  # the loop flushed them meanwhile
            self._space.release()
            return False
        if wake:
            self._loop.soon(self.wake)
        return True

    def wake(self) -> None:
        """(On the loop.)"""
        self._wake.set()

    def _wait_for_space(self, deadline: float) -> None:
        while True:
            if self.error is not None:
                raise PartyLost(self.peer.name, self.error)
            if self._space.acquire(timeout=0.2):
                return
            if time.monotonic() > deadline:
                raise PartyLost(self.peer.name, "it took no data for the whole timeout")

    async def start(self, channel, hello: bytes) -> None:
        """(On the loop.) Open the stream on ``channel``; its first frame is ``hello``."""
        self.channel = channel
        self._wake = asyncio.Event()
        self.call = channel.stream_unary(f"/{_SERVICE}/Stream", request_serializer=None,
                                         response_deserializer=None)()
        self._ready.append((hello, False))
        self._pump_task = asyncio.ensure_future(self._pump())
        self._watch_task = asyncio.ensure_future(self._watch())
        self._beat = asyncio.get_running_loop().call_later(self._heartbeat, self._check)

    def _check(self) -> None:
        """(On the loop, every heartbeat.) Send frames the party left held, or a heartbeat if the stream is quiet."""
        if self._closed or self.error is not None:
            return
        flushed = self._queue_held(holds_space=False)
        quiet = time.monotonic() - self._last_write
        if not flushed and quiet >= 0.9 * self._heartbeat and not self._ready:
            self._ready.append((_frame("", _HEARTBEAT), False))
        if self._ready:
            self._wake.set()
            quiet = 0.0
        self._beat = asyncio.get_running_loop().call_later(max(0.05, self._heartbeat - quiet), self._check)

    async def _pump(self) -> None:
        try:
            while True:
                if not self._ready:
                    self._wake.clear()
                    if not self._ready:
                        await self._wake.wait()
                    continue
                item = self._ready.popleft()
                if item is None:
                    await self.call.write(_frame("", _GOODBYE))
                    await self.call.done_writing()
                    return
                message, holds_space = item
                await self.call.write(message)
                self._last_write = time.monotonic()
                if holds_space:
                    self._space.release()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the stream failed: the watcher below says how, if it can
            if not self._closed and self.error is None:
                try:
                    await asyncio.wait_for(asyncio.shield(self._watch_task), 1.0)
                except Exception:  # noqa: BLE001 - no better reason came: keep the write's
                    pass
                if self.error is None:
                    self.error = _describe_rpc_error(exc)

    async def _watch(self) -> None:
        try:
            await self.call
            outcome = "it closed our stream"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # grpc.aio.AioRpcError: the peer's process or host went away, or it refused us
            outcome = _describe_rpc_error(exc)
        if not self._closed and self.error is None:
            self.error = outcome

    async def close(self, wait: float) -> None:
        """(On the loop.) Send what is held, say goodbye, wait (bounded) for the peer, close the channel."""
        self._closed = True
        self._beat.cancel()
        self._queue_held(holds_space=False)
        self._ready.append(None)
        self._wake.set()
        try:
            await asyncio.wait_for(self._pump_task, wait)
            await asyncio.wait_for(self.call, wait)
        except BaseException:  # noqa: BLE001 - closing: the peer may already be gone, nothing is left to deliver
            pass
        self._watch_task.cancel()
        await self.channel.close()


def _describe_rpc_error(exc: Exception) -> str:
    details = peer_text(getattr(exc, "details", lambda: None)() or str(exc))  # the peer's words, maybe
    code = getattr(exc, "code", lambda: None)()
    name = getattr(code, "name", "")
    if name == "PERMISSION_DENIED":
        return f"it refused this party: {details}"
    return f"its stream ended ({name or type(exc).__name__}: {details})"


# -- the hello: the server proves which certificate it holds ------------------------------------------------------
def _certificate_der(cert: bytes) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    if cert.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_certificate(cert).public_bytes(Encoding.DER)
    return bytes(cert)


def _hello_statement(nonce: bytes, client_cert: bytes, server_name: str) -> bytes:
    return _HELLO_STATEMENT + nonce + hashlib.sha256(_certificate_der(client_cert)).digest() + server_name.encode()


def _sign(key_pem: bytes, data: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa

    key = serialization.load_pem_private_key(key_pem, password=None)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)):
        return key.sign(data)
    raise ConfigError(f"a party key of type {type(key).__name__} cannot sign; make the certificates with "
                      "`secvfl certs --federation FILE`")


def _signature_holds(cert_der: bytes, signature: bytes, data: bytes) -> bool:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa

    try:
        key = x509.load_der_x509_certificate(cert_der).public_key()
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        elif isinstance(key, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
            key.verify(signature, data)
        else:
            return False
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def _hello_answer(cert_der: bytes, signature: bytes) -> bytes:
    return _LENGTH.pack(len(cert_der)) + cert_der + signature


def _read_hello_answer(payload: memoryview) -> tuple[bytes, bytes]:
    if len(payload) < _LENGTH.size:
        raise MessageError("a hello answer without its certificate")
    (n,) = _LENGTH.unpack_from(payload)
    if n > len(payload) - _LENGTH.size:
        raise MessageError("a hello answer's certificate runs past its end")
    return bytes(payload[_LENGTH.size:_LENGTH.size + n]), bytes(payload[_LENGTH.size + n:])


class _Refused(Exception):
    """(On the loop.) A peer broke a receive limit or sent a malformed frame: ``problem`` says how."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


class _Assembly:
    """The chunks of the one message a peer's stream is delivering (a stream delivers in order)."""

    __slots__ = ("kind", "seq", "count", "parts", "nbytes")

    def __init__(self) -> None:
        self.kind, self.seq, self.count, self.parts, self.nbytes = "", 0, 0, [], 0


class GrpcTransport(Transport):
    """The transport of one party process: ``local`` is this party's run name, ``peers`` every other party.

    ``verify(cert_name, cert)`` accepts or refuses (raising ProtocolError) a peer's certificate (PEM or DER) as the
    certificate of the party ``cert_name``: the server calls it for every client, the client for every server it
    opens a stream to. ``timeout`` bounds every wait for a message and every connection attempt; ``peer_timeout`` is
    how long a silent peer is tolerated (heartbeats come every ``heartbeat`` seconds). ``limits``: what a peer may
    make this party hold (:class:`ReceiveLimits`; :meth:`set_limits` changes them once a run knows its sizes).
    """

    def __init__(self, local: PeerAddress, peers: Mapping[str, PeerAddress], tls: TlsFiles, *,
                 verify: Callable[[str, bytes], None], timeout: float = 300.0, heartbeat: float = 1.0,
                 peer_timeout: float = 10.0, log: Callable[[str], None] | None = None,
                 limits: ReceiveLimits | None = None) -> None:
        # grpcio's own log lines (C-core, on stderr) would repeat what the errors raised here say in a party's terms
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
        import grpc  # deferred: the in-process default never needs grpcio loaded

        super().__init__()
        self._grpc = grpc
        self.local = local
        self.peers = dict(peers)
        self._by_cert = {p.cert_name: p for p in self.peers.values()}
        self.timeout = float(timeout)
        self.heartbeat = float(heartbeat)
        self.peer_timeout = float(peer_timeout)
        self.limits = limits or ReceiveLimits()
        self.control_stats = CommStats()
        self.wire_stats = CommStats()
        self.waited_seconds = 0.0  # time spent in take() waiting for messages (where a party's time goes)
        self._log = log or (lambda _: None)
        self._ca, self._cert, self._key = tls.read()
        self._cert_der = _certificate_der(self._cert)
        check_port_free(local.address, local.name)
        self._verify = verify
        self._inbox = Inbox()
        self._arrived = threading.Condition()
        self._last_seen: dict[str, float] = {}
        self._gone: dict[str, str] = {}
        self._failed: dict[str, str] = {}  # parties that reported their own failure (fatal to the run)
        self._violated: dict[str, str] = {}  # parties that broke the protocol (fatal to the run)
        self._assembling: dict[str, int] = {}  # bytes of the message a peer's stream is delivering
        self._paused: dict[str, asyncio.Event] = {}  # peers whose stream waits for room in their buffer
        self._streams: dict[str, int] = {}  # open streams per peer
        self._outgoing: dict[str, _Outgoing] = {}
        self._out_lock = threading.Lock()
        self._wire_lock = threading.Lock()  # the loop counts what arrives, the party's thread what it sends
        self._closed = False
        self._loop = _EventLoop(local.name, self._log)
        try:
            self._server = self._loop.run(self._start_server(), timeout=30.0)
        except BaseException:
            self._loop.stop(2.0)
            raise

    def set_limits(self, limits: ReceiveLimits) -> None:
        """Receive limits from now on (a run sets those derived from what it sends once it is built)."""
        with self._arrived:
            self.limits = limits
            for peer in list(self._paused):
                self._room_made(peer)

    async def _start_server(self):
        grpc = self._grpc
        limits = self.limits
        options = [("grpc.max_receive_message_length", 2 * CHUNK_BYTES + 4096),
                   ("grpc.max_send_message_length", 2 * CHUNK_BYTES + 4096),
                   ("grpc.so_reuseport", 0),  # a second process on this port must fail, not share the traffic
                   # what a connection may hold before and after authentication (gRPC's own limits)
                   ("grpc.max_allowed_incoming_connections", limits.connections),
                   ("grpc.server_handshake_timeout_ms", int(limits.handshake_seconds * 1000)),
                   ("grpc.max_concurrent_streams", 2 * limits.streams_per_peer + 2),
                   # The peers' keepalive pings come every heartbeat, also while no data flows (a party computing
                   # its PSI round for minutes): accept them instead of closing the stream ("too many pings").
                   ("grpc.http2.min_ping_interval_without_data_ms", 500),
                   ("grpc.http2.max_ping_strikes", 0)]
        server = grpc.aio.server(options=options)
        handlers = {
            "Hello": grpc.unary_unary_rpc_method_handler(self._hello, request_deserializer=None,
                                                         response_serializer=None),
            "Stream": grpc.stream_unary_rpc_method_handler(self._stream, request_deserializer=None,
                                                           response_serializer=None),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        credentials = grpc.ssl_server_credentials([(self._key, self._cert)], root_certificates=self._ca,
                                                  require_client_auth=True)
        local = self.local
        try:
            port = server.add_secure_port(local.address, credentials)
        except RuntimeError as exc:
            raise ConfigError(f"party {local.name} cannot listen on {local.address}: {exc}; free the port or change "
                              "its address in the federation file") from None
        if port == 0:
            raise ConfigError(f"party {local.name} cannot listen on {local.address} (in use?); free the port or "
                              "change its address in the federation file")
        await server.start()
        return server

    # -- server side: who is calling, and what they send -------------------------------------------------------
    async def _identify(self, first: bytes, context) -> tuple[PeerAddress, memoryview]:
        """The peer a hello frame (a stream's first frame, or the Hello call) comes from, after checking its
        certificate; returns it with the hello's payload (the client's nonce)."""
        grpc = self._grpc
        try:
            ftype, cert_name, *_, payload = _parse(first)
        except MessageError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.local.name}: {exc}")
        peer = self._by_cert.get(cert_name)
        if ftype != _HELLO or peer is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{self.local.name}: {peer_text(cert_name, 64)!r} is not a party of this federation")
        pem = (context.auth_context().get("x509_pem_cert") or [b""])[0]
        try:
            self._verify(cert_name, pem)
        except ProtocolError as exc:
            self._log(f"refused a connection: {exc}")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if peer.name in self._violated:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{self.local.name} closed its link to {peer.name}: {self._violated[peer.name]}")
        return peer, payload

    async def _hello(self, request: bytes, context) -> bytes:
        peer, nonce = await self._identify(request, context)
        if len(nonce) != _NONCE_BYTES:
            await context.abort(self._grpc.StatusCode.INVALID_ARGUMENT,
                                f"{self.local.name}: a hello carries a {_NONCE_BYTES}-byte nonce")
        client_cert = (context.auth_context().get("x509_pem_cert") or [b""])[0]
        statement = _hello_statement(bytes(nonce), client_cert, self.local.cert_name)
        return _frame(self.local.cert_name, _HELLO, payload=_hello_answer(self._cert_der, _sign(self._key, statement)))

    async def _stream(self, frames: AsyncIterator[bytes], context) -> bytes:
        incoming = frames.__aiter__()
        try:  # a stream that never says who it is holds nothing for long
            first = await asyncio.wait_for(incoming.__anext__(), self.limits.handshake_seconds)
        except (TimeoutError, StopAsyncIteration):
            return b""
        peer, _ = await self._identify(first, context)
        name = peer.name
        self._streams[name] = self._streams.get(name, 0) + 1
        try:
            if self._streams[name] > self.limits.streams_per_peer:
                raise _Refused(f"it opened {self._streams[name]} streams at once (limit {self.limits.streams_per_peer} "
                               "per peer: streams_per_peer)")
            return await self._read(peer, incoming, context)
        except _Refused as refused:
            await self._refuse(name, refused.problem, context)
        finally:
            self._streams[name] -= 1
        return b""

    async def _read(self, peer: PeerAddress, incoming, context) -> bytes:
        """(On the loop.) Deliver what ``peer``'s stream carries while the peer's buffer has room; without room,
        what was read waits here and nothing more is read (HTTP/2 flow control then holds the sender)."""
        name = peer.name
        self._seen(name)
        assembly = _Assembly()
        unread = _Unread()  # frames read and not yet delivered (at most one gRPC message's)
        ended = False
        try:
            while True:
                try:
                    if unread.head is not None or (unread.rest is not None and unread):
                        await self._wait_for_room(name)
                    else:
                        try:
                            frame = await incoming.__anext__()
                        except StopAsyncIteration:
                            break
                        self._seen(name)
                        with self._wire_lock:
                            self.wire_stats.count(name, self.local.name, "received", len(frame))
                        unread.load(frame)
                    ended = self._deliver(name, unread, assembly)
                except MessageError as exc:
                    raise _Refused(f"it sent a malformed frame ({exc})") from None
                if ended:
                    break
        except asyncio.CancelledError:  # the server is stopping (or the peer's call was cancelled)
            if not self._closed:
                self._lose(name, "its connection was cancelled (process stopped?)")
            raise
        except _Refused:
            raise
        except Exception as exc:  # noqa: BLE001 - the stream broke: the peer is lost
            self._lose(name, f"its connection broke ({type(exc).__name__}; process stopped?)")
            return b""
        finally:
            self._assembling.pop(name, None)
        if not ended and not self._closed:
            self._lose(name, "its connection closed without a goodbye (process stopped?)")
        return b""

    async def _refuse(self, peer: str, problem: str, context) -> None:
        """(On the loop.) ``peer`` broke the protocol: drop what it had buffered, remember why (every wait of the
        party now raises PeerViolation), and close its stream with the reason."""
        line = peer_text(problem, 500)
        with self._arrived:
            first = peer not in self._violated
            self._violated.setdefault(peer, line)
            self._inbox.drop(peer)
            self._arrived.notify_all()
        if first:
            self._log(f"{self.local.name}: closed the link from {peer}: {line}")
        await context.abort(self._grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.local.name} closed the link: {line}")

    def _has_room(self, peer: str) -> bool:
        """(Under the lock.)"""
        limits = self.limits
        return (self._inbox.bytes.get(peer, 0) + self._assembling.get(peer, 0) < limits.max_buffered_bytes
                and self._inbox.messages.get(peer, 0) < limits.max_buffered_messages)

    async def _wait_for_room(self, peer: str) -> None:
        while True:
            with self._arrived:
                if peer in self._violated:
                    raise _Refused(self._violated[peer])
                if self._has_room(peer):
                    return
                room = self._paused.get(peer)
                if room is None:
                    room = self._paused[peer] = asyncio.Event()
                    self._arrived.notify_all()  # a party waiting for this peer now learns that it is paused
            await room.wait()

    def _room_made(self, peer: str) -> None:
        """(Under the lock, from the party's thread.) Resume ``peer``'s stream if it waits and has room now."""
        room = self._paused.get(peer)
        if room is not None and (peer in self._violated or self._has_room(peer)):
            del self._paused[peer]
            self._last_seen[peer] = time.monotonic()  # its stream was not read while paused: not a silence
            self._loop.soon(room.set)

    def _deliver(self, sender: str, frames: _Unread, assembly: _Assembly) -> bool:
        """(On the loop.) Put the messages that ``frames`` complete in the inbox (chunks are gathered in
        ``assembly`` until their message is whole) and wake the party's thread once, taking frames off ``frames``
        while the sender's buffer has room; returns whether the peer said goodbye. A frame that breaks the rules
        raises _Refused (MessageError: a malformed one)."""
        arrived: list[tuple[str, bytes]] = []
        failure = None
        ended = False
        limits = self.limits
        # room left in the sender's buffer (the party's thread only ever makes more: read without the lock)
        room_messages = limits.max_buffered_messages - self._inbox.messages.get(sender, 0)
        room_bytes = limits.max_buffered_bytes - self._inbox.bytes.get(sender, 0) - assembly.nbytes
        while True:
            frame = frames.head
            if frame is None:
                if frames.rest is None or (frame := frames.peek()) is None:
                    break
            ftype, kind, seq, index, count, payload = frame
            if ftype != _DATA:
                frames.head = None
                if ftype == _HEARTBEAT:
                    continue
                if ftype == _GOODBYE:
                    ended = True
                    break
                raise _Refused(f"it sent a frame of type {ftype} inside a stream")
            size = len(payload)
            if index == 0:
                if room_messages <= 0 or room_bytes <= 0:
                    break  # no room for another message: the rest waits (see _read)
                if kind not in KINDS and kind not in _SIGNAL_KINDS:
                    raise _Refused(f"it sent a message of an unknown kind {peer_text(kind, 64)!r}")
                if assembly.parts:
                    raise _Refused(f"it started one {kind} message inside another")
                if count == 1:  # a whole message in one chunk (the common case)
                    frames.head = None
                    if size > CHUNK_BYTES or size > limits.max_message_bytes:
                        self._refuse_size(kind, size, limits)
                    room_messages -= 1
                    room_bytes -= size + ENTRY_COST
                    if kind == ERROR_KIND:
                        failure = self._failure(payload)
                    else:
                        arrived.append((kind, payload.tobytes()))
                    continue
                if (count - 1) * CHUNK_BYTES >= limits.max_message_bytes:
                    raise _Refused(f"it declared {count} chunks for one {kind} message (over {(count - 1) * CHUNK_BYTES} "
                                   f"bytes; limit {limits.max_message_bytes} bytes: max_message_mib)")
                assembly.kind, assembly.seq, assembly.count = kind, seq, count
            elif (index != len(assembly.parts) or kind != assembly.kind or seq != assembly.seq
                  or count != assembly.count):
                raise _Refused(f"chunk {index} of one {peer_text(kind, 64)} message came out of order")
            frames.head = None
            if size > CHUNK_BYTES:
                self._refuse_size(kind, size, limits)
            if index + 1 < count and size != CHUNK_BYTES:
                raise _Refused(f"chunk {index} of {count} of one {kind} message has {size} bytes, not {CHUNK_BYTES}")
            if index + 1 == count and size == 0:
                raise _Refused(f"the last chunk of one {kind} message is empty")
            assembly.parts.append(payload)
            assembly.nbytes += size
            room_bytes -= size
            if assembly.nbytes > limits.max_message_bytes:
                raise _Refused(f"it sent one {kind} message over {limits.max_message_bytes} bytes (max_message_mib)")
            if index + 1 < count:
                self._assembling[sender] = assembly.nbytes
                continue
            data = b"".join(assembly.parts)
            assembly.parts, assembly.nbytes = [], 0
            self._assembling[sender] = 0
            room_messages -= 1
            room_bytes -= ENTRY_COST
            if kind == ERROR_KIND:
                failure = self._failure(data)
            else:
                arrived.append((kind, data))
        if arrived or failure is not None:
            with self._arrived:
                if sender in self._violated:
                    return True
                add = self._inbox.add
                for kind, data in arrived:
                    add(sender, kind, data)
                if failure is not None:
                    self._failed.setdefault(sender, failure)
                self._arrived.notify_all()
        return ended

    @staticmethod
    def _refuse_size(kind: str, size: int, limits: ReceiveLimits) -> None:
        if size > CHUNK_BYTES:
            raise _Refused(f"it sent a chunk of {size} bytes (chunks are at most {CHUNK_BYTES})")
        raise _Refused(f"it sent one {kind} message over {limits.max_message_bytes} bytes (max_message_mib)")

    @staticmethod
    def _failure(data: bytes | memoryview) -> str:
        """A party's own error text, made safe for one line."""
        if len(data) > _MAX_ERROR_BYTES:
            raise _Refused(f"it reported an error of {len(data)} bytes (at most {_MAX_ERROR_BYTES})")
        return peer_text(bytes(data))

    def _seen(self, party: str) -> None:
        self._last_seen[party] = time.monotonic()

    def _lose(self, party: str, reason: str) -> None:
        with self._arrived:
            self._gone.setdefault(party, reason)
            self._arrived.notify_all()

    # -- client side ------------------------------------------------------------------------------------------
    def _link(self, receiver: str) -> _Outgoing:
        with self._out_lock:
            link = self._outgoing.get(receiver)
            if link is not None:
                return link
            peer = self.peers.get(receiver)
            if peer is None:
                raise MessageError(f"{self.local.name} has no address for party {receiver!r} (peers: "
                                   f"{sorted(self.peers)})")
            link = _Outgoing(peer, self._loop, self.heartbeat, lambda n, to=peer.name: self._count_sent(to, n))
            self._loop.run(self._open(peer, link), timeout=self.timeout + 30.0)
            self._outgoing[receiver] = link
            return link

    async def _open(self, peer: PeerAddress, link: _Outgoing) -> None:
        """(On the loop.) An open, verified channel to ``peer`` (retried until ``timeout`` while the peer is not up
        yet), and ``link``'s stream on it."""
        grpc = self._grpc
        credentials = grpc.ssl_channel_credentials(root_certificates=self._ca, private_key=self._key,
                                                   certificate_chain=self._cert)
        options = [("grpc.ssl_target_name_override", peer.cert_name), ("grpc.default_authority", peer.cert_name),
                   ("grpc.max_receive_message_length", 2 * CHUNK_BYTES + 4096),
                   ("grpc.max_send_message_length", 2 * CHUNK_BYTES + 4096),
                   ("grpc.keepalive_time_ms", max(1000, int(self.heartbeat * 1000))),
                   ("grpc.keepalive_timeout_ms", max(1000, int(self.peer_timeout * 1000))),
                   ("grpc.http2.max_pings_without_data", 0)]  # keep pinging through a long silence
        deadline = time.monotonic() + self.timeout
        while True:
            nonce = os.urandom(_NONCE_BYTES)
            hello = _frame(self.local.cert_name, _HELLO, payload=nonce)
            channel = grpc.aio.secure_channel(peer.address, credentials, options=options)
            call = channel.unary_unary(f"/{_SERVICE}/Hello", request_serializer=None, response_deserializer=None)
            try:
                answer = await call(hello, timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            except grpc.aio.AioRpcError as exc:
                await channel.close()
                details = peer_text(exc.details() or "")
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    raise ProtocolError(f"party {peer.name} at {peer.address} refused {self.local.name}: {details}"
                                        ) from None
                # (a handshake the server cut short is not a refusal: it drops connections over its cap, and
                # unauthenticated ones after its handshake timeout; retried until the timeout like a server not up)
                dropped = "socket closed" in details.lower() or "connection reset" in details.lower()
                if not dropped and any(w in details.lower() for w in ("ssl", "handshake", "certificate", "tls",
                                                                      "verification", "unauthenticated")):
                    raise ProtocolError(f"TLS with party {peer.name} at {peer.address} failed: {details.strip()}; "
                                        "both certificates must come from the federation's CA (`secvfl certs`) "
                                        f"and its certificate must name {peer.cert_name!r}") from None
                if time.monotonic() > deadline:
                    raise PartyLost(peer.name, f"no answer at {peer.address} within {self.timeout:g} s "
                                    f"({details.strip() or exc.code().name})") from None
                await asyncio.sleep(0.2)
                continue
            try:
                self._check_hello_answer(peer, answer, nonce)
            except (ProtocolError, MessageError):
                await channel.close()
                raise
            await link.start(channel, hello)
            return

    def _check_hello_answer(self, peer: PeerAddress, answer: bytes, nonce: bytes) -> None:
        """The server at ``peer.address`` must prove that it holds the key of a certificate that passes the same
        check a server applies to its clients, for the party the federation file puts there."""
        where = f"the party at {peer.address}"
        ftype, name, *_, payload = _parse(answer)
        if ftype != _HELLO or name != peer.cert_name:
            raise ProtocolError(f"{where} answered as {peer_text(name, 64)!r}, not {peer.cert_name!r}")
        cert_der, signature = _read_hello_answer(payload)
        try:
            self._verify(peer.cert_name, cert_der)
        except ProtocolError as exc:
            raise ProtocolError(f"{where} is refused: {exc}") from None
        if not _signature_holds(cert_der, signature, _hello_statement(nonce, self._cert_der, peer.cert_name)):
            raise ProtocolError(f"{where} did not prove that it holds the key of {peer.cert_name}'s certificate "
                                "(its hello's signature does not verify)")

    # -- Transport ---------------------------------------------------------------------------------------------
    def _send(self, sender: str, receiver: str, kind: str, data: bytes, stats: CommStats) -> None:
        if sender != self.local.name:
            raise MessageError(f"the transport of {self.local.name} cannot send for {sender}")
        if not isinstance(data, bytes):
            raise MessageError("the transport carries bytes only; encode the message first")
        link = self._link(receiver)
        if link.error is not None:
            raise PartyLost(receiver, link.error)
        stats.count(sender, receiver, kind, len(data))
        count = max(1, -(-len(data) // CHUNK_BYTES))
        view = memoryview(data)
        deadline = time.monotonic() + self.timeout
        link.seq += 1
        for index in range(count):
            frame = _frame(kind, _DATA, link.seq, index, count, view[index * CHUNK_BYTES:(index + 1) * CHUNK_BYTES])
            if link.held_bytes + _LENGTH.size + len(frame) > CHUNK_BYTES:
                link.flush(deadline)  # a batch stays within a chunk's size (one big frame goes alone)
            link.hold(frame)

    def _count_sent(self, receiver: str, nbytes: int) -> None:
        with self._wire_lock:
            self.wire_stats.count(self.local.name, receiver, "sent", nbytes)

    def flush(self) -> None:
        """Hand every frame sent since this party last waited to gRPC, one message per peer.

        ``put`` only holds a message; the party's next wait for a message (``take``, ``wait_any``, ``drain_until``)
        and ``close`` send what is held first, so a party never waits on an answer to something still held. Why:
        each gRPC message costs a hand-off to the event loop and a wake-up of the receiver, whatever its size, and
        a step's messages to one peer (a gradient, the backward request, the next forward request) are sent
        together without waiting in between: one gRPC message instead of three.
        """
        deadline = time.monotonic() + self.timeout
        flushed, lost = [], None
        for link in list(self._outgoing.values()):
            try:
                if link.holds and link.flush(deadline, wake=False):
                    flushed.append(link)
            except PartyLost as exc:  # the other peers still get theirs
                lost = lost or exc
        if flushed:
            self._loop.soon(_wake_all, flushed)  # one hand-off to the loop for every peer
        if lost is not None:
            raise lost

    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        self._send(sender, receiver, kind, data, self.stats)

    def put_control(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        """Send a party-handle request or reply (counted in ``control_stats``, not with the algorithm's messages)."""
        self._send(sender, receiver, kind, data, self.control_stats)

    def _pop(self, sender: str | None, kind: str | None) -> bytes | None:
        """(Under the lock.) The oldest buffered message matching the filters, taken out; None if none."""
        got = self._inbox.pop(sender, kind)
        if got is None:
            return None
        if self._paused:
            self._room_made(got[0])
        return got[2]

    def take(self, receiver: str, *, kind: str | None = None, sender: str | None = None,
             timeout: float | None = None) -> bytes:
        if receiver != self.local.name:
            raise MessageError(f"the transport of {self.local.name} cannot take {receiver}'s messages")
        self.flush()
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + limit
        what = f"{'a ' + kind if kind else 'any'} message from {sender or 'any party'}"
        with self._arrived:
            while True:
                data = self._pop(sender, kind)
                if data is not None:
                    self.waited_seconds += time.monotonic() - start
                    return data
                self._check_alive(sender, what, kind)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PartyLost(sender or "?", f"{self.local.name} waited {limit:g} s for {what}; raise "
                                    "--party-timeout if a step legitimately takes longer")
                self._arrived.wait(timeout=min(left, self.heartbeat))

    def wait_any(self, receiver: str, *, timeout: float | None = None) -> tuple[str, str]:
        """Wait for any message for ``receiver``; returns its sender and kind (it stays waiting, for take())."""
        if receiver != self.local.name:
            raise MessageError(f"the transport of {self.local.name} cannot wait for {receiver}'s messages")
        self.flush()
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._arrived:
            while True:
                oldest = self._inbox.peek()
                if oldest is not None:
                    return oldest
                self._check_alive(None, "any message", None)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PartyLost("?", f"{self.local.name} waited {limit:g} s and nothing came")
                self._arrived.wait(timeout=min(left, self.heartbeat))

    def _check_alive(self, sender: str | None, what: str, kind: str | None) -> None:
        """(Under the lock.) Raise why the wait for ``what`` cannot succeed, if it cannot."""
        for party, problem in sorted(self._violated.items()):
            raise PeerViolation(party, problem)
        for party, text in sorted(self._failed.items()):
            raise PartyLost(party, text)
        if sender is not None and sender in self._paused and not self._inbox.holds(sender, kind):
            # its buffer is full of messages this party did not ask for, and what it waits for is behind them
            limits = self.limits
            problem = (f"it sent {self._inbox.messages.get(sender, 0)} messages "
                       f"({self._inbox.bytes.get(sender, 0) + self._assembling.get(sender, 0)} bytes) that "
                       f"{self.local.name} did not ask for, filling its receive buffer (limits per peer: "
                       f"{limits.max_buffered_messages} messages, {limits.max_buffered_bytes} bytes: "
                       f"buffered_messages, buffer_mib) while {self.local.name} waited for {what}")
            self._violated[sender] = problem
            self._inbox.drop(sender)
            self._room_made(sender)  # its reader wakes, sees the violation and closes the stream
            raise PeerViolation(sender, problem)
        now = time.monotonic()
        for party in [sender] if sender is not None else sorted(self.peers):
            reason = self._gone.get(party)
            link = self._outgoing.get(party)
            if reason is None and link is not None and link.error is not None:
                reason = link.error
            seen = self._last_seen.get(party)
            if reason is None and seen is not None and now - seen > self.peer_timeout and party not in self._paused:
                reason = f"no heartbeat for {now - seen:.1f} s (limit {self.peer_timeout:g} s)"
            if reason is not None:
                raise PartyLost(party, f"{reason} (while {self.local.name} waited for {what})")

    def lost(self, party: str) -> str | None:
        """Why ``party`` is gone as this process sees it (its stream ended, its link failed, no heartbeat for the
        peer timeout), or None while it is heard from."""
        with self._arrived:
            try:
                self._check_alive(party, "nothing", None)
            except PartyLost as exc:
                return str(exc)
            except PeerViolation:
                return None
        return None

    def drain_until(self, receiver: str, sender: str, kind: str, *, timeout: float | None = None) -> int:
        """Discard ``sender``'s messages to ``receiver``, oldest first, up to and including the first of ``kind``
        (a barrier: one stream delivers in order, so nothing sent before it is still on the way); returns how many
        others were discarded."""
        if receiver != self.local.name:
            raise MessageError(f"the transport of {self.local.name} cannot take {receiver}'s messages")
        self.flush()
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        dropped = 0
        with self._arrived:
            while True:
                got = self._inbox.pop(sender, None)
                if got is not None:
                    if self._paused:
                        self._room_made(sender)
                    if got[1] == kind:
                        return dropped
                    dropped += 1
                    continue
                self._check_alive(sender, f"a {kind} message", None)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PartyLost(sender, f"{self.local.name} waited {limit:g} s for a {kind} message")
                self._arrived.wait(timeout=min(left, self.heartbeat))

    def pending(self, receiver: str | None = None) -> int:
        with self._arrived:
            return self._inbox.total

    def close(self, grace: float = 2.0) -> None:
        """Say goodbye on every stream, then stop the server (bounded by ``grace`` seconds per step)."""
        if self._closed:
            return
        try:
            self.flush()
        except SecvflError:  # closing: a peer that is gone gets nothing more
            pass
        self._closed = True
        with self._out_lock:
            links, self._outgoing = list(self._outgoing.values()), {}
        for link in links:
            try:
                self._loop.run(link.close(grace), timeout=3 * grace + 1.0)
            except Exception:  # noqa: BLE001 - closing: the peer may already be gone
                pass
        try:
            self._loop.run(self._server.stop(grace), timeout=grace + 1.0)
            self._loop.closing = True
            self._loop.run(self._loop.cancel_the_rest(grace), timeout=grace + 1.0)
        except Exception:  # noqa: BLE001 - closing
            pass
        self._loop.closing = True
        self._loop.stop(grace + 1.0)
