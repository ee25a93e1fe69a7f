"""Authenticated encrypted messages between parties (``--secure-channel``), end to end, also through relays.

Threat model: the network and any relaying party (an aggregator, a proxy, the transport itself) may read, drop,
modify, reorder, replay, reflect or re-address messages. Parties are identified by long-term Ed25519 keys whose
public halves every party has pinned from files beforehand (``--channel-keys``: no certificate authority, no trust on
first use). Without ``--channel-keys``, the keys come from the run itself, and the authentication is only as good as
what delivered them (:mod:`protocols.secure_plugins`; the run says at its start which case it is):

* ``secvfl train --secure-channel`` generates and pins every party's key in its one process: that authenticates
  parties within a simulation only, never between organisations.
* parties in separate processes (``secvfl party``, ``secvfl launch``) each generate their own key, and each pins its
  peers' keys from what they send it over their mutual-TLS link before their first handshake: the channel then
  authenticates parties exactly as far as the federation's CA does (whoever can get a certificate in a party's name
  can also have its own key pinned for that party), no further.

Everything that travels through this layer is authenticated by it, the public keys of ``--secagg mask`` included
(:mod:`protocols.secagg` authenticates them only this way).
Guarantees: confidentiality and integrity of every message body, authenticity of sender and receiver, rejection of
replayed, reordered, reflected and re-addressed messages and of replayed or modified handshake messages, forward
secrecy once the ephemeral keys are gone (the responder's right after use, the initiator's once the reply verified). Not
guaranteed: availability (an attacker can drop everything, or make a handshake fail), hiding of
routing metadata (message kind, sender, receiver and sizes stay visible: the transport routes on them), protection
against a compromised identity key.

On top of mutual TLS (parties in separate processes, :mod:`secvfl.transport.grpc_link`): TLS protects each hop
between two processes up to where TLS is terminated (the receiving process's gRPC stack, or a TLS-terminating proxy
in front of it) and authenticates its ends through the federation's CA; this layer seals each message from the
sender's party to the receiver's party (whatever terminates TLS sees only envelopes), renews its keys every epoch
and never writes them to a checkpoint, and refuses replayed and reordered messages per stream. With
``--channel-keys`` it also authenticates the parties independently of the CA: an attacker holding a certificate the
CA issued in a party's name (a compromised or careless CA) gets into the TLS links but can then only drop channel
messages, not read or forge them. The coordinator's requests and their answers (``party-call`` and
``party-result``: step numbers, row ids, party names, losses) and the identity-key messages of the second case above
are control traffic: protected by TLS only, not by this layer.

Handshake: SIGMA (Krawczyk, CRYPTO 2003) in its sign-and-MAC form, the composition TLS 1.3 uses for mutual
authentication (CertificateVerify, then Finished): each side signs the hash of the whole transcript with its identity
key and proves it holds the derived keys with an HMAC over the same hash, before any data. Built only from
``cryptography`` primitives (X25519, Ed25519, HKDF-SHA256, HMAC-SHA256); no construction of our own. Why not Noise:
the Python Noise packages on the package index are unmaintained (``noiseprotocol``: last release 0.3.1, November
2020; ``dissononce``: 2019), and Noise's static keys are X25519, not the Ed25519 identity keys that ``--channel-keys``
files and pins hold, so it would also change every key file. TLS 1.3 needs a TLS transport; the in-process one has
none (the multi-host mode adds TLS per hop, under this layer). With I the initiator, R the responder and ``r`` the
handshake round (how many handshakes the pair began since the layer was built; 8 bytes, big-endian)::

    hello  I -> R   meta {protocol, msg: "hello"}   blobs round r, nonce n_I (32 bytes), ephemeral e_I (X25519)
    reply  R -> I   meta {protocol, msg: "reply"}   blobs nonce n_R, ephemeral e_R,
                                                          signature Sig_R(SIG_R || th), mac HMAC(km_R, FIN_R || th)
    finish I -> R   meta {protocol, msg: "finish"}  blobs signature Sig_I(SIG_I || th), mac HMAC(km_I, FIN_I || th)

    th   = SHA-256(compact JSON [PROTOCOL, "transcript", r, I, R, pk_I, pk_R, n_I, e_I, n_R, e_R])   (bytes as hex;
           pk_X: X's raw Ed25519 identity key as the signer holds it and the verifier has pinned it)
    k_IR || k_RI || km_R || km_I || sid  =  HKDF-SHA256(ikm X25519(e_I, e_R), salt th, info PROTOCOL "|keys"),
           32 + 32 + 32 + 32 + 16 bytes; SIG_R, FIN_R, SIG_I, FIN_I: fixed labels naming the role (see ``_LABELS``)

Every field of the transcript -- protocol version, round, both names, both identity keys, both nonces, both ephemeral
keys -- is under both signatures and both MACs. R accepts a hello only while it listens for that peer's round (an
older round is a replay and is refused); I accepts a reply only for its pending hello, and only if Sig_R verifies
under R's pinned key and the MAC under the derived key; I installs its session when it sends the finish; R installs
its session only once Sig_I and the MAC verify. A handshake message must have exactly its shape (kind, step 0, meta
keys and values in this order, blob names in this order with these lengths, no tensors, the expected sender and
receiver). A refused message changes no state, except that a hello R accepts (a hello carries no proof of origin)
uses up that round: a forged or replayed one then makes the handshake fail, never succeed. A recorded hello replayed
into a later process is answered, but nobody without I's identity key can sign the finish over R's fresh nonce and
ephemeral key: the handshake never completes, so even the leaked ephemeral key of an old hello yields no session.
Cost: 3 messages (1.5 round trips) per pair instead of Noise KK's 2; :meth:`SecureChannelLayer.establish` runs all
pairs in 3 flights, once at the start and once per later epoch (bytes per pair: BENCHMARKS.md, "Secure channel
handshake"). ``tests/test_channel.py`` pins a known-answer vector of the key schedule.

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

Parties in separate processes (:mod:`secvfl.deploy`): each party's process builds this layer for its own party only
(``topology.local``): its identity key and its pins, never another party's private key or session keys. The
handshakes are the messages of the one-process run, sent over the transport between the two processes of each pair:
:meth:`SecureChannelLayer.establish` runs the same 3 flights in every process, each sending and taking only its own
party's messages (the first name of a pair in sorted order initiates, so both sides agree without asking). They run
at the start of every epoch, the first included (:meth:`SecureChannelLayer.start_epoch`), where one process
handshakes once when the run is built and again at each epoch whose sessions were used: the same handshakes, so a
launched run counts the same messages and bytes as the in-process run (``tests/test_deploy.py``). As in one process,
every pair of the run's parties handshakes, also a pair that exchanges no message (two feature parties of split-NN),
so each party must reach every other. Pins come from the ``<party>.pub.pem`` files of ``--channel-keys DIR`` (each
process reads only its own ``<party>.key.pem``; ``<party>`` is the run's name: ``label``, ``party0``, ...,
``aggregator``), or, without files, from an :data:`IDENTITY_KIND` message (the raw public key) each side of a pair
sends the other before their first handshake, the initiator first; it goes as control traffic
(:meth:`~secvfl.transport.network.Network.send_control`, counted with the coordinator's requests), since the
one-process run has nothing to send for it. The CKKS aggregator's process passes on whatever message comes that is
not a request (secvfl.deploy.party); it never gets a handshake or identity message it did not wait for, because
``aggregator`` sorts before every other run name: it initiates each of its pairs and receives only answers, while it
handshakes (a new run name that sorts first would have to keep this true).

Sessions and checkpoints: session keys are never written to a checkpoint. A process restarted from a checkpoint
would otherwise seal with counters the killed process had already used after that checkpoint (AES-GCM nonce reuse:
the XOR of two plaintexts and forgeries for whoever recorded both), and a stolen checkpoint would decrypt recorded
traffic (no forward secrecy). Instead every epoch, i.e. every checkpoint boundary, starts with a fresh handshake
(:meth:`SecureChannelLayer.start_epoch`): a resumed run handshakes where an uninterrupted one does, so both send
the same bytes, and the keys of an epoch are erased when the next begins.
"""

