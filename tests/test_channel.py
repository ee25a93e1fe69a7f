"""Secure channel: identity keys on disk, the transcript-bound (SIGMA) handshake with its known-answer vector, and
adversaries that replay hellos, use a leaked old ephemeral key, modify every handshake field, and flip, truncate,
reorder, replay, reflect, re-address or fuzz sealed messages. Every corruption is rejected, every honest run accepted."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import os
import pickle
import stat
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocols.channel as channel_module
from protocols.channel import (
    HANDSHAKE_KIND,
    ChannelCredentials,
    ChannelError,
    HandshakeError,
    IdentityKey,
    OutOfOrderError,
    PinnedKeys,
    ReflectionError,
    ReplayError,
    SecureChannelLayer,
    TamperedMessageError,
    UnknownSessionError,
    UnsealedMessageError,
    WrongReceiverError,
    WrongSenderError,
    load_public_key,
    require_outermost,
)
from secvfl.bench.decode import capture_corpus, mutate
from secvfl.errors import ConfigError, MessageError, ProtocolError
from secvfl.messages import Message, decode, encode
from secvfl.transport import InProcessTransport, Network
from secvfl.transport.layers import Layer, Role

PARTIES = ["label", "bank", "shop"]
ROLES = {"label": Role.LABEL, "bank": Role.FEATURE, "shop": Role.FEATURE}
IDENTITIES = {p: IdentityKey.generate() for p in PARTIES}
PINS = PinnedKeys({p: k.public_key for p, k in IDENTITIES.items()})


class AdversarialTransport(InProcessTransport):
    """An in-process transport whose inboxes an attacker (the test) can rewrite; remembers what it handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.last_taken: bytes | None = None
        self.sent: list[tuple[str, str, str, bytes]] = []  # what an eavesdropper recorded: (sender, receiver, kind, bytes)

    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        self.sent.append((sender, receiver, kind, data))
        super().put(sender, receiver, kind, data)

    @property
    def inbox(self) -> dict:
        return self._inbox

    def take(self, receiver: str, *, kind: str | None = None, sender: str | None = None) -> bytes:
        self.last_taken = None
        data = super().take(receiver, kind=kind, sender=sender)
        self.last_taken = data
        return data


def build(transport: InProcessTransport | None = None, parties=PARTIES) -> tuple[Network, SecureChannelLayer]:
    layer = SecureChannelLayer({p: ChannelCredentials(IDENTITIES[p], PINS) for p in parties})
    net = Network(ROLES, transport=transport, layers=[layer])
    layer.establish(net)
    return net, layer


def sample(sender: str, receiver: str, kind: str = "embedding", step: int = 0, fill: float = 1.0) -> Message:
    return Message(kind, sender, receiver, step, {kind: torch.full((2, 3), fill)}, meta={"split": "train"})


def same(a: Message, b: Message) -> bool:
    return (
        (a.kind, a.sender, a.receiver, a.step, dict(a.meta)) == (b.kind, b.sender, b.receiver, b.step, dict(b.meta))
        and a.tensors.keys() == b.tensors.keys()
        and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    )


# -- identity keys -----------------------------------------------------------------------------------------------
def test_identity_key_files_roundtrip_with_private_mode(tmp_path: Path) -> None:
    key = IdentityKey.generate()
    path = key.save(tmp_path / "bank.key.pem")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key.save_public(tmp_path / "bank.pub.pem")
    loaded = IdentityKey.load(path)
    assert loaded.fingerprint == key.fingerprint
    assert PinnedKeys.from_dir(tmp_path).names() == ["bank"]
    assert load_public_key(tmp_path / "bank.pub.pem").public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    ) == key.public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    sig = loaded.sign(b"x")
    key.public_key.verify(sig, b"x")  # the loaded key is the same key
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        key.save(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match=r"mode 0644.*chmod 600"):
        IdentityKey.load(path)
    key.save(path, overwrite=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    enc = key.save(tmp_path / "enc.pem", password=b"pw")
    assert IdentityKey.load(enc, password=b"pw").fingerprint == key.fingerprint
    with pytest.raises(ConfigError, match="wrong file or password"):
        IdentityKey.load(enc, password=b"nope")
    with pytest.raises(ConfigError, match="not a PEM public key"):
        load_public_key(path)


def test_keys_never_appear_in_repr_logs_errors_or_state(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    transport = AdversarialTransport()
    net, layer = build(transport)
    net.send(sample("bank", "label"))
    box = transport.inbox["label"]
    s, k, data = box.popleft()
    box.append((s, k, data[:-1] + bytes([data[-1] ^ 1])))
    errors = []
    try:
        net.receive("label", kind="embedding", sender="bank")
    except ChannelError as exc:
        errors.append(str(exc))
    assert errors
    secrets = []
    for ident in IDENTITIES.values():
        raw = ident._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())
        pem = ident._private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption())
        secrets += [raw.hex(), base64.b64encode(raw).decode(), pem.decode().splitlines()[1], repr(raw)[2:-1]]
    texts = [repr(layer), str(layer), repr(layer.describe()), repr(layer.state_dict()), *errors, caplog.text,
             *(repr(ident) for ident in IDENTITIES.values()), repr(PINS),
             *(repr(st) for st in layer._local.values()),
             *(repr(s) for st in layer._local.values() for s in st.sessions.values())]
    for text in texts:
        for secret in secrets:
            assert secret not in text
    assert "fingerprint=" in repr(IDENTITIES["bank"])
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(IDENTITIES["bank"])
    session = layer._local["label"].sessions["bank"]
    assert not hasattr(session, "__dict__")  # slots only: no stray attribute can hold a raw key


