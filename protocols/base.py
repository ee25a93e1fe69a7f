"""Helpers shared by the protocol implementations.

The interfaces protocols implement (:class:`~secvfl.transport.layers.Layer`,
:class:`~secvfl.transport.layers.Aggregation`, :class:`~secvfl.transport.layers.AlgorithmTraits`, ...) live in the
core, in :mod:`secvfl.transport.layers`; the plugin interface in :mod:`secvfl.plugins`.
"""

from __future__ import annotations

from secvfl.transport.layers import AlgorithmTraits

__all__ = ["broadcast_refusal"]


def broadcast_refusal(traits: AlgorithmTraits, flag: str) -> str:
    """Why a secure aggregation (``flag``) cannot serve an algorithm that never aggregates through the network."""
    return (
        f"{traits.name} sends each party's output to its receivers individually and never sums them through the "
        f"network, so {flag} would protect nothing; drop it (--secure-channel protects the messages in transit)"
    )