from __future__ import annotations

import hashlib
import hmac
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

from secvfl.errors import ConfigError, MessageError, ProtocolError
from secvfl.messages import Message, decode, encode, register_kind
from secvfl.transport.layers import Layer, Topology

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
    "IDENTITY_KIND",
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

PROTOCOL = "secvfl-channel-v2"
HANDSHAKE_KIND = register_kind("handshake")
# A party's raw Ed25519 identity key, sent to a peer in another process before their first handshake when the peers
# pin each other from the transport (SecureChannelLayer(pin_from_transport=True)): control traffic, not a run message.
IDENTITY_KIND = register_kind("channel-identity")
# The exact blobs of each handshake message, in this order: name -> length in bytes.
_SHAPES: dict[str, dict[str, int]] = {
    "hello": {"round": 8, "nonce": 32, "ephemeral": 32},
    "reply": {"nonce": 32, "ephemeral": 32, "signature": 64, "mac": 32},
    "finish": {"signature": 64, "mac": 32},
}
# What each signature and MAC says it is, so that no proof made for one role or purpose counts for another.
_LABELS = {
    ("responder", "signature"): b"secvfl-channel-v2 responder signature\x00",
    ("responder", "mac"): b"secvfl-channel-v2 responder finished\x00",
    ("initiator", "signature"): b"secvfl-channel-v2 initiator signature\x00",
    ("initiator", "mac"): b"secvfl-channel-v2 initiator finished\x00",
}
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
def _ephemeral_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def _fresh_nonce() -> bytes:
    return os.urandom(32)