# -- honest runs -------------------------------------------------------------------------------------------------
def test_handshake_is_counted_and_honest_messages_roundtrip() -> None:
    net, layer = build()
    kinds = net.stats.to_dict()["messages_by_kind"]
    assert kinds[HANDSHAKE_KIND] == 9  # 3 pairs, hello + reply + finish each
    view = net.record("label")
    sent = [sample("bank", "label", step=7, fill=2.5), sample("bank", "label", "logits", step=7)]
    net.send(*sent)
    got = [net.receive("label", kind="logits", sender="bank"), net.receive("label", kind="embedding", sender="bank")]
    assert same(got[0], sent[1]) and same(got[1], sent[0])
    assert got[0].wire_size and got[0].wire_size > 0
    assert view.received == got  # the view holds the opened messages, not envelopes
    assert layer.opened == 2 and layer.rejected == 0


def test_envelope_reveals_only_routing_metadata() -> None:
    transport = AdversarialTransport()
    net, _ = build(transport)
    secret = sample("bank", "label", step=42, fill=3.25)
    net.send(secret)
    _, _, data = transport.inbox["label"][0]
    env = decode(data)
    assert env.kind == "embedding" and env.step == 0 and not env.tensors
    assert set(env.meta) == {"sid", "seq", "ctr"} and set(env.blobs) == {"sealed"}
    assert b"split" not in data and encode(secret)[20:] not in data


# -- targeted attacks, each named ------------------------------------------------------------------------------
def _sent_bytes(transport: AdversarialTransport, receiver: str) -> tuple[str, str, bytes]:
    return transport.inbox[receiver].popleft()


def test_each_attack_raises_its_named_error() -> None:
    transport = AdversarialTransport()
    net, layer = build(transport)

    net.send(sample("bank", "label"))
    s, k, data = _sent_bytes(transport, "label")
    env = decode(data)
    flipped = bytearray(env.blobs["sealed"])
    flipped[5] ^= 0x10
    transport.put(s, "label", k, encode(env.replace(blobs={"sealed": bytes(flipped)})))
    with pytest.raises(TamperedMessageError, match="failed authentication"):
        net.receive("label", kind="embedding", sender="bank")
    transport.put(s, "label", k, encode(env.replace(blobs={"sealed": env.blobs["sealed"][:-3]})))
    with pytest.raises(TamperedMessageError):
        net.receive("label", kind="embedding", sender="bank")

    transport.put(s, "label", k, data)  # the genuine one is still accepted after the failed attempts
    assert net.receive("label", kind="embedding", sender="bank").tensor("embedding").sum() == 6
    transport.put(s, "label", k, data)
    with pytest.raises(ReplayError, match="already accepted"):
        net.receive("label", kind="embedding", sender="bank")

    net.send(sample("bank", "label", step=1), sample("bank", "label", step=2))
    first, second = _sent_bytes(transport, "label"), _sent_bytes(transport, "label")
    transport.inbox["label"].extend([second, first])
    with pytest.raises(OutOfOrderError, match="expected embedding message #1"):
        net.receive("label", kind="embedding", sender="bank")
    assert net.receive("label", kind="embedding", sender="bank").step == 1  # the skipped one is still next

    net.send(sample("label", "bank", "gradient"))
    s, k, data = _sent_bytes(transport, "bank")
    reflected = decode(data).replace(sender="bank", receiver="label")
    transport.put("bank", "label", k, encode(reflected))
    with pytest.raises(ReflectionError, match="its own gradient"):
        net.receive("label", kind="gradient", sender="bank")
    transport.put("label", "label", k, data)  # same bytes, delivered to the wrong inbox
    with pytest.raises(WrongReceiverError, match="addressed to bank"):
        net.receive("label", kind="gradient")

    net.send(sample("shop", "label"))
    s, k, data = _sent_bytes(transport, "label")
    transport.put("bank", "label", k, encode(decode(data).replace(sender="bank")))
    with pytest.raises(WrongSenderError, match="claims to come from bank but was sealed by shop"):
        net.receive("label", kind="embedding", sender="bank")
    transport.put("shop", "bank", k, encode(decode(data).replace(receiver="bank")))
    with pytest.raises(UnknownSessionError):
        net.receive("bank", kind="embedding", sender="shop")

    transport.put("bank", "label", "embedding", encode(sample("bank", "label")))  # plaintext downgrade
    with pytest.raises(UnsealedMessageError, match="unsealed"):
        net.receive("label", kind="embedding", sender="bank")
    assert transport.pending() == 0
    assert layer.rejected == 9
    assert all(issubclass(e, ProtocolError) for e in (TamperedMessageError, ReplayError, OutOfOrderError))


