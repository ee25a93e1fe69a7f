"""Each party reads its own file in a deployment (issue 18): rows aligned by PSI, splits drawn by the label party.

The reference is independent of the deployment code: the rows every party holds, joined by id in plain Python
into one CSV (feature columns in party order, then the label), read by ``secvfl train``'s own CSV loader. The
parties' files hold other rows too (ids only one party has), in other orders, with missing cells and a categorical
column, so alignment, one-hot encoding, imputation and standardisation all have to agree with the one-table path.
"""

from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_wine

from protocols.psi import Workers, align, align_rows_with_peers
from secvfl.config import TrainConfig
from secvfl.data import load_dataset
from secvfl.deploy.data import (
    PLAN_IDS_KIND,
    check_config,
    load_preprocessing,
    plan_rows,
    prepare_own_block,
    read_own_file,
    read_prepared_table,
    receive_plan,
    record_alignment,
    run_table,
    save_preprocessing,
    send_plan,
    uses_data_files,
)
from secvfl.deploy.loopback import loopback_federation
from secvfl.errors import ConfigError, DataError, MessageError, ProtocolError
from secvfl.federation import load_federation
from secvfl.messages import Message
from secvfl.transport.inprocess import InProcessTransport
from secvfl.transport.layers import Role
from secvfl.transport.network import Network

_P0 = [f"a{j}" for j in range(8)]  # party0: 8 numeric columns
_P1 = [f"b{j}" for j in range(5)] + ["grade"]  # party1: 5 numeric columns and one of 3 categories: 8 features
_GRADES = ("high", "low", "mid")


def _write(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)


def _files(folder: Path) -> dict[str, object]:
    """Three parties' files from wine (178 rows, 3 classes) and the joined reference table."""
    X, y = load_wine(return_X_y=True)
    rng = np.random.default_rng(7)
    ids = [f"c{i:04d}" for i in range(len(y))]
    cells = [[f"{v:.6g}" for v in row] for row in X]
    for r, c in zip(rng.integers(0, len(y), 12), rng.integers(0, 8, 12), strict=True):
        cells[r][c] = ""  # party0's missing cells
    grade = [_GRADES[int(v)] for v in np.digitize(X[:, 12], np.quantile(X[:, 12], [1 / 3, 2 / 3]))]
    only_label = set(rng.choice(len(y), 9, replace=False).tolist())
    not_at_p0 = set(rng.choice(len(y), 6, replace=False).tolist())
    folder.mkdir(parents=True, exist_ok=True)
    names = ["yes", "maybe", "no"]
    label_order = rng.permutation(len(y))
    _write(folder / "label.csv", ["id", "cultivar"], [[ids[i], names[y[i]]] for i in label_order]
           + [["x-only-label", "yes"]])
    p0 = [i for i in rng.permutation(len(y)) if i not in only_label and i not in not_at_p0]
    _write(folder / "p0.csv", ["id", *_P0, "ignored"], [[ids[i], *cells[i][:8], "7"] for i in p0]
           + [[f"extra{k}", *["1"] * 8, "7"] for k in range(5)])
    p1 = [i for i in rng.permutation(len(y)) if i not in only_label]
    _write(folder / "p1.csv", ["b0", "id", *_P1[1:]], [[cells[i][8], ids[i], *cells[i][9:13], grade[i]] for i in p1])
    held = set(p0) & set(p1)
    joined = [i for i in label_order if i in held]
    _write(folder / "joined.csv", [*_P0, *_P1, "cultivar"],
           [[*cells[i][:8], *cells[i][8:13], grade[i], names[y[i]]] for i in joined])
    def table(file: str, columns: list[str]) -> str:
        return f'{{ file = "{file}", id = "id", columns = [{", ".join(repr(c) for c in columns)}] }}'

    tables = {"label": '{ file = "label.csv", id = "id", label = "cultivar" }', "party0": table("p0.csv", _P0),
              "party1": table("p1.csv", _P1)}
    return {"tables": tables, "joined": folder / "joined.csv", "n_held": len(joined)}


