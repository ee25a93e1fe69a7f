"""``secvfl align``: private entity alignment of several parties' CSV files by their id column (ECDH-PSI).

Example::

    secvfl align --party label=label.csv --party bank=bank.csv.gz --party shop=shop.csv \\
        --id-column ID --out alignment.json

Every party runs in this process (embedded mode) as an isolated PSI party; only blinded curve points cross the
network, whose byte counts are reported. The output holds, per label-party id, which parties hold it (the
observed-block pattern for training with missing blocks), and the counts. ``--out`` ending in ``.csv`` writes one
row per label-party id with a 0/1 column per party instead of JSON (any other extension is refused, so a name
like ``x.txt`` never silently holds JSON). Ids are compared exactly after stripping
surrounding whitespace; a party file with a repeated id is refused (its rows could not be aligned).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import time
from pathlib import Path

from protocols.psi import align
from secvfl.cli.paths import check_output_file, write_output_text
from secvfl.data.files import READ_ERRORS, check_readable_file, check_unique_ids, describe_read_error
from secvfl.errors import ConfigError, DataError
from secvfl.transport.layers import Role
from secvfl.transport.network import Network

__all__ = ["register", "run", "read_ids"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "align",
        help="align parties' rows by id with private set intersection (ECDH-PSI)",
        description="Private entity alignment: which of the label party's ids each other party holds, computed "
        "with ECDH private set intersection over each party's CSV id column. Writes per-id holders and counts.",
    )
    p.add_argument("--party", action="append", required=True, metavar="NAME=CSV",
                   help="a party and its CSV file (.csv or .csv.gz); repeat for every party")
    p.add_argument("--id-column", default="ID", help="name of the id column in every file (default: ID)")
    p.add_argument("--label-party", default=None,
                   help="which party holds the labels (default: the first --party)")
    p.add_argument("--out", default=None,
                   help="write the alignment to this file; its extension picks the format: .json (per-id holders, "
                        "counts and bytes) or .csv (one row per label-party id, a 0/1 column per party)")
    p.set_defaults(func=run)


def _parse_parties(specs: list[str]) -> dict[str, Path]:
    parties: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise ConfigError(f"--party expects NAME=PATH, got {spec!r}")
        if name in parties:
            raise ConfigError(f"party {name!r} is given twice")
        parties[name] = Path(path)
    if len(parties) < 2:
        raise ConfigError("secvfl align needs at least two --party NAME=CSV entries (a label party and a feature party)")
    return parties


def read_ids(path: Path, column: str) -> list[str]:
    """The id column of a CSV (optionally gzipped) file, whitespace-stripped; refuses missing or repeated ids."""
    check_readable_file(path, "--party file", "--party NAME=CSV")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")
            reader = csv.reader(text)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{path} is empty")
            header = [h.strip() for h in header]
            if column not in header:
                raise DataError(f"{path} has no column {column!r}; its columns are {header[:20]} (use --id-column)")
            col = header.index(column)
            ids = []
            for line, row in enumerate(reader, start=2):
                if not row:
                    continue
                if col >= len(row) or not row[col].strip():
                    raise DataError(f"{path} line {line}: empty or missing {column!r}")
                ids.append(row[col].strip())
    except (*READ_ERRORS, csv.Error) as exc:
        raise DataError(f"cannot read {path} as UTF-8 CSV (.csv or .csv.gz): {describe_read_error(exc)}") from None
    if not ids:
        raise DataError(f"{path} has a header but no rows; every party needs at least one id to align")
    check_unique_ids(ids, path, column)
    return ids


def run(args: argparse.Namespace) -> int:
    parties = _parse_parties(args.party)
    label = args.label_party or next(iter(parties))
    if label not in parties:
        raise ConfigError(f"--label-party {label!r} is not one of the parties {list(parties)}")
    if args.out:
        check_output_file(Path(args.out), "--out", (".json", ".csv"))
    ids = {name: read_ids(path, args.id_column) for name, path in parties.items()}
    order = [label, *[p for p in parties if p != label]]
    net = Network({label: Role.LABEL, **{p: Role.FEATURE for p in order[1:]}})
    start = time.perf_counter()
    result = align({p: ids[p] for p in order}, label, net=net)
    seconds = time.perf_counter() - start
    counts = result.counts()
    summary = {
        "label_party": label,
        "parties": result.parties,
        "id_column": args.id_column,
        "protocol": "ECDH-PSI over P-256 (semi-honest, DDH)",
        "counts": counts,
        "seconds": round(seconds, 3),
        "communication": net.stats.to_dict(),
    }
    if args.out:
        out = Path(args.out)
        if out.suffix.lower() == ".csv":
            buf = io.StringIO(newline="")
            w = csv.writer(buf)
            w.writerow([args.id_column, *result.parties])
            for ident, row in zip(result.label_ids, result.pattern(), strict=True):
                w.writerow([ident, *(int(v) for v in row)])
            write_output_text(out, buf.getvalue(), "--out")
        else:
            doc = {**summary, "holders": result.holders}
            write_output_text(out, json.dumps(doc, ensure_ascii=False, indent=1) + "\n", "--out")
    print(f"aligned {counts['label_ids']} label-party ids in {seconds:.1f} s; shared with the label party: "
          + ", ".join(f"{p}={n}" for p, n in counts["shared_with_label"].items())
          + f"; held by all: {counts['held_by_all']}"
          + (f"; written to {args.out}" if args.out else ""))
    print(json.dumps({"counts": counts, "bytes_total": net.stats.bytes_total}, ensure_ascii=False))
    return 0
