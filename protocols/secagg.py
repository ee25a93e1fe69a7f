"""Masked secure aggregation (``--secagg mask``): the receiver learns the exact sum of the feature parties' tensors
and nothing else about any single party's tensor.

Protocol (pairwise additive masking, after Bonawitz et al. 2017, without the secret-sharing recovery round)::

    key agreement, once per pair and epoch       every party sends an X25519 public key to every other party
                                                 (``secagg-key`` messages, counted by the transport); each pair
                                                 derives a 32-byte pair seed with HKDF-SHA256 (fresh keys every
                                                 epoch, see ``start_epoch``; keys are never checkpointed)
    per round r (one call of ``aggregate``)      party i sends  y_i = enc(x_i) + sum_{j>i} PRG(s_ij, r)
                                                                              - sum_{j<i} PRG(s_ij, r)   (mod 2^64)
                                                 (``masked`` messages: int64 tensors)
    aggregator (or the receiver itself)          sum_i y_i = sum_i enc(x_i)   (mod 2^64): the masks cancel exactly
    receiver                                     decodes the sum (and divides by the count for a mean)

``enc`` is signed fixed point with ``frac_bits`` fractional bits in the ring Z / 2^64: ``enc(x) = round(x * 2^f)``.
With ``n`` parties every value must satisfy ``|x| <= 2^(62 - f) / n``; then the true sum of the encodings is at most
``2^62 + n/2`` in magnitude, far inside the signed range ``[-2^63, 2^63)``, so its two's-complement reading is exact. With the default
``f = 24`` and 4 parties the limit is 2^36 / 4, about 1.7e10. Values beyond it (or NaN/inf) are refused with a
:class:`~secvfl.errors.ProtocolError` before anything is sent. The decoded sum differs from the float sum by at most
``n * 2^-(f+1)`` per element (rounding of each encoding) plus the final cast to the input dtype.

PRG: AES-256-CTR keyed with the pair seed, counter block ``r (8 bytes) || 0 (8 bytes)``, so every round's masks are
fresh and keystreams of different rounds never overlap. Round numbers are handed out by the aggregation and never
reused, also after a failed round; each party additionally refuses a round number that is not larger than the last
one it masked (mask reuse would leak the difference of two inputs).

Threat model: semi-honest (honest-but-curious) parties and aggregator, no collusion between the aggregator (or the
receiver) and a feature party. Each masked vector alone is uniformly distributed in Z / 2^64 whatever the input
(AES-CTR is a PRF; each party has at least one peer). A coalition of the receiver with all but one party learns the
remaining party's input from the sum -- that is what a sum reveals.

The parties' public keys for the pairwise masks are authenticated ONLY when the secure channel is on
(``--secure-channel``: :class:`protocols.channel.SecureChannelLayer` seals the ``secagg-key`` messages in sessions
authenticated with pinned identity keys); this module does not authenticate them. Without the channel, whoever can
modify traffic (a relay, a proxy, the transport, an aggregator that forwards messages) can replace a party's keys with
its own, learn every pair seed of that party, strip its masks and read its individual input: the guarantee above
then holds only against a passive network. ``secvfl train --secagg mask`` without ``--secure-channel`` warns
(:class:`UnauthenticatedKeysWarning`). With ``--secure-channel`` but no ``--channel-keys``, the identity keys
themselves were generated and pinned in the one process of the run: authentication within a simulation, not between
organisations.

Who sees what: with a party of role :attr:`~secvfl.transport.layers.Role.AGGREGATOR` in the topology, the masked vectors go
there and only their (still encoded) sum goes to the receiver; otherwise the receiver adds the masked vectors itself.
Either way no party sees an unmasked tensor of another party.

Dropouts: a party that does not deliver an acceptable key or masked vector (nothing arrives, the bytes do not
decode, a layer refuses them, or the share is not the round's int64 tensors) makes the round fail as a whole: the
messages the others delivered are discarded, the round number is burnt, nothing reaches the receiver and no key
state changes. :meth:`MaskedAggregation.aggregate` then retries the round without the dropped party (masks are drawn
only between the remaining parties, under a fresh round number), so the receiver gets the exact sum of the parties
that delivered and training goes on; ``describe()`` lists every drop (``dropped``, ``retried_rounds``) and the first
one is logged. With fewer than 2 parties left it stops with :class:`PartyDroppedError`: a "sum" of one party's tensor
is that tensor. There is no recovery of a dropped party's masks (that would need Shamir shares of the pair seeds); a
retry is cheaper at VFL's party counts.

Layers: masked vectors travel as messages of kind ``masked`` (and ``masked-sum``), so layers that act on the
algorithm's float kinds (``embedding``, ``logits``) leave them alone, and an outermost secure channel seals them.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from protocols.base import FLOAT_DTYPES, SecureSumAggregation, refuse_unsummable
from secvfl.device import to_host
from secvfl.errors import MessageError, ProtocolError, SecvflWarning, UnsupportedError
from secvfl.messages import WIRE_DTYPES, Message, register_kind
from secvfl.transport.layers import AlgorithmTraits, Role, Topology

if TYPE_CHECKING:
    from secvfl.transport.network import Network

__all__ = [
    "MaskedAggregation",
    "PartyDroppedError",
    "UnauthenticatedKeysWarning",
    "FixedPoint",
    "KEY_KIND",
    "MASKED_KIND",
    "SUM_KIND",
]

KEY_KIND = register_kind("secagg-key")  # party -> party: X25519 public key for the pair seed
MASKED_KIND = register_kind("masked")  # party -> aggregator/receiver: fixed-point tensor + pairwise masks
SUM_KIND = register_kind("masked-sum")  # aggregator -> receiver: the sum of the masked tensors (masks cancelled)

_PROTOCOL = b"secvfl-secagg-v1"

log = logging.getLogger(__name__)

# drop_hook(party, phase, round) -> True: the party does not deliver in that phase ("keys" or "masked").
DropHook = Callable[[str, str, int], bool]


class UnauthenticatedKeysWarning(SecvflWarning):
    """Masking runs without the secure channel: the parties' public keys are not authenticated (module docstring)."""


