"""Per-round bytes of the VIM algorithms against their formulas (issue 16), counted by the network.

VIMADMM, per round and party (float32, batch B): ``B d_f 4`` up (the embedding) and ``2 B d_c 4 + d_f d_c 4`` down
(lambda_B, s^k_B and W_k), plus the header of each message. The headers are taken from the messages as they were
received (encoded size minus payload), never assumed.
"""

from __future__ import annotations

import pytest

from secvfl.config import TrainConfig
from secvfl.messages import payload_size
from secvfl.runner import build_run

B, D_F, PARTIES = 16, 8, 3


def _one_round(algo: str, dataset: str) -> tuple[object, dict[str, object], dict[str, int]]:
    cfg = TrainConfig(algo=algo, dataset=dataset, parties=PARTIES, epochs=1, batch_size=B, embedding_dim=D_F,
                      val_fraction=0.2, device="cpu", options={"vim_local_steps": 2} if algo != "vimsgd" else {})
    run = build_run(cfg)
    views = {p: run.net.record(p) for p in ["label", *run.algorithm.names]}
    run.net.start_epoch(0)
    ids = next(iter(run.algorithm.schedule.batches(0)))
    assert len(ids) == B
    links_before = dict(run.net.stats.bytes_by_link)
    present = run.algorithm._forward_all("train", ids, train=True)
    run.algorithm.round(ids, present)
    links = {k: v - links_before.get(k, 0) for k, v in run.net.stats.bytes_by_link.items()}
    return run, views, links


def _header(message) -> int:
    assert message.wire_size is not None
    return message.wire_size - payload_size(message)


@pytest.mark.parametrize("dataset, d_c", [("wine", 3), ("breast_cancer", 1)])
def test_vimadmm_round_bytes_match_the_formula(dataset: str, d_c: int) -> None:
    run, views, links = _one_round("vimadmm", dataset)
    for party in run.algorithm.names:
        (up,) = [m for m in views["label"].received if m.sender == party]
        assert (up.kind, payload_size(up)) == ("embedding", B * D_F * 4)
        down = views[party].received
        assert sorted(m.kind for m in down) == ["dual", "head"]
        assert sum(payload_size(m) for m in down) == 2 * B * d_c * 4 + D_F * d_c * 4
        assert links[f"{party}->label"] == B * D_F * 4 + _header(up)
        assert links[f"label->{party}"] == 2 * B * d_c * 4 + D_F * d_c * 4 + sum(_header(m) for m in down)
        assert all(0 < _header(m) < 400 for m in [up, *down])  # headers are small against the payloads
    assert set(links) == {f"{p}->label" for p in run.algorithm.names} | {f"label->{p}" for p in run.algorithm.names}


def test_vimsgd_and_vimadmm_j_round_bytes_match_their_formulas() -> None:
    d_c = 3
    run, views, links = _one_round("vimsgd", "wine")
    for party in run.algorithm.names:
        (up,) = [m for m in views["label"].received if m.sender == party]
        (down,) = views[party].received
        assert links[f"{party}->label"] == B * D_F * 4 + _header(up)
        assert links[f"label->{party}"] == B * D_F * 4 + _header(down)
    run, views, links = _one_round("vimadmm-j", "wine")
    for party in run.algorithm.names:
        (up,) = [m for m in views["label"].received if m.sender == party]
        (down,) = views[party].received
        assert (up.kind, down.kind) == ("logits", "dual")
        assert links[f"{party}->label"] == B * d_c * 4 + _header(up)
        assert links[f"label->{party}"] == 2 * B * d_c * 4 + _header(down)
