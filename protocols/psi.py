"""Private set intersection for entity alignment (``secvfl align``): which label-party ids each feature party holds.

Protocol: ECDH-PSI (Meadows 1986; Huberman, Franklin, Hogg 1999) between the label party L and each feature party F,
over the NIST P-256 group (prime order n, cofactor 1), with fresh secret scalars ``a`` (L, one per feature party)
and ``b`` (F)::

    round 1   L -> F : X([a] H(y)) for every y in Y, sorted      F -> L : X([b] H(x)) for every x in X, sorted
    round 2   L -> F : X([a] P) for every P F sent, same order    F -> L : X([b] P) for every P L sent, same order
    finish    L: y is shared  <=>  X([ab] H(y)) (from F, in L's order) is among X([ab] H(x)) (computed by L)
              F: x is shared  <=>  X([ab] H(x)) (from L, in F's order) is among X([ab] H(y)) (computed by F)

``H`` hashes an id to a curve point (try-and-increment: SHA-256 of a domain tag, a counter and the UTF-8 id gives an
x-coordinate; the first counter for which ``02 || x`` is a valid compressed point wins). ``X`` is the x-coordinate.

Why this is commutative with only ECDH from ``cryptography``: ``ECDH(k, P)`` returns ``X([k] P)``; lifting an
x-coordinate back to a point with prefix 02 gives ``+Q`` or ``-Q``, and ``X([k](-Q)) = X(-[k]Q) = X([k]Q)``, so
``X([b] lift(X([a] P))) = X([ab] P) = X([a] lift(X([b] P)))``. Working on x-coordinates identifies each point with
its negative; DDH on that quotient is as hard as DDH on P-256. OpenSSL validates every received point (it must be on
the curve; P-256 has no small subgroup), and a scalar in [1, n-1] never yields the point at infinity.

Security (semi-honest parties, DDH assumption on P-256, H modelled as a random oracle): F sees |Y| values
X([a] H(y)) that are pseudorandom to it for y outside X, plus the double-blinded values of its own ids, so F learns
its intersection with L and the size of Y, nothing else. Symmetrically L learns the intersection with each F and
the size of each X; it never learns an id outside its own set, and F never learns which other feature party holds
what. Every party's sets are sorted by blinded value before sending, which is a random permutation. Ids are
compared as exact UTF-8 strings (no Unicode normalisation, no trimming); duplicates are removed first (set
semantics). Not protected: a malicious party can probe ids it invents (inherent in any PSI that reveals the
intersection) or lie about its set; set sizes are revealed; hashing time varies slightly with the id (counter).

Cost per pair: |X| + |Y| hashes to the curve and 2 (|X| + |Y|) scalar multiplications split between the two
parties, 64 bytes of messages per id (32 per round). Everything goes through a :class:`Network` as messages of
kinds ``psi-points`` (round 1) and ``psi-reblinded`` (round 2), so bytes are counted and views can be recorded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec

from secvfl.errors import DataError, ProtocolError
from secvfl.messages import Message, register_kind
from secvfl.transport.layers import Role
from secvfl.transport.network import Network

__all__ = ["PsiParty", "Alignment", "align", "align_with_peers", "hash_to_curve", "POINTS_KIND", "REBLINDED_KIND"]

POINTS_KIND = register_kind("psi-points")  # round 1: own ids blinded with own scalar
REBLINDED_KIND = register_kind("psi-reblinded")  # round 2: the peer's points raised to own scalar, same order

_CURVE = ec.SECP256R1()
_POINT_BYTES = 32
_DOMAIN = b"secvfl-psi-v1/P-256/"
_MAX_TRIES = 256  # each try succeeds with probability ~1/2


def hash_to_curve(identifier: str) -> ec.EllipticCurvePublicKey:
    """Deterministic curve point for an id (try-and-increment on SHA-256; see the module docstring)."""
    data = identifier.encode("utf-8", errors="surrogatepass")
    for counter in range(_MAX_TRIES):
        x = hashlib.sha256(_DOMAIN + counter.to_bytes(2, "big") + data).digest()
        try:
            return ec.EllipticCurvePublicKey.from_encoded_point(_CURVE, b"\x02" + x)
        except ValueError:  # not an x-coordinate of the curve (or >= p): try the next counter
            continue
    raise ProtocolError("could not hash an id to P-256 in 256 tries (probability 2^-256)")  # pragma: no cover


def _lift(x: bytes, peer: str) -> ec.EllipticCurvePublicKey:
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(_CURVE, b"\x02" + x)
    except ValueError:
        raise ProtocolError(f"{peer} sent a value that is not a P-256 point; refusing the PSI run") from None


def _unique(ids: Iterable[str], party: str) -> list[str]:
    out: dict[str, None] = {}
    for i in ids:
        if not isinstance(i, str):
            raise DataError(f"{party}'s ids must be strings (as read from a file), got a {type(i).__name__}: "
                            "convert them with str() so that 1 and '1' cannot silently differ")
        out.setdefault(i, None)
    return list(out)


def _pack(points: Sequence[bytes]) -> bytes:
    return b"".join(points)


def _unpack(msg: Message, peer: str) -> list[bytes]:
    blob = msg.blobs.get("points", b"")
    count = msg.meta.get("count")
    if len(blob) % _POINT_BYTES or count != len(blob) // _POINT_BYTES:
        raise ProtocolError(f"{msg.kind} message from {peer} is malformed ({len(blob)} bytes, count {count})")
    return [blob[i : i + _POINT_BYTES] for i in range(0, len(blob), _POINT_BYTES)]


class PsiParty:
    """One party's side of ECDH-PSI: its own ids and one secret scalar per peer. Holds nothing of any other party."""

    def __init__(self, name: str, ids: Iterable[str]) -> None:
        self.name = name
        self.ids = _unique(ids, name)
        self._scalars: dict[str, ec.EllipticCurvePrivateKey] = {}
        self._order: dict[str, list[int]] = {}  # peer -> index into self.ids of each point sent, in sent order
        self._reblinded_peer: dict[str, set[bytes]] = {}
        self._hashed: list[ec.EllipticCurvePublicKey] | None = None
        self.learned: dict[str, list[str]] = {}  # peer -> own ids shared with that peer, in own input order

    def __repr__(self) -> str:
        return f"PsiParty({self.name!r}, {len(self.ids)} ids)"

    def _scalar(self, peer: str) -> ec.EllipticCurvePrivateKey:
        if peer not in self._scalars:
            self._scalars[peer] = ec.generate_private_key(_CURVE)  # uniform in [1, n-1], from OpenSSL's CSPRNG
        return self._scalars[peer]

    def points_for(self, peer: str, step: int = 0) -> Message:
        """Round 1: own ids blinded with the scalar for ``peer``, sorted (which hides the input order)."""
        if self._hashed is None:
            self._hashed = [hash_to_curve(i) for i in self.ids]
        k = self._scalar(peer)
        blinded = [k.exchange(ec.ECDH(), p) for p in self._hashed]
        order = sorted(range(len(blinded)), key=blinded.__getitem__)
        self._order[peer] = order
        return Message(POINTS_KIND, self.name, peer, step, blobs={"points": _pack([blinded[i] for i in order])},
                       meta={"count": len(order)})

    def reblind(self, msg: Message) -> Message:
        """Round 2: the peer's points raised to the scalar for that peer, in the order received."""
        peer = msg.sender
        if msg.kind != POINTS_KIND or msg.receiver != self.name:
            raise ProtocolError(f"{self.name} expected {POINTS_KIND} for itself, got {msg.kind} for {msg.receiver}")
        k = self._scalar(peer)
        out = [k.exchange(ec.ECDH(), _lift(x, peer)) for x in _unpack(msg, peer)]
        self._reblinded_peer[peer] = set(out)
        return Message(REBLINDED_KIND, self.name, peer, msg.step, blobs={"points": _pack(out)},
                       meta={"count": len(out)})

    def finish(self, msg: Message) -> list[str]:
        """Own ids shared with the peer: those whose double-blinded value is among the peer's double-blinded ids."""
        peer = msg.sender
        if peer not in self._order or peer not in self._reblinded_peer:
            raise ProtocolError(f"{self.name} got {peer}'s reblinded points before finishing rounds 1 and 2")
        mine = _unpack(msg, peer)
        order = self._order.pop(peer)
        if len(mine) != len(order):
            raise ProtocolError(f"{peer} returned {len(mine)} reblinded points for the {len(order)} sent")
        theirs = self._reblinded_peer.pop(peer)
        shared = sorted(order[j] for j, v in enumerate(mine) if v in theirs)
        self.learned[peer] = [self.ids[i] for i in shared]
        self._scalars.pop(peer, None)  # the scalar is not needed any more; a later run draws a fresh one
        return self.learned[peer]


