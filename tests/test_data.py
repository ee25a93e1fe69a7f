import gzip

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.cli.main import main
from secvfl.data import RawData, load_dataset, load_raw, partition_image, prepare
from secvfl.data.masks import parse_p_miss
from secvfl.data.partition import max_image_parties
from secvfl.data.preprocess import min_rows_per_class
from secvfl.errors import DataError, DataWarning


def _write(path, text, gz=False):
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def test_csv_with_missing_values_categories_and_id(tmp_path):
    rows = ["ID,age,city,income,label"]
    rng = np.random.default_rng(0)
    for i in range(200):
        age = "" if i % 17 == 0 else str(20 + i % 50)
        city = "?" if i % 23 == 0 else ["paris", "oslo", "rome"][i % 3]
        rows.append(f"{i},{age},{city},{rng.normal():.3f},{'yes' if i % 3 == 0 else 'no'}")
    p = _write(tmp_path / "t.csv.gz", "\n".join(rows) + "\n", gz=True)
    d = load_dataset(f"csv:{p}:label")
    assert d.n_classes == 2 and d.classes == ["no", "yes"]
    assert d.feature_names == ["age", "city=oslo", "city=paris", "city=rome", "income"]  # ID dropped, one-hot
    assert not np.isnan(d.X_train).any() and not np.isnan(d.X_test).any()
    assert any("imputed" in n for n in d.notes)
    assert abs(d.X_train.mean(axis=0)).max() < 1e-5  # standardised on the training split
    with pytest.raises(DataError, match="missing values .* 'error'"):
        load_dataset(f"csv:{p}:label", nan_policy="error")
    dropped = load_dataset(f"csv:{p}:label", nan_policy="drop")
    assert len(dropped.y_train) + len(dropped.y_val) + len(dropped.y_test) < 200


def test_csv_errors_are_clear(tmp_path):
    p = _write(tmp_path / "r.csv", "a,b,y\n1,2,0\n3,4\n")
    with pytest.raises(DataError, match="ragged: line 3 has 2 fields"):
        load_raw(f"csv:{p}")
    p = _write(tmp_path / "ok.csv", "a,b,y\n" + "".join(f"{i},{i},{i % 2}\n" for i in range(20)))
    with pytest.raises(DataError, match="label column 'target' not found"):
        load_raw(f"csv:{p}:target")
    with pytest.raises(DataError, match="does not exist"):
        load_raw(f"csv:{tmp_path}/nope.csv")
    p = _write(tmp_path / "one.csv", "a,y\n" + "".join(f"{i},1\n" for i in range(20)))
    with pytest.raises(DataError, match="single value"):
        load_raw(f"csv:{p}:y")
    with pytest.raises(DataError, match="unknown dataset 'cifar'"):
        load_raw("cifar")


def test_named_dataset_without_data_dir(monkeypatch):
    monkeypatch.delenv("SECVFL_DATA_DIR", raising=False)
    with pytest.raises(DataError, match="--data-dir"):
        load_raw("credit")


def test_bundled_sets_need_no_files():
    d = load_dataset("digits")
    assert d.image_shape == (8, 8) and d.n_classes == 10
    assert len(d.y_train) + len(d.y_val) + len(d.y_test) == 1797


def test_real_datasets(data_dir):
    credit = load_dataset("credit", data_dir, val_fraction=0)
    assert credit.n_features == 23 and len(credit.y_train) == 24000 and len(credit.y_test) == 6000
    assert credit.feature_names[0] == "LIMIT_BAL"
    assert abs(credit.y_test.mean() - credit.y_train.mean()) < 0.002  # stratified
    mnist = load_dataset("mnist", data_dir, val_fraction=0)
    assert mnist.X_train.shape == (60000, 784) and mnist.X_test.shape == (10000, 784)
    a9a = load_dataset("a9a", data_dir, val_fraction=0)
    assert a9a.X_train.shape == (32561, 123) and a9a.X_test.shape == (16281, 123)
    w8a = load_raw("w8a", data_dir)[1]
    assert w8a.X.shape == (49749, 300)
    mush = load_raw("mushrooms", data_dir)[1]
    assert mush.X.shape == (6513, 126) and mush.X_test.shape == (1611, 126)
    raw = load_raw(f"csv:{data_dir}/mushrooms/agaricus-lepiota.data.gz:#0", data_dir)[1]
    assert raw.X.shape[0] == 8124 and np.isnan(raw.X).any()  # stalk-root has '?' cells


