"""ECDH-PSI entity alignment (X25519): exact intersections, what a feature party gets to see, malformed chunks, the
real credit ID column."""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.psi import POINTS_KIND, REBLINDED_KIND, PsiParty, align, hash_to_curve, match_width
from protocols.psi_kernel import DOMAIN
from secvfl.cli.align import read_ids, register, run
from secvfl.errors import ConfigError, DataError, ProtocolError
from secvfl.messages import Message
from secvfl.transport import Network
from secvfl.transport.layers import Role

CREDIT = "uci_credit_default/default_of_credit_card_clients.csv.gz"


def x25519(key: X25519PrivateKey, u: bytes) -> bytes:
    return key.exchange(X25519PublicKey.from_public_bytes(u))


def is_square(v: int) -> bool:  # Euler's criterion with Python integers: independent of gmpy2
    return pow(v, (P - 1) // 2, P) == 1


P = 2**255 - 19


def test_hash_lands_on_the_curve_and_blinding_commutes() -> None:
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    for ident in ["client-17", "", "é", "e\u0301", "x" * 300]:
        u = hash_to_curve(ident.encode())
        assert u == hash_to_curve(ident.encode()) and len(u) == 32
        x = int.from_bytes(u, "little")
        assert x < P and is_square((x**3 + 486662 * x * x + x) % P)  # on the curve, not on its twist
        assert x25519(b, x25519(a, u)) == x25519(a, x25519(b, u))
    assert hash_to_curve(b"client-17") != hash_to_curve(b"client-18")
    # About half of all hashes would fall on the twist: try-and-increment moved them (counter > 0).
    digests = [int.from_bytes(hashlib.sha256(DOMAIN + b"\x00" + str(i).encode()).digest(), "little") % 2**255
               for i in range(200)]
    moved = sum(hash_to_curve(str(i).encode()) != d.to_bytes(32, "little") for i, d in enumerate(digests))
    assert 60 < moved < 140


@pytest.mark.parametrize("n, m, width", [(1, 1, 8), (10**5, 10**5, 10), (10**7, 10**7, 11), (2**60, 2**60, 20)])
def test_match_width_bounds_a_false_match_by_2_to_the_minus_40(n: int, m: int, width: int) -> None:
    assert match_width(n, m) == width == match_width(m, n)
    assert n * m * 2.0 ** (-8 * width) <= 2.0**-40


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


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 60), max_size=200), st.lists(st.integers(0, 60), max_size=200))
def test_alignment_of_arrow_arrays_and_chunked_messages(monkeypatch_chunk, label: list[int], bank: list[int]) -> None:
    """Arrow string arrays (as read from files) align as lists do; 7-id chunks exercise the chunked streams."""
    label_ids = pa.array([f"c{i}" for i in label], pa.string())
    bank_ids = pa.chunked_array([pa.array([f"c{i}" for i in bank[:50]], pa.large_string()),
                                 pa.array([f"c{i}" for i in bank[50:]], pa.large_string())])
    result = align({"label": label_ids, "bank": bank_ids}, "label")
    truth = {f"c{i}" for i in label} & {f"c{i}" for i in bank}
    assert result.label_ids.to_pylist() == list(dict.fromkeys(f"c{i}" for i in label))
    assert result.learned["bank"].to_pylist() == [x for x in dict.fromkeys(f"c{i}" for i in bank) if x in truth]
    first_row = {}
    for row, i in enumerate(bank):
        first_row.setdefault(f"c{i}", row)
    assert result.own_rows["bank"].tolist() == sorted(first_row[x] for x in truth)


@pytest.fixture
def monkeypatch_chunk():
    import protocols.psi as psi

    saved = psi.CHUNK_IDS
    psi.CHUNK_IDS = 7
    yield 7
    psi.CHUNK_IDS = saved


def test_the_process_pool_gives_the_same_result(monkeypatch_chunk) -> None:
    label = [f"id{i}" for i in range(0, 300, 2)]
    bank = [f"id{i}" for i in range(0, 300, 3)]
    result = align({"label": label, "bank": bank}, "label", workers=2)
    assert result.learned["bank"] == [f"id{i}" for i in range(0, 300, 6)]


