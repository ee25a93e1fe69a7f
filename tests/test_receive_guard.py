"""Every received algorithm message is checked before any party code uses it (secvfl.transport.guard).

A feature party that misbehaves (party1 here; a transport double rewrites what it sends, in one process on CPU)
sends non-finite values, a wrong shape or dtype, a step out of turn, an old message again, or a message twice. The
run must stop with one line naming party1 and what was wrong, before the values reach the label party's loss: the
reference is the message itself (which party, which step, which shape), not a recomputation.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.config import TrainConfig
from secvfl.errors import TrainingDiverged
from secvfl.messages import Message, decode, encode
from secvfl.runner import run_training
from secvfl.transport.base import PeerViolation
from secvfl.transport.inprocess import InProcessTransport

pytestmark = pytest.mark.filterwarnings("ignore")


def _overflowing_header(message: Message) -> bytes:
    """A 161-byte message from the same sender whose tensor sizes overflow (an empty tensor of 2^31-1 columns...)."""
    head = json.dumps({"kind": "embedding", "sender": message.sender, "receiver": message.receiver,
                       "step": message.step, "meta": {}, "tensors": [["embedding", "float32",
                                                                       [0, 2**31 - 1, 2**31 - 1, 2**31 - 1, 2**31 - 1]]],
                       "blobs": []}, separators=(",", ":")).encode()
    return struct.pack("<4sBI", b"SVFL", 1, len(head)) + head


def _nan(m: Message) -> Message:
    t = m.tensor("embedding").clone()
    t[0, 0], t[1, 1] = float("nan"), float("inf")
    return m.replace(tensors={"embedding": t})


TAMPER = {  # row of the table -> how party1's third embedding is rewritten (None: drop it)
    "nan-inf": _nan,
    "extra-column": lambda m: m.replace(tensors={"embedding": torch.cat([m.tensor("embedding"),
                                                                          torch.zeros(len(m.tensor("embedding")), 1)], 1)}),
    "one-row-short": lambda m: m.replace(tensors={"embedding": m.tensor("embedding")[:-1]}),
    "int64": lambda m: m.replace(tensors={"embedding": m.tensor("embedding").to(torch.int64)}),
    "step-plus-1000": lambda m: m.replace(step=m.step + 1000),
}
EXPECTED = {
    "nan-inf": "its embedding message to label .*holds 2 non-finite values",
    "extra-column": "has 9 columns in 'embedding'; the run's embedding width is 8",
    "one-row-short": "has 31 rows in 'embedding'; the batch has 32",
    "int64": "carries 'embedding' as torch.int64, not a floating-point tensor",
    "step-plus-1000": "is for step 1002, but label is at step 2 \\(a message from the future",
    "overflowing-header": "sent label bytes that are not a message .*dimensions whose product overflows",
    "replay": "is for step 0, but label is at step 2 \\(an old or replayed message",
    "duplicate": "is for step 2, but label is at step 3 \\(an old or replayed message, or one sent twice",
}


class MisbehavingParty1(InProcessTransport):
    """What party1 sends to the label party, rewritten at its third embedding (step 2) as ``row`` says."""

    def __init__(self, row: str) -> None:
        super().__init__()
        self.row = row
        self.first: bytes | None = None

    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        if sender != "party1" or kind != "embedding":
            return super().put(sender, receiver, kind, data)
        message = decode(data)
        if self.first is None:
            self.first = data
        if message.step != 2:
            return super().put(sender, receiver, kind, data)
        if self.row == "overflowing-header":
            data = _overflowing_header(message)
        elif self.row == "replay":  # the step-0 embedding (same shape) instead of this one
            data = self.first
        elif self.row == "duplicate":
            super().put(sender, receiver, kind, data)
        else:
            data = encode(TAMPER[self.row](message))
        return super().put(sender, receiver, kind, data)


def _run(row: str, tmp_path) -> None:  # noqa: ANN001
    cfg = TrainConfig(algo="splitnn", dataset="breast_cancer", parties=2, epochs=1, batch_size=32, embedding_dim=8,
                      hidden=(8,), head_hidden=(), seed=0, threads=1, device="cpu")

    def build(cfg: TrainConfig):  # noqa: ANN202
        from secvfl.runner import build_run

        run = build_run(cfg)
        run.net.transport = MisbehavingParty1(row)
        return run

    run_training(cfg, None, progress=False, log=lambda _: None, build=build)


@pytest.mark.parametrize("row", list(EXPECTED))
def test_a_misbehaving_party_s_message_stops_the_run_naming_it(row: str, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(PeerViolation, match=f"^party party1 broke the protocol: .*{EXPECTED[row]}") as err:
        _run(row, tmp_path)
    assert "\n" not in str(err.value) and err.value.party == "party1"


def test_a_nan_that_arrived_is_never_blamed_on_the_step_size(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(PeerViolation) as err:
        _run("nan-inf", tmp_path)
    assert not isinstance(err.value, TrainingDiverged) and "--lr" not in str(err.value)


def test_an_honest_run_passes_the_guard_and_counts_what_it_received() -> None:

    cfg = TrainConfig(algo="splitnn", dataset="breast_cancer", parties=2, epochs=1, batch_size=32, embedding_dim=8,
                      hidden=(8,), head_hidden=(), seed=0, threads=1, device="cpu")
    built = []
    summary = run_training(cfg, None, progress=False, log=lambda _: None, on_build=built.append)
    received = built[0].net.received.to_dict()
    # every message sent was received, each counted once at each end (sender: transport; receiver: network)
    assert received["bytes_by_link"] == summary["comm"]["bytes_by_link"]
    assert received["messages_by_kind"] == summary["comm"]["messages_by_kind"]
    assert built[0].net.guard.widths == {"embedding": 8}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=1, max_size=40),
       st.booleans())
def test_the_finiteness_check_agrees_with_numpy(dtype: torch.dtype, values: list[float], extreme: bool) -> None:
    from secvfl.transport.guard import _finite

    t = torch.tensor(values, dtype=torch.float64)
    if extreme:  # finite values whose sum overflows the dtype
        t = torch.where(torch.isfinite(t), torch.full_like(t, torch.finfo(dtype).max), t)
    t = t.to(dtype)  # (values beyond the dtype's range become infinite here, as on the wire)
    reference = bool(np.isfinite(t.to(torch.float64).numpy()).all())
    assert _finite(t) is reference


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([torch.float32, torch.float64]),
       st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=1, max_size=40),
       st.sampled_from(["plain", "extreme", "huge-squares"]))
def test_the_codec_s_sums_of_squares_decide_finiteness_as_numpy_does(dtype: torch.dtype, values: list[float],
                                                                     scale: str) -> None:
    """What the receiver (decode's sums) and the sender (encode_many's sums) decide about a float32/float64 tensor
    is numpy's ``isfinite(...).all()``, also where the squares overflow though every value is finite; the sums
    themselves are the float64 reference's within rounding."""
    from secvfl.messages import encode_many, square_sums
    from secvfl.transport.guard import ReceiveGuard

    t = torch.tensor(values, dtype=torch.float64)
    if scale != "plain":  # finite values whose sum (extreme) or squares (huge-squares) overflow the dtype
        big = torch.finfo(dtype).max if scale == "extreme" else math.sqrt(torch.finfo(dtype).max) * 4
        t = torch.where(torch.isfinite(t), torch.full_like(t, big), t)
    t = t.to(dtype).reshape(1, -1)
    values64 = t.to(torch.float64).numpy()
    finite = bool(np.isfinite(values64).all())
    message = Message("embedding", "party0", "label", 3, {"embedding": t})
    sums: list = []
    data = encode_many([message], sums)[0]
    received = decode(data)
    for got in (sums[0]["embedding"], square_sums(received)["embedding"]):
        with np.errstate(over="ignore", invalid="ignore"):
            reference = float((values64 ** 2).sum())
        if finite and math.isfinite(got):
            assert got == pytest.approx(reference, rel=1e-5)
        elif not finite:
            assert not math.isfinite(got)
    guard = ReceiveGuard(["embedding"], ["gradient"])
    if finite:
        guard.check(received, "label", as_read=True)
        guard.check_encoded([message], sums)
    else:
        with pytest.raises(PeerViolation, match="non-finite"):
            guard.check(received, "label", as_read=True)
        with pytest.raises(TrainingDiverged, match="its own computation"):
            guard.check_encoded([message], sums)


