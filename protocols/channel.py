"""Authenticated encrypted messages between parties (``--secure-channel``), end to end, also through relays.

Threat model: the network and any relaying party (an aggregator, a proxy, the transport itself) may read, drop,
modify, reorder, replay, reflect or re-address messages. Parties are identified by long-term Ed25519 keys whose
public halves every party has pinned from files beforehand (no certificate authority, no trust on first use).
Guarantees: confidentiality and integrity of every message body, authenticity of sender and receiver, rejection of
replayed, reordered, reflected and re-addressed messages, forward secrecy once the ephemeral keys are gone (they
are erased when a session is derived). Not guaranteed: availability (an attacker can drop everything), hiding of
routing metadata (message kind, sender, receiver and sizes stay visible: the transport routes on them), protection
against a compromised identity key. This runs on top of TLS in the multi-host mode: TLS protects each hop, this
layer protects end to end.

Handshake (signed ephemeral Diffie-Hellman, both hellos independent so neither side waits on the other)::

    hello(A -> B) = A, B, ephemeral X25519 public key e_A, 16-byte nonce n_A,
                    Ed25519 signature of A's identity key over ("secvfl-channel-v1", A, B, e_A, n_A)

Each side checks the peer's signature against the pinned key for that peer name (the signature names the intended
receiver, so a hello cannot be redirected to a third party), computes X25519(e_self, e_peer) and derives with
HKDF-SHA256 (salt: SHA-256 of both hellos in name order) one AES-256-GCM key per direction and a 16-byte session id.
Keys are confirmed implicitly: the first sealed message that opens proves the peer holds them.

Sealing: each message is encoded (the whole :class:`~secvfl.messages.Message`, tensors included) and encrypted as one
AES-256-GCM blob with the sender->receiver key and a 96-bit nonce ``0^32 || counter`` (a per-direction counter, never
repeated under one key). The envelope keeps the inner message's kind (the transport routes on it), sender and
receiver; its step is 0 and its meta holds only ``sid`` (session id), ``seq`` (position in the sender->receiver
stream of that kind) and ``ctr`` (the nonce counter). The associated data binds protocol version, session id,
sender, receiver, kind, seq and ctr. The receiver accepts exactly the next ``seq`` of each (sender, kind) stream, so
a replayed message (``seq`` already accepted) and a skipped or reordered one (``seq`` ahead) are refused; streams of
different kinds are independent because receivers take messages by kind. A rejected message changes no state.

Position in the stack: this layer must be LAST (outermost): on the way out it runs after every other layer and
seals their output; on the way in it runs first. A layer after it would see only sealed envelopes (no tensors).
:func:`require_outermost` checks a stack.

Key hygiene: no key material appears in any ``repr``, ``str``, error message, ``describe()`` or ``state_dict()``;
identity keys are shown only by fingerprint (SHA-256 of the raw public key, truncated).

Sessions and checkpoints: session keys are never written to a checkpoint. A process restarted from a checkpoint
would otherwise seal with counters the killed process had already used after that checkpoint (AES-GCM nonce reuse:
the XOR of two plaintexts and forgeries for whoever recorded both), and a stolen checkpoint would decrypt recorded
traffic (no forward secrecy). Instead every epoch, i.e. every checkpoint boundary, starts with a fresh handshake
(:meth:`SecureChannelLayer.start_epoch`): a resumed run handshakes where an uninterrupted one does, so both send
the same bytes, and the keys of an epoch are erased when the next begins.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from protocols.base import Layer, Topology
from secvfl.errors import ConfigError, MessageError, ProtocolError
from secvfl.messages import Message, decode, encode, register_kind

if TYPE_CHECKING:
    from secvfl.transport.network import Network

__all__ = [
    "IdentityKey",
    "PinnedKeys",
    "ChannelCredentials",
    "SecureChannelLayer",
    "require_outermost",
    "fingerprint",
    "save_public_key",
    "load_public_key",
    "HANDSHAKE_KIND",
    "ChannelError",
    "HandshakeError",
    "TamperedMessageError",
    "ReplayError",
    "OutOfOrderError",
    "ReflectionError",
    "WrongSenderError",
    "WrongReceiverError",
    "UnknownSessionError",
    "UnsealedMessageError",
]

PROTOCOL = "secvfl-channel-v1"
HANDSHAKE_KIND = register_kind("handshake")
_NONCE_PREFIX = bytes(4)
_MAX_COUNTER = 2**64 - 1


# -- errors ------------------------------------------------------------------------------------------------------
class ChannelError(ProtocolError):
    """A sealed message or handshake was refused. Subclasses name the failure."""


class HandshakeError(ChannelError):
    """A hello is malformed, signed by the wrong key, or comes from a party whose key is not pinned."""


class TamperedMessageError(ChannelError):
    """The envelope does not authenticate: its body or header was modified or truncated."""


class ReplayError(ChannelError):
    """A message that was already accepted (same stream position) arrived again."""


class OutOfOrderError(ChannelError):
    """A message arrived ahead of its turn: an earlier message of the stream was dropped or reordered."""


class ReflectionError(ChannelError):
    """A message the receiver itself sealed was sent back to it."""


class WrongSenderError(ChannelError):
    """A message sealed by one party claims to come from another."""


class WrongReceiverError(ChannelError):
    """A message sealed for one party was delivered to another."""


class UnknownSessionError(ChannelError):
    """The envelope names a session the receiver does not have (stale, for someone else, or forged)."""


class UnsealedMessageError(ChannelError):
    """A plaintext message arrived where the secure channel requires sealed ones (a downgrade attempt)."""


# -- identity keys ---------------------------------------------------------------------------------------------
def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(key: Ed25519PublicKey) -> str:
    """Short public identifier of an identity key: first 16 hex digits of SHA-256 of the raw public key."""
    return hashlib.sha256(_raw_public(key)).hexdigest()[:16]


class IdentityKey:
    """A party's long-term Ed25519 signing key. Shown only by fingerprint."""

    __slots__ = ("_private", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise ConfigError(f"an identity key must be Ed25519, got {type(private_key).__name__}")
        self._private = private_key
        self.public_key = private_key.public_key()

    @classmethod
    def generate(cls) -> IdentityKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def __repr__(self) -> str:
        return f"IdentityKey(fingerprint={self.fingerprint})"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("identity keys cannot be pickled; save them with IdentityKey.save (mode 0600)")

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False, password: bytes | None = None) -> Path:
        """Write the private key as PKCS#8 PEM with file mode 0600 (optionally encrypted with ``password``)."""
        path = Path(path)
        algo = (serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption())
        pem = self._private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, algo)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise ConfigError(f"{path} already exists; refusing to overwrite a private key (pass overwrite=True)") from None
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o600)  # also when overwriting a file that had looser permissions
            fh.write(pem)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, password: bytes | None = None) -> IdentityKey:
        """Read a private key written by :meth:`save`; refuses files readable by group or others."""
        path = Path(path)
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read identity key {path}: {exc.strerror}") from None
        if os.name == "posix" and mode & 0o077:
            raise ConfigError(f"identity key {path} is accessible by group or others (mode {mode:04o}); "
                              f"run `chmod 600 {path}`")
        try:
            key = serialization.load_pem_private_key(data, password=password)
        except (ValueError, TypeError):
            raise ConfigError(f"{path} is not a readable PEM private key (wrong file or password)") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{path} holds a {type(key).__name__}, not an Ed25519 identity key")
        return cls(key)

    def save_public(self, path: str | os.PathLike[str]) -> Path:
        return save_public_key(self.public_key, path)


