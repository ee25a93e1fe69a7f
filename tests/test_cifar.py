"""CIFAR-10/100 files (both distributed formats, folders and archives) and the image bottoms that train on them.

The files are generated here, small, in the layout the CIFAR page documents (binary: a label byte, for CIFAR-100 a
coarse and a fine one, then 1024 red, 1024 green and 1024 blue pixels row by row; python: a pickled dict with
``data`` (uint8 rows) and ``labels``). The reference is the generator's own pixel array.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from secvfl.cli.main import main
from secvfl.data import load_dataset, load_raw, partition_image
from secvfl.data.cifar import load_cifar
from secvfl.errors import ConfigError, DataError
from secvfl.models import ResNetBottom, SmallCNN, make_bottom

NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (n, 3, 32, 32) uint8 whose pixels encode their position, and labels covering every class."""
    rng = np.random.default_rng(seed)
    c, r, k = np.meshgrid(np.arange(3), np.arange(32), np.arange(32), indexing="ij")
    base = (c * 80 + r * 3 + k) % 256
    shift = rng.integers(0, 256, size=(n, 1, 1, 1))
    labels = np.arange(n) % 10
    return ((base[None] + shift) % 256).astype(np.uint8), labels.astype(np.int64)


def _binary_cifar10(folder: Path, batches: int = 2, per_batch: int = 30, test: int = 20) -> tuple[np.ndarray, ...]:
    folder.mkdir(parents=True)
    xs, ys = [], []
    for b in range(batches):
        x, y = _images(per_batch, seed=b)
        records = np.concatenate([y.astype(np.uint8)[:, None], x.reshape(per_batch, -1)], axis=1)
        (folder / f"data_batch_{b + 1}.bin").write_bytes(records.tobytes())
        xs.append(x)
        ys.append(y)
    xt, yt = _images(test, seed=99)
    (folder / "test_batch.bin").write_bytes(np.concatenate([yt.astype(np.uint8)[:, None], xt.reshape(test, -1)],
                                                           axis=1).tobytes())
    (folder / "batches.meta.txt").write_text("\n".join(NAMES) + "\n\n")
    return np.concatenate(xs), np.concatenate(ys), xt, yt


def _python_cifar10(folder: Path, x: np.ndarray, y: np.ndarray, xt: np.ndarray, yt: np.ndarray,
                    batches: int = 2) -> None:
    """The same images as the python version writes them (protocol 2, bytes keys, as the distributed files)."""
    folder.mkdir(parents=True)
    for b, (xb, yb) in enumerate(zip(np.array_split(x, batches), np.array_split(y, batches), strict=True)):
        content = {b"batch_label": b"training batch", b"labels": [int(v) for v in yb],
                   b"data": xb.reshape(len(xb), -1), b"filenames": [b"f.png"] * len(xb)}
        (folder / f"data_batch_{b + 1}").write_bytes(pickle.dumps(content, protocol=2))
    (folder / "test_batch").write_bytes(pickle.dumps({b"labels": [int(v) for v in yt],
                                                      b"data": xt.reshape(len(xt), -1)}, protocol=2))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [n.encode() for n in NAMES]}, protocol=2))


@pytest.fixture(scope="module")
def cifar10(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[np.ndarray, ...]]:
    root = tmp_path_factory.mktemp("cifar")
    arrays = _binary_cifar10(root / "cifar-10-batches-bin")
    return root, arrays


def test_the_binary_version_is_read_channel_major_with_its_test_batch(cifar10) -> None:
    root, (x, y, xt, yt) = cifar10
    raw = load_cifar(root / "cifar-10-batches-bin")
    np.testing.assert_array_equal(raw.X, x.reshape(len(x), -1) / 255.0)
    np.testing.assert_array_equal(raw.X_test, xt.reshape(len(xt), -1) / 255.0)
    assert raw.y.tolist() == y.tolist() and raw.y_test.tolist() == yt.tolist()
    assert raw.classes == NAMES and raw.image_shape == (32, 32) and raw.image_channels == 3
    # channel-major columns: green pixel (row 5, column 7) of image 3
    assert raw.X[3, 1 * 1024 + 5 * 32 + 7] == x[3, 1, 5, 7] / 255.0 and raw.feature_names[1024 + 5 * 32 + 7] == "g5_7"
    assert load_cifar(root).X.shape == raw.X.shape  # the folder that holds the batches folder
    name, by_spec = load_raw(f"cifar:{root}")
    assert name == root.name and np.array_equal(by_spec.X, raw.X)


