"""Each party's own data file in a deployment: read by that party alone, rows aligned by private set intersection.

When the federation file gives every party a ``data`` table, no process reads another party's file:

1. each party reads its own file (CSV, gzip or Parquet, with pyarrow: its id column and its feature columns; the label
   party its id and label columns), without a Python object per cell;
2. the label party runs ECDH-PSI with each feature party over the run's transport (``align_ids``, given by the
   command: protocols.psi.align_rows_with_peers, chunked messages, progress on stderr; each side learns which of its
   own ids the other holds, nothing else);
3. the label party keeps the ids it shares with *every* feature party, in the order of its own file, and draws the
   train / validation / test rows from its labels exactly as ``secvfl train`` does (secvfl.data.preprocess.
   split_rows); it sends each feature party the ids of each split (ids that party already holds) as ``plan-ids``
   messages of at most :data:`PLAN_CHUNK` ids, each declaring its split's total (:func:`send_plan`);
4. each feature party prepares its own columns for those rows (missing values, one-hot categories, standardisation
   with its training rows' statistics: :func:`secvfl.data.preprocess.prepare`), keeps that fitted preprocessing in
   its own directory (:class:`Preprocessing`, :func:`save_preprocessing`) and answers with its width; the label party
   keeps the class names and the widths (:func:`save_run_layout`);
5. every process builds the run from a table in which only its own block (or, at the label party, the labels) is
   filled: the other blocks are zeros of the announced widths, so the algorithm code is the same as in one process.

What this reveals beyond PSI (the threat model of step 3): each feature party learns which of its ids are in the
training set and in which split (the rows every party holds), the number of classes and the split sizes; the label
party learns each feature party's number of columns after encoding. Labels, feature values and ids a party does not
hold never leave their owner. Rows held by some feature parties only are left out (missing blocks from alignment
are not used yet); ``--p-miss-train/--p-miss-test`` (simulated missing blocks) and ``--nan-policy drop`` (which
would need every party's missing cells) are refused.

Serving (`secvfl serve`) prepares a feature party's table of customers to score with the same code as training:
:func:`read_prepared_table` encodes its columns with the saved encodings (secvfl.data.csv_loader.encode_columns)
and standardises them with the saved statistics (secvfl.data.preprocess.Standardisation), so the rows training saw
come out bit for bit as training prepared them (tests/test_serve.py). The rules for cells training never saw are
those of the encodings and the standardisation: a category outside the fitted ones is a missing cell
(secvfl.data.csv_loader.ColumnEncoding says why); a missing cell gets its column's training mean under ``--nan-policy
mean``, and makes its row unusable under ``error`` (the party reports that id as one it cannot score, with the
reason; the rest of the table is served); a non-number in a column of numbers, or an infinite number, refuses the
table with its file and line.

The equivalent one-process run: the rows every party holds, in the label party's file order, joined into one CSV
(feature columns in party order, then the label): ``secvfl train --dataset csv:joined.csv`` gives the same metrics
and bytes (tests/test_deploy_data.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from secvfl.config import TrainConfig
from secvfl.data import Dataset
from secvfl.data.csv_loader import ColumnEncoding, encode_columns, encode_labels, label_codes
from secvfl.data.dataset import RawData
from secvfl.data.files import check_readable_file, check_unique_ids
from secvfl.data.id_index import IdIndex
from secvfl.data.masks import parse_p_miss
from secvfl.data.partition import Partition, partition_columns
from secvfl.data.preprocess import NAN_POLICIES, Standardisation, check_class_sizes, prepare, split_rows
from secvfl.data.table import Column, TableFile, open_table, read_columns
from secvfl.errors import ConfigError, DataError, ProtocolError
from secvfl.federation import DataSpec, Federation
from secvfl.io import write_text_atomic
from secvfl.messages import Message, register_kind
from secvfl.transport.base import CommStats
from secvfl.transport.network import Network

__all__ = ["ALIGN", "PLAN", "AlignRows", "OwnFile", "RowPlan", "read_own_file", "uses_data_files", "check_config",
           "plan_rows", "prepare_own_block", "run_table", "counting_apart", "record_alignment", "send_plan",
           "receive_plan", "PREPROCESSING_FILE", "Preprocessing", "PreparedTable", "save_preprocessing",
           "load_preprocessing", "read_prepared_table", "LAYOUT_FILE", "save_run_layout", "load_run_layout"]

ALIGN, PLAN = "__align__", "__plan__"  # the coordinator's requests before the hello (secvfl.deploy.party)
PLAN_IDS_KIND = register_kind("plan-ids")  # the label party's rows of each split, as ids, in chunks
SPLITS = ("train", "val", "test")
PLAN_CHUNK = 1 << 16  # ids per plan message
PREPROCESSING_FILE = "preprocessing.json"
PREPROCESSING_VERSION = 2  # 1: an earlier format of serving alone; files without a version: an earlier format
LAYOUT_FILE = "serving.json"

# (network, this party, its peers, its own ids) -> per peer, this party's rows (sorted) whose ids the peer also
# holds: one side of a private set intersection with each peer (protocols.psi.align_rows_with_peers, with the
# party's progress log), given by the command.
AlignRows = Callable[[Network, str, Sequence[str], Any], dict[str, np.ndarray]]


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
    """One party's file as that party reads it: its ids (an Arrow string array, whitespace stripped, in file order)
    and its columns (a feature party) or its labels (the label party: rows without a label are left out)."""

    party: str
    file: Path
    table: TableFile
    ids: Any  # pyarrow string array
    rows: np.ndarray | None  # the table row of each id (None: the table's rows, every one, in order)
    columns: dict[str, Column] = field(default_factory=dict)  # feature party: its columns, every table row
    label_column: str | None = None
    label_codes: np.ndarray | None = None  # label party: per id, an index into label_texts
    label_texts: list[str] = field(default_factory=list)

    def id_list(self) -> list[str]:
        return self.ids.to_pylist()


def _read_table(spec: DataSpec, party: str, wanted: list[str], *, text: Sequence[str] = ()
                ) -> tuple[TableFile, dict[str, Column], Any]:
    """The party's table: (file, the ``wanted`` columns, its ids stripped), refusing empty or repeated ids."""
    import pyarrow as pa
    import pyarrow.compute as pc

    where = f"{party}'s data file"
    if not spec.file.exists():
        raise DataError(f"{where} {spec.file} does not exist; fix the file of [parties.{party}] data in the "
                        "federation file, or start this party on the host that holds its file")
    check_readable_file(spec.file, where, f"the file of [parties.{party}] data")
    table = open_table(spec.file, header="yes")
    if table.format == "csv" and len(table.first_rows) < 2:
        raise DataError(f"{spec.file}: {where} needs a header line naming its columns and at least one row")
    absent = [c for c in wanted if c not in table.names]
    if absent:
        raise DataError(f"{spec.file}: no column {absent[0]!r} (its columns: {table.names[:20]}); fix the data table "
                        f"of [parties.{party}] in the federation file")
    extra = [c for c in table.names if c not in wanted] if spec.label is not None else []
    if extra:  # a feature party names its columns; the label party's file would have them silently ignored
        shown = ", ".join(repr(c) for c in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise DataError(f"{spec.file}: column{'s' * (len(extra) > 1)} {shown} of the label party's file would not be "
                        f"used: the label party holds only the ids ({spec.id!r}) and the labels ({spec.label!r}), its "
                        "head has no bottom model for features; remove them from the file, or give them to a feature "
                        "party (it may run on the same host, on another port)")
    columns = read_columns(table, wanted, text=[c for c in text if c != spec.id], keep_arrow=[spec.id])
    ids = pc.utf8_trim_whitespace(columns.pop(spec.id).arrow)
    empty = np.flatnonzero(pc.equal(pc.utf8_length(ids), 0).to_numpy(zero_copy_only=False))
    if len(empty):
        raise DataError(f"{spec.file} {table.cell(int(empty[0]), spec.id)[0]}: empty id in {spec.id!r}; every row "
                        "needs an id")
    check_unique_ids(ids, spec.file, spec.id)
    pa.default_memory_pool().release_unused()  # pyarrow's pool keeps what the id checks freed, not for a later peak
    return table, columns, ids


def read_own_file(spec: DataSpec, party: str) -> OwnFile:
    """Read party ``party``'s own file as its data table in the federation file describes it."""
    wanted = [spec.id, *spec.columns, *([spec.label] if spec.label else [])]
    table, columns, ids = _read_table(spec, party, wanted, text=[spec.label] if spec.label else [])
    own = OwnFile(party, spec.file, table, ids, None)
    if spec.label is not None:
        codes, texts = label_codes(columns[spec.label])
        keep = np.flatnonzero(codes >= 0)
        own.ids, own.rows = ids.take(keep), keep
        own.label_column, own.label_codes, own.label_texts = spec.label, codes[keep], texts
    else:
        own.columns = {c: columns[c] for c in spec.columns}
    return own


@dataclass(frozen=True)
class RowPlan:
    """The label party's choice of rows: the ids of each split (train, val, test; Arrow arrays), their labels and
    classes."""

    ids: tuple[Any, Any, Any]
    y: tuple[np.ndarray, np.ndarray, np.ndarray]
    classes: list[str]
    counts: dict[str, Any]

    def digest(self) -> str:
        """SHA-256 of the ids of every split in order: a resumed run must align to exactly the same rows."""
        h = hashlib.sha256()
        for split, ids in zip(SPLITS, self.ids, strict=True):  # json.dumps([split, ids]), in chunks of ids
            h.update(f"[{json.dumps(split)}, [".encode())
            for chunk in range(0, len(ids), PLAN_CHUNK):
                text = json.dumps(ids.slice(chunk, PLAN_CHUNK).to_pylist())[1:-1]
                h.update(((", " if chunk else "") + text).encode())
            h.update(b"]]")
        return h.hexdigest()


def plan_rows(own: OwnFile, shared: dict[str, np.ndarray], cfg: TrainConfig) -> RowPlan:
    """The rows every party holds, in the label party's file order, split as ``secvfl train`` splits a table.
    ``shared``: per feature party, the label party's id positions (rows of ``own.ids``) it also holds."""
    held = np.ones(len(own.ids), dtype=bool)
    for rows in shared.values():
        mask = np.zeros(len(own.ids), dtype=bool)
        mask[np.asarray(rows, dtype=np.int64)] = True
        held &= mask
    rows = np.flatnonzero(held)
    counts = {"label_party_ids": len(own.ids), "shared_with_label": {p: int(len(v)) for p, v in shared.items()},
              "held_by_all": int(len(rows))}
    if not len(rows):
        raise DataError(f"no id of {own.file} is held by every feature party (shared with each: "
                        f"{counts['shared_with_label']}); check that the parties' id columns use the same ids")
    y, classes = encode_labels((own.label_codes[rows], own.label_texts), own.label_column)
    check_class_sizes(y, classes, f"the {len(rows)} rows every party holds")
    train, val, test = split_rows(y, seed=cfg.seed, val_fraction=cfg.val_fraction)
    for split, idx in zip(SPLITS, (train, val, test), strict=True):
        if len(idx) == 0 and (split != "val" or cfg.val_fraction > 0):
            raise DataError(f"the {len(rows)} rows every party holds leave the {split} split empty; more shared rows "
                            "are needed" + ("" if split != "val" else ", or --val-fraction 0"))
    ids = tuple(own.ids.take(rows[idx]) for idx in (train, val, test))
    counts["rows"] = {s: len(v) for s, v in zip(SPLITS, ids, strict=True)}
    return RowPlan(ids, (y[train], y[val], y[test]), classes, counts)  # type: ignore[arg-type]


def send_plan(net: Network, me: str, party: str, plan: RowPlan) -> None:
    """The ids of each split to feature party ``party``, in chunks of :data:`PLAN_CHUNK` (UTF-8 bytes and int64
    offsets), each naming its split and declaring the split's total."""
    for split, ids in zip(SPLITS, plan.ids, strict=True):
        import pyarrow as pa

        arr = ids.cast(pa.large_string())
        for start in range(0, max(len(arr), 1), PLAN_CHUNK):
            chunk = arr.slice(start, PLAN_CHUNK)
            offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int64)[chunk.offset : chunk.offset + len(chunk) + 1]
            data = chunk.buffers()[2]
            blob = bytes(memoryview(data)[offsets[0] : offsets[-1]]) if data is not None else b""
            net.send(Message(PLAN_IDS_KIND, me, party, 0, blobs={"data": blob, "offsets": (offsets - offsets[0])
                                                                  .tobytes()},
                             meta={"split": split, "total": len(arr), "offset": start, "count": len(chunk)}))