def save_public_key(key: Ed25519PublicKey, path: str | os.PathLike[str]) -> Path:
    """Write a public identity key as SubjectPublicKeyInfo PEM (what peers pin)."""
    path = Path(path)
    path.write_bytes(key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    path = Path(path)
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read public key {path}: {exc.strerror}") from None
    except ValueError:
        raise ConfigError(f"{path} is not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{path} holds a {type(key).__name__}, not an Ed25519 public key")
    return key


class PinnedKeys:
    """One party's trust store: peer name -> the Ed25519 public key it expects that peer to sign with."""

    def __init__(self, keys: Mapping[str, Ed25519PublicKey] | None = None) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        for name, key in (keys or {}).items():
            self.pin(name, key)

    def pin(self, name: str, key: Ed25519PublicKey) -> None:
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"pinned key for {name!r} must be an Ed25519 public key, got {type(key).__name__}")
        self._keys[name] = key

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> PinnedKeys:
        """Pin every ``<party>.pub.pem`` file of ``directory`` under the name ``<party>``."""
        directory = Path(directory)
        files = sorted(directory.glob("*.pub.pem"))
        if not files:
            raise ConfigError(f"no <party>.pub.pem files in {directory}; export peers' keys with save_public_key")
        return cls({f.name[: -len(".pub.pem")]: load_public_key(f) for f in files})

    def get(self, name: str) -> Ed25519PublicKey | None:
        return self._keys.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._keys

    def names(self) -> list[str]:
        return sorted(self._keys)

    def __repr__(self) -> str:
        return "PinnedKeys(" + ", ".join(f"{n}={fingerprint(k)}" for n, k in sorted(self._keys.items())) + ")"


