"""The AES-CTR noise source: construction, distribution, independence of streams, reproducibility."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from protocols.dp.rng import SecureNoise, SeededNoise, make_noise_source
from secvfl.errors import ConfigError


def test_keystream_is_aes256_ctr_of_the_block_counter() -> None:
    src = SeededNoise(7)
    key = src._key
    words = src._words(6)  # three blocks
    ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    expected = ecb.update(b"".join(i.to_bytes(16, "big") for i in range(3)))
    assert words.tobytes() == expected
    assert src.position == 3


def test_seeded_is_reproducible_and_seeds_and_purposes_differ() -> None:
    a, b = SeededNoise(1).standard_normal(1000), SeededNoise(1).standard_normal(1000)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, SeededNoise(2).standard_normal(1000))
    assert not np.array_equal(a, SeededNoise(1).derive("party-a").standard_normal(1000))
    assert not np.array_equal(
        SeededNoise(1).derive("party-a").standard_normal(10), SeededNoise(1).derive("party-b").standard_normal(10)
    )


def test_secure_sources_are_unpredictable_and_say_so() -> None:
    a, b = SecureNoise(), SecureNoise()
    assert not np.array_equal(a.standard_normal(64), b.standard_normal(64))
    assert a.secure and not SeededNoise(0).secure
    assert make_noise_source().secure
    assert not make_noise_source(reproducible=True, seed=3).secure
    assert "key" not in str(a.state_dict()).lower()
    with pytest.raises(ConfigError, match="seed"):
        make_noise_source(reproducible=True)


def test_gaussian_distribution() -> None:
    z = SeededNoise(11).standard_normal(200_000)
    n = z.size
    assert abs(z.mean()) < 5 / np.sqrt(n)
    assert abs(z.std() - 1.0) < 5 * np.sqrt(0.5 / n)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    # odd sizes and pairs: no value is reused
    z2 = SeededNoise(11).standard_normal(5)
    assert np.array_equal(z2, z[:5])
    assert len(np.unique(z)) == n


def test_uniform_open_interval_and_flat() -> None:
    u = SeededNoise(5).uniform(100_000)
    assert u.min() > 0 and u.max() < 1
    counts, _ = np.histogram(u, bins=20, range=(0, 1))
    assert stats.chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("high", [2, 3, 7, 1000, 2**40 + 3])
def test_integers_unbiased(high: int) -> None:
    x = SeededNoise(high).integers(high, 60_000)
    assert x.min() >= 0 and x.max() < high
    bins = min(high, 10)
    counts = np.bincount((x * bins // high).astype(np.int64) if high > 10 else x, minlength=bins)
    assert stats.chisquare(counts).pvalue > 1e-3


def test_integers_with_per_value_bounds() -> None:
    highs = np.array([1, 2, 5, 9] * 10_000)
    x = SeededNoise(9).integers(highs)
    assert np.all(x < highs) and np.all(x >= 0)
    assert np.all(x[highs == 1] == 0)
    five = x[highs == 5]
    assert stats.chisquare(np.bincount(five, minlength=5)).pvalue > 1e-3


def test_tensors_dtype_shape_and_scale() -> None:
    src = SeededNoise(3)
    t = src.normal((300, 200), std=2.5, dtype=torch.float32)
    assert t.dtype == torch.float32 and t.shape == (300, 200)
    assert float(t.std()) == pytest.approx(2.5, rel=0.02)
    base = torch.ones(50_000, dtype=torch.float32)
    noisy = src.add_gaussian(base, 0.5)
    assert noisy.dtype == torch.float32
    assert float((noisy - base).std()) == pytest.approx(0.5, rel=0.02)
    assert torch.equal(src.add_gaussian(base, 0.0), base)
    with pytest.raises(ConfigError):
        src.normal((3,), std=-1.0)


def test_resume_continues_the_stream() -> None:
    a = SeededNoise(4)
    a.standard_normal(101)
    state = a.state_dict()
    expected = a.standard_normal(50)
    b = SeededNoise(4)
    b.load_state_dict(state)
    assert np.array_equal(b.standard_normal(50), expected)
