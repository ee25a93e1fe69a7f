"""The receive limits a deployed party derives (secvfl.deploy.limits) hold the largest message each phase legitimately
sends: the private set intersection's chunks, the row plan's chunks of long ids, serving's calls and outputs. Each
message is built and encoded by the code that sends it, then measured; the CPU is enough (nothing here trains)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from protocols.psi import CHUNK_IDS, POINTS_KIND
from secvfl.config import TrainConfig
from secvfl.deploy.data import PLAN_CHUNK, RowPlan, send_plan
from secvfl.deploy.limits import MAX_SERVE_IDS, serve_limits, startup_limits
from secvfl.deploy.loopback import loopback_federation
from secvfl.federation import Federation, load_federation
from secvfl.messages import MAX_HEADER_BYTES, Message, encode
from secvfl.serve.wire import MAX_ID_CHARS, SERVE_OUTPUT, Call, call_message
from secvfl.transport.inprocess import InProcessTransport
from secvfl.transport.layers import Role
from secvfl.transport.network import Network


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return load_federation(loopback_federation(Path(tmp_path_factory.mktemp("fed")), 1))


def _plan_message_sizes(ids: pa.Array) -> list[int]:
    """The bytes of every row-plan message the label party sends for a plan whose training split is ``ids``."""
    transport = InProcessTransport()
    net = Network({"label": Role.LABEL, "party0": Role.FEATURE}, transport=transport)
    empty = pa.array([], pa.string())
    send_plan(net, "label", "party0", RowPlan((ids, empty, empty), (np.zeros(len(ids)),) * 3, ["a", "b"], {}))
    return [len(transport.take("party0")) for _ in range(transport.pending("party0"))]


@pytest.mark.parametrize("id_chars", [12, 300])
def test_a_feature_party_accepts_the_row_plan_of_its_own_ids_however_long(federation: Federation,
                                                                          id_chars: int) -> None:
    """Ids of 300 characters (longer than the 120 bytes a row's budget would allow) in a chunk of the plan."""
    n = PLAN_CHUNK + 10
    ids = pa.array([f"{i:0{id_chars}d}" for i in range(n)], pa.string())
    sizes = _plan_message_sizes(ids)
    limits = startup_limits(federation, ids)
    assert max(sizes) > PLAN_CHUNK * id_chars  # the largest chunk was measured
    assert max(sizes) <= limits.max_message_bytes and 2 * max(sizes) <= limits.max_buffered_bytes


def test_a_party_accepts_the_private_set_intersection_s_chunks_and_buffers_its_peer_s_points(
        federation: Federation) -> None:
    """A chunk of points fits the smallest limits; a party can buffer 16 times its own points meanwhile (each side
    sends all its points before it reads its peer's)."""
    chunk = Message(POINTS_KIND, "label", "party0", 0, blobs={"points": bytes(32 * CHUNK_IDS)},
                    meta={"total": 10**7, "offset": 0, "count": CHUNK_IDS})
    assert len(encode(chunk)) <= startup_limits(federation, None).max_message_bytes
    ids = pa.array([str(i) for i in range(200_000)], pa.string())
    assert startup_limits(federation, ids).max_buffered_bytes >= 16 * 32 * len(ids)


def test_serving_parties_accept_a_full_batch_s_call_and_outputs(federation: Federation) -> None:
    cfg = TrainConfig(algo="splitnn", dataset="wine", embedding_dim=16, device="cpu")
    max_ids = 100_000
    limits = serve_limits(federation, cfg, 3, max_ids)
    # a call: as many of the longest ids as a header holds
    ids = ["x" * MAX_ID_CHARS] * ((MAX_HEADER_BYTES - 4096) // (MAX_ID_CHARS + 3))
    call = encode(call_message("label", "party0", Call("embed", 7, step=7, ids=ids)))
    output = encode(Message(SERVE_OUTPUT, "party0", "label", 7, {"embedding": torch.zeros(max_ids, 16,
                                                                                              dtype=torch.float64)},
                            meta={"request": 7}))
    assert len(call) <= limits.max_message_bytes and len(output) <= limits.max_message_bytes
    assert 2 * len(output) <= limits.max_buffered_bytes
    top = serve_limits(federation, cfg, 3, MAX_SERVE_IDS)
    assert top.max_message_bytes >= 4 * MAX_SERVE_IDS * 16 * 8  # float64, times the protocols' factor


def test_both_sides_of_a_million_id_intersection_send_all_their_points_before_reading_and_neither_stalls(
        federation: Federation) -> None:
    """The traffic of a PSI of 10^6 ids a side over the deployed transport (the points only, 32 MB each way in
    512 KiB chunks, sent in full before either side reads) passes each side's limits from its own ids. (A sender
    also holds up to 64 MiB of frames itself; past that, at 10^7 ids, only the limits from the ids let both sides'
    sends finish before either reads.)"""
    import threading

    from secvfl.deploy.party import Timeouts, make_transport, run_names

    n = 1_000_000
    ids = pa.array([str(i) for i in range(n)], pa.string())
    runs = run_names(federation)
    timeouts = Timeouts(wait=60.0, peer=10.0, heartbeat=0.5)
    ends = {name: make_transport(federation, name, timeouts, lambda _: None, startup_limits(federation, ids))
            for name in ("label", "party0")}
    chunks = -(-n // CHUNK_IDS)
    got: dict[str, int] = {}
    errors: list[BaseException] = []

    def side(name: str, peer: str) -> None:
        try:
            me, other = runs[name], runs[peer]
            for i in range(chunks):
                points = Message(POINTS_KIND, me, other, 0, blobs={"points": bytes(32 * min(CHUNK_IDS, n - i * CHUNK_IDS))},
                                 meta={"total": n, "offset": i * CHUNK_IDS})
                ends[name].put(me, other, POINTS_KIND, encode(points))
            ends[name].flush()
            got[name] = sum(len(ends[name].take(me, kind=POINTS_KIND, sender=other)) for _ in range(chunks))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=side, args=pair) for pair in (("label", "party0"), ("party0", "label"))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for end in ends.values():
            end.close()
    assert not errors, errors
    assert got["label"] == got["party0"] > 32 * n
