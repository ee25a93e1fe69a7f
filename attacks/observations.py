"""What a feature party observes during training, in the form label-inference attacks consume.

A feature party receives one gradient message per batch (rows = the batch's examples, in batch order) and knows which
rows were in the batch (it looked up its own features for them). :func:`observe_gradients` turns a recorded
:class:`~secvfl.transport.network.View` -- or plain tensors, for tests and offline analysis -- into a list of
:class:`GradientBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from secvfl.errors import DataError
from secvfl.messages import Message
from secvfl.transport.network import View

__all__ = ["GradientBatch", "observe_gradients", "IDS_KEYS"]

#: Meta keys under which a message may carry its batch's row ids.
IDS_KEYS = ("ids", "batch_ids", "rows")


@dataclass(frozen=True)
class GradientBatch:
    """One received gradient: ``rows[i]`` is d loss / d (the attacker's output for example ``ids[i]``)."""

    rows: np.ndarray  # (B, k) float64, flattened per example
    ids: np.ndarray  # (B,) int64 row ids
    step: int = 0

    def __post_init__(self) -> None:
        if self.rows.ndim != 2:
            raise DataError(f"gradient rows must be 2-D (batch, values), got shape {self.rows.shape}")
        if self.ids.shape != (self.rows.shape[0],):
            raise DataError(
                f"a gradient batch of {self.rows.shape[0]} rows needs {self.rows.shape[0]} row ids, got shape {self.ids.shape}"
            )


def _rows(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().to(torch.float64).numpy()
    a = np.asarray(t, dtype=np.float64)
    if a.ndim == 0:
        raise DataError("a gradient batch must have a batch dimension; got a scalar")
    return a.reshape(a.shape[0], -1)


def _ids_from_meta(meta: Any) -> np.ndarray | None:
    for key in IDS_KEYS:
        if key in meta:
            values = list(meta[key])
            if values and isinstance(values[0], str):  # ["train", 4, 9, ...]: split name, then row ids
                values = values[1:]
            try:
                return np.asarray(values, dtype=np.int64).reshape(-1)
            except (TypeError, ValueError):
                raise DataError(f"message meta {key!r} does not hold row ids: {meta[key]!r:.80}") from None
    return None


def _from_messages(messages: Sequence[Message], view: View | None, tensor: str,
                   ids: Sequence[Any] | None) -> list[GradientBatch]:
    if ids is not None and len(ids) != len(messages):
        raise DataError(f"got {len(ids)} id arrays for {len(messages)} gradient messages; pass one per message")
    # The attacker's own released messages of the same step carry the batch ids it used (its own knowledge).
    sent_ids: dict[int, np.ndarray] = {}
    if view is not None:
        for m in view.sent:
            found = _ids_from_meta(m.meta)
            if found is not None:
                sent_ids.setdefault(m.step, found)
    out = []
    for i, m in enumerate(messages):
        rows = _rows(m.tensor(tensor))
        if ids is not None:
            batch_ids = np.asarray(ids[i], dtype=np.int64).reshape(-1)
        else:
            batch_ids = _ids_from_meta(m.meta)
            if batch_ids is None:
                batch_ids = sent_ids.get(m.step)
            if batch_ids is None:
                raise DataError(
                    f"gradient message of step {m.step} carries no row ids (meta keys {sorted(m.meta)}) and the view "
                    f"has no sent message of that step with ids; pass ids=[...] (one array per message)"
                )
        out.append(GradientBatch(rows, batch_ids, int(m.step)))
    return out


def observe_gradients(source: View | Sequence[Any], *, ids: Sequence[Any] | None = None, kind: str = "gradient",
                      tensor: str = "gradient") -> list[GradientBatch]:
    """The gradient batches an attacker received, in arrival order.

    ``source`` may be a recorded :class:`View` (its received ``kind`` messages are used), a list of
    :class:`Message`, a list of :class:`GradientBatch`, a list of ``(rows, ids)`` pairs, or a list of plain
    tensors/arrays. Plain tensors without ``ids`` get consecutive ids (batch 0 rows 0..B0-1, then B0.., ...), so a
    flat label vector in arrival order scores them.
    """
    if isinstance(source, View):
        messages = source.received_of(kind)
        if not messages:
            kinds = sorted({m.kind for m in source.received})
            raise DataError(f"the view of {source.party} holds no received {kind!r} messages (it has {kinds})")
        return _from_messages(messages, source, tensor, ids)
    items = list(source)
    if not items:
        raise DataError("no gradient batches to attack")
    if all(isinstance(x, Message) for x in items):
        return _from_messages(items, None, tensor, ids)
    if all(isinstance(x, GradientBatch) for x in items):
        return items
    if ids is not None and len(ids) != len(items):
        raise DataError(f"got {len(ids)} id arrays for {len(items)} gradient batches; pass one per batch")
    out, offset = [], 0
    for i, x in enumerate(items):
        if isinstance(x, tuple) and len(x) == 2:
            rows, batch_ids = _rows(x[0]), np.asarray(x[1], dtype=np.int64).reshape(-1)
        else:
            rows = _rows(x)
            batch_ids = (np.asarray(ids[i], dtype=np.int64).reshape(-1) if ids is not None
                         else np.arange(offset, offset + rows.shape[0], dtype=np.int64))
        offset += rows.shape[0]
        out.append(GradientBatch(rows, batch_ids, i))
    return out
