"""Each party's own data file in a deployment: read by that party alone, rows aligned by private set intersection.

When the federation file gives every party a ``data`` table, no process reads another party's file:

1. each party reads its own file (its id column and its feature columns; the label party its id and label columns);
2. the label party runs ECDH-PSI with each feature party over the run's transport (``align_ids``, protocols.psi:
   each side learns which of its own ids the other holds, nothing else);
3. the label party keeps the ids it shares with *every* feature party, in the order of its own file, and draws the
   train / validation / test rows from its labels exactly as ``secvfl train`` does (secvfl.data.preprocess.
   split_rows); it sends each feature party the ids of each split (ids that party already holds);
4. each feature party prepares its own columns for those rows (missing values, one-hot categories, standardisation
   with its training rows' statistics: :func:`secvfl.data.preprocess.prepare`) and answers with its width;
5. every process builds the run from a table in which only its own block (or, at the label party, the labels) is
   filled: the other blocks are zeros of the announced widths, so the algorithm code is the same as in one process.

What this reveals beyond PSI (the threat model of step 3): each feature party learns which of its ids are in the
training set and in which split (the rows every party holds), the number of classes and the split sizes; the label
party learns each feature party's number of columns after encoding. Labels, feature values and ids a party does not
hold never leave their owner. Rows held by some feature parties only are left out (missing blocks from alignment
are not used yet); ``--p-miss-train/--p-miss-test`` (simulated missing blocks) and ``--nan-policy drop`` (which
would need every party's missing cells) are refused.

The equivalent one-process run: the rows every party holds, in the label party's file order, joined into one CSV
(feature columns in party order, then the label): ``secvfl train --dataset csv:joined.csv`` gives the same metrics
and bytes (tests/test_deploy_data.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from secvfl.config import TrainConfig
from secvfl.data import Dataset
from secvfl.data.csv_loader import MISSING_TOKENS, encode_column, encode_labels, read_csv_rows
from secvfl.data.dataset import RawData
from secvfl.data.files import check_readable_file, check_unique_ids
from secvfl.data.masks import parse_p_miss
from secvfl.data.partition import Partition, partition_columns
from secvfl.data.preprocess import prepare, split_rows
from secvfl.errors import ConfigError, DataError, ProtocolError
from secvfl.federation import DataSpec, Federation
from secvfl.io import write_text_atomic
from secvfl.transport.base import CommStats
from secvfl.transport.network import Network

__all__ = ["ALIGN", "PLAN", "AlignIds", "OwnFile", "RowPlan", "read_own_file", "uses_data_files", "check_config",
           "plan_rows", "prepare_own_block", "run_table", "counting_apart", "record_alignment"]

ALIGN, PLAN = "__align__", "__plan__"  # the coordinator's requests before the hello (secvfl.deploy.party)
SPLITS = ("train", "val", "test")

# (network, this party, its peers, its own ids) -> per peer, this party's ids the peer also holds (in its order):
# one side of a private set intersection with each peer (protocols.psi.align_with_peers), given by the command.
AlignIds = Callable[[Network, str, Sequence[str], list[str]], dict[str, list[str]]]


def uses_data_files(federation: Federation) -> bool:
    """Whether the parties read their own files; every party with a data table, or none (else a ConfigError)."""
    holders = [p for p in federation.parties if p.name != federation.aggregator]
    with_files = [p.name for p in holders if p.data is not None]
    if with_files and len(with_files) != len(holders):
        without = [p.name for p in holders if p.data is None]
        raise ConfigError(f"{federation.source}: parties {', '.join(with_files)} name their own data files and "
                          f"{', '.join(without)} do not; give every party a data table (each reads its own file), "
                          "or none (each takes its block of --dataset)")
    return bool(with_files)


def check_config(cfg: TrainConfig) -> None:
    """Refuse, before any party reads a file, the settings that per-party files cannot honour."""
    problems = []
    for flag, value in (("--p-miss-train", cfg.p_miss_train), ("--p-miss-test", cfg.p_miss_test)):
        p_miss = parse_p_miss(value)
        if isinstance(p_miss, tuple) or p_miss > 0:
            problems.append(f"{flag} {value} simulates missing blocks, but the parties' own files decide which rows "
                            "each party holds; leave it at 0")
    if cfg.nan_policy == "drop":
        problems.append("--nan-policy drop would remove rows by cells of every party; use mean (each party imputes "
                        "its own columns with its training means) or error")
    if problems:
        raise ConfigError("; ".join(problems))


@dataclass
class OwnFile:
    """One party's file as that party reads it: ids in file order and the raw cells of its columns (or labels)."""

    party: str
    file: Path
    ids: list[str]
    lines: list[int]  # the file's line of each row, for errors
    columns: dict[str, list[str]] = field(default_factory=dict)  # feature party: column -> cells
    label_column: str | None = None
    labels: list[str] | None = None  # label party


