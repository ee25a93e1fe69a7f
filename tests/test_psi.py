"""ECDH-PSI entity alignment: exact intersections, what a feature party gets to see, the real credit ID column."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import random
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.psi import POINTS_KIND, REBLINDED_KIND, PsiParty, align, hash_to_curve
from secvfl.cli.align import read_ids, register, run
from secvfl.errors import ConfigError, DataError, ProtocolError
from secvfl.messages import Message
from secvfl.transport import Network
from secvfl.transport.layers import Role

CREDIT = "uci_credit_default/default_of_credit_card_clients.csv.gz"


def x_of(point: ec.EllipticCurvePublicKey) -> bytes:
    return point.public_numbers().x.to_bytes(32, "big")


def test_blinding_commutes() -> None:
    a, b = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    p = hash_to_curve("client-17")
    lift = lambda x: ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), b"\x02" + x)  # noqa: E731
    ab = b.exchange(ec.ECDH(), lift(a.exchange(ec.ECDH(), p)))
    ba = a.exchange(ec.ECDH(), lift(b.exchange(ec.ECDH(), p)))
    assert ab == ba
    assert hash_to_curve("client-17").public_numbers() == p.public_numbers()
    assert x_of(hash_to_curve("client-18")) != x_of(p)


ids = st.text(min_size=0, max_size=6)  # unicode, including the empty string and surrogates
id_lists = st.lists(st.one_of(ids, st.sampled_from(["1", "2", "3", "é", "e\u0301"])), max_size=25)


@settings(max_examples=30, deadline=None)
@given(label=id_lists, features=st.lists(id_lists, min_size=1, max_size=3))
def test_alignment_equals_the_true_intersection(label: list[str], features: list[list[str]]) -> None:
    parties = {"label": label, **{f"f{i}": xs for i, xs in enumerate(features)}}
    result = align(parties, "label")
    assert result.label_ids == list(dict.fromkeys(label))  # distinct, in input order
    for i, xs in enumerate(features):
        name = f"f{i}"
        truth = set(label) & set(xs)
        # each party learns its shared ids once each, in its own input order
        assert result.learned[name] == [x for x in dict.fromkeys(xs) if x in truth]
        assert {y for y in result.label_ids if name in result.holders[y]} == truth
    assert all(result.holders[y][0] == "label" for y in result.label_ids)
    pattern = result.pattern()
    assert pattern.shape == (len(result.label_ids), 1 + len(features)) and (len(pattern) == 0 or pattern[:, 0].all())


def test_feature_party_sees_only_blinded_points() -> None:
    label_ids = [f"client-{i}" for i in range(60)]
    bank_ids = [f"client-{i}" for i in range(40, 90)]  # 20 shared
    net = Network({"label": Role.LABEL, "bank": Role.FEATURE, "shop": Role.FEATURE})
    bank_view = net.record("bank")
    result = align({"label": label_ids, "bank": bank_ids, "shop": ["client-1", "zzz"]}, "label", net=net)
    assert result.learned["bank"] == [f"client-{i}" for i in range(40, 60)]
    assert [(m.kind, m.sender) for m in bank_view.received] == [(POINTS_KIND, "label"), (REBLINDED_KIND, "label")]
    round1, round2 = bank_view.received
    assert round1.meta == {"count": 60} and len(round1.blobs["points"]) == 60 * 32
    assert round2.meta == {"count": 50} and len(round2.blobs["points"]) == 50 * 32  # its own 50, blinded twice
    everything = b"".join(b for m in bank_view.received for b in m.blobs.values()) + json.dumps(
        [dict(m.meta) for m in bank_view.received]).encode()
    unhashed = {x_of(hash_to_curve(y)) for y in label_ids}
    chunks = {everything[i : i + 32] for i in range(0, len(round1.blobs["points"]) + len(round2.blobs["points"]), 32)}
    assert not chunks & unhashed  # no label id reaches the bank unblinded, not even as its hash
    for y in label_ids:
        assert y.encode() not in everything
    # Nothing about shop: the bank's messages come from the label party only and name no other party.
    assert all(m.sender == "label" and b"shop" not in json.dumps(dict(m.meta)).encode() for m in bank_view.received)
    # Bytes: 32 bytes per id and round, plus headers.
    kinds = net.stats.to_dict()["bytes_by_kind"]
    assert kinds[POINTS_KIND] >= 32 * (60 + 50 + 60 + 2)
    assert kinds[REBLINDED_KIND] >= 32 * (60 + 50 + 60 + 2)


def test_sets_are_sent_in_an_order_that_hides_the_input_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 1 carries exactly X([a] H(y)) for each distinct id, sorted by that value: with the same scalar, the
    same ids in another input order give byte-identical messages, so the order reveals nothing."""
    import protocols.psi as psi

    key = ec.generate_private_key(ec.SECP256R1())
    monkeypatch.setattr(psi.ec, "generate_private_key", lambda curve: key)  # every party and peer: scalar a
    ids_a = [str(i) for i in range(50)] + ["7", "3"]  # duplicates are sent once
    shuffled = list(ids_a)
    random.Random(0).shuffle(shuffled)
    sent = []
    for label_ids in (ids_a, shuffled):
        net = Network({"label": Role.LABEL, "bank": Role.FEATURE})
        view = net.record("bank")
        align({"label": label_ids, "bank": ["1", "x"]}, "label", net=net)
        sent.append(view.received[0])
    assert sent[0].kind == POINTS_KIND and sent[0].meta == sent[1].meta == {"count": 50}
    assert sent[0].blobs["points"] == sent[1].blobs["points"]
    blob = sent[0].blobs["points"]
    expected = sorted({key.exchange(ec.ECDH(), hash_to_curve(y)) for y in ids_a})  # computed here, independently
    assert [blob[i : i + 32] for i in range(0, len(blob), 32)] == expected