class PartyDroppedError(ProtocolError):
    """A party did not deliver during a masked-aggregation round (``phase`` "keys" or "masked"); the round can be
    retried without :attr:`parties`."""

    def __init__(self, message: str, parties: Sequence[str], round_number: int, phase: str = "masked") -> None:
        super().__init__(message)
        self.parties = tuple(parties)
        self.round_number = round_number
        self.phase = phase


@dataclass(frozen=True)
class FixedPoint:
    """Signed fixed point in Z / 2^64 with ``frac_bits`` fractional bits."""

    frac_bits: int = 24

    def __post_init__(self) -> None:
        if not 0 <= self.frac_bits <= 52:
            raise UnsupportedError(f"frac_bits must be in 0..52 (float64 precision), got {self.frac_bits}")

    @property
    def scale(self) -> float:
        return float(2**self.frac_bits)

    def max_abs(self, n_parties: int) -> float:
        """Largest ``|x|`` a party may contribute so that a sum over ``n_parties`` cannot wrap around."""
        return 2.0 ** (62 - self.frac_bits) / max(1, n_parties)

    def error_bound(self, n_parties: int) -> float:
        """Largest absolute difference between the decoded sum and the exact sum (before the output cast)."""
        return n_parties * 2.0 ** -(self.frac_bits + 1)

    def encode(self, x: torch.Tensor, n_parties: int, what: str) -> np.ndarray:
        """``round(x * 2^f)`` as uint64 (two's complement); refuses values that could overflow the sum."""
        v = to_host([x.detach()])[0].to(torch.float64).numpy().reshape(-1)  # from a GPU through pinned memory
        limit = self.max_abs(n_parties)
        refuse_unsummable(
            v, limit, what, "masked aggregation",
            f"the fixed-point limit {limit:.4g} for {n_parties} parties with {self.frac_bits} fractional bits "
            "(|x| <= 2^(62-f)/n); lower frac_bits or scale the values down",
        )
        return np.rint(v * self.scale).astype(np.int64).view(np.uint64)

    def decode(self, total: np.ndarray) -> np.ndarray:
        """float64 values of a uint64 sum read as two's complement."""
        return total.view(np.int64).astype(np.float64) / self.scale


