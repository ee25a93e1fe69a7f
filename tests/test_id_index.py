"""The index of a party's ids (secvfl.data.id_index): against a plain dict from id to row, on CPU (numpy, pyarrow)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.data.id_index import IdIndex, hash_ids

_ids = st.lists(st.text(min_size=0, max_size=12), max_size=60, unique=True)


class _Colliding(IdIndex):
    """Every id hashes to one of 3 values: each lookup has to compare candidates one by one."""

    _hash = staticmethod(lambda ids: hash_ids(ids) % np.uint64(3))


def _reference(table: list[str], wanted: list[str]) -> list[int]:
    rows = {ident: r for r, ident in enumerate(table)}
    return [rows.get(w, -1) for w in wanted]


@settings(max_examples=150, deadline=None)
@given(table=_ids, others=st.lists(st.text(max_size=12), max_size=20), large=st.booleans(), colliding=st.booleans(),
       chunks=st.integers(1, 3))
def test_rows_are_those_of_a_dict_from_id_to_row(table: list[str], others: list[str], large: bool, colliding: bool,
                                                  chunks: int) -> None:
    kind = pa.large_string() if large else pa.string()
    bounds = np.linspace(0, len(table), chunks + 1).astype(int)
    ids = pa.chunked_array([pa.array(table[a:b], kind) for a, b in zip(bounds[:-1], bounds[1:], strict=True)], kind)
    index = (_Colliding if colliding else IdIndex)(ids)
    wanted = [*table[::2], *others, *table[1::3]]
    assert index.rows(wanted).tolist() == _reference(table, wanted)
    assert index.rows(pa.array(wanted, pa.large_string())).tolist() == _reference(table, wanted)
    assert len(index) == len(table)


def test_a_sliced_array_and_unicode_ids() -> None:
    table = ["b", "ä", "😀x", "a" * 300, "", "c", "ab", "ba"]
    ids = pa.array(["skip", *table, "skip2"]).slice(1, len(table))  # an offset into shared buffers
    index = IdIndex(ids)
    wanted = ["ba", "ab", "😀x", "a" * 300, "a" * 299, "", "zz", "ä"]
    assert index.rows(wanted).tolist() == _reference(table, wanted)
    assert IdIndex(pa.array([], pa.string())).rows(["a"]).tolist() == [-1]
    assert index.rows([]).tolist() == []


def test_hashes_do_not_depend_on_the_chunk_or_the_offset_width() -> None:
    texts = [f"customer-{i}" for i in range(70_000)]  # more than one chunk of hashing
    whole = hash_ids(pa.array(texts))
    assert (whole == hash_ids(pa.array(texts, pa.large_string()))).all()
    assert (whole[40_000:40_010] == hash_ids(pa.array(texts).slice(40_000, 10))).all()
    assert len(np.unique(whole)) == len(texts)
    with pytest.raises(TypeError, match="Arrow string array"):
        hash_ids(pa.array([1, 2]))