def _transcript_hash(round_: int, initiator: str, responder: str, initiator_key: bytes, responder_key: bytes,
                     nonce_i: bytes, eph_i: bytes, nonce_r: bytes, eph_r: bytes) -> bytes:
    fields = [PROTOCOL, "transcript", round_, initiator, responder, initiator_key.hex(), responder_key.hex(),
              nonce_i.hex(), eph_i.hex(), nonce_r.hex(), eph_r.hex()]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).digest()


@dataclass(frozen=True, repr=False)
class _KeySchedule:
    """What one handshake derives. ``repr`` shows no key."""

    i_to_r: bytes
    r_to_i: bytes
    mac_r: bytes
    mac_i: bytes
    sid: str

    @classmethod
    def derive(cls, shared: bytes, th: bytes) -> _KeySchedule:
        okm = HKDF(hashes.SHA256(), 144, th, (PROTOCOL + "|keys").encode()).derive(shared)
        return cls(okm[:32], okm[32:64], okm[64:96], okm[96:128], okm[128:].hex())

    def __repr__(self) -> str:
        return f"_KeySchedule(sid={self.sid})"


def _proof_mac(key: bytes, role: str, th: bytes) -> bytes:
    return hmac.new(key, _LABELS[role, "mac"] + th, hashlib.sha256).digest()


def _exchange(private: X25519PrivateKey, peer_public: bytes, peer: str) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:  # a low-order point: the shared secret would be all zeros
        raise HandshakeError(f"the handshake message from {peer} carries an invalid ephemeral key") from None


