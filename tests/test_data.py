import gzip

import numpy as np
import pytest

from secvfl.data import load_dataset, load_raw
from secvfl.errors import DataError


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
