"""The options of the online family (``--stream``, ``--samples``, ``--activation``, ``--online-*``): one typed
:class:`OnlineOptions` that ogd, slr and dlr declare as their ``options_type``.

The run's length is ``--epochs`` blocks of ``--samples`` stream samples: a block is the runner's epoch (a checkpoint
and a metrics.jsonl line after each), so ``--resume DIR --epochs N`` continues a stream exactly like any run.
Per-sample SGD steps are set here (``--online-lr``); the core ``--lr``, ``--optimizer`` and ``--batch-size`` do
not apply (one sample per round, plain gradient steps as in the paper).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from secvfl.algorithms.online.activation import parse_activation
from secvfl.errors import ConfigError
from secvfl.options import Options, option

__all__ = ["OnlineOptions", "ONLINE_ALGOS"]

ONLINE_ALGOS = ("ogd", "slr", "dlr")


@dataclass(frozen=True)
class OnlineOptions(Options):
    title = "online family (ogd, slr, dlr): one stream sample per round"

    stream: Literal["stationary", "nonstationary"] = option(
        "stationary", "class probabilities of the replayed stream: equal every round (stationary), or redrawn from "
                      "U(0,1) and normalised every 50 rounds (nonstationary)")
    samples: int = option(
        100, "stream samples per epoch (block): the run sees --epochs x --samples samples, with a checkpoint and a "
             "metrics.jsonl line after each block", check=(lambda v: 1 <= v <= 10**9, "an integer in [1, 10^9]"))
    activation: str = option(
        "full", "which feature parties a round activates: full, random:P (each party with probability P), or "
                "event:GAMMA (a party whose input features average above GAMMA)",
        metavar="SPEC")
    online_window: int = option(
        10, "slr/dlr: window length l (ogd: 1)", check=(lambda v: 1 <= v <= 10_000, "an integer in [1, 10000]"),
        algos=("slr", "dlr"))
    online_alpha: float = option(
        0.95, "dlr: weight decay alpha of the window (weights alpha^i, i < l)",
        check=(lambda v: 0 < v <= 1, "in (0, 1]"), algos=("dlr",))
    online_lr: float = option(
        0.01, "step size of every party's plain gradient step (per sample)",
        check=(lambda v: 0 < v < math.inf, "a finite number > 0"))
    online_embedding: int = option(
        64, "width of each party's embedding (one linear layer -> ReLU)",
        check=(lambda v: 1 <= v <= 65_536, "an integer in [1, 65536]"))
    online_head: int = option(
        256, "hidden width of the label party's model (ReLU -> classes)",
        check=(lambda v: 1 <= v <= 65_536, "an integer in [1, 65536]"))
    metric_window: int = option(
        20_000, "prequential error is averaged over every this many samples (the paper's run-time error)",
        check=(lambda v: v >= 1, "an integer >= 1"))
    deform: Literal["auto", "on", "off"] = option(
        "auto", "small random affine deformation of each replayed image (auto: on for image data) so that the stream "
                "does not repeat")

    def problems(self) -> list[str]:
        try:
            parse_activation(self.activation)
        except ConfigError as exc:
            return [str(exc)]
        return []
