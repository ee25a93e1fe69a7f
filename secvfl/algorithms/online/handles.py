"""The requests an online coordinator may make of its parties (see :mod:`secvfl.handles`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from secvfl.algorithms.online.parties import OnlineFeatureParty, OnlineLabelParty
from secvfl.handles import LocalHandle, request
from secvfl.metrics import classification_metrics

__all__ = ["OnlineFeatureHandle", "OnlineLabelHandle"]


class OnlineFeatureHandle(LocalHandle):
    _party: OnlineFeatureParty

    @request
    def forward(self, step: int, *, to: str) -> None:
        """Answer round ``step`` with the embedding of the next event in the party's feed, sent to ``to``."""
        self._net.send(self._party.forward(step, to))

    @request
    def update(self, *, sender: str, active: bool) -> None:
        """Active: take the gradient ``sender`` sent and step; passive: enqueue zeros (no gradient, no step)."""
        self._party.backward(self._receive("gradient", sender) if active else None)

    @request
    def forward_eval(self, step: int, split: str, ids: np.ndarray, *, to: str) -> None:
        self._net.send(self._party.forward_eval(step, split, ids, to))

    @request
    def compute(self) -> dict[str, dict[str, float]]:
        """The party's own measurements: compute seconds and rounds, active and passive."""
        return {"seconds": dict(self._party.seconds), "rounds": dict(self._party.rounds)}


class OnlineLabelHandle(LocalHandle):
    """The coordinator runs in this party's process: its losses and predictions are the coordinator's own."""

    _party: OnlineLabelParty

    def __init__(self, party: OnlineLabelParty, net) -> None:  # noqa: ANN001 - a Network
        super().__init__(party, net)
        self._inputs: list = []
        self._predictions: list[np.ndarray] = []

    @request
    def receive(self, senders: Sequence[str]) -> list[str]:
        """Take one embedding per sender from the network; returns the senders that say they are active."""
        self._inputs = [self._receive("embedding", s) for s in senders]
        return [m.sender for m in self._inputs if m.meta.get("active") is True]

    @request
    def train_round(self, step: int, senders: Sequence[str], active: Sequence[str]) -> tuple[float, bool]:
        inputs, self._inputs = self._inputs, []
        loss, correct, grads = self._party.train_round(step, inputs, senders, active)
        self._send(grads)  # one release of the party's messages (in order, each its own message on the wire)
        return loss, correct

    @request
    def predict(self) -> None:
        """Predict the rows of the received evaluation embeddings; kept by the label party until :meth:`score`."""
        inputs, self._inputs = self._inputs, []
        self._predictions.append(self._party.predict(inputs).cpu().numpy())

    @request
    def score(self, split: str) -> dict[str, float]:
        """Metrics of the predictions made since the last score against the party's labels of ``split``."""
        proba, self._predictions = np.concatenate(self._predictions), []
        return classification_metrics(self._party.labels(split), proba)