def _keystream(seed: bytes, round_number: int, n_words: int) -> np.ndarray:
    """``n_words`` pseudorandom uint64 words from AES-256-CTR(seed) starting at counter block ``round || 0``."""
    if n_words == 0:
        return np.zeros(0, dtype=np.uint64)
    global _ZEROS
    if len(_ZEROS) < 8 * n_words:
        _ZEROS = bytes(8 * n_words)
    counter_block = struct.pack(">QQ", round_number, 0)
    enc = Cipher(algorithms.AES(seed), modes.CTR(counter_block)).encryptor()
    return np.frombuffer(enc.update(memoryview(_ZEROS)[: 8 * n_words]), dtype=np.uint64)


_ZEROS = b""  # shared all-zero plaintext for the keystream (public, read-only)


def _pair_info(a: str, b: str, pub_a: bytes, pub_b: bytes) -> bytes:
    lo, hi = sorted([(a, pub_a), (b, pub_b)])
    return _PROTOCOL + b"|pair|" + json.dumps([lo[0], hi[0], lo[1].hex(), hi[1].hex()]).encode()


_WIRE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


class _MaskingParty:
    """One party's secret masking state: its X25519 key and its pair seeds. Never shown in repr or errors."""

    __slots__ = ("name", "_private", "public", "_seeds", "last_round")

    def __init__(self, name: str) -> None:
        self.name = name
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self._seeds: dict[str, bytes] = {}
        self.last_round = -1

    def __repr__(self) -> str:
        return f"_MaskingParty({self.name!r}, peers={sorted(self._seeds)})"

    def has_seed(self, peer: str) -> bool:
        return peer in self._seeds

    def derive_seed(self, peer: str, peer_public: bytes) -> bytes:
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:
            raise ProtocolError(f"{self.name} received an invalid secagg public key from {peer}") from None
        info = _pair_info(self.name, peer, self.public, peer_public)
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)

    def commit_seed(self, peer: str, seed: bytes) -> None:
        self._seeds[peer] = seed

    def mask(self, encoded: np.ndarray, peers: Sequence[str], round_number: int) -> np.ndarray:
        """Add the pairwise masks (+ towards larger names, - towards smaller ones) to an encoded vector."""
        if round_number <= self.last_round:
            raise ProtocolError(
                f"{self.name} refuses to mask round {round_number}: it already masked round {self.last_round} "
                "and reusing a round's masks would reveal the difference of two inputs"
            )
        out = encoded.copy()
        for peer in peers:
            if peer == self.name:
                continue
            stream = _keystream(self._seeds[peer], round_number, out.size)
            if self.name < peer:
                out += stream
            else:
                out -= stream
        self.last_round = round_number
        return out