def _raw_x25519(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _handshake_message(name: str, sender: str, receiver: str, blobs: dict[str, bytes]) -> Message:
    return Message(HANDSHAKE_KIND, sender, receiver, 0, blobs=blobs, meta={"protocol": PROTOCOL, "msg": name})


def _handshake_name(msg: Message) -> str:
    """Which handshake message ``msg`` is, if it has exactly that message's shape; else :class:`HandshakeError`."""
    protocol = msg.meta.get("protocol")
    if protocol != PROTOCOL:
        raise HandshakeError(f"handshake message from {msg.sender} speaks {protocol!r}, not {PROTOCOL!r}; both "
                             "parties must run the same secvfl channel version")
    name = msg.meta.get("msg")
    shape = _SHAPES.get(name) if isinstance(name, str) else None
    if (shape is None or list(msg.meta.items()) != [("protocol", PROTOCOL), ("msg", name)] or msg.step != 0
            or msg.tensors or [(k, len(v)) for k, v in msg.blobs.items()] != list(shape.items())):
        raise HandshakeError(f"malformed handshake message from {msg.sender}: a handshake message is exactly "
                             "one of hello, reply, finish (step 0, no tensors, its meta and blobs only)")
    return name


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


class _Handshake:
    """One party's side of a handshake in progress with one peer. ``repr`` shows no key.

    Stages: the initiator is ``sent-hello`` until a valid reply makes it ``confirmed`` (its finish waits in
    ``outgoing``); the responder is ``listening`` until a hello makes it ``replying`` (its reply waits in
    ``outgoing``), then ``awaiting-finish``."""

    __slots__ = ("role", "stage", "round", "nonce_i", "eph_i", "private", "keys", "th", "outgoing")

    def __init__(self, role: str, stage: str, round_: int) -> None:
        self.role, self.stage, self.round = role, stage, round_
        self.nonce_i = self.eph_i = b""
        self.private: X25519PrivateKey | None = None  # the initiator's ephemeral key, until the reply arrives
        self.keys: _KeySchedule | None = None
        self.th = b""
        self.outgoing: Message | None = None

    def __repr__(self) -> str:
        return f"_Handshake(role={self.role}, stage={self.stage}, round={self.round})"


# What each stage waits for; any other handshake message is refused.
_EXPECTS = {"sent-hello": "reply", "listening": "hello", "awaiting-finish": "finish"}


@dataclass
class _PartyChannel:
    credentials: ChannelCredentials
    sessions: dict[str, _Session] = field(default_factory=dict)  # peer -> session
    by_sid: dict[str, _Session] = field(default_factory=dict)
    handshakes: dict[str, _Handshake] = field(default_factory=dict)  # peer -> handshake in progress
    rounds: dict[str, int] = field(default_factory=dict)  # peer -> handshakes begun with it (next round number)

    def identity_bytes(self) -> bytes:
        return _raw_public(self.credentials.identity.public_key)

    def pinned_bytes(self, peer: str) -> bytes:
        key = self.credentials.pinned.get(peer)
        assert key is not None  # checked when the handshake began
        return _raw_public(key)

    def __repr__(self) -> str:
        return f"_PartyChannel(identity={self.credentials.identity.fingerprint}, peers={sorted(self.sessions)})"


# -- the layer -------------------------------------------------------------------------------------------------
class SecureChannelLayer(Layer):
    """Seals every message end to end (see the module docstring). Must be the last layer of the stack.

    ``credentials`` holds the parties this process runs (all of them in the embedded mode; with the parties in
    separate processes, only the process's own party, ``topology.local``). Call :meth:`establish` once after building
    the network to run the handshakes through it; parties in separate processes handshake at every
    :meth:`start_epoch` instead, their first included (see the module docstring, "Parties in separate processes").

    ``pin_from_transport``: the local party pins each peer's identity key from a message that peer sends it over the
    transport before their first handshake (:data:`IDENTITY_KIND`, control traffic), instead of having it pinned
    beforehand. Only for a transport that authenticates each link as the named party (mutual TLS): the pin is then
    exactly as trustworthy as that link.
    """

    name: ClassVar[str] = "secure-channel"

    def __init__(self, credentials: Mapping[str, ChannelCredentials], *, pin_from_transport: bool = False) -> None:
        if not credentials:
            raise ConfigError("the secure channel needs the credentials of at least one local party")
        self._setup(credentials, pin_from_transport)

    def _setup(self, credentials: Mapping[str, ChannelCredentials], pin_from_transport: bool) -> None:
        self._local: dict[str, _PartyChannel] = {p: _PartyChannel(c) for p, c in credentials.items()}
        self.pin_from_transport = pin_from_transport
        self._announced: set[tuple[str, str]] = set()  # (party, peer): party sent peer its identity key
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
        if topology.local is not None and set(self._local) - {topology.local}:
            raise ConfigError(f"this process acts for {topology.local}, so its secure channel holds {topology.local}'s "
                              f"credentials only, not {sorted(self._local)}")
        if self.pin_from_transport and topology.local is None:
            raise ConfigError("pinning peers' identity keys from the transport needs parties in separate processes "
                              "over mutual TLS; in one process, pin them beforehand")

    def across_processes(self) -> str | None:
        return None  # each process holds its own party's credentials and runs its side of each handshake

    def describe(self) -> dict[str, Any]:
        return {
            "layer": self.name,
            "protocol": PROTOCOL,
            "identity": "Ed25519 (pinned)",
            "key_exchange": "SIGMA: X25519 ephemeral, Ed25519 signatures and HMAC-SHA256 key confirmation over the "
                            "transcript (3 messages per pair)",
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
    def _begin(self, party: str, peer: str, role: str, stage: str) -> _Handshake:
        st = self._party(party)
        if st.credentials.pinned.get(peer) is None:
            raise HandshakeError(f"{party} has no pinned identity key for {peer}; add {peer}.pub.pem to its pins")
        round_ = st.rounds.get(peer, 0)
        st.rounds[peer] = round_ + 1
        handshake = st.handshakes[peer] = _Handshake(role, stage, round_)  # a half-done earlier one is dropped
        return handshake

    def listen(self, party: str, peer: str) -> None:
        """Let ``party`` answer the next hello of ``peer`` (the responder's side of a new handshake)."""
        self._begin(party, peer, "responder", "listening")

    def hello(self, party: str, peer: str) -> Message:
        """The first message of a new handshake from ``party`` (initiator) to ``peer`` (who must :meth:`listen`)."""
        handshake = self._begin(party, peer, "initiator", "sent-hello")
        handshake.private = _ephemeral_key()
        handshake.nonce_i = _fresh_nonce()
        handshake.eph_i = _raw_x25519(handshake.private)
        return _handshake_message("hello", party, peer, {
            "round": handshake.round.to_bytes(8, "big"), "nonce": handshake.nonce_i, "ephemeral": handshake.eph_i})

    def reply(self, party: str, peer: str) -> Message:
        """The responder's answer to the hello it accepted from ``peer``."""
        handshake = self._ready(party, peer, "replying", f"reply: it accepted no hello from {peer}")
        handshake.stage = "awaiting-finish"
        return handshake.outgoing

    def finish(self, party: str, peer: str) -> Message:
        """The initiator's last message, once the reply of ``peer`` verified; installs ``party``'s session."""
        handshake = self._ready(party, peer, "confirmed", f"finish: it verified no reply from {peer}")
        st = self._local[party]
        del st.handshakes[peer]
        self._install(st, peer, handshake.keys, send=handshake.keys.i_to_r, recv=handshake.keys.r_to_i)
        return handshake.outgoing

    def _ready(self, party: str, peer: str, stage: str, why: str) -> Any:
        handshake = self._party(party).handshakes.get(peer)
        if handshake is None or handshake.stage != stage:
            raise HandshakeError(f"{party} has no handshake {why}")
        return handshake

    def _accept_handshake(self, msg: Message, party: str) -> None:
        st = self._party(party)
        if msg.receiver != party:
            raise WrongReceiverError(f"{party} got a handshake message addressed to {msg.receiver}")
        if st.credentials.pinned.get(msg.sender) is None:
            raise HandshakeError(f"{party} has no pinned identity key for {msg.sender}; refusing its handshake")
        name = _handshake_name(msg)
        handshake = st.handshakes.get(msg.sender)
        expected = _EXPECTS.get(handshake.stage) if handshake is not None else None
        if name != expected:
            now = f"it expects a {expected} of this handshake" if expected else "it expects no handshake message now"
            raise HandshakeError(f"{party} refuses a {name} from {msg.sender}: {now} (replayed, reordered or forged)")
        if name == "hello":
            self._on_hello(st, msg, party, handshake)
        elif name == "reply":
            self._on_reply(st, msg, party, handshake)
        else:
            self._on_finish(st, msg, party, handshake)

    def _on_hello(self, st: _PartyChannel, msg: Message, party: str, handshake: _Handshake) -> None:
        round_ = int.from_bytes(msg.blobs["round"], "big")
        if round_ != handshake.round:
            why = "a replayed hello" if round_ < handshake.round else "a hello out of step"
            raise HandshakeError(f"{party} refuses {why} from {msg.sender}: round {round_}, expected "
                                 f"{handshake.round}")
        private = _ephemeral_key()
        nonce_r, eph_r = _fresh_nonce(), _raw_x25519(private)
        shared = _exchange(private, msg.blobs["ephemeral"], msg.sender)  # the ephemeral key is dropped after this
        th = _transcript_hash(round_, msg.sender, party, st.pinned_bytes(msg.sender), st.identity_bytes(),
                              msg.blobs["nonce"], msg.blobs["ephemeral"], nonce_r, eph_r)
        keys = _KeySchedule.derive(shared, th)
        handshake.keys, handshake.th = keys, th
        handshake.outgoing = _handshake_message("reply", party, msg.sender, {
            "nonce": nonce_r, "ephemeral": eph_r,
            "signature": st.credentials.identity.sign(_LABELS["responder", "signature"] + th),
            "mac": _proof_mac(keys.mac_r, "responder", th)})
        handshake.stage = "replying"

    def _on_reply(self, st: _PartyChannel, msg: Message, party: str, handshake: _Handshake) -> None:
        assert handshake.private is not None
        peer = msg.sender
        th = _transcript_hash(handshake.round, party, peer, st.identity_bytes(), st.pinned_bytes(peer),
                              handshake.nonce_i, handshake.eph_i, msg.blobs["nonce"], msg.blobs["ephemeral"])
        self._verify_signature(st, msg, "responder", th,
                               f"or {peer} pins another key for {party} than {party}'s "
                               f"{st.credentials.identity.fingerprint}")
        keys = _KeySchedule.derive(_exchange(handshake.private, msg.blobs["ephemeral"], peer), th)
        self._verify_mac(msg, keys.mac_r, "responder", th)
        handshake.private = None  # forward secrecy: the ephemeral key is not needed any more
        handshake.keys, handshake.th = keys, th
        handshake.outgoing = _handshake_message("finish", party, peer, {
            "signature": st.credentials.identity.sign(_LABELS["initiator", "signature"] + th),
            "mac": _proof_mac(keys.mac_i, "initiator", th)})
        handshake.stage = "confirmed"

    def _on_finish(self, st: _PartyChannel, msg: Message, party: str, handshake: _Handshake) -> None:
        assert handshake.keys is not None
        self._verify_signature(st, msg, "initiator", handshake.th, "")
        self._verify_mac(msg, handshake.keys.mac_i, "initiator", handshake.th)
        del st.handshakes[msg.sender]
        self._install(st, msg.sender, handshake.keys, send=handshake.keys.r_to_i, recv=handshake.keys.i_to_r)

    @staticmethod
    def _verify_signature(st: _PartyChannel, msg: Message, role: str, th: bytes, other_cause: str) -> None:
        pinned = st.credentials.pinned.get(msg.sender)
        assert pinned is not None
        try:
            pinned.verify(msg.blobs["signature"], _LABELS[role, "signature"] + th)
        except InvalidSignature:
            meta = msg.meta["msg"]
            raise HandshakeError(
                f"{meta} claiming to come from {msg.sender} is not signed by {msg.sender}'s pinned key "
                f"({fingerprint(pinned)}) over this handshake's transcript: forged, modified or replayed"
                + (f", {other_cause}" if other_cause else "") + "; refusing it"
            ) from None

    @staticmethod
    def _verify_mac(msg: Message, key: bytes, role: str, th: bytes) -> None:
        if not hmac.compare_digest(msg.blobs["mac"], _proof_mac(key, role, th)):
            raise HandshakeError(f"{msg.meta['msg']} from {msg.sender} does not prove it holds this handshake's "
                                 "keys (key confirmation failed); refusing it")

    @staticmethod
    def _install(st: _PartyChannel, peer: str, keys: _KeySchedule, *, send: bytes, recv: bytes) -> None:
        old = st.sessions.get(peer)
        if old is not None:
            st.by_sid.pop(old.sid, None)
        session = _Session(peer, keys.sid, send, recv)
        st.sessions[peer] = session
        st.by_sid[keys.sid] = session

    def _here(self, party: str) -> bool:
        """Whether ``party``'s side of a handshake runs in this process (in one process: every party's)."""
        return self.topology.local is None or party in self._local

    def pairs(self) -> list[tuple[str, str]]:
        """(initiator, responder) of every handshake this process takes part in, the first name in sorted order
        initiating: every pair of its local parties, and with the parties in separate processes, its own party
        with every other party of the run."""
        names = sorted(self._local) if self.topology.local is None else sorted(self.topology.roles)
        return [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if a in self._local or b in self._local]

    def establish(self, net: Network, pairs: Iterable[tuple[str, str]] | None = None) -> None:
        """Handshake every pair of :meth:`pairs` (or ``pairs``: (initiator, responder)) through ``net``, so the bytes
        are counted: all hellos, then all replies, then all finishes (3 flights, whatever the number of pairs).

        With the parties in separate processes, this process sends and takes only its own party's messages; the
        other process of each pair runs the same flights at the same time (every wait is for a message the other
        side sent in an earlier flight, so the flights never wait on each other in a cycle)."""
        pairs = list(self.pairs() if pairs is None else pairs)
        if self.pin_from_transport:
            self._exchange_identities(net, pairs)
        for a, b in pairs:
            if self._here(b):
                self.listen(b, a)
            if self._here(a):
                net.send(self.hello(a, b))
        for a, b in pairs:
            if self._here(b):
                net.receive(b, kind=HANDSHAKE_KIND, sender=a)
                net.send(self.reply(b, a))
        for a, b in pairs:
            if self._here(a):
                net.receive(a, kind=HANDSHAKE_KIND, sender=b)
                net.send(self.finish(a, b))
        for a, b in pairs:
            if self._here(b):
                net.receive(b, kind=HANDSHAKE_KIND, sender=a)
        for a, b in pairs:
            if not all(self.has_session(x, y) for x, y in ((a, b), (b, a)) if self._here(x)):
                raise HandshakeError(f"handshake between {a} and {b} did not complete")

    # -- pins from the transport (parties in separate processes without key files) -----------------------------
    def _exchange_identities(self, net: Network, pairs: list[tuple[str, str]]) -> None:
        """Before a pair's first handshake, each side sends the other its raw identity key as control traffic and
        pins the one it gets: the initiator first, the responder once it has the initiator's (so a process only
        ever waits for a message its peer sends before waiting itself)."""
        outgoing = [(a, b) for a, b in pairs if a in self._local and b not in self._local]
        incoming = [(a, b) for a, b in pairs if b in self._local and a not in self._local]
        for a, b in outgoing:
            self._announce(net, a, b)
        for a, b in incoming:
            self._learn(net, b, a)
            self._announce(net, b, a)
        for a, b in outgoing:
            self._learn(net, a, b)

    def _announce(self, net: Network, party: str, peer: str) -> None:
        if (party, peer) not in self._announced:
            identity = self._party(party).identity_bytes()
            net.send_control(Message(IDENTITY_KIND, party, peer, 0, blobs={"identity": identity},
                                     meta={"protocol": PROTOCOL}))
            self._announced.add((party, peer))

    def _learn(self, net: Network, party: str, peer: str) -> None:
        pinned = self._party(party).credentials.pinned
        if pinned.get(peer) is not None:
            return
        msg = net.receive_control(party, kind=IDENTITY_KIND, sender=peer)
        raw = msg.blobs.get("identity", b"")
        if (list(msg.meta.items()) != [("protocol", PROTOCOL)] or list(msg.blobs) != ["identity"] or len(raw) != 32
                or msg.tensors or msg.step != 0):
            raise HandshakeError(f"{peer}'s identity key message to {party} is malformed (it must be exactly "
                                 f"{PROTOCOL}'s raw Ed25519 key); every party must run the same secvfl version")
        try:
            key = Ed25519PublicKey.from_public_bytes(raw)
        except ValueError:
            raise HandshakeError(f"{peer} sent {party} an invalid Ed25519 identity key") from None
        pinned.pin(peer, key)

    # -- sealing ---------------------------------------------------------------------------------------------
    def outbound(self, messages: list[Message], party: str) -> list[Message]:
        return [m if m.kind == HANDSHAKE_KIND else self._seal(m, party) for m in messages]

    def _seal(self, message: Message, party: str) -> Message:
        st = self._party(party)
        session = st.sessions.get(message.receiver)
        if session is None:
            if self.topology.local is not None:
                raise ChannelError(f"{party} has no secure session with {message.receiver}: parties in separate "
                                   "processes handshake at the start of each epoch, and none started since these "
                                   "processes did (a run resumed after its last epoch's checkpoint, before its "
                                   "summary, cannot evaluate under the channel across processes yet)")
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
                self._accept_handshake(message, party)
                return message
            return self._open(message, party)
        except ChannelError:
            self.rejected += 1
            raise

    def _open(self, env: Message, party: str) -> Message:
        st = self._party(party)
        # Keys in the order _seal writes them: a reordered meta is other bytes, so it is refused like any change.
        if list(env.meta) != ["sid", "seq", "ctr"] or set(env.blobs) != {"sealed"} or env.tensors:
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
        module docstring, "Sessions and checkpoints". Parties in separate processes handshake at every epoch's start,
        their first handshake included (the transport between their processes is up only then): every process
        decides alike, without knowing whether the others' sessions were used."""
        if self.topology.local is not None or any(s.send_ctr for st in self._local.values()
                                                  for s in st.sessions.values()):
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