@dataclass(frozen=True)
class ChannelCredentials:
    """What one party brings to the channel: its identity key and the peer keys it trusts."""

    identity: IdentityKey
    pinned: PinnedKeys

    @classmethod
    def load(cls, key_path: str | os.PathLike[str], pinned_dir: str | os.PathLike[str],
             *, password: bytes | None = None) -> ChannelCredentials:
        return cls(IdentityKey.load(key_path, password=password), PinnedKeys.from_dir(pinned_dir))


# -- sessions --------------------------------------------------------------------------------------------------
def _hello_body(sender: str, receiver: str, ephemeral: bytes, nonce: bytes) -> bytes:
    return json.dumps([PROTOCOL, "hello", sender, receiver, ephemeral.hex(), nonce.hex()]).encode()


def _associated_data(sid: str, sender: str, receiver: str, kind: str, seq: int, ctr: int) -> bytes:
    return json.dumps([PROTOCOL, "sealed", sid, sender, receiver, kind, seq, ctr], separators=(",", ":")).encode()


class _Session:
    """Keys and counters of one party's session with one peer. ``repr`` shows no key."""

    __slots__ = ("peer", "sid", "_send", "_recv", "send_ctr", "send_seq", "recv_seq")

    def __init__(self, peer: str, sid: str, send_key: bytes, recv_key: bytes) -> None:
        self.peer = peer
        self.sid = sid
        self._send = AESGCM(send_key)
        self._recv = AESGCM(recv_key)
        self.send_ctr = 0
        self.send_seq: dict[str, int] = {}
        self.recv_seq: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"_Session(peer={self.peer!r}, sid={self.sid}, sent={self.send_ctr})"

    @staticmethod
    def nonce(ctr: int) -> bytes:
        return _NONCE_PREFIX + ctr.to_bytes(8, "big")

    def seal(self, plaintext: bytes, ad: bytes, ctr: int) -> bytes:
        return self._send.encrypt(self.nonce(ctr), plaintext, ad)

    def open(self, ciphertext: bytes, ad: bytes, ctr: int) -> bytes:
        return self._recv.decrypt(self.nonce(ctr), ciphertext, ad)

    def open_own(self, ciphertext: bytes, ad: bytes, ctr: int) -> bytes:
        """Decrypt with this side's *sending* key: succeeds only for a message this side sealed (reflection)."""
        return self._send.decrypt(self.nonce(ctr), ciphertext, ad)


@dataclass
class _PartyChannel:
    credentials: ChannelCredentials
    sessions: dict[str, _Session] = field(default_factory=dict)  # peer -> session
    by_sid: dict[str, _Session] = field(default_factory=dict)
    own_hellos: dict[str, tuple[X25519PrivateKey, bytes]] = field(default_factory=dict)  # peer -> (eph, body)
    peer_hellos: dict[str, bytes] = field(default_factory=dict)  # peer -> verified body

    def __repr__(self) -> str:
        return f"_PartyChannel(identity={self.credentials.identity.fingerprint}, peers={sorted(self.sessions)})"