def receive_plan(net: Network, me: str, sender: str, limit: int) -> tuple[Any, Any, Any]:
    """The ids of each split from the label party (see :func:`send_plan`), checked: splits in order, chunks that add
    up, at most ``limit`` ids in all (this party's own intersection with the label party)."""
    import pyarrow as pa

    out = []
    seen = 0
    for split in SPLITS:
        parts: list[Any] = []
        offset, total = 0, None
        while total is None or offset < total:
            msg = net.receive(me, kind=PLAN_IDS_KIND, sender=sender)
            meta = msg.meta
            count, at = meta.get("count"), meta.get("offset")
            if total is None:
                total = meta.get("total")
                if not isinstance(total, int) or not 0 <= total <= limit - seen:
                    raise ProtocolError(f"the label party announced {total!r} {split} rows, more than the {limit} ids "
                                        f"{me} shares with it; refusing")
            if (meta.get("split") != split or meta.get("total") != total or at != offset or not isinstance(count, int)
                    or not 0 <= count <= PLAN_CHUNK or offset + count > total):
                raise ProtocolError(f"a plan message from the label party is malformed ({dict(meta)}); refusing")
            offsets = np.frombuffer(msg.blobs.get("offsets", b""), dtype=np.int64)
            data = msg.blobs.get("data", b"")
            if (len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != len(data)
                    or (np.diff(offsets) < 0).any()):
                raise ProtocolError("a plan message from the label party has inconsistent id offsets; refusing")
            arr = pa.Array.from_buffers(pa.large_string(), count, [None, pa.py_buffer(offsets.tobytes()),
                                                                   pa.py_buffer(data)])
            try:
                arr.validate(full=True)
                parts.append(arr)
            except pa.ArrowInvalid:
                raise ProtocolError("a plan message from the label party holds ids that are not UTF-8; refusing") \
                    from None
            offset += count
            if total == 0:
                break
        seen += total
        out.append(pa.concat_arrays(parts) if parts else pa.array([], pa.large_string()))
    return tuple(out)  # type: ignore[return-value]