def test_handshake_refuses_unpinned_and_impostor_keys() -> None:
    impostor = IdentityKey.generate()
    creds = {
        "label": ChannelCredentials(IDENTITIES["label"], PINS),
        "bank": ChannelCredentials(impostor, PINS),  # bank signs with a key nobody pinned
        "shop": ChannelCredentials(IDENTITIES["shop"], PinnedKeys({"label": IDENTITIES["label"].public_key})),
    }
    layer = SecureChannelLayer(creds)
    net = Network(ROLES, layers=[layer])
    # bank as responder: its reply's signature does not verify under the key label pinned for bank
    with pytest.raises(HandshakeError, match="reply claiming to come from bank is not signed by bank's pinned key"):
        layer.establish(net, [("label", "bank")])
    # bank as initiator: the transcripts differ (each side names the key it knows for bank), so bank is the one
    # that refuses, and the message names both possible causes
    with pytest.raises(HandshakeError, match=f"not signed by label's pinned key.*or label pins another key for bank "
                                             f"than bank's {impostor.fingerprint}"):
        layer.establish(net, [("bank", "label")])
    assert not layer.has_session("label", "bank") and not layer.has_session("bank", "label")
    with pytest.raises(HandshakeError, match="no pinned identity key for bank"):
        layer.establish(net, [("shop", "bank")])
    with pytest.raises(ChannelError, match="no secure session"):
        net.send(sample("bank", "label"))
    with pytest.raises(ConfigError, match="not parties of this run"):
        Network(ROLES, layers=[SecureChannelLayer({"mallory": creds["label"]})])


# -- the handshake: an independent reference of the documented schedule -----------------------------------------
SPEC = "secvfl-channel-v2"


def raw_ed25519(key) -> bytes:  # noqa: ANN001
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def raw_x25519(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def ref_transcript_hash(round_: int, i: str, r: str, pk_i: bytes, pk_r: bytes, n_i: bytes, e_i: bytes, n_r: bytes,
                        e_r: bytes) -> bytes:
    fields = [SPEC, "transcript", round_, i, r, pk_i.hex(), pk_r.hex(), n_i.hex(), e_i.hex(), n_r.hex(), e_r.hex()]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).digest()


def ref_keys(shared: bytes, th: bytes) -> dict:
    okm = HKDF(hashes.SHA256(), 144, th, f"{SPEC}|keys".encode()).derive(shared)
    return {"i_to_r": okm[:32], "r_to_i": okm[32:64], "mac_r": okm[64:96], "mac_i": okm[96:128],
            "sid": okm[128:].hex()}


def ref_signed(role: str, th: bytes) -> bytes:
    return f"{SPEC} {role} signature\x00".encode() + th


def ref_mac(key: bytes, role: str, th: bytes) -> bytes:
    return hmac.new(key, f"{SPEC} {role} finished\x00".encode() + th, hashlib.sha256).digest()


def ref_ad(sid: str, sender: str, receiver: str, kind: str, seq: int, ctr: int) -> bytes:
    return json.dumps([SPEC, "sealed", sid, sender, receiver, kind, seq, ctr], separators=(",", ":")).encode()


def ref_nonce(ctr: int) -> bytes:
    return bytes(4) + ctr.to_bytes(8, "big")


def step_handshake(net: Network, layer: SecureChannelLayer, transport: AdversarialTransport,
                   tamper: Callable[[int, bytes], bytes] | None = None,
                   initiator: str = "bank", responder: str = "label") -> int | None:
    """One handshake, flight by flight; ``tamper(flight, bytes)`` may rewrite each flight (0 hello, 1 reply,
    2 finish) in transit. Returns the flight whose receipt was refused, or None when the handshake completed."""
    layer.listen(responder, initiator)
    flights = [(initiator, responder, lambda: layer.hello(initiator, responder)),
               (responder, initiator, lambda: layer.reply(responder, initiator)),
               (initiator, responder, lambda: layer.finish(initiator, responder))]
    for flight, (sender, receiver, make) in enumerate(flights):
        net.send(make())
        if tamper is not None:
            box = transport.inbox[receiver]
            s, k, data = box.pop()
            box.append((s, k, tamper(flight, data)))
        try:
            net.receive(receiver, kind=HANDSHAKE_KIND, sender=sender)
        except (ChannelError, MessageError):
            return flight
    return None


def _handshake_bytes(transport: AdversarialTransport, sender: str, receiver: str) -> list[bytes]:
    return [d for s, r, k, d in transport.sent if (s, r, k) == (sender, receiver, HANDSHAKE_KIND)]