@dataclass
class MaskedAggregation(SecureSumAggregation):
    """Sum or mean of the parties' tensors through pairwise additive masks (see the module docstring).

    ``drop_hook(party, phase, round)`` models a party that stops responding: returning True makes ``party`` not
    deliver in that phase (``"keys"`` or ``"masked"``) of that round. Used in tests and fault-injection runs.
    A round a party drops out of is retried without it (module docstring, "Dropouts"); :attr:`dropped` lists
    ``{"step", "round", "party", "phase"}`` per drop and :attr:`retried_rounds` counts the retries.
    """

    name: ClassVar[str] = "mask"
    dense_inputs: ClassVar[str] = "masks"
    flag: ClassVar[str] = "--secagg mask"
    subject: ClassVar[str] = "masked aggregation"
    one_party_sum: ClassVar[str] = "one party's sum is its own tensor"
    frac_bits: int = 24
    drop_hook: DropHook | None = field(default=None, repr=False)
    topology: Topology | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.codec = FixedPoint(self.frac_bits)
        self._parties: dict[str, _MaskingParty] = {}
        self._next_round = 0
        self.rounds_completed = 0
        self.rounds_failed = 0
        self.retried_rounds = 0
        self.dropped: list[dict[str, Any]] = []

    # -- contract ------------------------------------------------------------------------------------------
    def _refusal(self, traits: AlgorithmTraits) -> str:
        return (
            f"masked aggregation only delivers sums or means of the parties' outputs, but {traits.name!r} "
            f"aggregates by {traits.aggregation!r}; use an algorithm that sums or averages (e.g. vafl, fdml) "
            "or drop --secagg"
        )

    def _layout(self, message: Message) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(name, tuple(t.shape), t.dtype) for name, t in message.tensors.items()]

    def _check_layout(self, layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        for name, _, dtype in layout:
            if dtype not in FLOAT_DTYPES:
                raise ProtocolError(f"masked aggregation adds floating-point tensors; {name!r} is {dtype}")

    def describe(self) -> dict[str, Any]:
        return {
            "aggregation": self.name,
            "ring": "Z/2^64",
            "frac_bits": self.frac_bits,
            "max_abs_per_party": "2^(62-frac_bits)/n_parties",
            "error_bound_per_element": "n_parties * 2^-(frac_bits+1)",
            "prg": "AES-256-CTR",
            "key_agreement": "X25519 + HKDF-SHA256",
            "rounds_completed": self.rounds_completed,
            "rounds_failed": self.rounds_failed,
            "retried_rounds": self.retried_rounds,
            "dropped": [dict(d) for d in self.dropped],
        }

    # -- epochs and checkpoints ----------------------------------------------------------------------------
    def start_epoch(self, net: Network, epoch: int) -> None:
        # Fresh X25519 keys and pair seeds every epoch: a process restarted from a checkpoint cannot have the old
        # ones (they are never written out: with them and the rounds replayed after the checkpoint, the same masks
        # would hide two different inputs), so an uninterrupted run renews them at the same points and sends the
        # same key messages as a resumed one.
        self._parties.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"next_round": self._next_round, "rounds_completed": self.rounds_completed,
                "rounds_failed": self.rounds_failed, "retried_rounds": self.retried_rounds,
                "dropped": [dict(d) for d in self.dropped]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Round numbers go on from the checkpoint (they are public and never reused; the keys are new anyway).
        self._next_round = int(state.get("next_round", 0))
        self.rounds_completed = int(state.get("rounds_completed", 0))
        self.rounds_failed = int(state.get("rounds_failed", 0))
        self.retried_rounds = int(state.get("retried_rounds", 0))
        self.dropped = [dict(d) for d in state.get("dropped", [])]

    # -- helpers -------------------------------------------------------------------------------------------
    def _state(self, party: str) -> _MaskingParty:
        if party not in self._parties:
            self._parties[party] = _MaskingParty(party)
        return self._parties[party]

    def _drops(self, party: str, phase: str, round_number: int) -> bool:
        return self.drop_hook is not None and bool(self.drop_hook(party, phase, round_number))

    def _route(self, net: Network, receiver: str) -> str:
        aggregators = net.topology.parties(Role.AGGREGATOR)
        if len(aggregators) > 1:
            raise UnsupportedError(f"masked aggregation uses one aggregator, the topology has {aggregators}")
        return aggregators[0] if aggregators else receiver

    @staticmethod
    def _take(net: Network, receiver: str, kind: str, sender: str) -> Message | None:
        """The next matching message, or None when the sender delivered nothing acceptable (a dropped party).

        Nothing waiting, bytes that are not a message, and a message a layer refused (e.g. the secure channel
        detected tampering) all count as not delivered, so the round fails as a whole instead of half-way.
        """
        try:
            return net.receive(receiver, kind=kind, sender=sender)
        except (MessageError, ProtocolError):
            return None

    def _agree_keys(self, net: Network, senders: list[str], round_number: int) -> None:
        """Give every pair of ``senders`` a seed; all-or-nothing (a drop leaves no new seed behind)."""
        missing = sorted(
            {a for a in senders for b in senders if a != b and not self._state(a).has_seed(b)}
        )
        if not missing:
            return
        needs = {a: [b for b in senders if b != a and not self._state(a).has_seed(b)] for a in missing}
        for a in missing:  # a sends its public key to every peer it still lacks a seed with
            if self._drops(a, "keys", round_number):
                continue
            for b in needs[a]:
                net.send(Message(KEY_KIND, a, b, 0, blobs={"public_key": self._state(a).public},
                                 meta={"protocol": _PROTOCOL.decode()}))
        pending: dict[tuple[str, str], bytes] = {}
        absent: set[str] = set()
        for a in missing:
            for b in needs[a]:
                msg = self._take(net, b, KEY_KIND, a)
                if msg is None:
                    absent.add(a)
                    continue
                pending[(b, a)] = self._state(b).derive_seed(a, bytes(msg.blobs.get("public_key", b"")))
        if absent:
            self.rounds_failed += 1
            raise PartyDroppedError(
                f"masked aggregation round {round_number} failed: {', '.join(sorted(absent))} did not deliver "
                "an acceptable key; nothing was aggregated, retry without the dropped party",
                sorted(absent), round_number, phase="keys",
            )
        for (owner, peer), seed in pending.items():
            self._state(owner).commit_seed(peer, seed)

    # -- the round -----------------------------------------------------------------------------------------
    def aggregate(self, net: Network, messages: Sequence[Message], receiver: str, op: str) -> Message:
        """The sum (or mean) of ``messages``' tensors at ``receiver``, over the parties that delivered.

        A round a party drops out of is retried without it, under a fresh round number, until every remaining
        party delivers; the result's ``meta["dropped"]`` names the parties left out. Fewer than 2 remaining parties
        stop the aggregation with :class:`PartyDroppedError`.
        """
        messages = list(messages)
        step = messages[0].step if messages else 0
        left_out: list[str] = []
        while True:
            try:
                out = self._round(net, messages, receiver, op)
            except PartyDroppedError as exc:
                self._record_drop(exc, step)
                messages = [m for m in messages if m.sender not in exc.parties]
                left_out += exc.parties
                if len(messages) < 2:
                    remaining = ", ".join(m.sender for m in messages) or "none"
                    raise PartyDroppedError(
                        f"masked aggregation at step {step} cannot go on: {', '.join(sorted(left_out))} dropped out "
                        f"and {len(messages)} party is left ({remaining}); a sum over one party would reveal its "
                        "tensor to the receiver, so it stops here (restart when at least 2 feature parties respond)",
                        sorted(left_out), exc.round_number, exc.phase,
                    ) from None
                self.retried_rounds += 1
                continue
            if left_out:
                out = out.replace(meta={**out.meta, "dropped": sorted(left_out)}, wire_size=out.wire_size)
            return out

    def _record_drop(self, exc: PartyDroppedError, step: int) -> None:
        first = not self.dropped
        self.dropped += [{"step": step, "round": exc.round_number, "party": p, "phase": exc.phase}
                         for p in exc.parties]
        if first:  # once per run: a flaky party would otherwise flood the log; every drop is in describe()
            log.warning(
                "masked aggregation: %s did not deliver its %s in round %d (step %d); the round is retried without "
                "it (later drops are listed under secagg.dropped in summary.json)",
                ", ".join(exc.parties), "key" if exc.phase == "keys" else "masked tensor", exc.round_number, step,
            )

    def _round(self, net: Network, messages: Sequence[Message], receiver: str, op: str) -> Message:
        """One masking round over exactly ``messages``' senders; :class:`PartyDroppedError` if one does not deliver."""
        messages = list(messages)
        senders, layout = self._check_round(net, messages, receiver, op)
        first = messages[0]
        route = self._route(net, receiver)
        if route in senders or receiver in senders:
            raise ProtocolError(f"the aggregator {route!r} / receiver {receiver!r} cannot also be a contributor")
        n = len(messages)
        # Every party encodes first, so a value out of range is refused before anything is sent.
        encoded = [
            np.concatenate([self.codec.encode(t, n, f"{m.sender}'s tensor {name!r}") for name, t in m.tensors.items()])
            if layout else np.zeros(0, dtype=np.uint64)
            for m in messages
        ]

        round_number = self._next_round
        self._next_round += 1  # burnt even if the round fails: masks are never reused
        self._agree_keys(net, senders, round_number)

        meta = self._share_meta(round_number, senders, first.kind, layout)
        for m, enc in zip(messages, encoded, strict=True):  # each party masks on its own
            masked = self._state(m.sender).mask(enc, senders, round_number)
            if self._drops(m.sender, "masked", round_number):
                continue
            net.send(Message(MASKED_KIND, m.sender, route, m.step, _split(masked, layout), meta=meta))

        received: list[Message] = []
        absent = []
        for s in senders:  # the aggregator collects; stale messages of earlier rounds are discarded
            while True:
                got = self._take(net, route, MASKED_KIND, s)
                if got is None or not _is_stale(got, round_number):
                    break
            if got is None or not _is_share_of(got, meta, layout):
                absent.append(s)
            else:
                received.append(got)
        if absent:
            self.rounds_failed += 1
            raise PartyDroppedError(
                f"masked aggregation round {round_number} failed: {', '.join(absent)} did not deliver an acceptable "
                f"masked tensor; the {len(received)} delivered tensor(s) were discarded and nothing reached {receiver}; "
                "retry without the dropped party",
                absent, round_number,
            )
        return self._finish(net, received, layout, first, receiver, route, round_number, op)

    def _share_meta(self, round_number: int, senders: Sequence[str], kind: str,
                    layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
        # the dtypes let a receiver in another process decode the sum to what the parties sent
        return {"round": round_number, "frac_bits": self.frac_bits, "parties": sorted(senders), "of": kind,
                "dtypes": [_WIRE_NAMES[dtype] for _, _, dtype in layout]}

    def _finish(self, net: Network, received: list[Message], layout: list[tuple[str, tuple[int, ...], torch.dtype]],
                first: Message, receiver: str, route: str, round_number: int, op: str) -> Message:
        """The aggregator's sum of the masked shares, passed on to ``receiver`` if that is another party, decoded."""
        n = len(received)
        total = _wire_sum(received, layout)
        wire = sum(g.wire_size or 0 for g in received)
        if route != receiver:
            net.send(Message(SUM_KIND, route, receiver, first.step, _split(total, layout),
                             meta={"round": round_number, "frac_bits": self.frac_bits, "parties": n}))
            summed = net.receive(receiver, kind=SUM_KIND, sender=route)
            wire = summed.wire_size or 0
            total = _wire_sum([summed], layout)
        values = self.codec.decode(total)
        if op == "mean":
            values = values / n
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape, dtype in layout:
            size = int(np.prod(shape, dtype=np.int64))
            out[name] = torch.from_numpy(values[offset : offset + size].reshape(shape)).to(dtype)
            offset += size
        self.rounds_completed += 1
        return self._result(first, receiver, out, op, n, wire, round=round_number)

    # -- parties in separate processes (secvfl.deploy) ------------------------------------------------------
    # Each process runs its own party's half of a round: a sender agrees its pair seeds with the other senders
    # (its public key to each, theirs from each: the same key messages as in one process), masks and sends; the
    # receiver collects the shares and decodes their sum. Round numbers advance in step in every process (every
    # party takes part in every round). A party that does not deliver stops the run (the transport names it and
    # every party resumes from the last checkpoint): rounds are not retried without it across processes.
    across_processes: ClassVar[bool] = True

    def send_share(self, net: Network, message: Message, senders: Sequence[str]) -> None:
        senders = list(senders)
        if message.sender not in senders or len(senders) < 2:
            raise UnsupportedError(f"{self.subject} needs at least 2 parties, {message.sender} among them (got "
                                   f"{senders}): {self.one_party_sum}")
        layout = self._layout(message)
        self._check_layout(layout)
        encoded = (np.concatenate([self.codec.encode(t, len(senders), f"{message.sender}'s tensor {name!r}")
                                   for name, t in message.tensors.items()])
                   if layout else np.zeros(0, dtype=np.uint64))
        round_number = self._next_round
        self._next_round += 1
        me = self._state(message.sender)
        peers = [b for b in senders if b != message.sender and not me.has_seed(b)]
        for b in peers:
            net.send(Message(KEY_KIND, message.sender, b, 0, blobs={"public_key": me.public},
                             meta={"protocol": _PROTOCOL.decode()}))
        for b in peers:
            got = net.receive(message.sender, kind=KEY_KIND, sender=b)
            me.commit_seed(b, me.derive_seed(b, bytes(got.blobs.get("public_key", b""))))
        route = self._route(net, message.receiver)
        masked = me.mask(encoded, senders, round_number)
        net.send(Message(MASKED_KIND, message.sender, route, message.step, _split(masked, layout),
                         meta=self._share_meta(round_number, senders, message.kind, layout)))

    def collect(self, net: Network, receiver: str, kind: str, senders: Sequence[str], op: str) -> Message:
        senders = list(senders)
        everyone = sorted(self.topology.feature_parties) if self.topology is not None else []
        if sorted(senders) != everyone:
            raise UnsupportedError(f"{self.subject} across processes sums every feature party's input; this round "
                                   f"has {sorted(senders)} of {everyone} (partial participation needs one process)")
        if op not in ("sum", "mean"):
            raise UnsupportedError(f"aggregation op must be 'sum' or 'mean', got {op!r}")
        route = self._route(net, receiver)
        if route != receiver:
            raise UnsupportedError(f"{self.subject} across processes delivers to its receiver directly")
        round_number = self._next_round
        self._next_round += 1
        received = [net.receive(route, kind=MASKED_KIND, sender=s) for s in senders]
        first = received[0]
        dtypes = first.meta.get("dtypes") if isinstance(first.meta, Mapping) else None
        if not isinstance(dtypes, list) or len(dtypes) != len(first.tensors):
            raise ProtocolError(f"a masked share from {first.sender} does not name its tensors' dtypes")
        unknown = [d for d in dtypes if d not in WIRE_DTYPES]
        if unknown:
            raise ProtocolError(f"a masked share from {first.sender} names unknown dtypes {unknown}")
        layout = [(name, tuple(t.shape), WIRE_DTYPES[d]) for (name, t), d in zip(first.tensors.items(), dtypes,
                                                                                 strict=True)]
        self._check_layout(layout)
        meta = self._share_meta(round_number, senders, kind, layout)
        for got in received:
            if not _is_share_of(got, meta, layout) or got.meta.get("of") != kind:
                raise ProtocolError(f"{got.sender}'s masked share is not round {round_number}'s {kind} share "
                                    "(round, parties, names or shapes differ)")
        template = Message(kind, first.sender, receiver, first.step)
        return self._finish(net, received, layout, template, receiver, route, round_number, op)


def _is_stale(got: Message, round_number: int) -> bool:
    """A share of an earlier round (left over from a failed one): skipped, not held against its sender."""
    r = got.meta.get("round") if isinstance(got.meta, Mapping) else None
    return type(r) is int and r < round_number


def _is_share_of(got: Message, meta: dict[str, Any], layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> bool:
    """Whether a decoded ``masked`` message is this round's share: same round and parties, int64 tensors of the
    agreed names and shapes. Anything else counts as not delivered, so one bad share fails the round cleanly."""
    if not isinstance(got.meta, Mapping):
        return False
    if type(got.meta.get("round")) is not int or got.meta["round"] != meta["round"]:
        return False
    if got.meta.get("parties") != meta["parties"] or list(got.tensors) != [name for name, _, _ in layout]:
        return False
    return all(got.tensors[name].dtype == torch.int64 and tuple(got.tensors[name].shape) == shape
               for name, shape, _ in layout)


def _split(words: np.ndarray, layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Cut one uint64 vector into int64 tensors with the message's names and shapes."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    signed = words.view(np.int64)
    for name, shape, _ in layout:
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = torch.from_numpy(signed[offset : offset + size].copy()).reshape(shape)
        offset += size
    return out


def _wire_sum(received: Sequence[Message], layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> np.ndarray:
    """Sum mod 2^64 of the int64 tensors of ``received`` as one flat uint64 vector."""
    total: np.ndarray | None = None
    for m in received:
        parts = []
        for name, shape, _ in layout:
            t = m.tensor(name)
            if t.dtype != torch.int64 or tuple(t.shape) != shape:
                raise ProtocolError(f"{m.kind} message from {m.sender}: tensor {name!r} is not int64 of shape {shape}")
            parts.append(t.numpy().reshape(-1).view(np.uint64))
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)
        total = flat.copy() if total is None else total + flat  # uint64 addition wraps: arithmetic mod 2^64
    assert total is not None
    return total