def read_own_file(spec: DataSpec, party: str) -> OwnFile:
    """Read party ``party``'s own file as its data table in the federation file describes it."""
    where = f"{party}'s data file"
    if not spec.file.exists():
        raise DataError(f"{where} {spec.file} does not exist; fix the file of [parties.{party}] data in the "
                        "federation file, or start this party on the host that holds its file")
    check_readable_file(spec.file, where, f"the file of [parties.{party}] data")
    rows, lines = read_csv_rows(spec.file)
    if len(rows) < 2:
        raise DataError(f"{spec.file}: {where} needs a header line naming its columns and at least one row")
    header = [c.strip() for c in rows[0]]
    body, body_lines = rows[1:], lines[1:]
    ragged = [i for i, r in enumerate(body) if len(r) != len(header)]
    if ragged:
        i = ragged[0]
        raise DataError(f"{spec.file} line {body_lines[i]}: {len(body[i])} fields, the header has {len(header)}; "
                        "fix the file or its delimiter")
    wanted = [spec.id, *spec.columns, *([spec.label] if spec.label else [])]
    absent = [c for c in wanted if c not in header]
    if absent:
        raise DataError(f"{spec.file}: no column {absent[0]!r} (its columns: {header[:20]}); fix the data table of "
                        f"[parties.{party}] in the federation file")
    extra = [c for c in header if c not in wanted] if spec.label is not None else []
    if extra:  # a feature party names its columns; the label party's file would have them silently ignored
        shown = ", ".join(repr(c) for c in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise DataError(f"{spec.file}: column{'s' * (len(extra) > 1)} {shown} of the label party's file would not be "
                        f"used: the label party holds only the ids ({spec.id!r}) and the labels ({spec.label!r}), its "
                        "head has no bottom model for features; remove them from the file, or give them to a feature "
                        "party (it may run on the same host, on another port)")
    cells = {c: [r[header.index(c)].strip() for r in body] for c in wanted}
    ids = cells[spec.id]
    empty = [i for i, v in enumerate(ids) if not v]
    if empty:
        raise DataError(f"{spec.file} line {body_lines[empty[0]]}: empty id in {spec.id!r}; every row needs an id")
    check_unique_ids(ids, spec.file, spec.id)
    own = OwnFile(party, spec.file, ids, body_lines)
    if spec.label is not None:
        keep = [i for i, v in enumerate(cells[spec.label]) if v.lower() not in MISSING_TOKENS]
        own.ids = [ids[i] for i in keep]
        own.lines = [body_lines[i] for i in keep]
        own.label_column = spec.label
        own.labels = [cells[spec.label][i] for i in keep]
    else:
        own.columns = {c: cells[c] for c in spec.columns}
    return own


@dataclass(frozen=True)
class RowPlan:
    """The label party's choice of rows: the ids of each split (train, val, test), their labels and classes."""

    ids: tuple[list[str], list[str], list[str]]
    y: tuple[np.ndarray, np.ndarray, np.ndarray]
    classes: list[str]
    counts: dict[str, Any]

    def digest(self) -> str:
        """SHA-256 of the ids of every split in order: a resumed run must align to exactly the same rows."""
        h = hashlib.sha256()
        for split, ids in zip(SPLITS, self.ids, strict=True):
            h.update(json.dumps([split, ids]).encode())
        return h.hexdigest()


def plan_rows(own: OwnFile, shared: dict[str, list[str]], cfg: TrainConfig) -> RowPlan:
    """The rows every party holds, in the label party's file order, split as ``secvfl train`` splits a table."""
    common = set(own.ids)
    for ids in shared.values():
        common &= set(ids)
    rows = [i for i, ident in enumerate(own.ids) if ident in common]
    counts = {"label_party_ids": len(own.ids), "shared_with_label": {p: len(v) for p, v in shared.items()},
              "held_by_all": len(rows)}
    if not rows:
        raise DataError(f"no id of {own.file} is held by every feature party (shared with each: "
                        f"{counts['shared_with_label']}); check that the parties' id columns use the same ids")
    y, classes = encode_labels([own.labels[i] for i in rows], own.label_column)
    train, val, test = split_rows(y, seed=cfg.seed, val_fraction=cfg.val_fraction)
    for split, idx in zip(SPLITS, (train, val, test), strict=True):
        if len(idx) == 0 and (split != "val" or cfg.val_fraction > 0):
            raise DataError(f"the {len(rows)} rows every party holds leave the {split} split empty; more shared rows "
                            "are needed" + ("" if split != "val" else ", or --val-fraction 0"))
    ids = tuple([own.ids[rows[i]] for i in idx] for idx in (train, val, test))
    counts["rows"] = {s: len(v) for s, v in zip(SPLITS, ids, strict=True)}
    return RowPlan(ids, (y[train], y[val], y[test]), classes, counts)  # type: ignore[arg-type]


def prepare_own_block(own: OwnFile, ids: Sequence[Sequence[str]], learned: set[str], cfg: TrainConfig
                      ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], list[str], list[str]]:
    """A feature party's columns for the label party's rows: (train, val, test) arrays, column names, notes."""
    wanted = [i for split in ids for i in split]
    outside = [i for i in wanted if i not in learned]
    if outside:  # an honest label party asks only for ids both hold; anything else would probe this party's file
        raise ProtocolError(f"the label party asked {own.party} for {len(outside)} row(s) outside their private set "
                            "intersection; refusing")
    index = {ident: r for r, ident in enumerate(own.ids)}
    rows = [index[i] for i in wanted]
    lines = [own.lines[r] for r in rows]
    blocks, names = [], []
    for column, cells in own.columns.items():
        block, block_names = encode_column(column, [cells[r] for r in rows], own.file.name, lines)
        blocks.append(block)
        names.extend(block_names)
    n = [len(split) for split in ids]
    bounds = np.cumsum([0, *n])
    raw = RawData(X=np.hstack(blocks), y=np.zeros(len(rows), dtype=np.int64), feature_names=names,
                  classes=["0", "1"])
    data = prepare(raw, own.file.name, seed=cfg.seed, val_fraction=cfg.val_fraction, nan_policy=cfg.nan_policy,
                   rows=tuple(np.arange(bounds[i], bounds[i + 1]) for i in range(3)))  # type: ignore[arg-type]
    return (data.X_train, data.X_val, data.X_test), data.feature_names, data.notes