def test_feature_party_sees_only_blinded_points() -> None:
    label_ids = [f"client-{i}" for i in range(60)]
    bank_ids = [f"client-{i}" for i in range(40, 90)]  # 20 shared
    net = Network({"label": Role.LABEL, "bank": Role.FEATURE, "shop": Role.FEATURE})
    bank_view = net.record("bank")
    result = align({"label": label_ids, "bank": bank_ids, "shop": ["client-1", "zzz"]}, "label", net=net)
    assert result.learned["bank"] == [f"client-{i}" for i in range(40, 60)]
    assert [(m.kind, m.sender) for m in bank_view.received] == [(POINTS_KIND, "label"), (REBLINDED_KIND, "label")]
    round1, round2 = bank_view.received
    width = match_width(60, 50)
    assert round1.meta == {"total": 60, "offset": 0, "count": 60} and len(round1.blobs["points"]) == 60 * 32
    assert round2.meta == {"total": 50, "offset": 0, "count": 50, "width": width}
    assert len(round2.blobs["values"]) == 50 * width  # its own 50, blinded twice, truncated
    everything = b"".join(b for m in bank_view.received for b in m.blobs.values()) + json.dumps(
        [dict(m.meta) for m in bank_view.received]).encode()
    unhashed = {hash_to_curve(y.encode()) for y in label_ids}
    points = round1.blobs["points"]
    assert not {points[i : i + 32] for i in range(0, len(points), 32)} & unhashed  # no label id unblinded
    for y in label_ids:
        assert y.encode() not in everything
    # Nothing about shop: the bank's messages come from the label party only and name no other party.
    assert all(m.sender == "label" and b"shop" not in json.dumps(dict(m.meta)).encode() for m in bank_view.received)
    # Bytes: 32 bytes per id in round 1, the match width in round 2, plus headers.
    kinds = net.stats.to_dict()["bytes_by_kind"]
    assert 32 * (60 + 50 + 60 + 2) <= kinds[POINTS_KIND] < 32 * (60 + 50 + 60 + 2) + 4 * 400
    assert kinds[REBLINDED_KIND] >= width * (60 + 50) + 8 * (60 + 2)


