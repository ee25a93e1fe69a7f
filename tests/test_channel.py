"""Secure channel: identity keys on disk, signed handshake, and an adversary that flips, truncates, reorders,
replays, reflects and re-addresses sealed messages. Every corruption is rejected, every honest run accepted."""

from __future__ import annotations

import base64
import logging
import os
import pickle
import stat
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.base import Layer, Role
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
from secvfl.errors import ConfigError, MessageError, ProtocolError
from secvfl.messages import Message, decode, encode
from secvfl.transport import InProcessTransport, Network

PARTIES = ["label", "bank", "shop"]
ROLES = {"label": Role.LABEL, "bank": Role.FEATURE, "shop": Role.FEATURE}
IDENTITIES = {p: IdentityKey.generate() for p in PARTIES}
PINS = PinnedKeys({p: k.public_key for p, k in IDENTITIES.items()})


class AdversarialTransport(InProcessTransport):
    """An in-process transport whose inboxes an attacker (the test) can rewrite; remembers what it handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.last_taken: bytes | None = None

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
    assert kinds[HANDSHAKE_KIND] == 6  # 3 pairs, one hello each way
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
    with pytest.raises(HandshakeError, match="not signed by bank's pinned key"):
        layer.establish(net, [("bank", "label")])
    with pytest.raises(HandshakeError, match="no pinned identity key for bank"):
        layer.establish(net, [("shop", "bank")])
    with pytest.raises(ChannelError, match="no secure session"):
        net.send(sample("bank", "label"))
    with pytest.raises(ConfigError, match="not parties of this run"):
        Network(ROLES, layers=[SecureChannelLayer({"mallory": creds["label"]})])


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
