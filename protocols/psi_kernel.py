"""The arithmetic of the private set intersection (protocols.psi): hashing ids to Curve25519 and blinding them.

Kept apart from :mod:`protocols.psi` so that a worker process of a party's pool imports only hashlib, numpy, gmpy2
and ``cryptography`` (not torch): each task is a chunk of ids or points as bytes, its answer bytes.

Group: the x-only Montgomery ladder of X25519 (RFC 7748) from ``cryptography`` (OpenSSL): ``X25519(k, u)`` is the
u-coordinate of ``[clamp(k)] P`` for a point ``P`` with u-coordinate ``u``. Scalar multiplication commutes, so
``X25519(a, X25519(b, u)) == X25519(b, X25519(a, u))``, which is all double blinding needs.

Hash to the curve (:func:`hash_to_curve`): try-and-increment. ``u = SHA-256(DOMAIN || counter || id) mod 2^255``
for counter 0, 1, ... until ``u < p`` and ``u^3 + A u^2 + u`` is a non-zero square mod ``p`` (Legendre symbol by
GMP through gmpy2), that is until ``u`` is the u-coordinate of a point of Curve25519 itself and not of its quadratic
twist (each counter succeeds with probability ~1/2; 256 failures in a row have probability 2^-256). Why not any
``u``: X25519 accepts twist points too, and a blinded value stays on the side (curve or twist) of its id's hash, which
anyone can test; a party would then learn, for every id of its peer, one bit of that id's hash (the number of twist
ids, and which of two candidate sets the peer holds). With every hash on the curve, every value a party sends is a
uniform-looking element of the prime-order subgroup (order ``l ~ 2^252``): clamping makes each scalar a multiple of
the cofactor 8, which removes the small-order component of a hashed point. Which counter succeeded depends on the
id, so hashing time varies slightly with the id (stated in protocols.psi's threat model).

Doubly blinded values are compared as ``SHA-256(DOMAIN_MATCH || u)`` truncated to ``width`` bytes (see
protocols.psi for the width and its collision bound).
"""

from __future__ import annotations

import hashlib

import gmpy2
import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

__all__ = ["DOMAIN", "DOMAIN_MATCH", "POINT_BYTES", "hash_to_curve", "on_curve", "blind_ids", "reblind_points",
           "NotOnCurve"]

DOMAIN = b"secvfl-psi-v2/X25519/hash-to-curve/"
DOMAIN_MATCH = b"secvfl-psi-v2/X25519/match/"
POINT_BYTES = 32
_P = (1 << 255) - 19
_GP = gmpy2.mpz(_P)
_A = 486662
_LOW255 = (1 << 255) - 1
_MAX_TRIES = 256


class NotOnCurve(ValueError):
    """A 32-byte value that is not the canonical u-coordinate of a point of Curve25519 (twist points included)."""


def on_curve(u: int) -> bool:
    """Whether ``u`` (an integer below p) is the u-coordinate of a point of Curve25519 of order above 2."""
    x = gmpy2.mpz(u)
    return gmpy2.legendre((x * (x * x + _A * x + 1)) % _GP, _GP) == 1


def hash_to_curve(identifier: bytes) -> bytes:
    """The u-coordinate (32 bytes, little-endian, canonical) of the curve point of ``identifier`` (module doc)."""
    for counter in range(_MAX_TRIES):
        digest = hashlib.sha256(DOMAIN + bytes((counter,)) + identifier).digest()
        u = int.from_bytes(digest, "little") & _LOW255
        if u < _P and on_curve(u):
            return u.to_bytes(POINT_BYTES, "little")
    raise ValueError("could not hash an id to Curve25519 in 256 tries (probability 2^-256)")  # pragma: no cover


def blind_ids(key: bytes, offsets: bytes, data: bytes) -> bytes:
    """``X25519(key, H(id))`` for every id of a chunk; ids are ``data[offsets[i]:offsets[i + 1]]`` (int64 offsets)."""
    k = X25519PrivateKey.from_private_bytes(key)
    bounds = np.frombuffer(offsets, dtype=np.int64).tolist()
    out = bytearray(POINT_BYTES * (len(bounds) - 1))
    for i in range(len(bounds) - 1):
        u = hash_to_curve(data[bounds[i] : bounds[i + 1]])
        out[POINT_BYTES * i : POINT_BYTES * (i + 1)] = k.exchange(X25519PublicKey.from_public_bytes(u))
    return bytes(out)


def reblind_points(key: bytes, points: bytes, width: int) -> bytes:
    """Truncated match values of ``X25519(key, u)`` for every received point ``u`` (32 bytes each, in order).

    Raises :class:`NotOnCurve` (with the point's index) for a value that no honest party sends: non-canonical, on
    the twist, or of small order (OpenSSL refuses the all-zero result)."""
    k = X25519PrivateKey.from_private_bytes(key)
    n = len(points) // POINT_BYTES
    out = bytearray(width * n)
    for i in range(n):
        raw = points[POINT_BYTES * i : POINT_BYTES * (i + 1)]
        u = int.from_bytes(raw, "little")
        if u >= _P or not on_curve(u):
            raise NotOnCurve(i)
        try:
            shared = k.exchange(X25519PublicKey.from_public_bytes(raw))
        except ValueError:
            raise NotOnCurve(i) from None
        out[width * i : width * (i + 1)] = hashlib.sha256(DOMAIN_MATCH + shared).digest()[:width]
    return bytes(out)
