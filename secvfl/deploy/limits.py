"""What a deployed party accepts from its peers: limits derived from what the run legitimately sends.

A party process starts before it knows the run (the label party proposes it in its hello), so it applies two sets
of limits (:class:`~secvfl.transport.inbox.ReceiveLimits`), each a small multiple of the largest message of its
phase:

* **before the run** (requests, private set intersection, the row plan): a message carries at most one blinded
  point (65 bytes) or one row id (8 bytes) per id of the peer's file; with files of similar sizes, 128 bytes per
  row of the party's own file bounds it (:func:`startup_limits`);
* **during the run** (once built, :func:`run_limits`): an algorithm's message carries at most one row per row of a
  batch (training or evaluation), each at most ``max(--embedding-dim, classes)`` float64 values, or one row per row
  of a whole split of at most ``classes`` values (the full-batch methods); protocol layers (ciphertexts, masks,
  seals) add at most a few times that.

Floor: 4 MiB for a message (a small run's requests and answers: tens of KiB), the buffer per peer four messages. A
federation file's ``[limits]`` table overrides any of them (:data:`secvfl.federation.LIMIT_KEYS`), as do the
announced-columns limits below, which bound what a party allocates for a table whose widths its peers announce.
"""

from __future__ import annotations

from typing import Any

from secvfl.federation import Federation
from secvfl.transport.inbox import ReceiveLimits

__all__ = ["startup_limits", "run_limits", "TableLimits", "table_limits"]

_MIB = 1 << 20
_FLOOR_MESSAGE = 4 * _MIB
_BUFFER_MESSAGES = 4  # the buffer per peer, in largest messages
_PROTOCOL_FACTOR = 4  # ciphertexts, masks and seals carry at most this many times a dense float64 message
_BYTES_PER_OWN_ROW = 128  # before the run: a blinded point or a row id per id of a file of similar size
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


def startup_limits(federation: Federation, own_rows: int | None) -> ReceiveLimits:
    """Limits before the run is known: ``own_rows`` is the number of rows of this party's own file (None: it reads
    none, and only requests cross before the run)."""
    return _limits(federation, _BYTES_PER_OWN_ROW * (own_rows or 0))


def run_limits(federation: Federation, run: Any) -> ReceiveLimits:
    """Limits for the built ``run`` (secvfl.runner.Run): see the module docstring."""
    cfg, data = run.cfg, run.ctx.data
    split_rows = max(len(data.y_train), len(data.y_val), len(data.y_test), 1)
    batch_rows = min(split_rows, max(cfg.batch_size, cfg.eval_batch_size))
    classes = max(int(data.n_classes), 2)
    dense = max(split_rows * classes, batch_rows * max(int(cfg.embedding_dim), classes)) * 8
    return _limits(federation, _PROTOCOL_FACTOR * dense)


class TableLimits:
    """What a party allocates for the widths its peers announce (the run table holds every party's columns)."""

    def __init__(self, columns: int, table_bytes: int) -> None:
        self.columns = columns
        self.table_bytes = table_bytes


def table_limits(federation: Federation) -> TableLimits:
    user = federation.limits
    return TableLimits(int(user.get("party_columns", _DEFAULT_COLUMNS)),
                       int(user.get("table_mib", _DEFAULT_TABLE_MIB) * _MIB))