@pytest.fixture
def federation(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    made = _files(tmp_path)
    return loopback_federation(tmp_path, 2, data=made["tables"]), made  # type: ignore[arg-type]


@pytest.mark.parametrize(("seed", "large"), [(0, False), (3, False), (3, True)])
def test_the_parties_own_files_give_the_joined_table_s_data(federation, seed: int, large: bool, monkeypatch) -> None:
    """``large``: the files are read as a large table is (float32 minus a shift, prepared in row chunks)."""
    fed_path, made = federation
    fed = load_federation(fed_path)
    assert uses_data_files(fed)
    cfg = TrainConfig(seed=seed, parties=2)
    ref = load_dataset(f"csv:{made['joined']}:cultivar", seed=seed, val_fraction=cfg.val_fraction)
    if large:
        import secvfl.data.csv_loader as csv_loader
        import secvfl.data.preprocess as preprocess
        import secvfl.data.table as table

        monkeypatch.setattr(table, "EXACT_CELLS", 50)
        monkeypatch.setattr(csv_loader, "EXACT_CELLS", 50)
        monkeypatch.setattr(preprocess, "_CHUNK_ROWS", 13)
    own = {p.name: read_own_file(p.data, p.name) for p in fed.parties}
    result = align({p: own[p].ids for p in ("label", "party0", "party1")}, "label")
    plan = plan_rows(own["label"], {p: np.flatnonzero(result.held[:, j]) for j, p in enumerate(("party0", "party1"))},
                     cfg)
    assert plan.counts["held_by_all"] == made["n_held"]
    blocks = [prepare_own_block(own[p], plan.ids, result.own_rows[p], cfg) for p in ("party0", "party1")]
    widths = [len(names) for _, names, _, _ in blocks]
    got, partition = run_table("fed", widths, [len(i) for i in plan.ids], len(plan.classes), labels=plan.y,
                               classes=plan.classes)
    for k, (columns, _, _, _) in enumerate(blocks):
        for split, part in zip(("train", "val", "test"), columns, strict=True):
            getattr(got, f"X_{split}")[:, partition.blocks[k]] = part
    assert widths == [8, 8] and got.classes == ref.classes == ["maybe", "no", "yes"]
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(getattr(got, f"y_{split}"), getattr(ref, f"y_{split}"))
        np.testing.assert_allclose(getattr(got, f"X_{split}"), getattr(ref, f"X_{split}"), rtol=1e-6,
                                   atol=2e-6 if large else 1e-6)
    assert np.isfinite(got.X_train).all() and abs(float(got.X_train[:, :8].mean())) < 1e-5  # imputed, standardised


def test_a_party_refuses_rows_outside_its_intersection_and_mixed_tables_are_refused(federation, tmp_path) -> None:
    fed_path, _ = federation
    fed = load_federation(fed_path)
    p0 = read_own_file(fed.party("party0").data, "party0")
    learned = np.arange(50)
    with pytest.raises(ProtocolError, match="outside their private set intersection"):
        prepare_own_block(p0, (p0.ids[:40], p0.ids[40:45], p0.ids[60:61]), learned, TrainConfig())
    with pytest.raises(ProtocolError, match="outside their private set intersection"):  # an id it does not hold
        prepare_own_block(p0, (p0.ids[:40], p0.ids[40:45], ["nobody"]), learned, TrainConfig())
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    text = fed_path.read_text().replace('data = { file = "p1.csv"', 'x = { file = "p1.csv"').replace("\nx = {", "\n#")
    (mixed / "federation.toml").write_text(text)
    for name in ("label.csv", "p0.csv"):
        (mixed / name).write_bytes((fed_path.parent / name).read_bytes())
    with pytest.raises(ConfigError, match="give every party a data table"):
        uses_data_files(load_federation(mixed / "federation.toml"))


@pytest.mark.parametrize(("changes", "message"), [
    ({"p_miss_train": "0.3"}, "--p-miss-train 0.3 simulates missing blocks"),
    ({"p_miss_test": "beta:2,2"}, "--p-miss-test beta:2,2 simulates missing blocks"),
    ({"nan_policy": "drop"}, "--nan-policy drop would remove rows"),
])
def test_settings_that_per_party_files_cannot_honour_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(TrainConfig(**changes))


def test_bad_party_files_get_one_line_naming_the_file(tmp_path: Path) -> None:
    from secvfl.federation import DataSpec

    (tmp_path / "dup.csv").write_text("id,x\n1,2\n1,3\n")
    (tmp_path / "short.csv").write_text("id,x\n1,2\n2\n")
    with pytest.raises(DataError, match="repeats 1 id"):
        read_own_file(DataSpec(file=tmp_path / "dup.csv", id="id", columns=("x",)), "p")
    with pytest.raises(DataError, match="short.csv is ragged: line 3 has 1 fields"):
        read_own_file(DataSpec(file=tmp_path / "short.csv", id="id", columns=("x",)), "p")
    with pytest.raises(DataError, match="no column 'y'"):
        read_own_file(DataSpec(file=tmp_path / "dup.csv", id="id", columns=("y",)), "p")
    with pytest.raises(DataError, match="does not exist"):
        read_own_file(DataSpec(file=tmp_path / "none.csv", id="id", columns=("x",)), "p")


def test_a_resumed_run_must_align_to_the_same_rows(federation, tmp_path: Path) -> None:
    fed_path, _ = federation
    fed = load_federation(fed_path)
    own = read_own_file(fed.party("label").data, "label")
    every = np.arange(len(own.ids))
    plan = plan_rows(own, {"party0": every, "party1": every}, TrainConfig())
    record_alignment(tmp_path / "run", plan, resumed=False)
    record_alignment(tmp_path / "run", plan, resumed=True)  # the same rows: accepted
    ids = [i.to_pylist() for i in plan.ids]
    assert json.loads((tmp_path / "run" / "alignment.json").read_text())["rows_sha256"] == hashlib.sha256(
        b"".join(json.dumps([s, i]).encode() for s, i in zip(("train", "val", "test"), ids, strict=True))).hexdigest()
    fewer = plan_rows(own, {"party0": every[:-20], "party1": every}, TrainConfig())
    with pytest.raises(ConfigError, match="align to other rows"):
        record_alignment(tmp_path / "run", fewer, resumed=True)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["splitnn", "vafl"])