# -- the layer -------------------------------------------------------------------------------------------------
class SecureChannelLayer(Layer):
    """Seals every message end to end (see the module docstring). Must be the last layer of the stack.

    ``credentials`` holds the parties this process runs (all of them in the embedded mode, one per host in the
    multi-host mode). Call :meth:`establish` once after building the network to run the handshakes through it.
    """

    name: ClassVar[str] = "secure-channel"

    def __init__(self, credentials: Mapping[str, ChannelCredentials]) -> None:
        if not credentials:
            raise ConfigError("the secure channel needs the credentials of at least one local party")
        self._local: dict[str, _PartyChannel] = {p: _PartyChannel(c) for p, c in credentials.items()}
        self.sealed = 0
        self.opened = 0
        self.rejected = 0

    def __repr__(self) -> str:
        return f"SecureChannelLayer(parties={sorted(self._local)}, sealed={self.sealed}, opened={self.opened})"

    def bind(self, topology: Topology) -> None:
        super().bind(topology)
        unknown = sorted(set(self._local) - set(topology.roles))
        if unknown:
            raise ConfigError(f"secure-channel credentials for {unknown}, which are not parties of this run "
                              f"(parties: {sorted(topology.roles)})")

    def describe(self) -> dict[str, Any]:
        return {
            "layer": self.name,
            "protocol": PROTOCOL,
            "identity": "Ed25519 (pinned)",
            "key_exchange": "X25519 ephemeral, signed",
            "kdf": "HKDF-SHA256",
            "aead": "AES-256-GCM, one key per direction, counter nonce",
            "identities": {p: st.credentials.identity.fingerprint for p, st in sorted(self._local.items())},
            "sessions": sorted({"|".join(sorted((p, s.peer))) for p, st in self._local.items() for s in st.sessions.values()}),
            "messages_sealed": self.sealed,
            "messages_opened": self.opened,
            "messages_rejected": self.rejected,
        }

    def _party(self, party: str) -> _PartyChannel:
        try:
            return self._local[party]
        except KeyError:
            raise ChannelError(f"{party} has no secure-channel credentials in this process "
                               f"(local parties: {sorted(self._local)})") from None

    def has_session(self, party: str, peer: str) -> bool:
        return peer in self._party(party).sessions

    # -- handshake -------------------------------------------------------------------------------------------
    def hello(self, party: str, peer: str) -> Message:
        """A fresh signed hello from ``party`` to ``peer`` (starts or restarts their session)."""
        st = self._party(party)
        if st.credentials.pinned.get(peer) is None:
            raise HandshakeError(f"{party} has no pinned identity key for {peer}; add {peer}.pub.pem to its pins")
        eph = X25519PrivateKey.generate()
        eph_pub = eph.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        nonce = os.urandom(16)
        body = _hello_body(party, peer, eph_pub, nonce)
        st.own_hellos[peer] = (eph, body)
        msg = Message(HANDSHAKE_KIND, party, peer, 0, blobs={
            "ephemeral": eph_pub, "nonce": nonce, "signature": st.credentials.identity.sign(body),
        }, meta={"protocol": PROTOCOL})
        self._maybe_complete(party, peer)
        return msg

    def _accept_hello(self, msg: Message, party: str) -> None:
        st = self._party(party)
        if msg.receiver != party:
            raise WrongReceiverError(f"{party} got a hello addressed to {msg.receiver}")
        if msg.meta.get("protocol") != PROTOCOL:
            raise HandshakeError(f"hello from {msg.sender} speaks {msg.meta.get('protocol')!r}, not {PROTOCOL!r}")
        pinned = st.credentials.pinned.get(msg.sender)
        if pinned is None:
            raise HandshakeError(f"{party} has no pinned identity key for {msg.sender}; refusing its hello")
        eph, nonce, sig = (msg.blobs.get(k, b"") for k in ("ephemeral", "nonce", "signature"))
        if len(eph) != 32 or len(nonce) != 16 or len(sig) != 64:
            raise HandshakeError(f"malformed hello from {msg.sender}")
        body = _hello_body(msg.sender, party, eph, nonce)
        try:
            pinned.verify(sig, body)
        except InvalidSignature:
            raise HandshakeError(
                f"hello claiming to come from {msg.sender} is not signed by {msg.sender}'s pinned key "
                f"({fingerprint(pinned)}); refusing it"
            ) from None
        st.peer_hellos[msg.sender] = body
        self._maybe_complete(party, msg.sender)

    def _maybe_complete(self, party: str, peer: str) -> None:
        st = self._local[party]
        if peer not in st.own_hellos or peer not in st.peer_hellos:
            return
        eph, own_body = st.own_hellos.pop(peer)  # the ephemeral private key is dropped here
        peer_body = st.peer_hellos.pop(peer)
        peer_eph = bytes.fromhex(json.loads(peer_body)[4])
        try:
            shared = eph.exchange(X25519PublicKey.from_public_bytes(peer_eph))
        except ValueError:
            raise HandshakeError(f"hello from {peer} carries an invalid ephemeral key") from None
        lo_body, hi_body = (own_body, peer_body) if party < peer else (peer_body, own_body)
        salt = hashlib.sha256(lo_body + b"\x00" + hi_body).digest()
        okm = HKDF(hashes.SHA256(), 80, salt, (PROTOCOL + "|session").encode()).derive(shared)
        k_lo_hi, k_hi_lo, sid = okm[:32], okm[32:64], okm[64:].hex()
        send, recv = (k_lo_hi, k_hi_lo) if party < peer else (k_hi_lo, k_lo_hi)
        old = st.sessions.get(peer)
        if old is not None:
            st.by_sid.pop(old.sid, None)
        session = _Session(peer, sid, send, recv)
        st.sessions[peer] = session
        st.by_sid[sid] = session

    def establish(self, net: Network, pairs: Iterable[tuple[str, str]] | None = None) -> None:
        """Handshake every pair of local parties (or ``pairs``) through ``net``, so the bytes are counted."""
        if pairs is None:
            names = sorted(self._local)
            pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
        pairs = list(pairs)
        for a, b in pairs:
            net.send(self.hello(a, b))
            net.send(self.hello(b, a))
        for a, b in pairs:
            net.receive(b, kind=HANDSHAKE_KIND, sender=a)
            net.receive(a, kind=HANDSHAKE_KIND, sender=b)
        for a, b in pairs:
            if not (self.has_session(a, b) and self.has_session(b, a)):
                raise HandshakeError(f"handshake between {a} and {b} did not complete")

    # -- sealing ---------------------------------------------------------------------------------------------
    def outbound(self, messages: list[Message], party: str) -> list[Message]:
        return [m if m.kind == HANDSHAKE_KIND else self._seal(m, party) for m in messages]

    def _seal(self, message: Message, party: str) -> Message:
        st = self._party(party)
        session = st.sessions.get(message.receiver)
        if session is None:
            raise ChannelError(f"{party} has no secure session with {message.receiver}; "
                               "run SecureChannelLayer.establish(net) after building the network")
        if session.send_ctr >= _MAX_COUNTER:
            raise ChannelError(f"session {party}->{message.receiver} used up its nonces; handshake again")
        ctr = session.send_ctr
        seq = session.send_seq.get(message.kind, 0)
        ad = _associated_data(session.sid, party, message.receiver, message.kind, seq, ctr)
        sealed = session.seal(encode(message), ad, ctr)
        session.send_ctr = ctr + 1
        session.send_seq[message.kind] = seq + 1
        self.sealed += 1
        return Message(message.kind, party, message.receiver, 0, blobs={"sealed": sealed},
                       meta={"sid": session.sid, "seq": seq, "ctr": ctr})

    def inbound(self, message: Message, party: str) -> Message:
        try:
            if message.kind == HANDSHAKE_KIND:
                self._accept_hello(message, party)
                return message
            return self._open(message, party)
        except ChannelError:
            self.rejected += 1
            raise

    def _open(self, env: Message, party: str) -> Message:
        st = self._party(party)
        if set(env.meta) != {"sid", "seq", "ctr"} or set(env.blobs) != {"sealed"} or env.tensors:
            if "sealed" not in env.blobs:
                raise UnsealedMessageError(
                    f"{party} refuses an unsealed {env.kind} message from {env.sender}: the secure channel "
                    "accepts only sealed messages")
            raise TamperedMessageError(f"envelope of a {env.kind} message from {env.sender} to {party} is malformed")
        sid, seq, ctr = env.meta["sid"], env.meta["seq"], env.meta["ctr"]
        if not (isinstance(sid, str) and type(seq) is int and type(ctr) is int and 0 <= seq and 0 <= ctr <= _MAX_COUNTER):
            raise TamperedMessageError(f"envelope header of a {env.kind} message from {env.sender} is malformed")
        if env.step != 0:
            raise TamperedMessageError(f"envelope of a {env.kind} message from {env.sender} has a modified step")
        blob = env.blobs["sealed"]
        if env.receiver != party:
            raise WrongReceiverError(f"{party} got a {env.kind} message addressed to {env.receiver}")
        session = st.by_sid.get(sid)
        if session is None:
            raise UnknownSessionError(
                f"{party} has no session {sid[:8]}... for a {env.kind} message claiming to come from {env.sender} "
                "(sealed for another receiver, under an old session, or forged)")
        ad = _associated_data(sid, env.sender, party, env.kind, seq, ctr)
        if session.peer != env.sender:
            self._diagnose_sender(session, env, party, seq, ctr)
        try:
            plain = session.open(blob, ad, ctr)
        except InvalidTag:
            self._diagnose_reflection(session, env, party, seq, ctr)
            raise TamperedMessageError(
                f"{env.kind} message from {env.sender} to {party} failed authentication (modified or truncated)"
            ) from None
        expected = session.recv_seq.get(env.kind, 0)
        if seq < expected:
            raise ReplayError(f"{party} already accepted {env.kind} message #{seq} from {env.sender} (replay)")
        if seq > expected:
            raise OutOfOrderError(f"{party} expected {env.kind} message #{expected} from {env.sender}, got #{seq} "
                                  "(an earlier message was dropped or reordered)")
        try:
            inner = decode(plain)
        except MessageError:
            raise TamperedMessageError(f"sealed {env.kind} message from {env.sender} holds no valid message") from None
        if (inner.kind, inner.sender, inner.receiver) != (env.kind, env.sender, party):
            raise TamperedMessageError(f"sealed message from {env.sender} does not match its envelope")
        session.recv_seq[env.kind] = expected + 1
        self.opened += 1
        return inner.replace(wire_size=env.wire_size)

    @staticmethod
    def _diagnose_sender(session: _Session, env: Message, party: str, seq: int, ctr: int) -> None:
        """The session belongs to another peer than the claimed sender: name who really sealed it, if anyone."""
        ad_true = _associated_data(session.sid, session.peer, party, env.kind, seq, ctr)
        try:
            session.open(env.blobs["sealed"], ad_true, ctr)
        except InvalidTag:
            raise TamperedMessageError(
                f"{env.kind} message claiming to come from {env.sender} does not authenticate") from None
        raise WrongSenderError(f"{env.kind} message claims to come from {env.sender} but was sealed by "
                               f"{session.peer}; refusing it")

    @staticmethod
    def _diagnose_reflection(session: _Session, env: Message, party: str, seq: int, ctr: int) -> None:
        ad_own = _associated_data(session.sid, party, env.sender, env.kind, seq, ctr)
        try:
            session.open_own(env.blobs["sealed"], ad_own, ctr)
        except InvalidTag:
            return
        raise ReflectionError(f"{party} received its own {env.kind} message to {env.sender} back (reflection)")

    def start_epoch(self, net: Network, epoch: int) -> None:
        """Handshake again unless the sessions are still unused (a process that just established them): see the
        module docstring, "Sessions and checkpoints"."""
        if any(s.send_ctr for st in self._local.values() for s in st.sessions.values()):
            self.establish(net)

    # Sessions hold live keys and are never checkpointed; every epoch starts with a fresh handshake.
    def state_dict(self) -> dict[str, Any]:
        return {"sealed": self.sealed, "opened": self.opened, "rejected": self.rejected}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sealed = int(state.get("sealed", 0))
        self.opened = int(state.get("opened", 0))
        self.rejected = int(state.get("rejected", 0))


def require_outermost(layers: Sequence[Layer]) -> None:
    """Refuse a stack where a layer comes after the secure channel (it would only see sealed envelopes)."""
    positions = [i for i, layer in enumerate(layers) if isinstance(layer, SecureChannelLayer)]
    if len(positions) > 1:
        raise ConfigError("the secure channel appears more than once in the protocol stack")
    if positions and positions[0] != len(layers) - 1:
        after = [layer.name for layer in layers[positions[0] + 1:]]
        raise ConfigError(f"the secure channel must be the last (outermost) layer, but {after} come after it")