def test_the_python_version_and_the_archives_give_the_same_data(cifar10, tmp_path: Path) -> None:
    root, (x, y, xt, yt) = cifar10
    want = load_cifar(root)
    _python_cifar10(tmp_path / "cifar-10-batches-py", x, y, xt, yt)
    for got in (load_cifar(tmp_path / "cifar-10-batches-py"), load_cifar(tmp_path)):
        assert np.array_equal(got.X, want.X) and np.array_equal(got.X_test, want.X_test)
        assert np.array_equal(got.y, want.y) and got.classes == NAMES
    for folder, archive in (("cifar-10-batches-bin", "cifar-10-binary.tar.gz"),
                            ("cifar-10-batches-py", "cifar-10-python.tar.gz")):
        source = root if folder.endswith("bin") else tmp_path
        with tarfile.open(tmp_path / archive, "w:gz") as tar:
            tar.add(source / folder, arcname=folder)
        got = load_cifar(tmp_path / archive)
        assert np.array_equal(got.X, want.X) and np.array_equal(got.y_test, want.y_test)


def test_cifar100_trains_on_its_fine_labels(tmp_path: Path) -> None:
    x, _ = _images(25, seed=4)
    fine, coarse = np.arange(25) * 4 % 100, np.arange(25) % 20
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    rows = np.concatenate([coarse.astype(np.uint8)[:, None], fine.astype(np.uint8)[:, None], x.reshape(25, -1)], 1)
    (folder / "train.bin").write_bytes(rows.tobytes())
    (folder / "test.bin").write_bytes(rows[:7].tobytes())
    raw = load_cifar(folder)
    assert raw.y.tolist() == fine.tolist() and len(raw.classes) == 100 and raw.y_test.tolist() == fine[:7].tolist()
    np.testing.assert_array_equal(raw.X, x.reshape(25, -1) / 255.0)
    with pytest.raises(DataError, match="holds CIFAR-100, not CIFAR-10"):
        load_cifar(folder, 10)


def test_a_pickle_that_names_anything_but_numpy_arrays_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):  # noqa: ANN204 - what a crafted file does: call a function while it loads
            return (os.system, (f"touch {marker}",))

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": Payload(), b"labels": []}, protocol=2))
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0]}))
    with pytest.raises(DataError, match=r"data_batch_1 .* is not a CIFAR python-version file: it names (posix|os)"):
        load_cifar(folder)
    assert not marker.exists()


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "data_batch_2.bin").write_bytes((d / "data_batch_2.bin").read_bytes()[:-5]),
     "data_batch_2.bin in .*: 92185 bytes is not a whole number of 3073-byte CIFAR-10 records"),
    (lambda d: (d / "test_batch.bin").write_bytes(b"\x0c" + (d / "test_batch.bin").read_bytes()[1:]),
     "a test label is 12, outside 0..9 of CIFAR-10"),
    (lambda d: (d / "test_batch.bin").unlink(), "holds no CIFAR files"),
])
def test_damaged_files_are_named_in_one_line(damage, message: str, tmp_path: Path) -> None:  # noqa: ANN001
    _binary_cifar10(tmp_path / "c")
    damage(tmp_path / "c")
    with pytest.raises(DataError, match=message):
        load_cifar(tmp_path / "c")


def test_a_party_holds_its_region_in_every_channel(cifar10) -> None:
    root, (x, *_) = cifar10
    raw = load_cifar(root)
    part = partition_image((32, 32), 4, "quadrants", channels=3)
    assert part.channels == 3 and part.block_shapes == ((16, 16),) * 4
    np.testing.assert_array_equal(part.take(raw.X, 3), x[:, :, 16:, 16:].reshape(len(x), -1) / 255.0)
    assert sorted(np.concatenate(part.blocks).tolist()) == list(range(3072))  # every column, once


