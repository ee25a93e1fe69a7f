"""What a receiver accepts of the algorithm's messages: the one check every received message goes through.

:meth:`secvfl.transport.network.Network.receive` (and the network's aggregation results) hand each message, after
the receiver's own protocol layers, to :meth:`ReceiveGuard.check` before any party code touches it. Algorithms
declare nothing per message and grow no branch: the guard knows

* the **round** the receiver is in: the public facts (``step``, ``split``, and the batch's rows from ``ids`` or
  ``rows``) of the party request being served in this process, recorded by the :func:`secvfl.handles.request`
  wrapper (and, in a coordinator's process, by the remote handles, for the requests it makes of parties in other
  processes); a request that names a step starts a new round, one that names only rows or a split adds them;
* the algorithm's **traits**: which kinds are its forward outputs (one row per batch row) and backward messages;
* the **widths** the algorithm declares for its forward outputs (:meth:`Algorithm.message_widths`), and what each
  stream (sender, receiver, kind, tensor) carried first: its dtype and trailing shape stay the same for the whole
  run.

Refused, naming the sender (:class:`~secvfl.transport.base.PeerViolation`): non-finite values in any floating
tensor (a NaN that arrived never reaches a loss, so no run blames ``--lr`` for a peer's NaN; an honest party whose
own model diverged stops before it sends one, naming its step size: :meth:`ReceiveGuard.sums_to_send`; in one process
whose receiver gets the sender's very bytes, the receiver's check says so instead); integer tensors where
an algorithm sends floats; a step other than the round's (stale, replayed, duplicated or future messages: an
algorithm numbers every training batch, so an extra or old message is out of turn), or older than the stream's
last; rows other than the round's (forward outputs and gradients have one row per batch row); a width other than
the declared or the stream's first. Evaluation batches share a step: there a duplicated message of the right
shape is indistinguishable from a wrong one (a party can always send wrong values), and is refused once its rows or
its turn differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from secvfl.errors import TrainingDiverged
from secvfl.messages import Message, square_sums
from secvfl.transport.base import PeerViolation

__all__ = ["ReceiveGuard", "Round", "SentSums"]

_INTEGER_KINDS = frozenset({"prediction", "labels"})  # outputs that are class labels, not values
_WIDE_FLOATS = frozenset({torch.float32, torch.float64})  # summed in their own dtype
_isfinite = math.isfinite
_NO_SUMS: Mapping[str, float] = {}


@dataclass
class Round:
    """The public facts of the request a process is serving: what the messages it receives must match."""

    step: int | None = None
    split: str | None = None
    rows: int | None = None


def _sum(t: torch.Tensor) -> float:
    return float(t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum())


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of the floating tensor ``t`` is finite. A sum is NaN or infinite if any value is, and
    costs a tenth of ``torch.isfinite(t).all()``; only an infinite sum of finite values (an overflow) needs the
    exact check."""
    return math.isfinite(_sum(t)) or _exactly_finite(t)


def _exactly_finite(t: torch.Tensor) -> bool:
    """Every value of ``t`` checked, for a tensor whose sum is not finite (NaN or infinity in it, or an overflow)."""
    if t.device.type != "cpu":  # (a party's own output on its accelerator, before it is encoded)
        return bool(torch.isfinite(t).all())
    values = t.float() if t.dtype is torch.bfloat16 else t
    return bool(np.isfinite(values.detach().numpy()).all())


def _default_cause() -> str:
    return ("The step size is probably too large or the data hold huge values; start again with a smaller step size "
            "or check the data")


class SentSums:
    """The sums of the floating CUDA tensors a party is about to send, for :meth:`ReceiveGuard.check_sent`: copied to
    pinned host memory without a wait; the send path waits once for its messages' tensors
    (:func:`secvfl.messages.encode_many`), and the sums are read after that wait."""

    def __init__(self, tensors: list[tuple[Message, torch.Tensor]]) -> None:
        self.tensors = tensors
        self._pending: list[tuple[list[int], torch.Tensor, Any]] = []  # (positions, host sums, copy done event)
        on_device: dict[torch.device, list[int]] = {}
        for i, (_, t) in enumerate(tensors):
            on_device.setdefault(t.device, []).append(i)
        for device, positions in on_device.items():
            sums = torch.stack([tensors[i][1].detach().sum(dtype=torch.float64) for i in positions])
            host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            self._pending.append((positions, host, done))

    def values(self) -> list[float]:
        out = [0.0] * len(self.tensors)
        for positions, host, done in self._pending:
            done.synchronize()  # already done once the messages' tensors were copied: no wait then
            for i, total in zip(positions, host.tolist(), strict=True):
                out[i] = total
        return out


