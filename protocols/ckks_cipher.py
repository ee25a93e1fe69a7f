"""One party's CKKS operations through SEAL's own API (``tenseal.sealapi``), with ciphertexts sent at the lowest
level that still carries the sums.

Why not TenSEAL's ``ckks_vector``: it always encrypts at the first data level, under every prime but the special
one ([60, 40, 40] bits for the default parameters), keeping room for multiplications. Aggregation only adds, so
those levels buy nothing and triple what every party encrypts, serialises and sends, what the aggregator reads and
adds and what the label party decrypts. :class:`CKKSCipher` encodes the floats at the level of
:attr:`CKKSParams.wire_primes <protocols.ckks.CKKSParams.wire_primes>` primes (one 60-bit prime for the defaults)
and encrypts there. TenSEAL's vectors are also real-only, while CKKS slots hold complex numbers: we put two floats
in each slot, as the real and imaginary part, which halves the ciphertexts for the same cost per ciphertext (the
error bound holds for the complex error, so for both parts).

Security: SEAL encrypts at a level below the key level by encrypting a zero at the level above and dividing by the
dropped prime (``Encryptor::encrypt_zero_internal``), i.e. a fresh public-key encryption followed by the public
modulus switch. Whatever can be learnt from the switched ciphertext can be computed from the fresh one, so it is
no weaker than a fresh ciphertext at the first level; the keys stay those of the full parameters (128-bit).

It is also cheaper than working at the first level: each ciphertext carries 8192 floats instead of 4096 (N = 8192),
and encrypting, serialising and decrypting one takes less time and fewer bytes (measured per ciphertext:
BENCHMARKS.md, "Secure aggregation: CKKS and masking"; `secvfl bench crypto` reports it per run).

The SEAL bindings read and write ciphertexts only through file paths, so bytes pass through a scratch file on a
memory file system (``/dev/shm`` when writable, else the temporary directory): a fresh 0600 file per call, removed
before the call returns, so threads and forked processes never share one and nothing is left behind. Only
ciphertexts, which travel in the clear anyway, ever touch it: never keys or plaintexts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import tenseal as ts
from tenseal import sealapi

__all__ = ["CKKSCipher", "CiphertextError"]


class CiphertextError(ValueError):
    """Bytes that are not a ciphertext this party can use (malformed, or of other parameters, level or scale)."""


def _scratch_dir() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None  # None: the temp directory


_SCRATCH_DIR = _scratch_dir()


def _dump(obj: Any) -> bytes:
    fd, path = tempfile.mkstemp(prefix="secvfl-ct-", dir=_SCRATCH_DIR)  # 0600, a fresh name for every call
    try:
        os.close(fd)
        obj.save(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def _load(obj: Any, context: Any, blob: bytes) -> None:
    fd, path = tempfile.mkstemp(prefix="secvfl-ct-", dir=_SCRATCH_DIR)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        obj.load(context, path)
    finally:
        os.unlink(path)


class CKKSCipher:
    """CKKS under one party's TenSEAL context, at the level with ``wire_primes`` data primes.

    What a party can do follows from its keys: anyone holding the parameters can read, add and write ciphertexts;
    encrypting needs the public key, decrypting the secret key (asking without it raises ``PermissionError``).
    """

    def __init__(self, context: ts.Context, wire_primes: int, scale: float) -> None:
        seal = context.seal_context().data
        level = seal.first_context_data()
        while level is not None and len(level.parms().coeff_modulus()) > wire_primes:
            level = level.next_context_data()
        if level is None or len(level.parms().coeff_modulus()) != wire_primes:
            raise ValueError(f"the CKKS context has no level with {wire_primes} data prime(s)")
        self._seal = seal
        self.parms_id = level.parms_id()
        self.scale = float(scale)
        self.slots = level.parms().poly_modulus_degree() // 2
        self._encoder = sealapi.CKKSEncoder(seal)
        self._evaluator = sealapi.Evaluator(seal)
        self._encryptor = sealapi.Encryptor(seal, context.public_key().data) if context.has_public_key() else None
        self._decryptor = sealapi.Decryptor(seal, context.secret_key().data) if context.has_secret_key() else None

    @property
    def can_encrypt(self) -> bool:
        return self._encryptor is not None

    @property
    def can_decrypt(self) -> bool:
        return self._decryptor is not None

    # -- encrypting (public key) ----------------------------------------------------------------------------------
    def encrypt(self, values: np.ndarray | Sequence[float]) -> Any:
        """One ciphertext of at most ``2 * slots`` floats: values 2i and 2i+1 are the real and imaginary part of
        slot i (unused slots hold zeros)."""
        if self._encryptor is None:
            raise PermissionError("this CKKS context holds no public key and cannot encrypt")
        flat = np.asarray(values, dtype=np.float64).reshape(-1)
        if flat.size > 2 * self.slots:
            raise ValueError(f"{flat.size} floats do not fit one ciphertext of {self.slots} complex slots")
        if flat.size % 2:
            flat = np.append(flat, 0.0)
        pairs = np.ascontiguousarray(flat).view(np.complex128)  # (re, im) pairs, no copy
        plain = sealapi.Plaintext()
        self._encoder.encode(pairs.tolist(), self.parms_id, self.scale, plain)
        out = sealapi.Ciphertext()
        self._encryptor.encrypt(plain, out)
        return out

    def encrypt_values(self, flat: np.ndarray) -> list[bytes]:
        """Cut ``flat`` into as few ciphertexts as possible (``2 * slots`` floats each), encrypt and serialise them."""
        size = 2 * self.slots
        return [self.dump(self.encrypt(flat[start : start + size])) for start in range(0, flat.size, size)]

    # -- reading, adding, writing (parameters only) ------------------------------------------------------------
    @staticmethod
    def dump(ciphertext: Any) -> bytes:
        return _dump(ciphertext)

    def load(self, blob: bytes) -> Any:
        """A ciphertext read from bytes, checked to be a fresh-encryption-shaped ciphertext at this cipher's level
        and scale; :class:`CiphertextError` otherwise. (SEAL's own load checks the data against the parameters.)"""
        ct = sealapi.Ciphertext()
        try:
            _load(ct, self._seal, bytes(blob))
        except (ValueError, RuntimeError, TypeError) as exc:
            raise CiphertextError(f"not a valid CKKS ciphertext ({exc})") from None
        if ct.size() != 2 or list(ct.parms_id()) != list(self.parms_id) or not ct.is_ntt_form() \
                or ct.scale != self.scale:
            raise CiphertextError(
                f"not a fresh ciphertext at the agreed level (size {ct.size()}, {ct.coeff_modulus_size()} prime(s), "
                f"scale 2^{np.log2(max(ct.scale, 1e-300)):.2f})"
            )
        return ct

    def add_inplace(self, total: Any, other: Any) -> None:
        self._evaluator.add_inplace(total, other)

    # -- decrypting (secret key) -------------------------------------------------------------------------------
    def decrypt(self, ciphertext: Any, count: int) -> np.ndarray:
        """The first ``count`` floats of ``ciphertext`` (slot by slot, real then imaginary part) as float64."""
        if self._decryptor is None:
            raise PermissionError("this CKKS context holds no secret key and cannot decrypt")
        plain = sealapi.Plaintext()
        self._decryptor.decrypt(ciphertext, plain)
        pairs = np.asarray(self._encoder.decode_complex(plain)[: (count + 1) // 2], dtype=np.complex128)
        return pairs.view(np.float64)[:count]