def test_the_image_bottoms_read_a_region_as_channels_and_refuse_what_is_not_one() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16, 16)
    for model in (ResNetBottom((16, 16), 10, in_channels=3, width=8), SmallCNN((16, 16), 10, in_channels=3)):
        out = model(x.reshape(5, -1))
        assert out.shape == (5, 10)
        features = model.stem(x) if isinstance(model, ResNetBottom) else model.features(x)
        assert features.shape[1] in (8, 32)
    resnet = ResNetBottom((16, 16), 10, in_channels=3, width=8).train()
    alone = resnet(x[:1].reshape(1, -1))
    in_batch = resnet(x.reshape(5, -1))[:1]
    torch.testing.assert_close(alone, in_batch)  # GroupNorm: a row's embedding depends on that row only
    assert isinstance(make_bottom("resnet", 768, 10, [8], (16, 16), channels=3), ResNetBottom)
    with pytest.raises(ConfigError, match="needs image data split into regions"):
        make_bottom("resnet", 768, 10, [8], None)
    with pytest.raises(ConfigError, match="a 3x16x16 image region has 768 values, the block has 700"):
        make_bottom("cnn", 700, 10, [8], (16, 16), channels=3)


@pytest.mark.parametrize("bottom, algo", [("resnet", "splitnn"), ("cnn", "vafl")])
def test_training_on_cifar_with_an_image_bottom(cifar10, bottom: str, algo: str, tmp_path: Path) -> None:
    root, _ = cifar10
    out = tmp_path / "run"
    assert main(["train", "--dataset", f"cifar:{root}", "--algo", algo, "--bottom", bottom, "--hidden", "8",
                 "--parties", "4", "--epochs", "1", "--batch-size", "16", "--val-fraction", "0", "--device", "cpu",
                 "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["n_train"] == 60 and summary["data"]["n_features"] == 3072
    assert any("cifar-10 (binary version)" in note for note in summary["data"]["notes"])


def test_colour_images_are_standardised_per_channel(cifar10) -> None:
    root, (x, *_) = cifar10
    data = load_dataset(f"cifar:{root}", val_fraction=0)
    per_channel = data.X_train.reshape(len(data.X_train), 3, -1).astype(np.float64)
    np.testing.assert_allclose(per_channel.mean(axis=(0, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(per_channel.std(axis=(0, 2)), 1, atol=1e-5)
    raw = x.reshape(len(x), 3, -1) / 255.0  # the reference: each channel's own mean and std
    want = (raw - raw.mean(axis=(0, 2), keepdims=True)) / raw.std(axis=(0, 2), keepdims=True)
    np.testing.assert_allclose(np.sort(per_channel.ravel()), np.sort(want.ravel()), atol=1e-5)


def test_the_image_bottoms_are_refused_where_the_parties_run_no_such_model(capsys: pytest.CaptureFixture) -> None:
    for algo in ("dlr", "eg", "eg-mlp"):
        assert main(["train", "--algo", algo, "--dataset", "digits", "--bottom", "cnn", "--device", "cpu",
                     "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"--bottom does not apply to --algo {algo} (drop it)" in err and "Traceback" not in err


def test_cifar_shortcuts_look_in_the_data_directory(cifar10, tmp_path: Path) -> None:
    root, _ = cifar10
    raw = load_raw("cifar10", root)[1]
    assert raw.image_channels == 3
    with pytest.raises(DataError, match="has no CIFAR-100 .*cifar-100-binary"):
        load_raw("cifar100", root)
    with pytest.raises(DataError, match="needs a path"):
        load_raw("cifar:")
    with pytest.raises(DataError, match="not a .tar.gz archive"):
        (tmp_path / "x.bin").write_bytes(b"1")
        load_cifar(tmp_path / "x.bin")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("readme.txt")
        tar.addfile(info, io.BytesIO(b""))
    (tmp_path / "empty.tar.gz").write_bytes(buf.getvalue())
    with pytest.raises(DataError, match="holds no CIFAR files"):
        load_cifar(tmp_path / "empty.tar.gz")


def test_model_completion_shifts_every_channel_of_a_colour_region_alike() -> None:
    from attacks.model_completion import CompletionConfig, _Augment

    base = torch.arange(1, 2 * 6 * 6 + 1, dtype=torch.float32).reshape(2, 1, 6, 6)
    x = torch.cat([base + 100 * c for c in range(3)], dim=1).reshape(2, -1)  # channel c = channel 0 + 100 c
    out = _Augment(x, (6, 6), CompletionConfig(seed=0), torch.Generator().manual_seed(1)).shift(x).reshape(2, 3, 6, 6)
    padded = out[:, 0] == 0  # the zero padding the shift brought in
    assert padded.any() and not padded.all()
    for c in (1, 2):
        assert torch.equal(out[:, c] == 0, padded)  # the same shift in every channel
        assert torch.equal((out[:, c] - out[:, 0])[~padded], torch.full_like(out[:, 0][~padded], 100.0 * c))