# -- the handshake: replay, a leaked old ephemeral key, every field modified, known answer --------------------------
def test_replayed_hello_is_refused() -> None:
    transport = AdversarialTransport()
    net, layer = build(transport, parties=["bank", "label"])
    old_hello = _handshake_bytes(transport, "bank", "label")[0]
    # between handshakes nobody waits for a hello
    transport.put("bank", "label", HANDSHAKE_KIND, old_hello)
    with pytest.raises(HandshakeError, match="refuses a hello from bank: it expects no handshake message"):
        net.receive("label", kind=HANDSHAKE_KIND, sender="bank")
    # in the next handshake (every epoch starts one), ahead of the genuine hello
    layer.listen("label", "bank")
    genuine = layer.hello("bank", "label")
    transport.put("bank", "label", HANDSHAKE_KIND, old_hello)
    net.send(genuine)
    with pytest.raises(HandshakeError, match="replayed hello from bank: round 0, expected 1"):
        net.receive("label", kind=HANDSHAKE_KIND, sender="bank")
    net.receive("label", kind=HANDSHAKE_KIND, sender="bank")  # the refusal changed nothing: the genuine one goes on
    net.send(layer.reply("label", "bank"))
    transport.put("bank", "label", HANDSHAKE_KIND, encode(genuine))  # and the genuine hello itself, again
    with pytest.raises(HandshakeError, match="refuses a hello from bank: it expects a finish"):
        net.receive("label", kind=HANDSHAKE_KIND, sender="bank")
    net.receive("bank", kind=HANDSHAKE_KIND, sender="label")
    net.send(layer.finish("bank", "label"))
    net.receive("label", kind=HANDSHAKE_KIND, sender="bank")
    sent = sample("bank", "label", fill=4.0)
    net.send(sent)
    assert same(net.receive("label", kind="embedding", sender="bank"), sent)
    assert layer.rejected == 3 and transport.pending() == 0


def test_a_leaked_old_ephemeral_key_yields_no_new_session(monkeypatch: pytest.MonkeyPatch) -> None:
    generated: list[X25519PrivateKey] = []

    def recorded() -> X25519PrivateKey:
        generated.append(X25519PrivateKey.generate())
        return generated[-1]

    monkeypatch.setattr(channel_module, "_ephemeral_key", recorded)
    transport = AdversarialTransport()
    build(transport, parties=["bank", "label"])
    old_hello = decode(_handshake_bytes(transport, "bank", "label")[0])
    old_finish = decode(_handshake_bytes(transport, "bank", "label")[1])
    leaked = generated[0]  # bank's ephemeral key of that handshake, stolen afterwards
    assert raw_x25519(leaked) == old_hello.blobs["ephemeral"]

    # A later process with the same identity keys (a resumed run): its rounds start at 0 again, so the recorded hello
    # fits. The attacker drops bank's genuine hello and delivers the old one; label answers it, as it must.
    transport2 = AdversarialTransport()
    layer2 = SecureChannelLayer({p: ChannelCredentials(IDENTITIES[p], PINS) for p in ("bank", "label")})
    net2 = Network(ROLES, transport=transport2, layers=[layer2])
    layer2.listen("label", "bank")
    layer2.hello("bank", "label")  # never delivered
    transport2.put("bank", "label", HANDSHAKE_KIND, encode(old_hello))
    net2.receive("label", kind=HANDSHAKE_KIND, sender="bank")
    net2.send(layer2.reply("label", "bank"))
    reply = decode(transport2.take("bank", kind=HANDSHAKE_KIND, sender="label"))  # intercepted

    # The attacker computes every key of this handshake (with the reference schedule: they are label's keys) ...
    th = ref_transcript_hash(0, "bank", "label", raw_ed25519(IDENTITIES["bank"].public_key),
                             raw_ed25519(IDENTITIES["label"].public_key), old_hello.blobs["nonce"],
                             old_hello.blobs["ephemeral"], reply.blobs["nonce"], reply.blobs["ephemeral"])
    keys = ref_keys(leaked.exchange(X25519PublicKey.from_public_bytes(reply.blobs["ephemeral"])), th)
    assert reply.blobs["mac"] == ref_mac(keys["mac_r"], "responder", th)
    # ... but cannot sign the finish as bank: not with another key, not with bank's old finish signature
    for signature in (Ed25519PrivateKey.generate().sign(ref_signed("initiator", th)), old_finish.blobs["signature"]):
        forged = Message(HANDSHAKE_KIND, "bank", "label", 0, meta={"protocol": SPEC, "msg": "finish"},
                         blobs={"signature": signature, "mac": ref_mac(keys["mac_i"], "initiator", th)})
        transport2.put("bank", "label", HANDSHAKE_KIND, encode(forged))
        with pytest.raises(HandshakeError, match="finish claiming to come from bank is not signed by bank's pinned"):
            net2.receive("label", kind=HANDSHAKE_KIND, sender="bank")
    assert not layer2.has_session("label", "bank")
    # and a message sealed under those keys in bank's name is refused: label installed no such session
    inner = sample("bank", "label", fill=6.0)
    sealed = AESGCM(keys["i_to_r"]).encrypt(ref_nonce(0), encode(inner),
                                            ref_ad(keys["sid"], "bank", "label", "embedding", 0, 0))
    transport2.put("bank", "label", "embedding", encode(Message(
        "embedding", "bank", "label", 0, blobs={"sealed": sealed}, meta={"sid": keys["sid"], "seq": 0, "ctr": 0})))
    with pytest.raises(UnknownSessionError):
        net2.receive("label", kind="embedding", sender="bank")

    # The genuine handshake then completes, under keys the attacker does not have.
    layer2.establish(net2)
    net2.send(inner)
    env = decode(transport2.inbox["label"][-1][2])
    assert env.meta["sid"] != keys["sid"]
    with pytest.raises(InvalidTag):
        AESGCM(keys["i_to_r"]).decrypt(ref_nonce(0), env.blobs["sealed"],
                                       ref_ad(env.meta["sid"], "bank", "label", "embedding", 0, 0))
    assert same(net2.receive("label", kind="embedding", sender="bank"), inner)


