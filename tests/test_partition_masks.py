import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from secvfl.data import draw_masks, make_partition, partition_columns, partition_image
from secvfl.errors import DataError


@given(n=st.integers(1, 300), data=st.data())
def test_partition_covers_every_column_exactly_once(n, data):
    k = data.draw(st.integers(1, n))
    part = partition_columns(n, k)
    cols = np.concatenate(part.blocks)
    assert sorted(cols.tolist()) == list(range(n))
    assert max(part.sizes()) - min(part.sizes()) <= 1
    assert all(np.all(np.diff(b) == 1) for b in part.blocks)  # contiguous


@given(h=st.integers(4, 30), w=st.integers(4, 30), k=st.integers(1, 4), mode=st.sampled_from(["strips", "quadrants"]))
def test_image_partition_covers_every_pixel_once(h, w, k, mode):
    part = partition_image((h, w), k, mode)
    assert part.n_blocks == k
    assert sorted(np.concatenate(part.blocks).tolist()) == list(range(h * w))
    assert all(len(b) == s[0] * s[1] for b, s in zip(part.blocks, part.block_shapes, strict=True))


def test_mnist_style_quadrants():
    part = make_partition(28 * 28, 4, image_shape=(28, 28))
    assert part.block_shapes == ((14, 14),) * 4
    assert part.blocks[1][0] == 14  # top-right quadrant starts at column 14 of row 0


def test_more_parties_than_columns_is_a_clear_error():
    with pytest.raises(DataError, match="cannot split 3 feature columns among 5 parties"):
        partition_columns(3, 5)
    with pytest.raises(DataError, match="sum"):
        partition_columns(10, 2, [3, 3])


@given(p=st.floats(0.0, 0.95), k=st.integers(1, 6), seed=st.integers(0, 1000))
def test_masks_respect_p_miss_in_expectation(p, k, seed):
    n = 4000
    m = draw_masks(n, k, p, np.random.default_rng(seed))
    assert m.shape == (n, k) and m.dtype == bool
    sd = np.sqrt(p * (1 - p) / (n * k)) + 1e-9
    assert abs((~m).mean() - p) < 5 * sd + 1e-3


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "abc", "beta:0,1", "beta:x"])
def test_bad_p_miss_is_a_clear_error(bad):
    with pytest.raises(DataError):
        draw_masks(10, 3, bad, np.random.default_rng(0))


def test_beta_per_block_probabilities():
    m = draw_masks(20000, 4, "beta:2,2", np.random.default_rng(0))
    rates = (~m).mean(axis=0)
    assert len(set(np.round(rates, 2))) > 1  # blocks differ
