"""Noise sources for differential privacy: an AES-256-CTR keystream turned into uniforms, integers and Gaussians.

Why not ``torch.randn``: a Mersenne-Twister or Philox stream seeded from a small integer is predictable to whoever
learns (or guesses) the seed, and predictable noise is no noise. Production DP runs therefore draw from
:class:`SecureNoise`, whose AES-256 key comes from the operating system's CSPRNG (``os.urandom``) and never leaves
the process. :class:`SeededNoise` runs the *same* generator with a key derived from an integer seed; it exists for
``--dp-reproducible`` (debugging, and tests that replay the same noise on neighbouring datasets) and every summary
says when it was used, because its guarantee holds only against an adversary who does not know the seed.

Construction (both classes)
    keystream = AES-256-CTR(key, counter = 128-bit big-endian block index) -- the CTR keystream of a block cipher is
    a pseudorandom function of the counter, so consecutive 64-bit little-endian words are uniform and independent.
    uniform   = ((word >> 11) + 0.5) * 2**-53, strictly inside (0, 1) on a 2**-53 grid.
    Gaussian  = Box-Muller in float64 on pairs of uniforms: one AES block (16 bytes) -> two standard normals.

Known deviations from an ideal Gaussian, stated so an auditor can account for them:
    * Tails are cut at sqrt(-2 ln 2**-54) ~= 8.65 standard deviations (the smallest uniform is 2**-54); the total
      variation distance to the exact Gaussian is below 1e-17 per draw, to be added to delta per draw.
    * Floating-point arithmetic: noise is drawn and added in float64 and the sum rounded once to the released dtype
      (:meth:`NoiseSource.add_gaussian`). This blunts but does not provably remove the least-significant-bit attacks
      known for textbook floating-point Laplace/Gaussian samplers (Mironov 2012; Jin et al. 2022).

Streams never overlap: a source hands out each keystream block once (it tracks its block position), and
:meth:`NoiseSource.derive` gives an independent source per purpose (per party, per mechanism) -- a fresh random key
for :class:`SecureNoise`, a key derived from (seed, purpose) for :class:`SeededNoise`.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from secvfl.device import to_device
from secvfl.errors import ConfigError

__all__ = ["NoiseSource", "SecureNoise", "SeededNoise", "make_noise_source"]

_BLOCK = 16  # AES block size in bytes; one block -> two 64-bit words -> two uniforms -> two Gaussians
_U53 = 2.0**-53
_TWO_PI = 2.0 * np.pi


class NoiseSource(ABC):
    """A stream of cryptographically generated randomness; all draws are vectorised."""

    secure: bool

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ConfigError(f"AES-256 needs a 32-byte key, got {len(key)} bytes")
        self._key = key
        self._position = 0  # keystream blocks handed out so far
        self._encryptor = self._encryptor_at(0)

    def _encryptor_at(self, block: int):  # noqa: ANN202 - cryptography's context type is private
        nonce = (block % (1 << 128)).to_bytes(16, "big")
        return Cipher(algorithms.AES(self._key), modes.CTR(nonce)).encryptor()

    # -- raw material ------------------------------------------------------------------------------------------
    def _words(self, n: int) -> np.ndarray:
        """``n`` uniform 64-bit words (uint64), from whole keystream blocks (an odd word's partner is discarded)."""
        if n < 0:
            raise ValueError(f"cannot draw a negative number of values ({n})")
        blocks = (n + 1) // 2
        stream = self._encryptor.update(bytes(blocks * _BLOCK))
        self._position += blocks
        return np.frombuffer(stream, dtype="<u8")[:n]

    def uniform(self, n: int) -> np.ndarray:
        """``n`` float64 values uniform on the 2**-53 grid strictly inside (0, 1)."""
        return ((self._words(n) >> np.uint64(11)).astype(np.float64) + 0.5) * _U53

    def integers(self, high: int | np.ndarray, n: int | None = None) -> np.ndarray:
        """Uniform integers in ``[0, high)`` without modulo bias (rejection sampling on 64-bit words).

        ``high`` is one bound (then ``n`` values are drawn) or an array of per-value bounds (``n`` is its length).
        """
        highs = np.asarray(high, dtype=np.uint64)
        if highs.ndim == 0:
            if n is None:
                raise ValueError("integers(high, n): n is required when high is a single bound")
            highs = np.full(n, highs, dtype=np.uint64)
        if highs.size and int(highs.min()) < 1:
            raise ValueError("integers(): every bound must be >= 1")
        out = np.empty(highs.shape, dtype=np.int64)
        todo = np.arange(highs.size)
        # Largest multiple of high that fits in 2**64; words at or above it are rejected (probability < 1/2).
        limit = (np.uint64(2**64 - 1) // highs) * highs  # (2**64-1)//h*h <= 2**64 - h: exact accept region
        while todo.size:
            w = self._words(todo.size)
            ok = w < limit[todo]
            out[todo[ok]] = (w[ok] % highs[todo[ok]]).astype(np.int64)
            todo = todo[~ok]
        return out

    def standard_normal(self, n: int) -> np.ndarray:
        """``n`` independent N(0, 1) draws in float64 (Box-Muller on keystream uniforms)."""
        pairs = (n + 1) // 2
        u = self.uniform(2 * pairs)
        u1, u2 = u[0::2], u[1::2]
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = _TWO_PI * u2
        z = np.empty(2 * pairs, dtype=np.float64)
        z[0::2] = radius * np.cos(angle)
        z[1::2] = radius * np.sin(angle)
        return z[:n]

    # -- tensors -----------------------------------------------------------------------------------------------
    def normal(self, shape: Sequence[int] | torch.Size, std: float = 1.0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A tensor of N(0, std**2) draws, generated in float64 and then cast to ``dtype``."""
        if not std >= 0:
            raise ConfigError(f"noise standard deviation must be >= 0, got {std}")
        n = int(np.prod(shape)) if len(shape) else 1
        z = torch.from_numpy(self.standard_normal(n) * float(std)).reshape(tuple(shape))
        return z.to(dtype)

    def add_gaussian(self, tensor: torch.Tensor, std: float) -> torch.Tensor:
        """``tensor + N(0, std**2 I)``: added in float64, rounded once to ``tensor``'s dtype (see module notes)."""
        noise = self.normal(tensor.shape, std, torch.float64)
        if tensor.is_cpu:
            return (tensor.detach().to(torch.float64) + noise).to(dtype=tensor.dtype)
        # on a GPU the noise goes to the tensor (no host wait) and is added there: the same float64 sum, rounded once
        return (tensor.detach().to(torch.float64) + to_device(noise, tensor.device)).to(dtype=tensor.dtype)

    # -- streams -----------------------------------------------------------------------------------------------
    @abstractmethod
    def derive(self, purpose: str) -> NoiseSource:
        """An independent source for ``purpose`` (e.g. ``"label-dp/party0"``)."""

    @property
    def position(self) -> int:
        """Keystream blocks consumed so far."""
        return self._position

    def describe(self) -> dict[str, Any]:
        return {
            "generator": "AES-256-CTR keystream -> 53-bit uniforms -> Box-Muller (float64)",
            "secure": self.secure,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._position = int(state["position"])
        self._encryptor = self._encryptor_at(self._position)


class SecureNoise(NoiseSource):
    """Noise keyed by 32 bytes from ``os.urandom``: unpredictable to everyone, including the operator."""

    secure = True

    def __init__(self) -> None:
        super().__init__(os.urandom(32))

    def derive(self, purpose: str) -> SecureNoise:
        return SecureNoise()

    def state_dict(self) -> dict[str, Any]:
        # The key is never written out: a resumed run continues with a fresh key (at the saved position, so the
        # block count stays the run's total), which is just as good as noise; its draws differ from those an
        # uninterrupted run would have made, as any two secure runs do.
        return {"position": self._position, "secure": True}


class SeededNoise(NoiseSource):
    """The same generator keyed by SHA-256(seed, purpose): reproducible, hence private only if the seed is secret."""

    secure = False

    def __init__(self, seed: int, purpose: str = "") -> None:
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise ConfigError(f"the reproducible DP noise seed must be an integer, got {seed!r}")
        self.seed = int(seed)
        self.purpose = purpose
        digest = hashlib.sha256(f"secvfl/dp/seeded-noise/v1\x00{self.seed}\x00{purpose}".encode()).digest()
        super().__init__(digest)

    def derive(self, purpose: str) -> SeededNoise:
        return SeededNoise(self.seed, f"{self.purpose}/{purpose}" if self.purpose else purpose)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "seed": self.seed, "purpose": self.purpose}


def make_noise_source(*, reproducible: bool = False, seed: int | None = None) -> NoiseSource:
    """The noise source a run should use: :class:`SecureNoise` unless ``reproducible`` (then ``seed`` is needed)."""
    if reproducible:
        if seed is None:
            raise ConfigError("--dp-reproducible needs a seed (--seed N)")
        return SeededNoise(seed)
    return SecureNoise()