def run_table(name: str, widths: Sequence[int], sizes: Sequence[int], n_classes: int, *,
              block: int | None = None, columns: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
              labels: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, classes: list[str] | None = None
              ) -> tuple[Dataset, Partition]:
    """The run's table in one party's process: its own block ``block`` (a feature party) or the labels (the label
    party) filled in, every other block zeros of its announced width, placeholder labels where none are held."""
    partition = partition_columns(int(sum(widths)), len(widths), sizes=[int(w) for w in widths])
    X = [np.zeros((int(n), int(sum(widths))), dtype=np.float32) for n in sizes]
    if block is not None and columns is not None:
        for split, part in zip(X, columns, strict=True):
            split[:, partition.blocks[block]] = part
    y = labels if labels is not None else tuple(np.zeros(int(n), dtype=np.int64) for n in sizes)
    data = Dataset(name=name, X_train=X[0], y_train=y[0], X_val=X[1], y_val=y[1], X_test=X[2], y_test=y[2],
                   n_classes=int(n_classes), feature_names=[f"x{j}" for j in range(int(sum(widths)))],
                   classes=classes or [str(c) for c in range(int(n_classes))],
                   notes=[f"federated: {len(widths)} feature parties with their own files ({', '.join(map(str, widths))} "
                          "columns), rows aligned by private set intersection"])
    return data, partition


class counting_apart:  # noqa: N801 - a context manager, read as a phrase
    """Count what a transport sends inside the block in a separate ledger (alignment is not training traffic)."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.stats = CommStats()

    def __enter__(self) -> CommStats:
        self._saved, self.transport.stats = self.transport.stats, self.stats
        return self.stats

    def __exit__(self, *exc: object) -> None:
        self.transport.stats = self._saved


def record_alignment(run_dir: Path | None, plan: RowPlan, resumed: bool) -> None:
    """Keep the plan's digest in the run directory; a resumed run must align to exactly the same rows."""
    if run_dir is None:
        return
    path = Path(run_dir) / "alignment.json"
    if resumed and path.exists():
        before = json.loads(path.read_text()).get("rows_sha256")
        if before != plan.digest():
            raise ConfigError(f"the parties' files now align to other rows than when {run_dir} started (alignment "
                              f"digest {str(before)[:12]} became {plan.digest()[:12]}); restore the files, or start a "
                              "new run")
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"rows_sha256": plan.digest(), **plan.counts}, indent=2) + "\n")


def with_federation_dataset(cfg: TrainConfig, federation: Federation) -> TrainConfig:
    """The run's dataset name when the parties read their own files (shown in summaries and config.toml)."""
    return replace(cfg, dataset=f"federation:{federation.name}")
