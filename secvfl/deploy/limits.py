"""What a deployed party accepts from its peers: limits derived from what the run legitimately sends.

A party process starts before it knows the run (the label party proposes it in its hello), so it applies two sets
of limits (:class:`~secvfl.transport.inbox.ReceiveLimits`), each a small multiple of the largest message of its
phase:

* **before the run** (requests, private set intersection, the row plan; :func:`startup_limits`): each side of the
  private set intersection sends all its points (32 bytes an id, in chunks of at most 512 KiB) before it reads its
  peer's, so a party must be able to hold what a peer sends meanwhile: 128 bytes per row of its own file make the
  message limit (the buffer per peer holds four of them: 16 times its own points), so at least the party with fewer
  ids finishes sending and reads, and the other's sends go on. A chunk of the row plan carries at most
  :data:`~secvfl.deploy.data.PLAN_CHUNK` of this party's own ids (each at most as long as its longest id);
* **during the run** (once built, :func:`run_limits`): an algorithm's message carries at most one row per row of a
  batch (training or evaluation), each at most ``max(--embedding-dim, classes)`` float64 values, or one row per row
  of a whole split of at most ``classes`` values (the full-batch methods); protocol layers (ciphertexts, masks,
  seals) add at most a few times that;
* **while serving** (``secvfl serve``, once the coordinator's hello is read, :func:`serve_limits`): a call carries
  at most ``--max-batch-ids`` ids in its header (at most :data:`~secvfl.messages.MAX_HEADER_BYTES`), an output or
  answer one row per id of at most ``max(--embedding-dim, classes)`` values, times the protocols' factor.

Floor: 4 MiB for a message (a small run's requests and answers: tens of KiB), the buffer per peer four messages. A
federation file's ``[limits]`` table overrides any of them (:data:`secvfl.federation.LIMIT_KEYS`), as do the
announced-columns limits below, which bound what a party allocates for a table whose widths its peers announce.
"""

from __future__ import annotations

from typing import Any

from secvfl.deploy.data import PLAN_CHUNK
from secvfl.federation import Federation
from secvfl.messages import MAX_HEADER_BYTES
from secvfl.transport.inbox import ReceiveLimits

__all__ = ["startup_limits", "run_limits", "serve_limits", "MAX_SERVE_IDS", "TableLimits", "table_limits"]

_MIB = 1 << 20
_FLOOR_MESSAGE = 4 * _MIB
_BUFFER_MESSAGES = 4  # the buffer per peer, in largest messages
_PROTOCOL_FACTOR = 4  # ciphertexts, masks and seals carry at most this many times a dense float64 message
_BYTES_PER_OWN_ROW = 128  # before the run: four times a point per own id (see the module docstring)
_PLAN_ID_BYTES = 8  # a row plan's offset per id, beside the id's own bytes
_HEADER_ROOM = 64 << 10  # a message's prefix and the rest of its header
MAX_SERVE_IDS = 1_000_000  # the most ids one serving batch may hold (--max-batch-ids)
_DEFAULT_COLUMNS = 16384
_DEFAULT_TABLE_MIB = 2048


def _limits(federation: Federation, largest: int) -> ReceiveLimits:
    message = max(_FLOOR_MESSAGE, largest)
    user = federation.limits
    if "max_message_mib" in user:
        message = int(user["max_message_mib"] * _MIB)
    buffer = int(user["buffer_mib"] * _MIB) if "buffer_mib" in user else _BUFFER_MESSAGES * message
    defaults = ReceiveLimits()
    return ReceiveLimits(
        max_message_bytes=message, max_buffered_bytes=buffer,
        max_buffered_messages=int(user.get("buffered_messages", defaults.max_buffered_messages)),
        streams_per_peer=int(user.get("streams_per_peer", defaults.streams_per_peer)),
        connections=int(user.get("connections", defaults.connections)),
        handshake_seconds=float(user.get("handshake_seconds", defaults.handshake_seconds)),
    )


def startup_limits(federation: Federation, own_ids: Any | None) -> ReceiveLimits:
    """Limits before the run is known: ``own_ids`` are the ids of this party's own file (a pyarrow string array;
    None: it reads none, and only requests cross before the run)."""
    if own_ids is None or not len(own_ids):
        return _limits(federation, 0)
    import pyarrow.compute as pc

    n = len(own_ids)
    longest = int(pc.max(pc.binary_length(own_ids)).as_py() or 0)
    plan_chunk = min(n, PLAN_CHUNK) * (longest + _PLAN_ID_BYTES) + _HEADER_ROOM
    return _limits(federation, max(_BYTES_PER_OWN_ROW * n, plan_chunk))


def run_limits(federation: Federation, run: Any) -> ReceiveLimits:
    """Limits for the built ``run`` (secvfl.runner.Run): see the module docstring."""
    cfg, data = run.cfg, run.ctx.data
    split_rows = max(len(data.y_train), len(data.y_val), len(data.y_test), 1)
    batch_rows = min(split_rows, max(cfg.batch_size, cfg.eval_batch_size))
    classes = max(int(data.n_classes), 2)
    dense = max(split_rows * classes, batch_rows * max(int(cfg.embedding_dim), classes)) * 8
    return _limits(federation, _PROTOCOL_FACTOR * dense)


def serve_limits(federation: Federation, cfg: Any, n_classes: int, max_ids: int) -> ReceiveLimits:
    """Limits while serving ``cfg``'s model (secvfl.config.TrainConfig) in batches of at most ``max_ids`` ids (at
    most :data:`MAX_SERVE_IDS`): see the module docstring."""
    values = max(int(cfg.embedding_dim), int(n_classes), 2)
    return _limits(federation, max(MAX_HEADER_BYTES + _HEADER_ROOM, _PROTOCOL_FACTOR * max_ids * values * 8))


class TableLimits:
    """What a party allocates for the widths its peers announce (the run table holds every party's columns)."""

    def __init__(self, columns: int, table_bytes: int) -> None:
        self.columns = columns
        self.table_bytes = table_bytes


def table_limits(federation: Federation) -> TableLimits:
    user = federation.limits
    return TableLimits(int(user.get("party_columns", _DEFAULT_COLUMNS)),
                       int(user.get("table_mib", _DEFAULT_TABLE_MIB) * _MIB))