def test_invalid_points_and_bad_inputs_are_refused() -> None:
    bank = PsiParty("bank", ["a", "b"])
    bad = Message(POINTS_KIND, "label", "bank", 0, blobs={"points": b"\xff" * 32}, meta={"count": 1})
    with pytest.raises(ProtocolError, match="not a P-256 point"):
        bank.reblind(bad)
    with pytest.raises(ProtocolError, match="malformed"):
        bank.reblind(bad.replace(meta={"count": 2}))
    with pytest.raises(DataError, match="must be strings"):
        PsiParty("bank", [1, 2])
    with pytest.raises(DataError, match="label party 'lab'"):
        align({"label": ["a"], "bank": ["a"]}, "lab")
    with pytest.raises(DataError, match="at least one feature party"):
        align({"label": ["a"]}, "label")


# -- real data ---------------------------------------------------------------------------------------------------
def _credit_rows(data_dir: Path) -> tuple[list[str], list[list[str]]]:
    with gzip.open(data_dir / CREDIT, "rt", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        rows = list(reader)
    return header, rows


def _write_party(path: Path, header: list[str], rows: list[list[str]], columns: list[str]) -> Path:
    idx = [header.index(c) for c in columns]
    with gzip.open(path, "wt", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(columns)
        w.writerows([[r[i] for i in idx] for r in rows])
    return path


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="secvfl")
    register(parser.add_subparsers())
    return parser.parse_args(argv)


@pytest.mark.parametrize("n_rows", [1000, pytest.param(30000, marks=pytest.mark.slow)])
def test_cli_aligns_the_credit_id_column(data_dir: Path, tmp_path: Path, n_rows: int, capsys) -> None:
    header, rows = _credit_rows(data_dir)
    assert header[0] == "ID" and len(rows) == 30000
    rows = rows[:n_rows]
    rng = random.Random(5)
    kept = {}
    files = {}
    blocks = {"label": ["ID", "LIMIT_BAL", "default payment next month"], "bank": ["ID", "PAY_0", "BILL_AMT1"],
              "shop": ["ID", "PAY_AMT1", "PAY_AMT2"]}
    for party, keep in (("label", 0.9), ("bank", 0.7), ("shop", 0.5)):
        mine = [r for r in rows if rng.random() < keep]
        rng.shuffle(mine)  # each party stores its rows in its own order
        kept[party] = {r[0] for r in mine}
        files[party] = _write_party(tmp_path / f"{party}.csv.gz", header, mine, blocks[party])
    out = tmp_path / "alignment.json"
    args = _cli(["align", *[f"--party={p}={f}" for p, f in files.items()], "--id-column", "ID", "--out", str(out)])
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    holders = doc["holders"]
    assert set(holders) == kept["label"]
    for ident, who in holders.items():
        assert who == ["label", *[p for p in ("bank", "shop") if ident in kept[p]]]
    counts = doc["counts"]
    assert counts["shared_with_label"] == {p: len(kept["label"] & kept[p]) for p in ("bank", "shop")}
    assert counts["held_by_all"] == len(kept["label"] & kept["bank"] & kept["shop"])
    assert sum(counts["patterns"].values()) == len(kept["label"])
    assert doc["communication"]["bytes_by_kind"][POINTS_KIND] > 32 * len(kept["label"])
    assert "aligned" in capsys.readouterr().out
    # CSV output: one row per label id with a 0/1 column per party.
    out_csv = tmp_path / "alignment.csv"
    args = _cli(["align", *[f"--party={p}={f}" for p, f in files.items()], "--out", str(out_csv)])
    assert run(args) == 0
    with out_csv.open(newline="") as fh:
        table = list(csv.reader(fh))
    assert table[0] == ["ID", "label", "bank", "shop"] and len(table) == len(kept["label"]) + 1
    assert all(row[2] == str(int(row[0] in kept["bank"])) for row in table[1:])


def test_cli_refuses_bad_input_with_clear_errors(tmp_path: Path) -> None:
    good = tmp_path / "a.csv"
    good.write_text("ID,x\n1,0\n2,0\n")
    dup = tmp_path / "dup.csv"
    dup.write_text("ID,x\n1,0\n1,0\n")
    other = tmp_path / "other.csv"
    other.write_text("key,x\n1,0\n")
    with pytest.raises(DataError, match="repeats 1 id"):
        read_ids(dup, "ID")
    with pytest.raises(DataError, match=r"no column 'ID'.*\['key', 'x'\]"):
        read_ids(other, "ID")
    with pytest.raises(DataError, match="does not exist"):
        read_ids(tmp_path / "missing.csv", "ID")
    with pytest.raises(ConfigError, match="NAME=PATH"):
        run(_cli(["align", "--party", str(good), "--party", f"b={good}"]))
    with pytest.raises(ConfigError, match="at least two"):
        run(_cli(["align", "--party", f"a={good}"]))
    with pytest.raises(ConfigError, match="--label-party 'z'"):
        run(_cli(["align", "--party", f"a={good}", "--party", f"b={good}", "--label-party", "z"]))