_BLOBS = {"hello": ["round", "nonce", "ephemeral"], "reply": ["nonce", "ephemeral", "signature", "mac"],
          "finish": ["signature", "mac"]}


def _field_mutations(name: str) -> dict[str, Callable[[Message], Message]]:
    out: dict[str, Callable[[Message], Message]] = {}
    for b in _BLOBS[name]:
        out[f"{b}-flipped"] = lambda m, b=b: m.replace(blobs={**m.blobs, b: bytes([m.blobs[b][0] ^ 1]) + m.blobs[b][1:]})
        out[f"{b}-shortened"] = lambda m, b=b: m.replace(blobs={**m.blobs, b: m.blobs[b][:-1]})
        out[f"{b}-dropped"] = lambda m, b=b: m.replace(blobs={k: v for k, v in m.blobs.items() if k != b})
    other = next(n for n in _BLOBS if n != name)
    out.update({
        "blobs-reordered": lambda m: m.replace(blobs=dict(reversed(list(m.blobs.items())))),
        "extra-blob": lambda m: m.replace(blobs={**m.blobs, "pad": b"\x00"}),
        "extra-tensor": lambda m: m.replace(tensors={"pad": torch.zeros(1)}),
        "extra-meta": lambda m: m.replace(meta={**m.meta, "note": 1}),
        "meta-reordered": lambda m: m.replace(meta=dict(reversed(list(m.meta.items())))),
        "protocol-dropped": lambda m: m.replace(meta={"msg": m.meta["msg"]}),
        "msg-dropped": lambda m: m.replace(meta={"protocol": m.meta["protocol"]}),
        "old-protocol": lambda m: m.replace(meta={**m.meta, "protocol": "secvfl-channel-v1"}),
        "other-msg": lambda m: m.replace(meta={**m.meta, "msg": other}),
        "step": lambda m: m.replace(step=1),
        "sender": lambda m: m.replace(sender="shop"),
        "receiver": lambda m: m.replace(receiver="shop"),
        "kind": lambda m: m.replace(kind="control"),
    })
    return out


FIELD_CASES = [(flight, name, mutation) for flight, name in enumerate(_BLOBS) for mutation in _field_mutations(name)]


@pytest.mark.parametrize(("flight", "name", "mutation"), FIELD_CASES, ids=[f"{n}-{m}" for _, n, m in FIELD_CASES])
def test_every_handshake_field_modified_is_refused(flight: int, name: str, mutation: str) -> None:
    transport = AdversarialTransport()
    net, layer = build(transport, parties=["bank", "label"])
    before = layer._local["label"].sessions["bank"]
    change = _field_mutations(name)[mutation]
    refused_at = step_handshake(
        net, layer, transport, lambda i, data: encode(change(decode(data))) if i == flight else data)
    # A hello's nonce and ephemeral key carry no proof of origin; the reply's transcript covers them, so the
    # initiator refuses the reply. Every other field is refused by the party that receives it.
    in_transcript = name == "hello" and mutation in ("nonce-flipped", "ephemeral-flipped")
    assert refused_at == (flight + 1 if in_transcript else flight)
    assert layer._local["label"].sessions["bank"] is before  # the responder installed nothing
    assert transport.pending() == 0
    # nothing stuck: the next handshake completes and carries messages
    assert step_handshake(net, layer, transport) is None
    assert layer._local["label"].sessions["bank"] is not before
    sent = sample("bank", "label", fill=5.0)
    net.send(sent)
    assert same(net.receive("label", kind="embedding", sender="bank"), sent)


# Fixed inputs and the outputs computed from them (by the reference above; Ed25519 signatures are deterministic, so
# the handshake's bytes are fixed too). A change of the transcript or the key schedule changes these.
KAT = {
    "th": "2727d777909612dd9828c7b07328988ce4d2a7b086992ea2806c953e3ec14a9e",
    "i_to_r": "ab0d794ba7cd9dd632779f5ed16f295e1918a56f4644d4cb89ba52cd916546ca",
    "r_to_i": "c185e822e86252c87939cfbb91a7b1afefd716dd5296f127b0e56599e7b08618",
    "mac_r": "38a1923564ea959ea4f49eaf82915b7344b5c11271e25d3f60e78bfae66f1852",
    "mac_i": "250c5eb8873f37724001b10b58b08164cec5456209e6361994d34592abfcff28",
    "sid": "62fb634ca12a82d008154e97a190d556",
    "handshake_sha256": "d932e01aa520522e579d6280a992a85d415353f8a32395713ae297df61f987d7",
}