@dataclass
class Alignment:
    """Result of aligning the parties' ids. ``holders`` is what the label party learns; ``learned[f]`` is all
    feature party ``f`` learns (its own ids that the label party also holds)."""

    label_party: str
    feature_parties: list[str]
    label_ids: list[str]  # the label party's distinct ids, in its input order
    holders: dict[str, list[str]]  # label id -> parties holding it (label party first, then feature parties)
    learned: dict[str, list[str]] = field(default_factory=dict)
    set_sizes: dict[str, int] = field(default_factory=dict)

    @property
    def parties(self) -> list[str]:
        return [self.label_party, *self.feature_parties]

    def pattern(self) -> np.ndarray:
        """Observed-block mask: ``bool[len(label_ids), len(parties)]``, True where the party holds the row."""
        cols = {p: j for j, p in enumerate(self.parties)}
        out = np.zeros((len(self.label_ids), len(cols)), dtype=bool)
        for i, ident in enumerate(self.label_ids):
            for p in self.holders[ident]:
                out[i, cols[p]] = True
        return out

    def counts(self) -> dict[str, Any]:
        pat = self.pattern()
        per_pattern: dict[str, int] = {}
        for row in pat:
            key = "+".join(p for p, held in zip(self.parties, row, strict=True) if held)
            per_pattern[key] = per_pattern.get(key, 0) + 1
        return {
            "label_ids": len(self.label_ids),
            "set_sizes": dict(self.set_sizes),
            "shared_with_label": {p: len(self.learned.get(p, [])) for p in self.feature_parties},
            "held_by_all": int(pat.all(axis=1).sum()) if len(pat) else 0,
            "held_by_label_only": int((~pat[:, 1:]).all(axis=1).sum()) if len(pat) else 0,
            "patterns": dict(sorted(per_pattern.items(), key=lambda kv: -kv[1])),
        }


