"""Helpers shared by the protocol implementations.

The interfaces protocols implement (:class:`~secvfl.transport.layers.Layer`,
:class:`~secvfl.transport.layers.Aggregation`, :class:`~secvfl.transport.layers.AlgorithmTraits`, ...) live in the
core, in :mod:`secvfl.transport.layers`; the plugin interface in :mod:`secvfl.plugins`.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from secvfl.errors import ProtocolError, UnsupportedError
from secvfl.messages import Message
from secvfl.transport.layers import Aggregation, AlgorithmTraits

if TYPE_CHECKING:
    from secvfl.transport.network import Network

__all__ = ["FLOAT_DTYPES", "SecureSumAggregation", "broadcast_refusal", "refuse_unsummable"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUMMING_ALGORITHMS = ("sum", "mean", "subset-mean")  # AlgorithmTraits.aggregation values a secure sum serves
_OPS = ("sum", "mean")


def broadcast_refusal(traits: AlgorithmTraits, flag: str) -> str:
    """Why a secure aggregation (``flag``) cannot serve an algorithm that never aggregates through the network."""
    return (
        f"{traits.name} sends each party's output to its receivers individually and never sums them through the "
        f"network, so {flag} would protect nothing; drop it (--secure-channel protects the messages in transit)"
    )


def refuse_unsummable(values: np.ndarray, limit: float, what: str, scheme: str, limit_text: str) -> None:
    """Refuse, before anything leaves the party, values a secure sum cannot carry: NaN or infinities, and magnitudes
    above ``limit``, beyond which the sum wraps around the modulus and decodes to garbage with no error.

    ``what`` names the values ("p1's embedding"), ``scheme`` the protocol that needs finite numbers, and
    ``limit_text`` completes "above ...": the limit, why, and how to raise it.
    """
    peak = float(np.abs(values).max()) if values.size else 0.0
    if not math.isfinite(peak):
        raise ProtocolError(f"{what} contains NaN or infinite values; {scheme} needs finite numbers")
    if peak > limit:
        raise ProtocolError(f"{what} has a value of magnitude {peak:.4g}, above {limit_text}")


class SecureSumAggregation(Aggregation):
    """An aggregation that delivers only the sum (or mean) of at least two parties' tensors: CKKS and masking.

    It serves algorithms that sum or average their parties' outputs, and checks a round's input before anything is
    encrypted or masked, in this order: the op; the receiver (:meth:`_check_receiver`); at least two parties (a sum
    over one party is its output), each once; who may contribute (:meth:`_check_contributors`); one message kind and
    one layout of tensor names, shapes and dtypes (:meth:`_layout`, :meth:`_check_layout`). Subclasses name
    themselves in the refusals (:attr:`flag`, :attr:`subject`, :attr:`one_party_sum`) and do the cryptography.
    """

    flag: ClassVar[str]  # the option that switches it on, named when an algorithm is refused ("--he ckks")
    accepts_encoded: ClassVar[bool] = False  # it adds each party's dense tensor, encrypted or masked (check_stack)
    subject: ClassVar[str]  # how refusals name it ("CKKS aggregation")
    one_party_sum: ClassVar[str]  # why a sum over one party is refused, in its own words

    def check(self, traits: AlgorithmTraits) -> list[str]:
        if traits.individual_outputs:
            return [f"{traits.name} cannot run on a sum of the parties' outputs: {traits.individual_outputs}; drop "
                    f"{self.flag}"]
        if traits.aggregation in _SUMMING_ALGORITHMS:
            return []
        if traits.aggregation == "broadcast":
            return [broadcast_refusal(traits, self.flag)]
        return [self._refusal(traits)]

    @abstractmethod
    def _refusal(self, traits: AlgorithmTraits) -> str:
        """Why an algorithm that combines its parties' outputs otherwise (concatenation, not at all) is refused."""

    @abstractmethod
    def _layout(self, message: Message) -> list[Any]:
        """The names, shapes and dtypes of ``message``'s tensors, as the subclass reports them in refusals."""

    def _check_receiver(self, net: Network, receiver: str) -> None:  # noqa: B027 - optional hook
        """Refuse a receiver that may not get the sum (before the messages are looked at)."""

    def _check_contributors(self, senders: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Refuse senders that may not contribute to the sum."""

    def _check_layout(self, layout: list[Any]) -> None:  # noqa: B027 - optional hook
        """Refuse a layout all parties agree on but the protocol cannot add (e.g. integer tensors)."""

    def _check_round(self, net: Network, messages: Sequence[Message], receiver: str,
                     op: str) -> tuple[list[str], list[Any]]:
        """The senders and the common layout of a round's ``messages``; refuses a round that cannot be summed."""
        if op not in _OPS:
            raise UnsupportedError(f"aggregation op must be 'sum' or 'mean', got {op!r}")
        self._check_receiver(net, receiver)
        senders = [m.sender for m in messages]
        if len(messages) < 2:
            raise UnsupportedError(f"{self.subject} needs at least 2 parties (got {senders}): {self.one_party_sum}")
        if len(set(senders)) != len(senders):
            raise ProtocolError(f"{self.subject} got two messages from one party: {senders}")
        self._check_contributors(senders)
        first = messages[0]
        layout = self._layout(first)
        for m in messages[1:]:
            if m.kind != first.kind:
                raise ProtocolError(f"{self.subject} mixes message kinds {first.kind!r} and {m.kind!r}")
            got = self._layout(m)
            if got != layout:
                raise ProtocolError(
                    f"{m.sender}'s {m.kind} tensors {got} do not match {first.sender}'s {layout}; every party must "
                    "send the same names, shapes and dtypes"
                )
        self._check_layout(layout)
        return senders, layout

    def _result(self, first: Message, receiver: str, tensors: dict[str, torch.Tensor], op: str, parties: int,
                wire_size: int | None, **meta: Any) -> Message:
        """The sum as the receiver gets it: ``first``'s kind and step, no sender but "aggregate"."""
        return Message(first.kind, "aggregate", receiver, first.step, tensors, {},
                       {"op": op, "parties": parties, "aggregation": self.name, **meta}, wire_size=wire_size)
