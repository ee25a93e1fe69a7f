"""The trainer interface every algorithm implements, and the context it is built from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from secvfl.config import TrainConfig
from secvfl.data import Dataset, Partition
from secvfl.handles import FeatureHandle, LabelHandle, PartyHandle, local_party
from secvfl.options import Options
from secvfl.parties import FeatureParty, LabelParty, ProtocolHooks
from secvfl.transport.layers import AlgorithmTraits, Role
from secvfl.transport.network import Network

__all__ = ["Algorithm", "FeatureLabelAlgorithm", "RunContext", "batch_ids", "BatchSchedule", "ProgressFn", "LABEL_PARTY", "feature_party_names"]

LABEL_PARTY = "label"
SPLITS = ("train", "val", "test")
ProgressFn = Callable[[float], None]


def feature_party_names(k: int) -> list[str]:
    return [f"party{i}" for i in range(k)]


@dataclass
class RunContext:
    """Everything an algorithm needs to build its parties. ``masks[split]`` is (n, K): which blocks are observed."""

    config: TrainConfig
    data: Dataset
    partition: Partition
    masks: dict[str, np.ndarray]
    device: torch.device
    dtype: torch.dtype

    def rows(self, split: str) -> int:
        return int(len(getattr(self.data, f"y_{split}")))


def batch_ids(n_or_ids: int | np.ndarray, batch_size: int, seed: int, epoch: int) -> Iterator[np.ndarray]:
    """Mini-batches of row ids from a seed every party shares (so no party has to send ids)."""
    ids = np.arange(n_or_ids) if isinstance(n_or_ids, int) else np.asarray(n_or_ids)
    order = ids[np.random.default_rng([seed, epoch]).permutation(len(ids))]
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


class BatchSchedule:
    """The public schedule of training batches: the training row ids (from the public alignment pattern), the batch
    size and the shared seed, from which every party derives the same batch order, plus the epoch being trained
    (None outside training).

    Protocol hooks installed on a party (a compression tagger naming a batch's rows, say) get this, never the
    algorithm: the algorithm is the coordinator and reaches every party (through their handles), and its context
    holds every party's features and the labels. The schedule holds public facts only (it copies the row ids).
    """

    def __init__(self, rows: np.ndarray, batch_size: int, seed: int) -> None:
        self.rows = np.array(rows, dtype=np.int64)
        self.rows.setflags(write=False)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch: int | None = None

    def batches(self, epoch: int) -> Iterator[np.ndarray]:
        return batch_ids(self.rows, self.batch_size, self.seed, epoch)

    def order(self, epoch: int) -> np.ndarray:
        """Every training row id in the order epoch ``epoch`` visits them (its batches one after another)."""
        batches = list(self.batches(epoch))
        return np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)


class Algorithm(ABC):
    """A VFL training algorithm: builds its parties, trains an epoch, evaluates.

    The algorithm is the coordinator: it holds a handle per party (:mod:`secvfl.handles`), never a party object,
    and makes requests of them; what parties exchange goes through ``self.net`` (send/receive/aggregate), so every
    protocol layer applies to them. Subclasses declare ``traits`` so layers can check they are valid for the
    algorithm.
    """

    name: ClassVar[str]
    traits: ClassVar[AlgorithmTraits]
    # The algorithm family's own options (secvfl.options), read with ``self.cfg.options_for(type)``; None: none.
    options_type: ClassVar[type[Options] | None] = None
    # Core settings (TrainConfig fields) this algorithm does not read, each with what sets it instead: given with a
    # value other than their default they are refused, in one line, before anything is loaded (TrainConfig), as an
    # algorithm family's option given for another algorithm is.
    unused_settings: ClassVar[Mapping[str, str]] = {}
    # What evaluate("val") measures, as the per-epoch log line names it.
    val_name: ClassVar[str] = "val"

    def __init__(self, ctx: RunContext, net: Network) -> None:
        self.ctx = ctx
        self.net = net
        self.cfg = ctx.config
        self.step = 0

    @classmethod
    def party_roles(cls, k: int) -> dict[str, Role]:
        roles = {p: Role.FEATURE for p in feature_party_names(k)}
        roles[LABEL_PARTY] = Role.LABEL
        return roles

    @abstractmethod
    def train_epoch(self, epoch: int, progress: ProgressFn | None = None) -> dict[str, float]:
        """One pass over the training rows; returns at least ``{"loss": mean batch loss}``."""

    @abstractmethod
    def evaluate(self, split: str) -> dict[str, float]:
        """Metrics on ``split`` ("val" or "test"), computed by the party that owns the labels."""

    def batches_per_epoch(self) -> int:
        n = self.ctx.rows("train")
        return -(-n // self.cfg.batch_size)

    def step_size(self) -> tuple[str, float] | None:
        """The flag that sets this algorithm's step size and its value (a diverged run names it); None when no flag
        sets it (the step sizes come from the problem)."""
        return "--lr", self.cfg.lr

    def protocol_hooks(self) -> ProtocolHooks:
        """The parties' public hook points protocols may use (none by default: protocols that need one refuse)."""
        return ProtocolHooks()

    def epoch_record(self) -> dict[str, Any]:
        """What the algorithm adds to an epoch's metrics.jsonl line (JSON values; none by default)."""
        return {}

    def message_widths(self) -> dict[str, int]:
        """Columns of each forward output kind the parties send (one row per batch row); a receiver refuses
        another width (secvfl.transport.guard). Undeclared kinds keep the width of their first message."""
        return {}

    def report(self, run_dir: Path | None) -> dict[str, Any]:
        """What the algorithm adds to summary.json at the end of a run; it may write its own files to ``run_dir``."""
        return {}

    @abstractmethod
    def handles(self) -> dict[str, PartyHandle]:
        """Party name -> the handle this algorithm reaches that party through (its only way to reach it)."""

    def parties(self) -> dict[str, object]:
        """Party name -> party object, in process only (:func:`~secvfl.handles.local_party`): for protocol set-up,
        attacks and tests. Training, evaluation and checkpoints go through :meth:`handles`."""
        return {n: local_party(h) for n, h in self.handles().items()}

    def state_dict(self) -> dict[str, dict]:
        # each party's state comes from the party itself (a checkpoint file per party)
        return {"step": self.step, "parties": {n: h.state_dict() for n, h in self.handles().items()}}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        for n, h in self.handles().items():
            h.load_state_dict(state["parties"][n])


class FeatureLabelAlgorithm(Algorithm):
    """An algorithm whose feature parties all answer one label party (the split algorithms, VIM): it reaches them
    through ``feature_handles`` and ``label_handle`` and trains in the public batch order ``schedule``, whose ``epoch``
    is the epoch being trained (None outside ``train_epoch``)."""

    feature_handles: list[FeatureHandle]
    label_handle: LabelHandle
    schedule: BatchSchedule

    @property
    def current_epoch(self) -> int | None:
        return self.schedule.epoch

    @current_epoch.setter
    def current_epoch(self, epoch: int | None) -> None:
        self.schedule.epoch = epoch

    def handles(self) -> dict[str, PartyHandle]:
        return {**{h.name: h for h in self.feature_handles}, LABEL_PARTY: self.label_handle}

    @property
    def feature_parties(self) -> list[FeatureParty]:
        """The feature party objects, in process only (protocol set-up, attacks, tests; see :meth:`parties`)."""
        return [local_party(h) for h in self.feature_handles]

    @property
    def label_party(self) -> LabelParty:
        """The label party object, in process only (see :meth:`parties`)."""
        return local_party(self.label_handle)

    def predict_proba(self, split: str) -> np.ndarray:
        raise NotImplementedError

    def protocol_hooks(self) -> ProtocolHooks:
        return ProtocolHooks(label=self.label_party, feature_parties=tuple(self.feature_parties),
                             schedule=self.schedule, predict=self.predict_proba)