@pytest.mark.parametrize("where", ["one-process", "rewriting-transport", "sender-process", "sender-with-a-layer"])
def test_a_party_s_own_non_finite_output_names_its_own_divergence_wherever_it_is_checked(where: str) -> None:
    """On the CPU: party0's own embedding holds a NaN. Its process stops the run with its divergence (the step size),
    never as a violation: at the send in party0's own process (``local``), at the receive when every party is in
    one process and the plain transport hands the receiver the sender's very bytes (the receiver's check is then the
    sender's). A transport that may rewrite what it carries is not trusted so: there the sender checks, and what
    arrives non-finite is the sender's violation."""
    from secvfl.transport.guard import ReceiveGuard
    from secvfl.transport.layers import Layer, Role
    from secvfl.transport.network import Network

    class Rewriting(InProcessTransport):
        def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
            message = decode(data)
            super().put(sender, receiver, kind, encode(_nan(message)) if message.step == 2 else data)

    class Observing(Layer):  # a protocol layer: the sender checks its output before the layer sees it
        seen: list[Message] = []

        def outbound(self, messages: list[Message], party: str) -> list[Message]:
            self.seen.extend(messages)
            return messages

    transport = Rewriting() if where == "rewriting-transport" else InProcessTransport()
    layer = Observing()
    net = Network({"label": Role.LABEL, "party0": Role.FEATURE}, transport=transport,
                  layers=[layer] if where == "sender-with-a-layer" else (),
                  local="party0" if where == "sender-process" else None)
    net.guard = ReceiveGuard(["embedding"], ["gradient"])
    good = torch.randn(8, 4)
    net.send(Message("embedding", "party0", "label", 0, {"embedding": good}))
    assert torch.equal(net.receive("label", kind="embedding", sender="party0").tensor("embedding"), good)
    diverged = "party0's embedding became non-finite at step 1 \\(its own computation\\)\\. The step size"
    own = _nan(Message("embedding", "party0", "label", 1, {"embedding": good.clone()}))
    if where == "one-process":
        net.send(own)
        with pytest.raises(TrainingDiverged, match=diverged):
            net.receive("label", kind="embedding", sender="party0")
    else:
        with pytest.raises(TrainingDiverged, match=diverged):
            net.send(own)
        assert net.transport.pending("label") == 0
        assert [m.step for m in layer.seen] == ([0] if where == "sender-with-a-layer" else [])
    if where == "rewriting-transport":  # finite as party0 sent it, rewritten on the way: party0's violation
        net.send(Message("embedding", "party0", "label", 2, {"embedding": good}))
        with pytest.raises(PeerViolation, match="^party party0 broke the protocol: .*holds 2 non-finite values"):
            net.receive("label", kind="embedding", sender="party0")
