"""``secvfl align``: private entity alignment of several parties' tables (CSV, .csv.gz or Parquet) by their id
column (ECDH-PSI over Curve25519, protocols.psi).

Example::

    secvfl align --party label=label.csv --party bank=bank.csv.gz --party shop=shop.csv \\
        --id-column ID --out alignment.json

Every party runs in this process (embedded mode) as an isolated PSI party; only blinded curve points and truncated
match values cross the network, whose byte counts are reported; the curve arithmetic runs in ``--workers``
processes, with progress on stderr. The output holds, per label-party id, which parties hold it (the
observed-block pattern for training with missing blocks), and the counts. ``--out`` ending in ``.csv`` writes one
row per label-party id with a 0/1 column per party instead of JSON (any other extension is refused, so a name
like ``x.txt`` never silently holds JSON). Ids are compared exactly after stripping
surrounding whitespace; a party file with a repeated id is refused (its rows could not be aligned).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from protocols.psi import PROTOCOL, align
from secvfl.cli.paths import check_output_file, write_output_text
from secvfl.data.files import check_readable_file, check_unique_ids
from secvfl.data.table import open_table, read_columns
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
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes for the curve arithmetic (default: this machine's CPUs)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
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


def read_ids(path: Path, column: str) -> Any:
    """The id column of a table (CSV, .csv.gz or Parquet), whitespace-stripped, as an Arrow string array (no Python
    object per id); refuses missing or repeated ids."""
    import pyarrow.compute as pc

    check_readable_file(path, "--party file", "--party NAME=CSV")
    try:
        table = open_table(path, header="yes")
        if table.format == "csv" and not table.first_rows:
            raise DataError(f"{path} is empty")
        if column not in table.names:
            raise DataError(f"{path} has no column {column!r}; its columns are {table.names[:20]} (use --id-column)")
        ids = pc.utf8_trim_whitespace(read_columns(table, [column], keep_arrow=[column])[column].arrow)
    except DataError as exc:
        raise DataError(str(exc).replace("as CSV (gzip is read transparently)", "as UTF-8 CSV (.csv or .csv.gz)")) \
            from None
    if not len(ids):
        raise DataError(f"{path} has a header but no rows; every party needs at least one id to align")
    empty = np.flatnonzero(pc.equal(pc.utf8_length(ids), 0).to_numpy(zero_copy_only=False))
    if len(empty):
        raise DataError(f"{path} {table.cell(int(empty[0]), column)[0]}: empty or missing {column!r}")
    check_unique_ids(ids, path, column)
    return ids


def run(args: argparse.Namespace) -> int:
    parties = _parse_parties(args.party)
    label = args.label_party or next(iter(parties))
    if label not in parties:
        raise ConfigError(f"--label-party {label!r} is not one of the parties {list(parties)}")
    if args.out:
        check_output_file(Path(args.out), "--out", (".json", ".csv"))
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    ids = {name: read_ids(path, args.id_column) for name, path in parties.items()}
    order = [label, *[p for p in parties if p != label]]
    net = Network({label: Role.LABEL, **{p: Role.FEATURE for p in order[1:]}})
    start = time.perf_counter()
    progress = None if args.no_progress else (lambda line: print(line, file=sys.stderr, flush=True))
    result = align({p: ids[p] for p in order}, label, net=net, workers=args.workers, progress=progress)
    seconds = time.perf_counter() - start
    counts = result.counts()
    summary = {
        "label_party": label,
        "parties": result.parties,
        "id_column": args.id_column,
        "protocol": PROTOCOL,
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
            pattern = result.pattern().astype(np.int8)
            for start_row in range(0, len(pattern), 1 << 16):  # a chunk of ids at a time as Python objects
                block = pattern[start_row : start_row + (1 << 16)].tolist()
                names = result.label_ids.slice(start_row, 1 << 16).to_pylist()
                w.writerows([ident, *row] for ident, row in zip(names, block, strict=True))
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