def test_idx_and_svmlight_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_raw(f"idx:{tmp_path}/none")
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + b"\x00" * 3)
    with pytest.raises(DataError):
        load_raw(f"idx:{tmp_path}")
    bad = _write(tmp_path / "bad.svm", "1 a:b\n")
    with pytest.raises(DataError, match="svmlight"):
        load_raw(f"svmlight:{bad}")


# -- bad files: one DataError naming the file and the problem (issue 13) -------------------------------------------
_CORRUPT_GZIP = b"\x1f\x8b\x08\x00garbagegarbage"  # a gzip header, then no deflate stream


def test_corrupt_or_truncated_gzip_is_a_data_error_naming_the_file(tmp_path):
    (tmp_path / "c.csv.gz").write_bytes(_CORRUPT_GZIP)
    good = gzip.compress(b"a,b,y\n" + b"".join(b"%d,%d,%d\n" % (i, i, i % 2) for i in range(200)))
    (tmp_path / "t.csv.gz").write_bytes(good[: len(good) // 2])
    (tmp_path / "c.svm.gz").write_bytes(_CORRUPT_GZIP)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(_CORRUPT_GZIP)
    for spec, name in [("csv:{}/c.csv.gz", "c.csv.gz"), ("csv:{}/t.csv.gz", "t.csv.gz"),
                       ("svmlight:{}/c.svm.gz", "c.svm.gz"), ("idx:{}", "train-images-idx3-ubyte.gz")]:
        with pytest.raises(DataError, match=rf"{name}.*corrupt or truncated gzip data"):
            load_raw(spec.format(tmp_path))


def test_svmlight_errors_name_the_line(tmp_path):
    p = _write(tmp_path / "d.svm", "1 1:0.5 2:1\n# a comment\n0 1:0.3 2:1\n1 3:x\n")
    with pytest.raises(DataError, match=r"d.svm line 4: the value in '3:x' is not a number"):
        load_raw(f"svmlight:{p}")
    p = _write(tmp_path / "e.svm", "1 1:0.5\nyes 1:1\n")
    with pytest.raises(DataError, match=r"e.svm line 2: the label 'yes' is not a number"):
        load_raw(f"svmlight:{p}")
    p = _write(tmp_path / "n.svm", "\n# nothing\n")
    with pytest.raises(DataError, match="has no data lines"):
        load_raw(f"svmlight:{p}")


def test_directories_and_infinite_values_are_refused(tmp_path):
    with pytest.raises(DataError, match="is a directory"):
        load_raw(f"csv:{tmp_path}")
    with pytest.raises(DataError, match="is a directory"):
        load_raw(f"svmlight:{tmp_path}")
    p = _write(tmp_path / "i.csv", "a,b,y\n" + "".join(f"{i},{'-1e999' if i == 5 else i},{i % 2}\n" for i in range(30)))
    with pytest.raises(DataError, match=r"i.csv line 7: column 'b' holds '-1e999', an infinite number"):
        load_raw(f"csv:{p}")
    p = _write(tmp_path / "i.svm", "1 1:0.5\n0 1:inf\n")
    with pytest.raises(DataError, match=r"row 2, column 'f1' holds inf; features must be finite"):
        load_dataset(f"svmlight:{p}")


def test_a_column_without_values_is_dropped_with_a_warning(tmp_path):
    rng = np.random.default_rng(1)
    rows = [(f"{rng.normal():.4f}", f"{rng.normal():.4f}", str(i % 3)) for i in range(150)]
    with_empty = _write(tmp_path / "e.csv", "a,gone,b,y\n" + "".join(f"{a},,{b},{y}\n" for a, b, y in rows))
    without = _write(tmp_path / "w.csv", "a,b,y\n" + "".join(f"{a},{b},{y}\n" for a, b, y in rows))
    with pytest.warns(DataWarning, match=r"column\(s\) 'gone' have no value in the training split; dropped them"):
        d = load_dataset(f"csv:{with_empty}", nan_policy="drop")  # dropping rows would otherwise drop every row
    ref = load_dataset(f"csv:{without}", nan_policy="drop")
    assert d.feature_names == ref.feature_names == ["a", "b"]
    for split in ("train", "val", "test"):
        np.testing.assert_allclose(getattr(d, f"X_{split}"), getattr(ref, f"X_{split}"), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(getattr(d, f"y_{split}"), getattr(ref, f"y_{split}"))
    assert any("dropped them" in n for n in d.notes)


def test_a_pixel_without_values_keeps_the_image_grid():
    X = np.random.default_rng(0).random((60, 16))
    X[:, 5] = np.nan
    raw = RawData(X=X, y=np.arange(60) % 2, feature_names=[f"p{j}" for j in range(16)], classes=["0", "1"],
                  image_shape=(4, 4))
    with pytest.warns(DataWarning, match="pixel column"):
        d = prepare(raw, "img")
    assert d.n_features == 16 and not np.isnan(d.X_train).any()


def test_a_one_row_csv_is_refused(tmp_path):
    p = _write(tmp_path / "o.csv", "a,b,y\n1,2,0\n")
    with pytest.raises(DataError, match="has 1 data row below its header"):
        load_raw(f"csv:{p}")


@settings(max_examples=40, deadline=None)
@given(st.floats(0.05, 0.5), st.one_of(st.just(0.0), st.floats(0.01, 0.5)))
def test_min_rows_per_class_is_where_the_real_split_starts_to_fill_every_split(test_fraction, val_fraction):
    m = min_rows_per_class(test_fraction, val_fraction)

    def raw(n):
        return RawData(X=np.arange(2 * n, dtype=float)[:, None], y=np.repeat([0, 1], n), feature_names=["x"],
                       classes=["0", "1"])

    d = prepare(raw(m), "t", test_fraction=test_fraction, val_fraction=val_fraction)
    assert len(d.y_train) and len(d.y_test) and (len(d.y_val) or val_fraction == 0)
    if m > 1:
        with pytest.raises(DataError, match="split(s are| is) empty"):
            prepare(raw(m - 1), "t", test_fraction=test_fraction, val_fraction=val_fraction)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 10), st.integers(1, 10))
def test_max_image_parties_is_the_largest_grid_that_partition_image_cuts(h, w):
    def cuts(k):
        try:
            partition_image((h, w), k, "quadrants")
            return True
        except DataError:
            return False

    assert max_image_parties(h, w) == max(k for k in range(1, h * w + 1) if cuts(k))


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)))
def test_parse_p_miss_accepts_exactly_the_probabilities_in_0_1(value):
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None and 0 <= number < 1:
        assert parse_p_miss(value) == number
    elif isinstance(value, str) and value.strip().startswith("beta:"):
        return  # Beta specs have their own checks
    else:
        with pytest.raises(DataError):
            parse_p_miss(value)


def test_corrupt_gzip_through_secvfl_align(tmp_path, capsys):
    (tmp_path / "l.csv").write_text("ID,a\n1,2\n2,3\n")
    (tmp_path / "f.csv.gz").write_bytes(_CORRUPT_GZIP)
    assert main(["align", "--party", f"l={tmp_path / 'l.csv'}", "--party", f"f={tmp_path / 'f.csv.gz'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("secvfl: error: cannot read") and "corrupt or truncated gzip data" in err
    assert err.count("\n") == 1
