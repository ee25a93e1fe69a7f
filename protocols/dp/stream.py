"""Label DP on a stream (``--algo ogd | slr | dlr --privacy dp``): randomized response of each label as it arrives.

The online label party takes one (entity, label) event from its feed per round; :class:`StreamRR`, installed through
the party's ``install_label_transform`` hook, replaces that label once, by K-ary randomized response at the run's
epsilon, when the event is taken. The party trains on the returned label only: the round's loss and gradients, the
head's update and every later reuse of the label (DLR's window of past gradients, SLR's window of the last l labels)
are post-processing of that one release.

What epsilon means for a stream: every stream sample is a new individual whose label is released once, so the run is
epsilon-label-DP *per stream sample* (neighbouring streams: one sample's label replaced), by parallel composition
over distinct samples, however long the stream runs. For a dataset replayed as a stream the unit of privacy is the
stream sample, not the source row: a source row drawn r times has its label released r times (r * epsilon for that
row). Events from live sources (:class:`~secvfl.algorithms.online.live.RoundJoin`) are individuals.

The draws come from the DP layer's noise source (secure unless ``--dp-reproducible``); its position is the layer's
checkpoint state, so a resumed ``--dp-reproducible`` run randomises exactly the labels an uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.dp.rng import NoiseSource
from protocols.dp.rr import randomized_response

__all__ = ["StreamRR"]


class StreamRR:
    """``transform(entity, label)`` for the online label party: each call is one randomized-response release."""

    def __init__(self, n_classes: int, epsilon: float, noise: NoiseSource) -> None:
        self.n_classes = int(n_classes)
        self.epsilon = float(epsilon)
        self.noise = noise
        self.released = 0  # labels randomised over the whole run (every process: restored from the checkpoint)

    def __call__(self, entity: int, label: int) -> int:
        released = int(randomized_response(np.array([label]), self.n_classes, self.epsilon, self.noise)[0])
        self.released += 1
        return released

    def describe(self) -> dict[str, Any]:
        return {"stream_labels_released": self.released}

    def state_dict(self) -> dict[str, Any]:
        return {"released": self.released}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.released = int(state["released"])