def _seeded(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()


def test_key_schedule_known_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = {p: IdentityKey(Ed25519PrivateKey.from_private_bytes(_seeded(f"identity {p}"))) for p in ("bank", "label")}
    ephemeral = [X25519PrivateKey.from_private_bytes(_seeded(f"ephemeral {p}")) for p in ("bank", "label")]
    nonces = [_seeded(f"nonce {p}") for p in ("bank", "label")]
    draws_e, draws_n = iter(ephemeral), iter(nonces)
    monkeypatch.setattr(channel_module, "_ephemeral_key", lambda: next(draws_e))
    monkeypatch.setattr(channel_module, "_fresh_nonce", lambda: next(draws_n))
    transport = AdversarialTransport()
    pins = PinnedKeys({p: k.public_key for p, k in ids.items()})
    layer = SecureChannelLayer({p: ChannelCredentials(k, pins) for p, k in ids.items()})
    net = Network(ROLES, transport=transport, layers=[layer])
    layer.establish(net)  # bank initiates (first name of the pair)

    flights = [d for _, _, k, d in transport.sent if k == HANDSHAKE_KIND]
    hello, reply, finish = (decode(d) for d in flights)
    e_i, e_r = raw_x25519(ephemeral[0]), raw_x25519(ephemeral[1])
    assert hello.blobs == {"round": bytes(8), "nonce": nonces[0], "ephemeral": e_i}
    assert (reply.blobs["nonce"], reply.blobs["ephemeral"]) == (nonces[1], e_r)
    th = ref_transcript_hash(0, "bank", "label", raw_ed25519(ids["bank"].public_key),
                             raw_ed25519(ids["label"].public_key), nonces[0], e_i, nonces[1], e_r)
    shared = ephemeral[0].exchange(X25519PublicKey.from_public_bytes(e_r))
    keys = ref_keys(shared, th)
    ids["label"].public_key.verify(reply.blobs["signature"], ref_signed("responder", th))
    ids["bank"].public_key.verify(finish.blobs["signature"], ref_signed("initiator", th))
    assert reply.blobs["mac"] == ref_mac(keys["mac_r"], "responder", th)
    assert finish.blobs["mac"] == ref_mac(keys["mac_i"], "initiator", th)
    got = {"th": th.hex(), **{k: v if isinstance(v, str) else v.hex() for k, v in keys.items()},
           "handshake_sha256": hashlib.sha256(b"".join(flights)).hexdigest()}
    assert got == KAT

    # The sessions use exactly these keys: each direction opens with the reference key, nonce and associated data.
    for sender, receiver, key in (("bank", "label", "i_to_r"), ("label", "bank", "r_to_i")):
        msg = sample(sender, receiver, fill=1.5)
        net.send(msg)
        env = decode(transport.inbox[receiver][-1][2])
        assert env.meta == {"sid": keys["sid"], "seq": 0, "ctr": 0}
        ad = ref_ad(keys["sid"], sender, receiver, "embedding", 0, 0)
        assert AESGCM(keys[key]).decrypt(ref_nonce(0), env.blobs["sealed"], ad) == encode(msg)
        assert same(net.receive(receiver, kind="embedding", sender=sender), msg)


def test_low_order_ephemeral_key_is_refused_without_a_state_change() -> None:
    transport = AdversarialTransport()
    net, layer = build(transport, parties=["bank", "label"])
    layer.listen("label", "bank")
    genuine = layer.hello("bank", "label")
    transport.put("bank", "label", HANDSHAKE_KIND, encode(genuine.replace(blobs={**genuine.blobs, "ephemeral": bytes(32)})))
    with pytest.raises(HandshakeError, match="invalid ephemeral key"):
        net.receive("label", kind=HANDSHAKE_KIND, sender="bank")
    net.send(genuine)
    net.receive("label", kind=HANDSHAKE_KIND, sender="bank")  # label still listens: the genuine hello goes through


# -- fuzzing: every kind of sealed message, and every handshake flight ------------------------------------------
class HypothesisDraw:
    """The mutations' choices, drawn through hypothesis (so failures shrink and replay)."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options):  # noqa: ANN001, ANN201
        return self.data.draw(st.sampled_from(options))


@contextlib.contextmanager
def _repeatable_randomness():
    """Ephemeral keys and nonces from a counter: an example's bytes, and so the mutations hypothesis draws for them
    (some depend on the bytes, e.g. which header letters to escape), repeat exactly when it replays the example."""
    count = itertools.count()
    saved = channel_module._ephemeral_key, channel_module._fresh_nonce
    channel_module._ephemeral_key = lambda: X25519PrivateKey.from_private_bytes(_seeded(f"fuzz {next(count)}"))
    channel_module._fresh_nonce = lambda: _seeded(f"fuzz nonce {next(count)}")
    try:
        yield
    finally:
        channel_module._ephemeral_key, channel_module._fresh_nonce = saved


@pytest.fixture(scope="module")
def fuzz_world() -> dict:
    """Real plaintext messages of every kind (captured from short real runs, as the decoder's fuzz does) and fixed
    identity keys for every name in them."""
    corpus = capture_corpus()
    plaintexts = {key: [decode(d) for d in found] for key, found in corpus.items()
                  if not key.endswith("[sealed]") and key != HANDSHAKE_KIND}
    names = sorted({p for msgs in plaintexts.values() for m in msgs for p in (m.sender, m.receiver)} | {"bank", "label"})
    ids = {p: IdentityKey(Ed25519PrivateKey.from_private_bytes(_seeded(f"fuzz identity {p}"))) for p in names}
    return {"plaintexts": plaintexts, "ids": ids, "pins": PinnedKeys({p: k.public_key for p, k in ids.items()})}


def _fresh_pair(world: dict, a: str, b: str) -> tuple[Network, SecureChannelLayer, AdversarialTransport]:
    """A new network in which ``a`` and ``b`` hold a new session: every byte of an example is the same whenever
    hypothesis runs it again (fixed identities, repeatable ephemeral keys and nonces, round 0)."""
    layer = SecureChannelLayer({p: ChannelCredentials(world["ids"][p], world["pins"]) for p in (a, b)})
    transport = AdversarialTransport()
    net = Network({p: Role.FEATURE for p in world["ids"]}, transport=transport, layers=[layer])
    layer.establish(net)
    return net, layer, transport


def _fuzz_sealed(world: dict, data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(world["plaintexts"])), label="kind")
    msg = data.draw(st.sampled_from(world["plaintexts"][key]), label="original")
    with _repeatable_randomness():
        net, _, transport = _fresh_pair(world, msg.sender, msg.receiver)
    net.send(msg)
    sender, kind, genuine = transport.inbox[msg.receiver].pop()
    mutated, _ = mutate(genuine, HypothesisDraw(data))
    if mutated != genuine:
        transport.put(sender, msg.receiver, kind, mutated)
        with pytest.raises((ChannelError, MessageError)):
            net.receive(msg.receiver, kind=kind, sender=sender)
    transport.put(sender, msg.receiver, kind, genuine)  # the refusal changed no state: the genuine one opens
    assert encode(net.receive(msg.receiver, kind=kind, sender=sender)) == encode(msg)


def _fuzz_handshake(world: dict, data: st.DataObject) -> None:
    flight = data.draw(st.integers(0, 2), label="flight")
    changed = []

    def tamper(i: int, raw: bytes) -> bytes:
        if i != flight:
            return raw
        mutated, _ = mutate(raw, HypothesisDraw(data))
        changed.append(mutated != raw)
        return mutated

    with _repeatable_randomness():
        net, layer, transport = _fresh_pair(world, "bank", "label")
        before = layer._local["label"].sessions["bank"]
        refused_at = step_handshake(net, layer, transport, tamper)
        if changed[0]:
            assert refused_at is not None and layer._local["label"].sessions["bank"] is before
            assert transport.pending() == 0
            assert step_handshake(net, layer, transport) is None  # the next handshake completes
        else:
            assert refused_at is None
    assert layer._local["label"].sessions["bank"] is not before


_FUZZ = dict(deadline=None, derandomize=True, database=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=300, **_FUZZ)
@given(data=st.data())
def test_modified_sealed_messages_of_every_kind_are_refused(fuzz_world: dict, data: st.DataObject) -> None:
    _fuzz_sealed(fuzz_world, data)


@settings(max_examples=300, **_FUZZ)
@given(data=st.data())
def test_modified_handshake_messages_never_complete_a_handshake(fuzz_world: dict, data: st.DataObject) -> None:
    _fuzz_handshake(fuzz_world, data)


@pytest.mark.slow
@settings(max_examples=10_000, **_FUZZ)
@given(data=st.data())
def test_ten_thousand_modified_sealed_messages_are_refused(fuzz_world: dict, data: st.DataObject) -> None:
    _fuzz_sealed(fuzz_world, data)


@pytest.mark.slow
@settings(max_examples=10_000, **_FUZZ)
@given(data=st.data())
def test_ten_thousand_modified_handshake_messages_never_complete_a_handshake(fuzz_world: dict,
                                                                              data: st.DataObject) -> None:
    _fuzz_handshake(fuzz_world, data)


# -- what the flags say about the keys -------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "expected"), [
    (["--secagg", "mask"], ["secvfl: warning: --secagg mask without --secure-channel: the parties' public keys for "
                            "the masks are not authenticated"]),
    (["--secagg", "mask", "--secure-channel"], ["secvfl: warning: --secure-channel without --channel-keys: every "
                                                "party's identity key was generated and pinned in this one process"]),
    (["--secure-channel", "--channel-keys", "{keys}"], ["secvfl: warning: --secure-channel with --channel-keys {keys}: "
                                                        "identity keys come from the key files in {keys}"]),
], ids=["mask-alone", "mask-with-channel", "channel-with-key-files"])
@pytest.mark.filterwarnings("default")  # the suite ignores these warnings elsewhere (pyproject.toml); here they count
def test_start_of_run_says_how_keys_are_authenticated(flags: list[str], expected: list[str], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from protocols.secure_plugins import generate_channel_keys
    from secvfl.cli.main import main

    keys = generate_channel_keys(tmp_path / "keys", ["label", "party0", "party1"])
    flags = [f.replace("{keys}", str(keys)) for f in flags]
    rc = main(["train", "--algo", "vafl", "--dataset", "wine", "--parties", "2", "--epochs", "1", "--no-progress",
               "--device", "cpu", *flags, "--out", str(tmp_path / "run")])
    assert rc == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("secvfl: warning:")]
    assert len(warned) == len(expected)  # one line each, nothing about masking once the channel is on
    for line, start in zip(warned, expected, strict=True):
        assert line.startswith(start.replace("{keys}", str(keys)))


def test_stack_position_is_checked() -> None:
    class Passthrough(Layer):
        name = "noop"

    channel = SecureChannelLayer({"label": ChannelCredentials(IDENTITIES["label"], PINS)})
    require_outermost([Passthrough(), channel])
    with pytest.raises(ConfigError, match=r"last \(outermost\).*\['noop'\]"):
        require_outermost([channel, Passthrough()])


# -- the adversary -----------------------------------------------------------------------------------------------
PAIRS = [(a, b) for a in PARTIES for b in PARTIES if a != b]

plans = st.lists(st.tuples(st.sampled_from(PAIRS), st.sampled_from(["embedding", "gradient", "control"])),
                 min_size=1, max_size=6)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 10**6)),
        st.tuples(st.just("truncate"), st.integers(0, 10**6), st.integers(0, 10**6)),
        st.tuples(st.just("swap"), st.integers(0, 10**6), st.integers(0, 10**6)),
        st.tuples(st.just("replay"), st.integers(0, 10**6), st.integers(0, 10**6)),
        st.tuples(st.just("move"), st.integers(0, 10**6), st.sampled_from(PARTIES)),
        st.tuples(st.just("resender"), st.integers(0, 10**6), st.sampled_from(PARTIES)),
        st.tuples(st.just("reflect"), st.integers(0, 10**6), st.just(0)),
    ),
    max_size=3,
)


def _attack(transport: AdversarialTransport, op: tuple) -> None:
    """Apply one corruption to the queued (receiver, sender, kind, bytes) items, as a network attacker could."""
    items = [(r, s, k, d) for r, box in transport.inbox.items() for (s, k, d) in box]
    if not items:
        return
    name, i, arg = op
    r, s, k, d = items[i % len(items)]
    box = transport.inbox[r]
    pos = next(j for j, e in enumerate(box) if e[2] is d)
    if not d:
        return
    if name == "flip":
        bit = arg % (8 * len(d))
        box[pos] = (s, k, d[: bit // 8] + bytes([d[bit // 8] ^ (1 << bit % 8)]) + d[bit // 8 + 1:])
    elif name == "truncate":
        box[pos] = (s, k, d[: arg % len(d)])
    elif name == "swap":
        j = arg % len(box)
        box[pos], box[j] = box[j], box[pos]
    elif name == "replay":
        box.insert(arg % (len(box) + 1), (s, k, d))
    elif name == "move":  # the same bytes into another party's inbox
        del box[pos]
        transport.inbox[arg].append((s, k, d))
    else:  # the header rewrites need bytes the attacker can still parse
        try:
            env = decode(d)
        except MessageError:
            return
        if name == "resender":  # rewrite the claimed sender (header and routing alike)
            box[pos] = (arg, k, encode(env.replace(sender=arg)))
        elif name == "reflect":  # send it back to its sender, addressed as if it came from the receiver
            del box[pos]
            transport.inbox[s].append((r, k, encode(env.replace(sender=r, receiver=s))))


def _streams(transport: AdversarialTransport) -> dict[tuple[str, str, str], list[bytes]]:
    out: dict[tuple[str, str, str], list[bytes]] = defaultdict(list)
    for r, box in transport.inbox.items():
        for s, k, d in box:
            out[(r, s, k)].append(d)
    return dict(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans, attack=ops)
def test_adversary_never_gets_a_corrupted_message_accepted(plan: list, attack: list) -> None:
    transport = AdversarialTransport()
    net, _ = build(transport)
    honest: dict[tuple[str, str, str], list[tuple[bytes, Message]]] = defaultdict(list)
    for step, ((s, r), kind) in enumerate(plan):
        msg = sample(s, r, kind, step=step, fill=float(step))
        net.send(msg)
        honest[(r, s, kind)].append((transport.inbox[r][-1][2], msg))
    before = _streams(transport)
    for op in attack:
        _attack(transport, op)
    changed = _streams(transport) != before

    accepted: dict[tuple[str, str, str], int] = defaultdict(int)
    rejections = 0

    def attempt(receiver: str, kind: str | None = None, sender: str | None = None) -> None:
        nonlocal rejections
        try:
            got = net.receive(receiver, kind=kind, sender=sender)
        except (ProtocolError, MessageError):
            rejections += 1
            return
        stream = (got.receiver, got.sender, got.kind)
        position = accepted[stream]
        # Whatever is accepted is the genuine next message of its stream, byte for byte.
        assert stream in honest and position < len(honest[stream])
        assert transport.last_taken == honest[stream][position][0]
        assert same(got, honest[stream][position][1])
        accepted[stream] += 1

    for (s, r), kind in plan:  # the receivers' program: take by kind and sender, as algorithms do
        attempt(r, kind, s)
    for r in PARTIES:  # then whatever is still queued, e.g. replayed or re-addressed copies
        while transport.pending(r):
            attempt(r)

    if not changed:
        assert rejections == 0 and all(accepted[k] == len(v) for k, v in honest.items())
    else:
        assert rejections > 0