def test_a_federation_of_own_files_trains_as_one_process_on_the_joined_table(federation, tmp_path: Path,
                                                                             algo: str) -> None:
    fed_path, made = federation
    common = ("--algo", algo, "--parties", "2", "--epochs", "2", "--seed", "5", "--batch-size", "16", "--device", "cpu")
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "secvfl.cli.main", "launch", "--federation", str(fed_path),
                           "--out", str(run), "--threads", "1", "--party-timeout", "60", *common],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((run / "label" / "summary.json").read_text())
    from secvfl.cli.main import main

    assert main(["train", "--out", str(tmp_path / "inproc"), "--no-progress", "--threads", "1",
                 "--dataset", f"csv:{made['joined']}:cultivar", *common]) == 0
    expected = json.loads((tmp_path / "inproc" / "summary.json").read_text())
    for key, value in expected["metrics"]["test"].items():
        assert got["metrics"]["test"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert got["comm"] == expected["comm"]  # alignment traffic is counted apart, under "alignment"
    alignment = got["alignment"]
    assert alignment["held_by_all"] == made["n_held"] and alignment["widths"] == [8, 8]
    assert alignment["psi_bytes"] > 64 * 2 * made["n_held"] and alignment["psi_messages"] == 8  # 2 rounds, both ways
    assert json.loads((run / "label" / "alignment.json").read_text())["rows_sha256"] == alignment["rows_sha256"]
    assert "[party0]" in done.stderr and "ids are also held by label" in done.stderr


class _BlockingTransport(InProcessTransport):
    """The in-process transport, shared by parties in threads: a take waits (30 s at most) for its message."""

    def __init__(self) -> None:
        super().__init__()
        self._ready = threading.Condition()

    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        with self._ready:
            super().put(sender, receiver, kind, data)
            self._ready.notify_all()

    def take(self, receiver: str, *, kind: str | None = None, sender: str | None = None) -> bytes:
        deadline = time.monotonic() + 30
        with self._ready:
            while True:
                try:
                    return super().take(receiver, kind=kind, sender=sender)
                except MessageError:
                    if not self._ready.wait(max(0.0, deadline - time.monotonic())):
                        raise


def test_each_party_aligning_on_its_own_gets_the_in_process_alignment(federation, monkeypatch) -> None:
    """The deployed side (align_rows_with_peers: each party its own PsiParty, its own messages, here in threads over
    one blocking transport) gives every party what the in-process align gives it; 16-id chunks."""
    import protocols.psi as psi

    monkeypatch.setattr(psi, "CHUNK_IDS", 16)
    fed_path, _ = federation
    fed = load_federation(fed_path)
    own = {p.name: read_own_file(p.data, p.name) for p in fed.parties}
    expected = align({p: own[p].ids for p in ("label", "party0", "party1")}, "label")
    transport = _BlockingTransport()
    roles = {"label": Role.LABEL, "party0": Role.FEATURE, "party1": Role.FEATURE}
    got: dict[str, dict] = {}

    def side(me: str, peers: list[str]) -> None:
        net = Network(roles, transport=transport)
        got[me] = align_rows_with_peers(net, me, peers, own[me].ids, workers=Workers(1))

    threads = [threading.Thread(target=side, args=("label", ["party0", "party1"]))]
    threads += [threading.Thread(target=side, args=(p, ["label"])) for p in ("party0", "party1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for j, p in enumerate(("party0", "party1")):
        np.testing.assert_array_equal(got["label"][p], np.flatnonzero(expected.held[:, j]))
        np.testing.assert_array_equal(got[p]["label"], expected.own_rows[p])
    assert transport.pending() == 0


def test_the_plan_travels_in_bounded_checked_messages(federation, monkeypatch) -> None:
    import secvfl.deploy.data as deploy_data

    monkeypatch.setattr(deploy_data, "PLAN_CHUNK", 7)
    fed_path, _ = federation
    own = read_own_file(load_federation(fed_path).party("label").data, "label")
    every = np.arange(len(own.ids))
    plan = plan_rows(own, {"party0": every}, TrainConfig())
    net = Network({"label": Role.LABEL, "party0": Role.FEATURE})
    view = net.record("party0")
    send_plan(net, "label", "party0", plan)
    ids = receive_plan(net, "party0", "label", limit=len(own.ids))
    assert [i.to_pylist() for i in ids] == [i.to_pylist() for i in plan.ids]
    assert max(m.meta["count"] for m in view.received) == 7
    send_plan(net, "label", "party0", plan)
    with pytest.raises(ProtocolError, match="more than the 10 ids"):
        receive_plan(net, "party0", "label", limit=10)
    forged = Message(PLAN_IDS_KIND, "label", "party0", 0, blobs={"data": b"ab", "offsets": np.array([0, 3]).tobytes()},
                     meta={"split": "train", "total": 1, "offset": 0, "count": 1})
    net2 = Network({"label": Role.LABEL, "party0": Role.FEATURE})
    net2.send(forged)
    with pytest.raises(ProtocolError, match="inconsistent id offsets"):
        receive_plan(net2, "party0", "label", limit=10)


def test_saved_preprocessing_prepares_new_rows_as_the_training_rows(federation, tmp_path: Path) -> None:
    """What a feature party saves in its run directory (encodings, imputation means, statistics, its nan policy)
    prepares its own table again to the very block it trained on; an unseen category is a missing cell."""
    fed_path, _ = federation
    fed = load_federation(fed_path)
    own = read_own_file(fed.party("party1").data, "party1")
    label = read_own_file(fed.party("label").data, "label")
    result = align({"label": label.ids, "party1": own.ids}, "label")
    plan = plan_rows(label, {"party1": np.flatnonzero(result.held[:, 0])}, TrainConfig())
    (train, _, _), names, _, preprocessing = prepare_own_block(own, plan.ids, result.own_rows["party1"], TrainConfig())
    save_preprocessing(tmp_path / "p1", preprocessing)
    saved = load_preprocessing(tmp_path / "p1")
    assert saved.party == "party1" and saved.standardisation.columns == names and saved.nan_policy == "mean"
    table = read_prepared_table(fed.party("party1").data, "party1", saved)
    assert table.X.dtype == np.float32 and table.X.shape == (len(own.ids), len(names)) and table.usable.all()
    np.testing.assert_array_equal(table.X[table.rows(plan.ids[0])], train)
    new = tmp_path / "new.csv"
    new.write_text("b0,id,b1,b2,b3,b4,grade\n1,n1,2,3,4,5,unseen\n")
    table = read_prepared_table(replace(fed.party("party1").data, file=new), "party1", saved)
    grades = [j for j, n in enumerate(names) if n.startswith("grade=")]
    assert table.ids.to_pylist() == ["n1"] and len(grades) == 3
    assert any("1 cell(s) hold a category training never saw" in note for note in table.notes)
    # a missing cell, filled with the training frequencies of the categories: 0 once standardised (not -mean/std)
    np.testing.assert_allclose(table.X[0, grades], 0.0, atol=1e-6)
    with pytest.raises(ConfigError, match="preprocessing.json does not exist"):
        load_preprocessing(tmp_path / "elsewhere")
