"""CKKS-encrypted sum/mean aggregation (``--he ckks``, TenSEAL): the label party learns the sum of the feature
parties' outputs and nothing else about any single party's output.

Protocol (one call of :meth:`CKKSAggregation.aggregate`)::

    once per federation    label party   creates the CKKS context and keeps the secret key; sends
                                         feature parties a public context (public key only: no secret, relin or
                                         Galois keys)                                      (``ckks-context``)
                                         and the aggregator the bare parameters (no keys at all)
    every call             feature party packs its tensors (batch x dim floats, flattened, all tensors of the
                                         message one after another) into ciphertexts of N/2 complex slots, two
                                         floats per slot (real and imaginary part), encrypts them at the wire
                                         level (below) and sends the serialised ciphertexts to the aggregator
                                                                                          (``ciphertext``)
                           aggregator    deserialises and adds the ciphertexts slot-wise, sends only the sum to
                                         the label party                                  (``ciphertext-sum``)
                           label party   decrypts the sum, unpacks the original names, shapes and dtypes and
                                         divides by the number of parties for a mean

The gradient w.r.t. the aggregate travels back to every feature party in plaintext, as without encryption (the
algorithm sends it; for a mean it is scaled by ``1/K`` like the aggregate itself).

Who learns what (semi-honest parties, and an honest aggregator: see below):

* label party: the secret key and the decrypted *sum over at least two parties*, which the head needs anyway.
  It never receives an individual party's ciphertext: ciphertexts go to the aggregator, a sum over one party is
  refused, and so is a set of subset sums in one step from which a single party's output could be solved for
  (relevant for subset means such as LASER-VFL's).
* Honest aggregator (assumed, not enforced): the aggregator adds every ciphertext of the round and forwards only
  that sum. Nothing binds the ciphertext the label party decrypts to the parties that contributed: the "at least two
  parties" and subset-sum checks above apply to the set of senders a round starts with, and the aggregator's reply
  is checked only against its own report of what it added (``meta`` ``count`` and ``parties``, which catches a
  faulty aggregator, not a lying one). An aggregator that forwards one party's ciphertext (or a difference of two)
  under a correct-looking report makes the label party decrypt that party's output with no error -- the same
  exposure as the collusion excluded below. Signed ciphertext digests would not close this: the label party cannot
  recompute a sum from digests without the individual ciphertexts, which it must never receive. A check on the
  ciphertexts before decryption would, e.g. a linearly homomorphic MAC (each party sends the label party
  ``<r, c_i> mod q`` for a key ``r`` the aggregator never sees; the label party checks ``<r, sum> = sum of tags``
  before decrypting); it is not implemented (SEAL's Python bindings expose ciphertext coefficients only through
  their compressed serialisation). Where no aggregator can be trusted to follow the protocol, use
  ``--secagg mask``: in ``secvfl train`` the label party adds the masked outputs itself, and the masks cancel only
  in the sum of every party's output (a single masked output is uniformly random).
* aggregator: the CKKS parameters (its context carries no key: it can neither encrypt nor decrypt), every party's
  ciphertexts (IND-CPA under RLWE at 128-bit security), which parties contribute, the shapes, and timing.
* feature parties: the public key; nothing new about other parties beyond the plaintext gradient they get anyway.
* Non-collusion: the aggregator and the label party are assumed not to collude; together they decrypt every
  individual ciphertext (plaintext VFL). A feature party colluding with the label party learns the sum of the
  other parties' outputs -- with two feature parties, the other party's output. Decrypted sums must stay with the
  label party: CKKS decryptions leak noise, and a holder of both a ciphertext and its exact decryption can attack
  the key (Li & Micciancio, EUROCRYPT 2021).
* Integrity: CKKS ciphertexts are malleable and carry no authentication. Malformed, truncated or foreign
  ciphertexts (other parameters, wrong length, scale or level) are refused with a :class:`ProtocolError`; a
  well-formed ciphertext under the right public key but with wrong contents cannot be detected here -- run under
  an authenticated channel (``protocols.channel``) against active attackers.

Parameters (:class:`CKKSParams`): N = 8192, coefficient primes [60, 40, 40, 60] bits, scale 2^40 by default; a
ciphertext holds N/2 = 4096 complex slots, so 8192 floats. Keys are generated for the whole modulus, but
aggregation only adds, so ciphertexts are encrypted, sent, added and decrypted at the *wire level*: under the first ``wire_primes`` primes
only (the 60-bit prime for the defaults; :mod:`protocols.ckks_cipher` explains why this is as secure and what it
saves), with two floats per complex slot: a ciphertext is 4x the float32 bytes it carries, and a step costs a party
fewer bytes and less time than with TenSEAL's real-only vectors at the first data level (BENCHMARKS.md, "Secure
computation"). Parameters are checked against the HomomorphicEncryption.org standard's 128-bit table (total
coefficient-modulus bits per N) and for precision: a decrypted sum over ``K`` parties is within
``K * error_bound_per_party`` of the exact sum (a high-probability bound on encryption and modulus-switch noise, Kim
et al.; measured errors stay well below it: BENCHMARKS.md, "Secure aggregation: CKKS and masking", "Precision"), before the cast to the input dtype.
Values must stay below ``max_abs_sum / K`` per party so the sum cannot wrap around the wire modulus (2^18 for the
defaults); larger (or non-finite) values are refused before anything is encrypted.

Encryption is randomised by design (SEAL draws from the OS), so decrypted sums are reproducible only up to the
error bound, not bit for bit. SEAL's bindings hold the GIL while encrypting (measured: two threads are slower than one),
so parties that share a process encrypt one after another unless ``workers > 0`` starts encryption processes
(fresh interpreters holding only public contexts; floats in, ciphertext bytes out). The training process keeps an
equal share of the parties and encrypts it while the workers encrypt the rest: on 2 cores, ``workers=1`` keeps both
busy. Parties on their own hosts encrypt in parallel anyway.

Layers: ciphertexts travel as messages of kinds ``ckks-context``, ``ciphertext`` and ``ciphertext-sum``, so layers
acting on the algorithm's float kinds (``embedding``, ``logits``) leave them alone and an outermost secure channel
seals them. A layer that should change the values before aggregation (e.g. noise) must act before ``aggregate``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import tenseal as ts
import torch

from protocols.base import FLOAT_DTYPES, SecureSumAggregation, refuse_unsummable
from protocols.ckks_cipher import CiphertextError, CKKSCipher
from protocols.ckks_worker import read_frame, write_frame
from secvfl.device import to_host
from secvfl.errors import ConfigError, ProtocolError, UnsupportedError
from secvfl.messages import WIRE_DTYPES, Message, register_kind
from secvfl.options import Options, option
from secvfl.plugins import ProtocolPlugin, ProtocolSetup
from secvfl.transport.layers import AlgorithmTraits, Role, Topology

if TYPE_CHECKING:
    from secvfl.algorithms.base import RunContext
    from secvfl.config import TrainConfig
    from secvfl.transport.network import Network

__all__ = [
    "CKKSAggregation",
    "CKKSPlugin",
    "CKKSParams",
    "CKKSParameterWarning",
    "HE_STANDARD_MAX_BITS",
    "PRESETS",
    "CONTEXT_KIND",
    "CIPHERTEXT_KIND",
    "SUM_KIND",
    "pack",
]

CONTEXT_KIND = register_kind("ckks-context")  # label party -> feature parties / aggregator: public context
CIPHERTEXT_KIND = register_kind("ciphertext")  # feature party -> aggregator: serialised CKKS vectors
SUM_KIND = register_kind("ciphertext-sum")  # aggregator -> label party: the slot-wise sum of the ciphertexts

# Largest total coefficient-modulus bit count for 128-bit classical security with a ternary secret
# (HomomorphicEncryption.org security standard, Nov 2018, Table 1; SEAL's CoeffModulus.MaxBitCount agrees).
HE_STANDARD_MAX_BITS: dict[int, int] = {1024: 27, 2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881}

_SIGMA = 3.2  # SEAL's standard deviation of the error distribution
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
_MIN_HEADROOM_BITS = 10  # integer bits a sum needs at least (|sum| < 2^8 with the margin below)
_COMFORT_SUM = 2.0**16  # sums a ciphertext on the wire should carry without a warning
_PRECISION_WARNING = 1e-4  # absolute error per party above which the parameters are flagged


class CKKSParameterWarning(UserWarning):
    """Valid CKKS parameters with a practical drawback (low precision, little headroom)."""


@dataclass(frozen=True)
class CKKSParams:
    """CKKS parameters: ring degree N, coefficient-modulus prime sizes (the last one is the special prime used only
    for key switching), and the encoding scale 2^scale_bits. Invalid combinations raise :class:`ConfigError`."""

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 60)
    scale_bits: int = 40

    def __post_init__(self) -> None:
        try:
            bits = tuple(int(b) for b in self.coeff_mod_bit_sizes)
        except (TypeError, ValueError):
            raise ConfigError(f"CKKS coefficient prime sizes must be integers, got {self.coeff_mod_bit_sizes!r}") from None
        object.__setattr__(self, "coeff_mod_bit_sizes", bits)
        problems = self.problems()
        if problems:
            raise ConfigError(f"invalid CKKS parameters {self.spec()}:\n  " + "\n  ".join(problems))
        if self.error_bound_per_party > _PRECISION_WARNING:
            warnings.warn(
                f"CKKS parameters {self.spec()}: a decrypted sum may be off by up to {self.error_bound_per_party:.1e} "
                f"per party; raise the scale (scale bits > {self.scale_bits}) for better precision",
                CKKSParameterWarning, stacklevel=3,
            )
        if self.max_abs_sum < 2.0**16:
            warnings.warn(
                f"CKKS parameters {self.spec()}: sums must stay below {self.max_abs_sum:.4g} in magnitude; add a data "
                "prime or lower the scale for more headroom",
                CKKSParameterWarning, stacklevel=3,
            )

    # -- derived quantities ---------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """CKKS slots of one ciphertext (complex numbers)."""
        return self.poly_modulus_degree // 2

    @property
    def floats_per_ciphertext(self) -> int:
        """Floats one ciphertext carries: two per slot, as the real and imaginary part."""
        return 2 * self.slots

    @property
    def total_bits(self) -> int:
        return sum(self.coeff_mod_bit_sizes)

    @property
    def data_bits(self) -> int:
        """Bits of the modulus at the first data level (every prime but the special one)."""
        return sum(self.coeff_mod_bit_sizes[:-1])

    @property
    def wire_primes(self) -> int:
        """Data primes a ciphertext keeps when it is encrypted and sent: the fewest (from the first) whose product
        holds sums up to 2^16 at this scale, else all of them. Aggregation only adds, so the primes a
        multiplication would consume are dropped before encryption (see :mod:`protocols.ckks_cipher`); one 60-bit
        prime for the defaults."""
        data = self.coeff_mod_bit_sizes[:-1]
        for j in range(1, len(data) + 1):
            if 2.0 ** (sum(data[:j]) - self.scale_bits - 2) >= _COMFORT_SUM:
                return j
        return len(data)

    @property
    def wire_bits(self) -> int:
        """Bits of the modulus ciphertexts are sent and added under."""
        return sum(self.coeff_mod_bit_sizes[: self.wire_primes])

    @property
    def max_abs_sum(self) -> float:
        """Largest ``|sum|`` that decrypts correctly (value * scale must stay well inside the wire modulus)."""
        return 2.0 ** (self.wire_bits - self.scale_bits - 2)

    @property
    def error_bound_per_party(self) -> float:
        """High-probability bound on the absolute decryption error one fresh ciphertext adds to each slot.

        Canonical-embedding bound on fresh public-key encryption noise, 8*sqrt(2)*sigma*N + 6*sigma*sqrt(N) +
        16*sigma*sqrt(h*N) with a ternary secret of Hamming weight h ~ 2N/3 (Kim, Papadimas, Song; HEAAN), plus N
        for encoding rounding, plus the rounding a modulus switch adds, sqrt(N/3) * (3 + 8*sqrt(h)) (the
        encryption lands below the key level by one; the fresh noise itself shrinks by the dropped prime, but the
        bound keeps it whole), divided by the scale. Errors add up over the parties of a sum.
        """
        n = self.poly_modulus_degree
        h = 2 * n / 3
        noise = 8 * math.sqrt(2) * _SIGMA * n + 6 * _SIGMA * math.sqrt(n) + 16 * _SIGMA * math.sqrt(h * n)
        switch = math.sqrt(n / 3) * (3 + 8 * math.sqrt(h))
        return (noise + switch + n) / 2.0**self.scale_bits

    def error_bound(self, n_parties: int) -> float:
        """Bound on ``|decrypted sum - exact sum|`` per element for a sum over ``n_parties`` (before the dtype cast)."""
        return n_parties * self.error_bound_per_party

    # -- validation -----------------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        n, bits, s = self.poly_modulus_degree, self.coeff_mod_bit_sizes, self.scale_bits
        out: list[str] = []
        if n not in HE_STANDARD_MAX_BITS:
            out.append(f"poly modulus degree N={n} is not supported; use one of {sorted(HE_STANDARD_MAX_BITS)}")
            return out
        if len(bits) < 2:
            out.append(
                f"{len(bits)} coefficient prime(s) given; CKKS needs at least one data prime and the special prime "
                "(the last one, used for key switching), e.g. 60,40,40,60"
            )
        if any(not 2 <= b <= 60 for b in bits):
            out.append(f"coefficient primes must have 2..60 bits (SEAL's limit), got {list(bits)}")
        max_bits = HE_STANDARD_MAX_BITS[n]
        if self.total_bits > max_bits:
            bigger = [m for m in HE_STANDARD_MAX_BITS if HE_STANDARD_MAX_BITS[m] >= self.total_bits]
            hint = f" or use N={bigger[0]}" if bigger else ""
            out.append(
                f"the coefficient modulus has {self.total_bits} bits, above the {max_bits}-bit maximum for 128-bit "
                f"security at N={n} (HomomorphicEncryption.org standard); use fewer or smaller primes{hint}"
            )
        if not 1 <= s < 60:
            out.append(f"scale bits must be in 1..59, got {s}")
        elif len(bits) >= 2 and self.data_bits - s < _MIN_HEADROOM_BITS:
            out.append(
                f"scale 2^{s} leaves {self.data_bits - s} bits for the integer part of a sum in the {self.data_bits}-bit "
                f"data modulus (need at least {_MIN_HEADROOM_BITS}); lower the scale or add a data prime"
            )
        if not out:
            out += _seal_prime_problems(n, bits)
        return out

    # -- (de)serialisation ----------------------------------------------------------------------------------
    def spec(self) -> str:
        """The ``--ckks-params`` string of these parameters: ``N:b1,b2,...:scale_bits``."""
        return f"{self.poly_modulus_degree}:{','.join(map(str, self.coeff_mod_bit_sizes))}:{self.scale_bits}"

    @classmethod
    def parse(cls, spec: str | None) -> CKKSParams:
        """Parameters from ``--ckks-params``: a preset name (``default``, ``compact``, ``small``) or ``N:b1,b2,...:scale_bits``,
        e.g. ``8192:60,40,40,60:40``."""
        if spec is None or not spec.strip():
            return cls()
        spec = spec.strip()
        if spec in PRESETS:
            return PRESETS[spec]
        m = re.fullmatch(r"(\d+)\s*:\s*(\d+(?:\s*,\s*\d+)*)\s*:\s*(\d+)", spec)
        if m is None:
            raise ConfigError(
                f"cannot read --ckks-params {spec!r}; write N:PRIME_BITS:SCALE_BITS (e.g. 8192:60,40,40,60:40) "
                f"or a preset ({', '.join(sorted(PRESETS))})"
            )
        return cls(int(m.group(1)), tuple(int(b) for b in m.group(2).split(",")), int(m.group(3)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "poly_modulus_degree": self.poly_modulus_degree,
            "coeff_mod_bit_sizes": list(self.coeff_mod_bit_sizes),
            "scale_bits": self.scale_bits,
        }

    def describe(self) -> dict[str, Any]:
        bits = self.coeff_mod_bit_sizes
        middle = bits[1:-1]  # between the first data prime and the special prime
        out = {
            **self.to_dict(),
            "spec": self.spec(),
            "slots_per_ciphertext": self.slots,
            "floats_per_ciphertext": self.floats_per_ciphertext,
            "coeff_modulus_bits": self.total_bits,
            "max_coeff_modulus_bits_128": HE_STANDARD_MAX_BITS[self.poly_modulus_degree],
            "wire_primes": list(bits[: self.wire_primes]),
            "wire_note": "ciphertexts are encrypted and sent under these primes only: addition needs no more",
            "security": "128-bit classical, HomomorphicEncryption.org standard (ternary secret)",
            "abs_error_bound_per_party": self.error_bound_per_party,
            "max_abs_sum": self.max_abs_sum,
        }
        if any(b != self.scale_bits for b in middle):
            out["note"] = (
                f"middle primes {list(middle)} differ from the scale 2^{self.scale_bits}: harmless for aggregation "
                "(no rescaling), but such parameters lose precision under multiplication"
            )
        return out




def _seal_prime_problems(n: int, bits: Sequence[int]) -> list[str]:
    """Ask SEAL whether primes of these sizes exist for N (cheap; no keys are generated)."""
    try:
        from tenseal import sealapi
    except ImportError:  # pragma: no cover - TenSEAL builds without the SEAL bindings; keygen reports it later
        return []
    try:
        sealapi.CoeffModulus.Create(n, list(bits))
    except (RuntimeError, ValueError) as exc:
        return [f"SEAL cannot find distinct primes of {list(bits)} bits with p = 1 mod 2N for N={n} ({exc}); use larger primes"]
    return []


PRESETS: dict[str, CKKSParams] = {
    # The default: TenSEAL's usual parameters; leaves room for two multiplications we do not use.
    "default": CKKSParams(8192, (60, 40, 40, 60), 40),
    # Addition only needs one data prime. Ciphertexts are the default's (both are sent under the 60-bit prime);
    # the public context is half the size and key generation cheaper.
    "compact": CKKSParams(8192, (60, 60), 40),
    # Half the ring: N = 4096 allows 109 bits at 128-bit security, the same 60-bit wire prime plus a 49-bit special
    # prime. A ciphertext carries 4096 floats in half the bytes (about 66 kB instead of 131 kB), so a step whose
    # message has at most 4096 floats (vafl's default batch of 64 x 16) costs each party half the bytes and
    # encryption time; for larger messages the bytes per float are the default's (4x float32) within 4 %. Same sum
    # headroom (2^18), half the error bound (the noise grows with N).
    "small": CKKSParams(4096, (60, 49), 40),
}


# -- packing and the per-party crypto steps --------------------------------------------------------------------

Layout = list[tuple[str, str, tuple[int, ...]]]  # (tensor name, wire dtype name, shape)


def _layout_of(message: Message) -> Layout:
    out = []
    for name, t in message.tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise ProtocolError(
                f"CKKS aggregation adds real numbers; {message.sender}'s tensor {name!r} has dtype {t.dtype}"
            )
        out.append((name, _DTYPE_NAMES[t.dtype], tuple(int(s) for s in t.shape)))
    return out


def _layout_from_meta(raw: Any, who: str) -> Layout:
    try:
        layout = [(str(n), str(d), tuple(int(s) for s in shape)) for n, d, shape in raw]
    except (TypeError, ValueError):
        raise ProtocolError(f"{who} sent a ciphertext message with an unreadable layout: {raw!r}") from None
    for name, dname, shape in layout:
        if dname not in WIRE_DTYPES or WIRE_DTYPES[dname] not in FLOAT_DTYPES or any(s < 0 for s in shape):
            raise ProtocolError(f"{who} sent a ciphertext message with a bad tensor entry {name!r}: {dname} {shape}")
    return layout


def _numel(layout: Layout) -> int:
    return sum(math.prod(shape) for _, _, shape in layout)


def _chunk_sizes(total: int, size: int) -> list[int]:
    return [min(size, total - start) for start in range(0, total, size)]


def _flatten(tensors: Mapping[str, torch.Tensor]) -> np.ndarray:
    # GPU tensors come to pinned host memory with one wait for all (secvfl.device.to_host), then go to float64
    parts = [t.detach().reshape(-1).to(torch.float64) for t in to_host(list(tensors.values()))]
    if not parts:
        return np.zeros(0, dtype=np.float64)
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).numpy()


def _chunks(flat: np.ndarray, size: int) -> list[np.ndarray]:
    return [flat[start : start + size] for start in range(0, flat.size, size)]


def pack(tensors: Mapping[str, torch.Tensor], size: int) -> list[np.ndarray]:
    """All tensors, flattened one after another (float64), cut into chunks of at most ``size`` floats (one per
    ciphertext: ``CKKSParams.floats_per_ciphertext``)."""
    return _chunks(_flatten(tensors), size)


# -- optional worker processes for the feature parties' encryption ---------------------------------------------

def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the worker returns
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


class _EncryptionWorkers:
    """Processes that encrypt and serialise on behalf of feature parties.

    TenSEAL holds the GIL while encrypting, so threads cannot run parties in parallel; processes can. Each worker
    is a fresh interpreter (not a fork: it holds nothing of the parent's memory, in particular no secret key) that
    serves fixed parties and holds only their public contexts. Floats go in and ciphertexts come out as raw bytes in
    length-prefixed frames over pipes. One request per worker is in flight at a time, so pipes cannot deadlock.
    """

    def __init__(self, n: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # The worker imports only protocols.ckks_worker (numpy, TenSEAL), not torch: it starts in a fraction of the time.
        cmd = [sys.executable, "-c", "from protocols.ckks_worker import main; main()"]
        try:
            self._procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
                           for _ in range(n)]
        except OSError as exc:
            raise ConfigError(f"cannot start CKKS encryption worker processes ({exc}); use workers=0") from None
        self._assigned: dict[str, int] = {}  # party -> worker index; len(procs) = the training process itself
        self._finalizer = weakref.finalize(self, _stop, self._procs)

    def _request(self, worker: int, header: dict[str, Any], payload: bytes = b"") -> None:
        proc = self._procs[worker]
        try:
            write_frame(proc.stdin, header, payload)
        except (OSError, ValueError) as exc:
            raise ProtocolError(f"CKKS encryption worker {worker} is gone ({exc}, exit code {proc.poll()})") from None

    def _reply(self, worker: int) -> tuple[dict[str, Any], bytes]:
        proc = self._procs[worker]
        try:
            header, payload = read_frame(proc.stdout)
        except (EOFError, OSError, ValueError) as exc:
            raise ProtocolError(f"CKKS encryption worker {worker} stopped answering ({exc}, exit code {proc.poll()})") from None
        if "error" in header:
            raise ProtocolError(f"CKKS encryption worker {worker} failed: {header['error']}")
        return header, payload

    def install(self, party: str, context: bytes, params: CKKSParams) -> None:
        """Deal ``party`` round-robin over the workers and the training process itself (the last slot): the
        process encrypts its parties while the workers encrypt theirs, an equal share each."""
        if party in self._assigned:
            return
        slot = len(self._assigned) % (len(self._procs) + 1)
        self._assigned[party] = slot
        if slot < len(self._procs):
            header = {"op": "context", "party": party, "wire_primes": params.wire_primes,
                      "scale": 2.0**params.scale_bits}
            self._request(slot, header, context)
            self._reply(slot)

    def serves(self, party: str) -> bool:
        return self._assigned.get(party, len(self._procs)) < len(self._procs)

    def submit(self, jobs: Sequence[tuple[str, np.ndarray]]) -> tuple[dict[int, list[int]], int]:
        """Send each ``(party, float64 values)`` job to its worker; :meth:`collect` returns the ciphertexts."""
        by_worker: dict[int, list[int]] = {}
        for i, (party, _) in enumerate(jobs):
            if not self.serves(party):
                raise ProtocolError(f"{party} has no CKKS context in an encryption worker")
            by_worker.setdefault(self._assigned[party], []).append(i)
        for worker, idx in by_worker.items():
            header = {"op": "encrypt", "jobs": [[jobs[i][0], int(jobs[i][1].size)] for i in idx]}
            self._request(worker, header, b"".join(np.ascontiguousarray(jobs[i][1], dtype="<f8").tobytes() for i in idx))
        return by_worker, len(jobs)

    def collect(self, pending: tuple[dict[int, list[int]], int]) -> list[list[bytes]]:
        by_worker, n = pending
        out: list[list[bytes]] = [[] for _ in range(n)]
        replies, failure = {}, None
        for worker in by_worker:  # read every reply, even after a failure, so no stale frame stays in a pipe
            try:
                replies[worker] = self._reply(worker)
            except ProtocolError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        for worker, idx in by_worker.items():
            header, payload = replies[worker]
            view, offset = memoryview(payload), 0
            for i, sizes in zip(idx, header["sizes"], strict=True):
                for size in sizes:
                    out[i].append(bytes(view[offset : offset + size]))
                    offset += size
        return out

    def close(self) -> None:
        self._finalizer()


@dataclass
class _Release:
    """What the label party has received in one step, to refuse sums that would expose a single party."""

    step: int
    subsets: list[frozenset[str]]


class CKKSAggregation(SecureSumAggregation):
    """Sum or mean of the feature parties' tensors under CKKS encryption (see the module docstring).

    Key material is kept per party (``party name -> TenSEAL context``): only the label party's context holds the
    secret key. ``bind`` starts a new federation (fresh keys on the next ``aggregate``).
    """

    name: ClassVar[str] = "ckks"
    dense_inputs: ClassVar[str] = "CKKS-encrypts"
    flag: ClassVar[str] = "--he ckks"
    subject: ClassVar[str] = "CKKS aggregation"
    one_party_sum: ClassVar[str] = "a sum over one party is its own output"

    def __init__(self, params: CKKSParams | str | None = None, aggregator: str = "aggregator", workers: int = 0) -> None:
        self.params = params if isinstance(params, CKKSParams) else CKKSParams.parse(params)
        self.aggregator_name = aggregator
        if not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"CKKS encryption workers must be a non-negative integer, got {workers!r}")
        self.workers = workers
        self._workers: _EncryptionWorkers | None = None
        self.topology: Topology | None = None
        self._contexts: dict[str, ts.Context] = {}
        self._handed_out: set[str] = set()
        self._ciphers: dict[str, CKKSCipher] = {}
        self._released: dict[tuple[Any, ...], _Release] = {}
        self.sums_delivered = 0
        self.ciphertexts_added = 0
        self.params_choice: str | None = None  # how --ckks-params chose them (summary.json)

    # -- contract ------------------------------------------------------------------------------------------
    def _refusal(self, traits: AlgorithmTraits) -> str:
        if traits.aggregation == "concat":
            return (
                f"CKKS needs sum or mean aggregation; algorithm {traits.name!r} concatenates embeddings — use vafl "
                "or fdml (they sum or average), or drop --he ckks (--he none)"
            )
        return (
            f"CKKS needs sum or mean aggregation; algorithm {traits.name!r} combines no party outputs "
            f"(aggregation {traits.aggregation!r}) — drop --he ckks"
        )

    def extra_roles(self) -> dict[str, Role]:
        """The party this aggregation adds to a run's topology (see ``secvfl.runner.build_run``)."""
        return {self.aggregator_name: Role.AGGREGATOR}

    def bind(self, topology: Topology) -> None:
        label = topology.label_party  # raises unless there is exactly one
        aggregators = topology.parties(Role.AGGREGATOR)
        if not aggregators:
            raise UnsupportedError(
                "CKKS aggregation needs an aggregator party (role 'aggregator') that holds no secret key: feature "
                f"parties send it their ciphertexts and only the sum reaches the label party {label!r}, which must "
                "never receive an individual party's ciphertext; add an aggregator party, or use --secagg mask "
                "(works without one) or --he none"
            )
        if len(aggregators) > 1:
            raise UnsupportedError(f"CKKS aggregation uses exactly one aggregator party, the topology has {aggregators}")
        if len(topology.feature_parties) < 2:
            raise UnsupportedError(
                f"CKKS aggregation needs at least 2 feature parties, the topology has {topology.feature_parties}: "
                "the sum over one party is that party's own output"
            )
        self.topology = topology
        self._contexts = {}
        self._handed_out = set()
        self._ciphers = {}
        self._released = {}
        self.close()

    def close(self) -> None:
        """Stop the encryption worker processes, if any (they are also stopped when this object is collected)."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"aggregation": self.name, "library": f"tenseal {ts.__version__}", **self.params.describe()}
        if self.topology is not None:
            out["key_holder"] = self.topology.label_party
            out["aggregator"] = self.topology.parties(Role.AGGREGATOR)[0]
        out.update(
            {
                "feature_parties_hold": "public key",
                "aggregator_holds": "parameters only (no keys)",
                "trust": ("semi-honest; an honest aggregator (it forwards only the sum of every ciphertext, which "
                          "is not checked); the aggregator and the label party do not collude"),
                "encryption_workers": self.workers,
                **({"params_choice": self.params_choice} if self.params_choice else {}),
                "sums_delivered": self.sums_delivered,
                # the label party in its own process does not see the aggregator's additions
                "ciphertexts_added": self.ciphertexts_added if not self._handed_out else "in the aggregator's process",
            }
        )
        return out

    # -- key material ----------------------------------------------------------------------------------------
    def context_of(self, party: str) -> ts.Context:
        """The TenSEAL context ``party`` holds (for audits and tests: which keys does it have?)."""
        try:
            return self._contexts[party]
        except KeyError:
            raise ProtocolError(f"{party} holds no CKKS context yet (contexts are handed out on the first sum)") from None

    def cipher_of(self, party: str) -> CKKSCipher:
        """The CKKS operations ``party`` can perform with the keys it holds (see :class:`CKKSCipher`)."""
        cipher = self._ciphers.get(party)
        if cipher is None:
            cipher = self._ciphers[party] = CKKSCipher(self.context_of(party), self.params.wire_primes,
                                                       2.0**self.params.scale_bits)
        return cipher

    def _key_holder(self) -> str:
        if self.topology is None:
            raise ProtocolError("CKKS aggregation is not bound to a network; build the Network with it first")
        return self.topology.label_party

    def _keygen(self, label: str) -> ts.Context:
        p = self.params
        try:
            ctx = ts.context(ts.SCHEME_TYPE.CKKS, p.poly_modulus_degree, coeff_mod_bit_sizes=list(p.coeff_mod_bit_sizes),
                             n_threads=1)
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(f"TenSEAL refused the CKKS parameters {p.spec()}: {exc}") from None
        ctx.global_scale = 2.0**p.scale_bits
        self._contexts[label] = ctx
        return ctx

    def _distribute(self, net: Network, parties: Sequence[str], step: int) -> None:
        """The label party hands each party that lacks one the context it needs (and nothing more)."""
        label = self._key_holder()
        ctx = self._contexts.get(label) or self._keygen(label)
        missing = [p for p in parties if p not in self._contexts]
        if not missing:
            return
        aggregator = self.topology.parties(Role.AGGREGATOR)[0]  # type: ignore[union-attr]
        # Least privilege: feature parties get the public key (to encrypt), the aggregator only the parameters (to
        # read and add ciphertexts). Nobody gets relinearisation or Galois keys: addition needs neither.
        public = ctx.serialize(save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False)
        bare = ctx.serialize(save_public_key=False, save_secret_key=False, save_galois_keys=False, save_relin_keys=False)
        meta = {"params": self.params.to_dict()}
        # step 0: key material belongs to no training step (and a label party in another process sends it before it
        # knows the round's step, see collect)
        net.send(*[Message(CONTEXT_KIND, label, p, 0, blobs={"context": bare if p == aggregator else public}, meta=meta)
                   for p in missing])
        for p in missing:
            msg = net.receive(p, kind=CONTEXT_KIND, sender=label)
            self._install(p, msg, needs_public_key=p != aggregator)
            if p != aggregator and self.workers > 0:
                if self._workers is None:
                    self._workers = _EncryptionWorkers(self.workers)
                self._workers.install(p, bytes(msg.blobs["context"]), self.params)

    def _install(self, party: str, msg: Message, needs_public_key: bool) -> None:
        """``party`` loads the context it received, after checking it is what it should be."""
        try:
            ctx = ts.context_from(bytes(msg.blobs["context"]), n_threads=1)
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise ProtocolError(f"{party} could not read the CKKS context sent by {msg.sender}: {exc}") from None
        if ctx.has_secret_key() or not ctx.is_public():
            raise ProtocolError(
                f"{party} received a CKKS context carrying a secret key from {msg.sender}; refusing it: only the "
                "label party may hold the secret key"
            )
        if needs_public_key and not ctx.has_public_key():
            raise ProtocolError(f"{party} received a CKKS context without a public key from {msg.sender}; it cannot encrypt")
        # A party checks the security of what it is asked to encrypt under; it does not trust the key holder's word.
        try:
            key_data = ctx.seal_context().data.key_context_data()
            n, bits = key_data.parms().poly_modulus_degree(), key_data.total_coeff_modulus_bit_count()
        except (AttributeError, RuntimeError):  # pragma: no cover - TenSEAL without the introspection bindings
            n, bits = self.params.poly_modulus_degree, self.params.total_bits
        if n != self.params.poly_modulus_degree or bits > HE_STANDARD_MAX_BITS.get(n, 0):
            raise ProtocolError(
                f"{party} refuses the CKKS context from {msg.sender}: N={n} with a {bits}-bit modulus is not the agreed "
                f"{self.params.spec()} or is below 128-bit security"
            )
        self._contexts[party] = ctx

    # -- the steps each role performs ------------------------------------------------------------------------
    def _plaintext(self, message: Message, parties: Sequence[str]) -> tuple[Layout, np.ndarray]:
        """The feature party's checks before encryption: float tensors, finite, small enough not to wrap around."""
        layout = _layout_of(message)
        flat = _flatten(message.tensors)
        limit = self.params.max_abs_sum / len(parties)
        refuse_unsummable(
            flat, limit, f"{message.sender}'s {message.kind}", "CKKS",
            f"{limit:.4g}, the most a sum over {len(parties)} parties can carry at CKKS parameters "
            f"{self.params.spec()}; lower the scale or add a data prime (--ckks-params)",
        )
        return layout, flat

    @staticmethod
    def _ciphertext_message(message: Message, layout: Layout, blobs: Sequence[bytes], to: str,
                            parties: Sequence[str]) -> Message:
        meta = {"of": message.kind, "layout": [[n, d, list(s)] for n, d, s in layout], "parties": sorted(parties)}
        return Message(CIPHERTEXT_KIND, message.sender, to, message.step,
                       blobs={f"c{i}": b for i, b in enumerate(blobs)}, meta=meta)

    def encrypt_message(self, message: Message, to: str, parties: Sequence[str]) -> Message:
        """The feature party ``message.sender`` encrypts its tensors for a sum over ``parties`` (sent to ``to``)."""
        cipher = self.cipher_of(message.sender)
        layout, flat = self._plaintext(message, parties)
        blobs = cipher.encrypt_values(flat)
        return self._ciphertext_message(message, layout, blobs, to, parties)

    def _encrypt_all(self, messages: Sequence[Message], to: str, parties: Sequence[str]) -> list[Message]:
        # Every party checks its values first, so a value out of range stops the round before any encryption.
        plain = [self._plaintext(m, parties) for m in messages]
        workers = self._workers
        remote = [i for i, m in enumerate(messages) if workers is not None and workers.serves(m.sender)]
        pending = workers.submit([(messages[i].sender, plain[i][1]) for i in remote]) \
            if workers is not None and remote else None
        blobs: list[list[bytes]] = [[] for _ in messages]
        try:
            for i, (m, (_, flat)) in enumerate(zip(messages, plain, strict=True)):  # while the workers encrypt theirs
                if i not in remote:
                    blobs[i] = self.cipher_of(m.sender).encrypt_values(flat)
        except BaseException:
            if pending is not None:  # drain the workers' replies, so no stale frame is read as the next answer
                try:
                    workers.collect(pending)  # type: ignore[union-attr]
                except ProtocolError:
                    pass
            raise
        if pending is not None:
            for i, b in zip(remote, workers.collect(pending), strict=True):  # type: ignore[union-attr]
                blobs[i] = b
        return [self._ciphertext_message(m, layout, b, to, parties)
                for m, (layout, _), b in zip(messages, plain, blobs, strict=True)]

    def _load(self, cipher: CKKSCipher, blob: bytes, who: str, index: int) -> Any:
        try:
            return cipher.load(blob)
        except CiphertextError as exc:
            raise ProtocolError(
                f"ciphertext {index} from {who} is {exc} for parameters {self.params.spec()}; it is truncated, "
                "corrupted, or encrypted under other parameters, level or scale"
            ) from None

    def add_messages(self, aggregator: str, received: Sequence[Message], to: str) -> Message:
        """The aggregator adds the parties' ciphertexts slot by slot; it holds no key and sees only ciphertexts."""
        cipher = self.cipher_of(aggregator)
        first = received[0]
        for m in received:
            if m.meta.get("layout") != first.meta.get("layout") or m.meta.get("parties") != first.meta.get("parties") \
                    or m.meta.get("of") != first.meta.get("of"):
                raise ProtocolError(
                    f"{m.sender}'s ciphertexts do not match {first.sender}'s (layout, parties or kind differ); every "
                    "party must encrypt the same names and shapes for the same sum"
                )
        layout = _layout_from_meta(first.meta.get("layout"), first.sender)
        sizes = _chunk_sizes(_numel(layout), self.params.floats_per_ciphertext)
        for m in received:
            if sorted(m.blobs) != sorted(f"c{i}" for i in range(len(sizes))):
                raise ProtocolError(f"{m.sender} sent {len(m.blobs)} ciphertexts, expected {len(sizes)} for its layout")
        total = [self._load(cipher, first.blobs[f"c{i}"], first.sender, i) for i in range(len(sizes))]
        for m in received[1:]:
            for i in range(len(sizes)):
                ct = self._load(cipher, m.blobs[f"c{i}"], m.sender, i)
                try:
                    cipher.add_inplace(total[i], ct)
                except (ValueError, RuntimeError) as exc:
                    raise ProtocolError(f"cannot add ciphertext {i} from {m.sender}: {exc}") from None
        self.ciphertexts_added += len(received) * len(sizes)
        meta = {**dict(first.meta), "count": len(received)}
        return Message(SUM_KIND, aggregator, to, first.step,
                       blobs={f"c{i}": cipher.dump(ct) for i, ct in enumerate(total)}, meta=meta)

    def decrypt(self, party: str, message: Message, divide_by: int = 1) -> dict[str, torch.Tensor]:
        """``party`` decrypts a ciphertext(-sum) message into tensors of the original names, shapes and dtypes
        (divided by ``divide_by`` in float64 first, for a mean). Only the key holder can: others are refused."""
        cipher = self.cipher_of(party)
        if not cipher.can_decrypt:
            raise ProtocolError(f"{party} holds no CKKS secret key and cannot decrypt; only the label party can")
        layout = _layout_from_meta(message.meta.get("layout"), message.sender)
        sizes = _chunk_sizes(_numel(layout), self.params.floats_per_ciphertext)
        if len(message.blobs) != len(sizes):
            raise ProtocolError(f"{message.sender} sent {len(message.blobs)} ciphertexts, expected {len(sizes)}")
        values = np.empty(sum(sizes), dtype=np.float64)
        offset = 0
        for i, n in enumerate(sizes):
            ct = self._load(cipher, message.blobs.get(f"c{i}", b""), message.sender, i)
            values[offset : offset + n] = cipher.decrypt(ct, n)
            offset += n
        if divide_by != 1:
            values /= divide_by
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for name, dname, shape in layout:
            n = math.prod(shape)
            out[name] = torch.from_numpy(values[offset : offset + n].reshape(shape)).to(WIRE_DTYPES[dname], copy=True)
            offset += n
        return out

    # -- disclosure control ------------------------------------------------------------------------------------
    def _check_disclosure(self, receiver: str, kind: str, step: int, layout: Layout, senders: Sequence[str]) -> tuple:
        """Refuse a sum that, with the sums ``receiver`` already got for the same data, would expose one party."""
        key = (receiver, kind, tuple(shape for _, _, shape in layout))
        past = self._released.get(key)
        subsets = list(past.subsets) if past is not None and past.step == step else []
        new = frozenset(senders)
        if new not in subsets:
            subsets.append(new)
        parties = sorted(set().union(*subsets))
        rows = np.array([[p in s for p in parties] for s in subsets], dtype=np.float64)
        rank = np.linalg.matrix_rank(rows)
        exposed = [p for j, p in enumerate(parties)
                   if np.linalg.matrix_rank(np.vstack([rows, np.eye(len(parties))[j]])) == rank]
        if exposed:
            given = ", ".join("{" + ",".join(sorted(s)) + "}" for s in subsets[:-1]) or "nothing"
            raise ProtocolError(
                f"CKKS aggregation refused: after the sums over {given} in step {step}, a sum over "
                f"{{{','.join(sorted(new))}}} would let {receiver} solve for the output of {', '.join(exposed)}; "
                "subset sums must not isolate a single party (advance the step counter for each new batch)"
            )
        return key, _Release(step, subsets)

    # -- the checks of a round (SecureSumAggregation's hooks) ------------------------------------------------
    def _layout(self, message: Message) -> Layout:
        return _layout_of(message)  # refuses non-float tensors

    def _check_receiver(self, net: Network, receiver: str) -> None:
        label = self._key_holder()
        if dict(net.topology.roles) != dict(self.topology.roles):  # type: ignore[union-attr]
            raise ProtocolError("this CKKS aggregation is bound to another network's parties; use one per network")
        if receiver != label:
            raise UnsupportedError(
                f"CKKS aggregation delivers sums only to the key holder, the label party {label!r}; got {receiver!r}"
            )

    def _check_contributors(self, senders: Sequence[str]) -> None:
        features = set(self.topology.feature_parties)  # type: ignore[union-attr]
        strangers = [s for s in senders if s not in features]
        if strangers:
            raise ProtocolError(f"only feature parties contribute to a CKKS sum; {strangers} are not feature parties")

    # -- the whole round -----------------------------------------------------------------------------------
    def aggregate(self, net: Network, messages: Sequence[Message], receiver: str, op: str) -> Message:
        messages = list(messages)
        senders, layout = self._check_round(net, messages, receiver, op)
        first = messages[0]
        release = self._check_disclosure(receiver, first.kind, first.step, layout, senders)
        aggregator = self.topology.parties(Role.AGGREGATOR)[0]  # type: ignore[union-attr]
        self._distribute(net, [*senders, aggregator], first.step)

        for c in self._encrypt_all(messages, aggregator, senders):
            net.send(c)
        received = [net.receive(aggregator, kind=CIPHERTEXT_KIND, sender=s) for s in senders]
        net.send(self.add_messages(aggregator, received, receiver))
        summed = net.receive(receiver, kind=SUM_KIND, sender=aggregator)
        # The aggregator's own report: catches a faulty aggregator, not a lying one (honest-aggregator assumption).
        if summed.meta.get("count") != len(senders) or summed.meta.get("parties") != sorted(senders):
            raise ProtocolError(f"{aggregator} delivered a sum over {summed.meta.get('parties')}, expected {sorted(senders)}")
        tensors = self.decrypt(receiver, summed, divide_by=len(messages) if op == "mean" else 1)
        self._released[release[0]] = release[1]
        self.sums_delivered += 1
        return self._result(first, receiver, tensors, op, len(messages), summed.wire_size)

    # -- parties in separate processes (secvfl.deploy) ------------------------------------------------------
    # Each role runs in its own process with the same messages as above: the label party sends each party that has
    # none yet its context (on its first sum), a feature party waits for its context before its first encryption,
    # encrypts and sends to the aggregator; the aggregator's process hands every message it gets to relay(), which
    # installs its context or, on a round's first ciphertext, collects the others (the round's parties are in its
    # meta), adds them and sends the sum to the label party, which decrypts it in collect().
    across_processes: ClassVar[bool] = True

    def _aggregator(self) -> str:
        return self.topology.parties(Role.AGGREGATOR)[0]  # type: ignore[union-attr]

    def _await_context(self, net: Network, party: str) -> None:
        if party not in self._contexts:
            msg = net.receive(party, kind=CONTEXT_KIND, sender=self._key_holder())
            self._install(party, msg, needs_public_key=party != self._aggregator())

    def send_share(self, net: Network, message: Message, senders: Sequence[str]) -> None:
        if self.workers:
            raise UnsupportedError("--ckks-workers applies in one process; each party process encrypts its own")
        self._check_contributors([message.sender])
        self._await_context(net, message.sender)
        net.send(self.encrypt_message(message, self._aggregator(), senders))

    def relay(self, net: Network, message: Message) -> None:
        """The aggregator's process: ``message`` is its context, or the first ciphertext of a round."""
        aggregator = self._aggregator()
        if message.kind == CONTEXT_KIND:
            self._install(aggregator, message, needs_public_key=False)
            return
        if message.kind != CIPHERTEXT_KIND:
            raise ProtocolError(f"the CKKS aggregator got a {message.kind} message from {message.sender}")
        self._await_context(net, aggregator)
        parties = message.meta.get("parties")
        if not isinstance(parties, list) or message.sender not in parties:
            raise ProtocolError(f"{message.sender}'s ciphertexts do not name the round's parties")
        self._check_contributors(parties)
        got = {message.sender: message}
        for s in parties:
            if s not in got:
                got[s] = net.receive(aggregator, kind=CIPHERTEXT_KIND, sender=s)
        net.send(self.add_messages(aggregator, [got[s] for s in parties], self._key_holder()))

    def collect(self, net: Network, receiver: str, kind: str, senders: Sequence[str], op: str) -> Message:
        if op not in ("sum", "mean"):
            raise UnsupportedError(f"aggregation op must be 'sum' or 'mean', got {op!r}")
        self._check_receiver(net, receiver)
        senders = list(senders)
        if len(senders) < 2:
            raise UnsupportedError(f"{self.subject} needs at least 2 parties (got {senders}): {self.one_party_sum}")
        self._check_contributors(senders)
        aggregator = self._aggregator()
        label = self._key_holder()
        ctx = self._contexts.get(label) or self._keygen(label)
        missing = [p for p in [*senders, aggregator] if p not in self._contexts and p not in self._handed_out]
        if missing:  # the same context messages as _distribute sends in one process
            public = ctx.serialize(save_public_key=True, save_secret_key=False, save_galois_keys=False,
                                   save_relin_keys=False)
            bare = ctx.serialize(save_public_key=False, save_secret_key=False, save_galois_keys=False,
                                 save_relin_keys=False)
            meta = {"params": self.params.to_dict()}
            net.send(*[Message(CONTEXT_KIND, label, p, 0, blobs={"context": bare if p == aggregator else public},
                               meta=meta) for p in missing])
            self._handed_out.update(missing)  # parties in other processes: their copies are theirs
        summed = net.receive(receiver, kind=SUM_KIND, sender=aggregator)
        if summed.meta.get("count") != len(senders) or summed.meta.get("parties") != sorted(senders) \
                or summed.meta.get("of") != kind:
            raise ProtocolError(f"{aggregator} delivered a {summed.meta.get('of')} sum over "
                                f"{summed.meta.get('parties')}, expected {kind} over {sorted(senders)}")
        layout = _layout_from_meta(summed.meta.get("layout"), aggregator)
        release = self._check_disclosure(receiver, kind, summed.step, layout, senders)
        tensors = self.decrypt(receiver, summed, divide_by=len(senders) if op == "mean" else 1)
        self._released[release[0]] = release[1]
        self.sums_delivered += 1
        template = Message(kind, aggregator, receiver, summed.step)
        return self._result(template, receiver, tensors, op, len(senders), summed.wire_size)


@dataclass(frozen=True)
class CKKSOptions(Options):
    he: Literal["none", "ckks"] = option(
        "none", "encrypt the parties' outputs before they are summed or averaged (vafl, fdml): ckks = TenSEAL CKKS; an "
                "aggregator party adds the ciphertexts, the label party decrypts only the sum")
    ckks_workers: int = option(
        0, "processes that encrypt for the feature parties in parallel with the training process (TenSEAL holds the "
           "GIL, so threads cannot); 0 = all in the training process; on 2 cores use 1. Each costs a Python start-up "
           "(a few seconds) once per run", metavar="N", check=(lambda n: n >= 0, "a non-negative integer"))
    ckks_params: str = option(
        "auto", "CKKS parameters: auto (small when one training message of a party fits one N = 4096 ciphertext, i.e. batch size x width <= 4096, else default), default (8192:60,40,40,60:40), compact (8192:60,60:40: smaller public key, same "
                   "ciphertexts: both are sent under the first prime only, which addition needs), small "
                   "(4096:60,49:40: half the bytes per step when a party's message has at most 4096 floats, e.g. "
                   "batches of 64 x 16) or N:PRIME_BITS:SCALE_BITS; checked for 128-bit security and precision",
        metavar="SPEC")


class CKKSPlugin(ProtocolPlugin):
    """``--he ckks`` and ``--ckks-params`` for ``secvfl train``. Not an entry point itself: ``secvfl train`` uses
    :class:`protocols.secure_plugins.CKKSTrainPlugin`, which also stops the encryption workers when a run ends."""

    name = "he"
    options_type = CKKSOptions

    def configure(self, cfg: TrainConfig, traits: AlgorithmTraits, ctx: RunContext) -> ProtocolSetup | None:
        o = cfg.options_for(CKKSOptions)
        if o.he == "none":
            if o.ckks_params != "auto" or o.ckks_workers:
                raise UnsupportedError("--ckks-params and --ckks-workers only apply with --he ckks")
            return None
        spec, why = o.ckks_params, "given"
        if spec == "auto":
            # a party's training message is batch x (embedding width or class count); under N = 4096 one ciphertext
            # of half the bytes carries it (larger ones cost the default's bytes per float within 4 %)
            floats = cfg.batch_size * max(cfg.embedding_dim, ctx.data.n_classes)
            spec = "small" if floats <= PRESETS["small"].floats_per_ciphertext else "default"
            why = f"auto: a training message has up to {floats} floats"
        aggregation = CKKSAggregation(spec, workers=o.ckks_workers)
        aggregation.params_choice = f"{spec} ({why})"
        problems = aggregation.check(traits)
        if problems:
            raise UnsupportedError("; ".join(problems))
        return ProtocolSetup(aggregation=aggregation, summary=lambda: {"he": aggregation.describe()})