def prepare_own_block(own: OwnFile, ids: Sequence[Any], learned: np.ndarray, cfg: TrainConfig
                      ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], list[str], list[str], Preprocessing]:
    """A feature party's columns for the label party's rows: (train, val, test) arrays, column names, notes, and
    the fitted preprocessing (:func:`save_preprocessing`). ``learned``: this party's rows the label party holds."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = own.ids.type  # the plan's ids in the type of this party's own (a copy only where they differ)
    wanted = pa.chunked_array([(i if isinstance(i, (pa.Array, pa.ChunkedArray)) else pa.array(i, kind)).cast(kind)
                               for i in ids], type=kind)
    position = pc.index_in(wanted, value_set=own.ids)
    del wanted
    found = position.is_valid().to_numpy(zero_copy_only=False)
    rows = position.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    del position
    pa.default_memory_pool().release_unused()  # the hash table's memory back to the system before the block's
    allowed = np.zeros(len(own.ids), dtype=bool)
    allowed[np.asarray(learned, dtype=np.int64)] = True
    outside = int((~found).sum() + (~allowed[rows[found]]).sum())
    if outside:  # an honest label party asks only for ids both hold; anything else would probe this party's file
        raise ProtocolError(f"the label party asked {own.party} for {outside} row(s) outside their private set "
                            "intersection; refusing")
    if own.rows is not None:
        rows = own.rows[rows]
    block = encode_columns(list(own.columns.values()), own.table, rows=rows)
    n = [len(split) for split in ids]
    bounds = np.cumsum([0, *n])
    raw = RawData(X=block.X, y=np.zeros(len(rows), dtype=np.int64), feature_names=block.names,
                  classes=["0", "1"], shift=block.shift, encodings=block.encodings)
    del block
    data = prepare(raw, own.file.name, seed=cfg.seed, val_fraction=cfg.val_fraction, nan_policy=cfg.nan_policy,
                   rows=tuple(np.arange(bounds[i], bounds[i + 1]) for i in range(3)))  # type: ignore[arg-type]
    preprocessing = Preprocessing(own.party, str(own.file), list(raw.encodings), data.standardisation)
    return (data.X_train, data.X_val, data.X_test), data.feature_names, data.notes, preprocessing


@dataclass(frozen=True)
class Preprocessing:
    """A feature party's preprocessing fitted on its training rows: each source column's encoding (numbers, or its
    categories one-hot) and the standardisation (the features kept, the means that fill missing cells, the training
    means and deviations, the ``--nan-policy``). Saved in the party's own run directory (:func:`save_preprocessing`;
    nothing in it leaves the party); :func:`read_prepared_table` prepares new rows with it."""

    party: str
    file: str  # the training file (a record of where the statistics come from)
    encodings: list[ColumnEncoding]
    standardisation: Standardisation

    @property
    def width(self) -> int:
        return len(self.standardisation.columns)

    @property
    def nan_policy(self) -> str:
        return self.standardisation.nan_policy

    def to_dict(self) -> dict[str, Any]:
        return {"version": PREPROCESSING_VERSION, "party": self.party, "file": self.file,
                "columns": [e.to_dict() for e in self.encodings], "standardisation": self.standardisation.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Preprocessing:
        """Read back what :meth:`to_dict` wrote; a damaged file or another format gets a ConfigError naming it."""
        fix = "retrain the run, or restore the file from a backup"
        if not isinstance(d, dict):
            raise ConfigError(f"{where} is damaged (not a JSON object); {fix}")
        if d.get("version") != PREPROCESSING_VERSION:
            raise ConfigError(f"{where} is of format version {d.get('version')}, written by another secvfl; this one "
                              f"reads version {PREPROCESSING_VERSION}: retrain the run with it, or serve with the "
                              "secvfl that trained")
        try:
            encodings = [ColumnEncoding.from_dict(c) for c in d["columns"]]
            standard = Standardisation.from_dict(d["standardisation"])
            made = cls(str(d["party"]), str(d["file"]), encodings, standard)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{where} is damaged ({type(exc).__name__}: {exc}); {fix}") from None
        names = [n for e in encodings for n in e.output_names]
        stats = [standard.mean, standard.std, *([] if standard.impute is None else [standard.impute])]
        if (not encodings or any(e.kind not in ("number", "categories") for e in encodings)
                or len({e.name for e in encodings}) != len(encodings) or len(set(names)) != len(names)
                or not standard.columns or not set(standard.columns) <= set(names)
                or len(set(standard.columns)) != len(standard.columns) or standard.image
                or any(s.shape != (len(standard.columns),) or not np.isfinite(s).all() for s in stats)
                or (standard.std <= 0).any() or standard.nan_policy not in NAN_POLICIES):
            raise ConfigError(f"{where} is damaged (its columns and statistics do not fit together); {fix}")
        return made


def save_preprocessing(run_dir: Path, preprocessing: Preprocessing) -> Path:
    """Keep a feature party's fitted preprocessing in its own run directory (``preprocessing.json``, atomically)."""
    path = Path(run_dir) / PREPROCESSING_FILE
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(preprocessing.to_dict(), indent=1) + "\n")
    return path


