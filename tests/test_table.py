"""Tables read with pyarrow (secvfl.data.table): the previous reader's rules, Parquet, and large tables held as
float32 and prepared in chunks. References: the reader's rules written out in plain Python, and the float64 path."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import secvfl.data.csv_loader as csv_loader
import secvfl.data.table as table
from secvfl.data import load_dataset, load_raw
from secvfl.errors import DataError


def _table_text(n: int = 300, seed: int = 0) -> str:
    """Numbers (some missing, some large with a small spread), text that is numeric, categories, a label."""
    rng = np.random.default_rng(seed)
    lines = ["ID,amount,when,code,city,score,label"]
    for i in range(n):
        amount = "" if i % 13 == 0 else f"{rng.normal(1000, 50):.4f}"
        when = f"{1.7e9 + rng.integers(0, 5000)}"  # large values, small spread
        code = "NA" if i % 11 == 0 else f" {rng.integers(0, 9)} "  # numbers written as padded text
        city = ["paris", "oslo", " rome", "?"][i % 4]
        lines.append(f"c{i},{amount},{when},{code},{city},{rng.normal():.5f},{['no', 'yes', 'maybe'][i % 3]}")
    return "\n".join(lines) + "\n"


def _python_reference(text: str) -> tuple[list[str], np.ndarray]:
    """The rules of the reader, in plain Python: strip, missing tokens, numbers by float(), sorted categories."""
    rows = [r.split(",") for r in text.strip().split("\n")]
    header, body = rows[0], rows[1:]
    names, cols = [], []
    for j, name in enumerate(header):
        if name in ("ID", "label"):
            continue
        cells = [r[j].strip() for r in body]
        missing = [c.lower() in table.MISSING_TOKENS for c in cells]
        present = [c for c, m in zip(cells, missing, strict=True) if not m]
        if all(table.is_number(c) for c in present):
            names.append(name)
            cols.append([np.nan if m else float(c) for c, m in zip(cells, missing, strict=True)])
        else:
            for cat in sorted(set(present)):
                names.append(f"{name}={cat}")
                cols.append([np.nan if m else float(c == cat) for c, m in zip(cells, missing, strict=True)])
    return names, np.array(cols).T


def test_csv_columns_follow_the_reader_s_rules(tmp_path: Path) -> None:
    text = _table_text()
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(text.encode()))
    raw = load_raw(f"csv:{path}:label")[1]
    names, X = _python_reference(text)
    assert raw.feature_names == names == ["amount", "when", "code", "city=oslo", "city=paris", "city=rome", "score"]
    assert raw.X.dtype == np.float64 and raw.shift is None
    np.testing.assert_array_equal(raw.X, X)  # bit for bit, NaN where missing
    assert raw.classes == ["maybe", "no", "yes"] and [e.kind for e in raw.encodings] == ["number"] * 3 + [
        "categories", "number"]


def test_parquet_gives_the_csv_s_data(tmp_path: Path) -> None:
    """The same table as Parquet, typed (floats with nulls, a dictionary column, integers, booleans)."""
    rng = np.random.default_rng(1)
    n = 200
    amount = [None if i % 9 == 0 else float(v) for i, v in enumerate(rng.normal(size=n))]
    city = [["oslo", "paris", "rome"][i % 3] for i in range(n)]
    count = rng.integers(0, 5, n)
    flag = rng.random(n) < 0.5
    label = [["a", "b"][i % 2] for i in range(n)]
    pq.write_table(pa.table({"amount": pa.array(amount, pa.float64()), "city": pa.array(city).dictionary_encode(),
                             "count": pa.array(count), "flag": pa.array(flag), "label": label}), tmp_path / "t.parquet")
    with (tmp_path / "t.csv").open("w") as fh:
        fh.write("amount,city,count,flag,label\n")
        for i in range(n):
            fh.write(f"{'' if amount[i] is None else repr(amount[i])},{city[i]},{count[i]},{int(flag[i])},{label[i]}\n")
    from_parquet = load_dataset(f"csv:{tmp_path / 't.parquet'}:label")
    from_csv = load_dataset(f"csv:{tmp_path / 't.csv'}:label")
    assert from_parquet.feature_names == from_csv.feature_names == ["amount", "city=oslo", "city=paris", "city=rome",
                                                                    "count", "flag"]
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(getattr(from_parquet, f"X_{split}"), getattr(from_csv, f"X_{split}"))
        np.testing.assert_array_equal(getattr(from_parquet, f"y_{split}"), getattr(from_csv, f"y_{split}"))
    pq.write_table(pa.table({"when": pa.array(np.array(["2024-01-01"] * 4, dtype="datetime64[ms]")), "y": ["a", "b"] * 2}),
                   tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"column 'when' has Parquet type timestamp.*convert it"):
        load_raw(f"csv:{tmp_path / 'd.parquet'}:y")


@pytest.mark.parametrize("nan_policy", ["mean", "drop"])
def test_a_large_table_is_prepared_in_float32_as_the_float64_path_prepares_it(tmp_path: Path, monkeypatch,
                                                                               nan_policy: str) -> None:
    """Above EXACT_CELLS a table is held as float32 minus a shift and prepared in chunks: the same rows, names and
    notes, values within float32 rounding of the float64 path (columns of 1.7e9 +- 5000 included)."""
    path = tmp_path / "t.csv"
    path.write_text(_table_text(3000, seed=2))
    exact = load_dataset(f"csv:{path}:label", nan_policy=nan_policy, seed=4)
    monkeypatch.setattr(table, "EXACT_CELLS", 500)
    monkeypatch.setattr(csv_loader, "EXACT_CELLS", 500)
    import secvfl.data.preprocess as preprocess

    monkeypatch.setattr(preprocess, "_CHUNK_ROWS", 97)
    raw = load_raw(f"csv:{path}:label")[1]
    assert raw.X.dtype == np.float32 and raw.shift is not None
    large = load_dataset(f"csv:{path}:label", nan_policy=nan_policy, seed=4)
    assert large.feature_names == exact.feature_names and large.notes == exact.notes
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(getattr(large, f"y_{split}"), getattr(exact, f"y_{split}"))
        np.testing.assert_allclose(getattr(large, f"X_{split}"), getattr(exact, f"X_{split}"), rtol=0, atol=2e-5)
        assert getattr(large, f"X_{split}").dtype == np.float32
    assert large.X_train.base is large.X_test.base  # one block, the splits are views of it
    gap = np.abs(large.standardisation.mean - exact.standardisation.mean)
    assert (gap <= 1e-6 * exact.standardisation.std).all()  # float32 rounding, in units of the column's spread


def test_a_numeric_column_with_text_further_down_becomes_categorical(tmp_path: Path, monkeypatch) -> None:
    """pyarrow types a column from the first block; text later re-reads it as text, as the rules say."""
    monkeypatch.setattr(table, "_BLOCK_BYTES", 64)
    path = tmp_path / "t.csv"
    path.write_text("a,b,y\n" + "".join(f"{i},{i % 3},{i % 2}\n" for i in range(60)) + "7,x,1\n")
    raw = load_raw(f"csv:{path}")[1]
    assert raw.feature_names == ["a", "b=0", "b=1", "b=2", "b=x"]


def test_the_new_refusals_name_the_column_and_the_fix(tmp_path: Path) -> None:
    def csv(text: str) -> str:
        p = tmp_path / "d.csv"
        p.write_text(text)
        return f"csv:{p}"

    with pytest.raises(DataError, match=r"column name 'a' appears twice \(columns 1 and 2\).*rename one"):
        load_raw(csv("a,a,y\n1,2,0\n3,4,1\n"))
    with pytest.raises(DataError, match=r"column 'customer_id' is named like a row id but 1 of its 4 values repeat "
                                        r"\(e.g. '7' on line 2 and line 4\)"):
        load_raw(csv("customer_id,a,y\n7,1,0\n8,2,1\n7,3,0\n9,4,1\n"))
    with pytest.raises(DataError, match=r"class 'rare' has a single row; a stratified split"):
        load_dataset(csv("a,y\n" + "".join(f"{i},{'ab'[i % 2]}\n" for i in range(40)) + "99,rare\n"))
    with pytest.raises(DataError, match=r"column 'b' holds values as large as -?1e\+308.*rescale the column"):
        load_dataset(csv("a,b,y\n" + "".join(f"{i},{'-1e308' if i % 3 else '1e308'},{i % 2}\n" for i in range(40))))
    # Distinct ids are still dropped quietly; a large but standardisable column is fine.
    d = load_dataset(csv("ID,a,b,y\n" + "".join(f"{i},{i},{i * 1e150},{i % 2}\n" for i in range(40))))
    assert d.feature_names == ["a", "b"] and np.isfinite(d.X_train).all()