class ReceiveGuard:
    """Checks each message a party of this process receives against the round, the algorithm's traits and what
    the stream carried before (see the module docstring). Every received message passes here: the common path
    builds no text and looks each fact up once."""

    def __init__(self, forward_kinds: Sequence[str] = (), backward_kinds: Sequence[str] = ()) -> None:
        self.forward = frozenset(forward_kinds)
        self.backward = frozenset(backward_kinds)
        self._kinds = self.forward | self.backward
        self._row_kinds = self.forward | ({"gradient"} & self.backward)  # one row per batch row
        self.round = Round()
        self.widths: dict[str, int] = {}
        # why this process's own computation diverged, and the fix (secvfl.runner sets the run's)
        self.divergence_cause: Callable[[], str] = _default_cause
        # (sender, receiver, kind) -> what the stream carried so far (see check)
        self._streams: dict[tuple[str, str, str], list[Any]] = {}

    def enter(self, step: Any, split: Any, ids: Any) -> None:
        """A request is being served whose ``step``, ``split`` and rows (``ids`` or ``rows``) arguments have these
        values (None: the request has no such argument; see :func:`secvfl.handles.facts_reader`). An integer step
        starts a new round; a split name or rows alone change the current one."""
        round_ = self.round
        if isinstance(step, int) and not isinstance(step, bool):
            round_.step, round_.split, round_.rows = step, None, None
        if isinstance(split, str):
            round_.split = split
        if ids is not None and hasattr(ids, "__len__") and not isinstance(ids, (str, bytes, dict)):
            round_.rows = len(ids)

    def declare_widths(self, widths: Mapping[str, int]) -> None:
        """Columns of each forward kind's tensors, as the algorithm builds them."""
        self.widths.update({k: int(v) for k, v in widths.items()})
        for (_, _, kind), known in self._streams.items():
            known[2] = self.widths.get(kind)

    def sums_to_send(self, messages: Sequence[Message]) -> SentSums | None:
        """Check what the party itself computed (the algorithm's messages it is about to send, before its layers): a
        party never sends non-finite values, its own model diverged (its step size or its data), which it says
        itself (:attr:`divergence_cause`), so that a non-finite value that arrives is always the sender's
        violation. This is the CUDA tensors' part: their sums, launched on the device and read by
        :meth:`check_sent` after the send's one wait (None: no CUDA tensor); :meth:`check_encoded` checks the CPU
        tensors."""
        if not torch.cuda.is_initialized():  # no CUDA in this process: no tensor is on a GPU
            return None
        kinds = self._kinds
        on_device = None
        for m in messages:
            if m.kind not in kinds:
                continue
            for t in m.tensors.values():
                if t.is_cuda and t.is_floating_point():
                    on_device = on_device or []
                    on_device.append((m, t))
        return None if on_device is None else SentSums(on_device)

    def check_encoded(self, messages: Sequence[Message], sums: Sequence[Mapping[str, float]] | None = None) -> None:
        """The CPU tensors' part of :meth:`sums_to_send`. ``sums``: per message, the sums of squares the encoder read
        off their bytes (:func:`secvfl.messages.encode_many`); a tensor without one (16-bit floats, or no ``sums``)
        is summed here. A sum is NaN or infinite if any value is; only an overflowing sum of finite values needs the
        exact check."""
        kinds = self._kinds
        for i, m in enumerate(messages):
            if m.kind not in kinds:
                continue
            by_name = _NO_SUMS if sums is None else sums[i]
            for name, t in m.tensors.items():
                if not t.is_floating_point() or t.is_cuda:  # (an empty tensor sums to 0)
                    continue
                total = by_name.get(name)
                if total is None:
                    if not _finite(t.detach()):
                        self._diverged(m)
                elif not _isfinite(total) and not _exactly_finite(t.detach()):
                    self._diverged(m)

    def check_sent(self, sent: SentSums | None) -> None:
        """The CUDA tensors' part of :meth:`sums_to_send`."""
        if sent is None:
            return
        for (message, t), total in zip(sent.tensors, sent.values(), strict=True):
            if not math.isfinite(total) and not _exactly_finite(t):
                self._diverged(message)

    def _diverged(self, message: Message) -> None:
        raise TrainingDiverged(f"training stopped: {message.sender}'s {message.kind} became non-finite at step "
                               f"{message.step} (its own computation). {self.divergence_cause()}")

    def check(self, message: Message, receiver: str, own: bool = False, as_read: bool = False) -> None:
        """Raise :class:`PeerViolation` naming ``message.sender`` if ``receiver`` must not accept it. ``own``: the
        sender is a party of this process whose message arrives as it was encoded (no layer, no other process: see
        :meth:`secvfl.transport.network.Network.send`), and did not check it itself; a non-finite value is then its
        own divergence (:meth:`sums_to_send`), every other problem still a violation. ``as_read``: the message is
        what :func:`~secvfl.messages.decode` returned, untouched since (no layer): the sums of squares it computed
        while reading the bytes stand for its tensors' values (:func:`~secvfl.messages.square_sums`)."""
        kind = message.kind
        sums = square_sums(message) if as_read else _NO_SUMS
        if kind not in self._kinds:  # a protocol's own message: its values must be finite, the rest is its business
            for name, t in message.tensors.items():
                if t.is_floating_point():
                    total = sums.get(name)
                    if not (_finite(t) if total is None else _isfinite(total) or _exactly_finite(t)):
                        self._nonfinite(message, receiver, name, t, own)
            return
        # One entry per stream (sender, receiver, kind): [its last step, whether its tensors have one row per batch
        # row, the declared width, {tensor: (dtype, trailing shape or None) of its first message}]. The common
        # path builds no text and looks each fact up once.
        stream = (message.sender, receiver, kind)
        known = self._streams.get(stream)
        if known is None:
            known = self._streams[stream] = [-math.inf, kind in self._row_kinds, self.widths.get(kind), {}]
        step, expected = message.step, self.round.step
        if (expected is not None and step != expected) or step < known[0]:
            self._refuse_step(message, receiver, expected, None if known[0] == -math.inf else known[0])
        known[0] = step
        _, per_row, width, firsts = known
        for name, t in message.tensors.items():
            dtype = t.dtype
            # a sum is NaN or infinite if any value is; only an overflowing sum needs the exact check (the decoder's
            # sums of squares of float32 and float64 values, else torch's sum; 16-bit floats are summed in float32:
            # their own sums overflow at 65504)
            total = sums.get(name)
            if total is None:
                if dtype in _WIDE_FLOATS:
                    total = float(t.sum())
                elif dtype.is_floating_point:
                    total = float(t.sum(dtype=torch.float32))
                elif kind not in _INTEGER_KINDS:
                    self._refuse(message, receiver, f"carries {name!r} as {dtype}, not a floating-point tensor")
                else:
                    total = 0.0
            if not _isfinite(total) and not _exactly_finite(t):
                self._nonfinite(message, receiver, name, t, own)
            trailing = None
            if per_row:
                shape = t.shape
                if not shape:
                    self._refuse(message, receiver, f"carries {name!r} as a scalar, not one row per batch row")
                rows = self.round.rows
                if rows is not None and shape[0] != rows:
                    self._refuse(message, receiver, f"has {shape[0]} rows in {name!r}; the batch has {rows}")
                trailing = shape[1:]
                if width is not None and (not trailing or trailing[0] != width):
                    self._refuse(message, receiver, f"has {trailing[0] if trailing else 'no'} columns in {name!r}; "
                                 f"the run's {kind} width is {width}")
            first = firsts.get(name)
            if first is None:
                firsts[name] = (dtype, trailing)
            elif dtype is not first[0]:
                self._refuse(message, receiver, f"carries {name!r} as {dtype}; its earlier ones were {first[0]}")
            elif trailing != first[1]:
                self._refuse(message, receiver, f"has rows of shape {list(trailing)} in {name!r}; its earlier ones "
                             f"had {list(first[1])}")

    def _nonfinite(self, message: Message, receiver: str, name: str, t: torch.Tensor, own: bool) -> None:
        if own:
            self._diverged(message)
        self._refuse_nonfinite(message, receiver, name, t)

    # -- the refusals (built only when one happens) ---------------------------------------------------------------
    @staticmethod
    def _refuse(message: Message, receiver: str, problem: str) -> None:
        raise PeerViolation(message.sender, f"its {message.kind} message to {receiver} (step {message.step}) {problem}")

    @staticmethod
    def _refuse_nonfinite(message: Message, receiver: str, name: str, t: torch.Tensor) -> None:
        bad = int((~torch.isfinite(t)).sum())
        raise PeerViolation(message.sender, f"its {message.kind} message to {receiver} (step {message.step}) holds "
                            f"{bad} non-finite value{'s' * (bad != 1)} (NaN or infinity) in {name!r}")

    @staticmethod
    def _refuse_step(message: Message, receiver: str, expected: int | None, last: int | None) -> None:
        where, step = f"its {message.kind} message to {receiver}", message.step
        if expected is not None and step != expected:
            what = "an old or replayed message, or one sent twice" if step < expected else "a message from the future"
            raise PeerViolation(message.sender, f"{where} is for step {step}, but {receiver} is at step {expected} "
                                f"({what})")
        raise PeerViolation(message.sender, f"{where} is for step {step}, after one for step {last} (an old or "
                            "replayed message)")