def load_preprocessing(run_dir: Path) -> Preprocessing:
    path = Path(run_dir) / PREPROCESSING_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: {run_dir} holds no fitted preprocessing of a feature party (a "
                          "party saves it when it trains on its own file); pass the directory `secvfl party --out` "
                          "wrote for this party (after `secvfl launch --out RUN`: RUN/<party>)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}; restore it from a backup, or retrain the run") from None
    return Preprocessing.from_dict(data, str(path))


@dataclass
class PreparedTable:
    """A party's table prepared for its model (:func:`read_prepared_table`): its ids (an Arrow string array, in file
    order), one float32 block (rows x features; zeros in a row that cannot be used), which rows can be used, and
    what was done to cells training never saw (``notes``; ``why_unusable``: why a row cannot be used)."""

    file: Path
    ids: Any
    X: np.ndarray
    usable: np.ndarray
    notes: list[str]
    why_unusable: str = ""

    @cached_property
    def index(self) -> IdIndex:
        return IdIndex(self.ids)

    def rows(self, wanted: Sequence[str] | Any) -> np.ndarray:
        """The row of each of ``wanted`` ids, -1 where the table does not hold it (secvfl.data.id_index)."""
        return self.index.rows(wanted)


def read_prepared_table(spec: DataSpec, party: str, preprocessing: Preprocessing) -> PreparedTable:
    """A party's own table (``spec.file``: its training file, or new customers to score with the same id and
    columns; CSV or Parquet) prepared as its training rows were, by the code that prepared them (see the module
    doc for cells training never saw)."""
    encodings = preprocessing.encodings
    categories = [e.name for e in encodings if e.kind == "categories"]  # compared as text, whatever they look like
    table, columns, ids = _read_table(spec, party, [spec.id, *[e.name for e in encodings]], text=categories)
    block = encode_columns([columns[e.name] for e in encodings], table, encodings=encodings)
    del columns
    standard = preprocessing.standardisation
    policy = standard.nan_policy
    notes = [f"column {name!r}: {k} cell(s) hold a category training never saw, treated as missing cells "
             f"(--nan-policy {policy})" for name, k in block.unseen.items()]
    incomplete = np.zeros(len(ids), dtype=bool)
    X = standard.apply(block.X, block.names, block.shift, missing=incomplete)
    del block
    usable = np.ones(len(ids), dtype=bool)
    why = ""
    if incomplete.any():
        if policy == "mean":
            notes.append(f"{int(incomplete.sum())} row(s) with missing cells filled with the training means")
        else:
            usable = ~incomplete
            X[incomplete] = 0.0
            why = f"its row has a missing cell, and the model was trained with --nan-policy {policy}"
            notes.append(f"{int(incomplete.sum())} row(s) with missing cells cannot be scored (--nan-policy {policy})")
    return PreparedTable(spec.file, ids, X, usable, notes, why)


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