def test_sets_are_sent_in_an_order_that_hides_the_input_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 1 carries exactly X25519(a, H(y)) for each distinct id, sorted by that value: with the same scalar,
    the same ids in another input order give byte-identical messages, so the order reveals nothing."""
    import protocols.psi as psi

    key = X25519PrivateKey.generate()
    monkeypatch.setattr(psi, "_new_key", key.private_bytes_raw)  # every party: scalar a
    ids_a = [str(i) for i in range(50)] + ["7", "3"]  # duplicates are sent once
    shuffled = list(ids_a)
    random.Random(0).shuffle(shuffled)
    sent = []
    for label_ids in (ids_a, shuffled):
        net = Network({"label": Role.LABEL, "bank": Role.FEATURE})
        view = net.record("bank")
        align({"label": label_ids, "bank": ["1", "x"]}, "label", net=net)
        sent.append(view.received[0])
    assert sent[0].kind == POINTS_KIND and sent[0].meta == sent[1].meta == {"total": 50, "offset": 0, "count": 50}
    assert sent[0].blobs["points"] == sent[1].blobs["points"]
    blob = sent[0].blobs["points"]
    expected = sorted({x25519(key, hash_to_curve(y.encode())) for y in ids_a})  # computed here, independently
    assert [blob[i : i + 32] for i in range(0, len(blob), 32)] == expected


def _round1(sender: str, receiver: str, points: bytes, **meta) -> Message:
    meta = {"total": len(points) // 32, "offset": 0, "count": len(points) // 32, **meta}
    return Message(POINTS_KIND, sender, receiver, 0, blobs={"points": points}, meta=meta)


def test_invalid_points_and_bad_inputs_are_refused() -> None:
    bank = PsiParty("bank", ["a", "b"])
    twist = next(u for u in range(2, 100) if not is_square((u**3 + 486662 * u * u + u) % P))
    for bad in [b"\xff" * 32, twist.to_bytes(32, "little"), (P + 1).to_bytes(32, "little"), bytes(32)]:
        with pytest.raises(ProtocolError, match="not a point of Curve25519"):
            list(bank.reblind("label", [_round1("label", "bank", bad)]))
    good = hash_to_curve(b"z")
    with pytest.raises(ProtocolError, match="malformed"):
        list(bank.reblind("label", [_round1("label", "bank", good, count=2)]))
    with pytest.raises(ProtocolError, match="malformed"):
        list(bank.reblind("label", [_round1("label", "bank", good, offset=1)]))
    with pytest.raises(ProtocolError, match="over this party's limit"):
        list(PsiParty("bank", ["a"], max_peer_ids=5).reblind("label", [_round1("label", "bank", good, total=6)]))
    with pytest.raises(ProtocolError, match="expected psi-points from label"):
        list(bank.reblind("label", [_round1("shop", "bank", good)]))
    with pytest.raises(ProtocolError, match="ended after 1 of 2"):
        list(bank.reblind("label", [_round1("label", "bank", good, total=2)]))
    with pytest.raises(ProtocolError, match="before reblinding"):
        bank.finish("shop", [])
    with pytest.raises(DataError, match="must be strings"):
        PsiParty("bank", [1, 2])
    with pytest.raises(DataError, match="must be strings"):
        PsiParty("bank", pa.array([1, 2]))
    with pytest.raises(DataError, match="missing value"):
        PsiParty("bank", pa.array(["a", None]))
    with pytest.raises(DataError, match="label party 'lab'"):
        align({"label": ["a"], "bank": ["a"]}, "lab")
    with pytest.raises(DataError, match="at least one feature party"):
        align({"label": ["a"]}, "label")


def test_round_two_values_of_the_wrong_width_are_refused() -> None:
    label, bank = PsiParty("label", ["a", "b"]), PsiParty("bank", ["b", "c"])
    list(label.reblind("bank", bank.points_for("label")))
    reply = list(bank.reblind("label", label.points_for("bank")))[0]
    forged = reply.replace(meta={**reply.meta, "width": 9}, blobs={"values": reply.blobs["values"][:2] * 9})
    with pytest.raises(ProtocolError, match="width 9, expected 8"):
        label.finish("bank", [forged])


@pytest.mark.slow
def test_alignment_is_exact_at_100k_ids() -> None:
    """10^5 x 10^5 ids, half shared, through the process pool: exactly the set intersection."""
    rng = np.random.default_rng(3)
    label = [f"C{i:08d}" for i in rng.permutation(100_000)]
    bank = [f"C{i:08d}" for i in rng.permutation(np.arange(50_000, 150_000))]
    result = align({"label": label, "bank": bank}, "label", workers=2)
    truth = set(label) & set(bank)
    assert len(truth) == 50_000
    assert result.learned["bank"] == [x for x in bank if x in truth]
    assert [y for y, h in zip(result.label_ids, result.held[:, 0], strict=True) if h] == [y for y in label if y in truth]


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


def test_membership_is_exact_when_64_bit_prefixes_collide() -> None:
    """Matching sorts on the first 8 bytes; rows that share them (a 2^-64 event for real values) are compared in
    full. Reference: Python sets of the rows as bytes."""
    from protocols.psi import _members, _sorted_distinct

    rng = np.random.default_rng(0)
    theirs = rng.integers(0, 256, (300, 11), dtype=np.uint8)
    theirs[:100, :8] = theirs[0, :8]  # a hundred values with one prefix
    mine = np.concatenate([theirs[rng.choice(300, 80, replace=False)], rng.integers(0, 256, (70, 11), dtype=np.uint8)])
    mine[-20:, :8] = theirs[0, :8]  # same prefix, other tails: not members
    truth = {bytes(r) for r in theirs}
    np.testing.assert_array_equal(_members(mine, theirs), [bytes(r) in truth for r in mine])
    points = np.repeat(rng.integers(0, 256, (50, 32), dtype=np.uint8), 3, axis=0)[rng.permutation(150)]
    points[:, :8] = 7  # every prefix equal: the full values decide the order and the repeats
    kept = _sorted_distinct(points)
    assert [bytes(points[i]) for i in kept] == sorted({bytes(r) for r in points})
    first = {}
    for i, r in enumerate(points):
        first.setdefault(bytes(r), i)
    assert sorted(kept.tolist()) == sorted(first.values())
