"""`secvfl train` flags of the missing-feature-block algorithms (laser, ensemble, combinatorial, plugvfl, ...).

They join the command line through the protocol-plugin mechanism (an entry point of group ``secvfl.protocols``: the
one extension point for train flags) but add no protocol layer: ``configure`` only validates them. Values land in
``TrainConfig.options``.
"""

from __future__ import annotations

import argparse

from secvfl.errors import ConfigError, UnsupportedError
from secvfl.plugins import ProtocolPlugin, ProtocolSetup
from secvfl.transport.layers import AlgorithmTraits

__all__ = ["MissingFeatureFlags", "MISSING_ALGOS"]

MISSING_ALGOS = ("laser", "local-missing", "ensemble", "svfl", "combinatorial", "plugvfl")


class MissingFeatureFlags(ProtocolPlugin):
    name = "missing-features"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--class-balanced", action="store_true",
                            help="missing-feature algorithms: class-balanced batches (equal draws per class per "
                                 "epoch) for imbalanced labels")
        parser.add_argument("--p-drop", type=float, default=0.05,
                            help="plugvfl: probability of dropping each passive party's representation per batch")

    def configure(self, cfg, traits: AlgorithmTraits, ctx) -> ProtocolSetup | None:  # noqa: ANN001
        p_drop = float(cfg.option("p_drop", 0.05))
        if not 0.0 <= p_drop < 1.0:
            raise ConfigError(f"--p-drop must be in [0, 1), got {p_drop}")
        if cfg.option("class_balanced", False) and traits.name not in MISSING_ALGOS:
            raise UnsupportedError(f"--class-balanced applies to {', '.join(MISSING_ALGOS)}, not {traits.name}")
        return None