def save_run_layout(run_dir: Path, *, classes: Sequence[str], widths: Sequence[int]) -> Path:
    """The label party's record of what a served answer needs that its other files do not keep (``serving.json``):
    the class names, in the order of the model's outputs, and each feature party's width after encoding."""
    path = Path(run_dir) / LAYOUT_FILE
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"version": 1, "classes": [str(c) for c in classes],
                                        "widths": [int(w) for w in widths]}, indent=1) + "\n")
    return path


def load_run_layout(run_dir: Path) -> tuple[list[str], list[int]]:
    """(class names, each feature party's width) from the label party's ``serving.json``."""
    path = Path(run_dir) / LAYOUT_FILE
    try:
        data = json.loads(path.read_text())
        classes, widths = [str(c) for c in data["classes"]], [int(w) for w in data["widths"]]
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: {run_dir} is not the label party's directory of a run whose "
                          "parties read their own files (trained with this secvfl); pass the directory "
                          "`secvfl party --out` (or `secvfl launch --out RUN`: RUN/<label party>) wrote") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is damaged ({type(exc).__name__}); retrain, or restore it from a backup") from None
    if len(classes) < 2 or not widths or any(w < 1 for w in widths):
        raise ConfigError(f"{path} is damaged (classes {classes[:5]}, widths {widths}); retrain, or restore it")
    return classes, widths


def with_federation_dataset(cfg: TrainConfig, federation: Federation) -> TrainConfig:
    """The run's dataset name when the parties read their own files (shown in summaries and config.toml)."""
    return replace(cfg, dataset=f"federation:{federation.name}")