def align(
    ids_by_party: Mapping[str, Iterable[str]],
    label_party: str,
    *,
    net: Network | None = None,
) -> Alignment:
    """Run ECDH-PSI between ``label_party`` and every other party, through ``net`` (built if not given).

    Embedded mode: every party runs in this process, as isolated :class:`PsiParty` objects that only exchange
    messages. Returns the label party's view (``holders``) and each feature party's own result (``learned``).
    """
    if label_party not in ids_by_party:
        raise DataError(f"label party {label_party!r} is not among the parties {sorted(ids_by_party)}")
    features = [p for p in ids_by_party if p != label_party]
    if not features:
        raise DataError("alignment needs at least one feature party besides the label party")
    parties = {p: PsiParty(p, ids) for p, ids in ids_by_party.items()}
    if net is None:
        net = Network({label_party: Role.LABEL, **{p: Role.FEATURE for p in features}})
    label = parties[label_party]
    for f in features:
        feat = parties[f]
        net.send(label.points_for(f))
        net.send(feat.points_for(label_party))
        net.send(feat.reblind(net.receive(f, kind=POINTS_KIND, sender=label_party)))
        net.send(label.reblind(net.receive(label_party, kind=POINTS_KIND, sender=f)))
        feat.finish(net.receive(f, kind=REBLINDED_KIND, sender=label_party))
        label.finish(net.receive(label_party, kind=REBLINDED_KIND, sender=f))
    shared = {f: set(label.learned[f]) for f in features}
    holders = {i: [label_party, *[f for f in features if i in shared[f]]] for i in label.ids}
    return Alignment(
        label_party=label_party,
        feature_parties=features,
        label_ids=list(label.ids),
        holders=holders,
        learned={f: list(parties[f].learned[label_party]) for f in features},
        set_sizes={p: len(parties[p].ids) for p in parties},
    )


def align_with_peers(net: Network, me: str, peers: Sequence[str], ids: Iterable[str]) -> dict[str, list[str]]:
    """Party ``me``'s side of ECDH-PSI with each of ``peers``, each of which runs its own side in its own process
    (secvfl.deploy): the same two rounds as :func:`align`, through ``net``. Returns, per peer, ``me``'s ids that the
    peer also holds, in ``me``'s input order. A feature party passes its one peer, the label party."""
    party = PsiParty(me, ids)
    for peer in peers:
        net.send(party.points_for(peer))
    for peer in peers:
        net.send(party.reblind(net.receive(me, kind=POINTS_KIND, sender=peer)))
    for peer in peers:
        party.finish(net.receive(me, kind=REBLINDED_KIND, sender=peer))
    return {peer: party.learned[peer] for peer in peers}
