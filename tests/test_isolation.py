"""Parties must only see what crossed the transport."""

import pytest
import torch

from secvfl.config import TrainConfig
from secvfl.errors import PartyIsolationError
from secvfl.messages import Message
from secvfl.runner import build_run


def _run():
    return build_run(TrainConfig(dataset="wine", parties=2, epochs=1, batch_size=16, val_fraction=0))


def test_party_refuses_a_message_handed_over_directly():
    run = _run()
    fp = run.algorithm.feature_parties[0]
    fp.forward(0, "train", [0, 1], "label")
    with pytest.raises(PartyIsolationError, match="handed over directly"):
        fp.backward(Message("gradient", "label", fp.name, 0, {"gradient": torch.zeros(2, 16)}))
    lp = run.algorithm.label_party
    with pytest.raises(PartyIsolationError):
        lp.train_step(0, [0, 1], [fp.forward(0, "train", [0, 1], "label")], [fp.name])


def test_no_party_ever_holds_another_partys_tensor_storage():
    """Every tensor a party receives during training has storage no other party's tensor uses."""
    run = _run()
    algo = run.algorithm
    own = {}
    for name, party in algo.parties().items():
        tensors = list(party.state_dict().values())
        ptrs = set()
        for t in [*getattr(party, "_x", {}).values(), *getattr(party, "_y", {}).values()]:
            ptrs.add(t.untyped_storage().data_ptr())
        model = getattr(party, "model", None) or getattr(party, "head", None)
        ptrs |= {p.untyped_storage().data_ptr() for p in model.parameters()}
        own[name] = ptrs
        assert tensors
    seen = []
    receive = run.net.receive

    def spy(receiver, **kw):
        msg = receive(receiver, **kw)
        seen.append((receiver, [t.untyped_storage().data_ptr() for t in msg.tensors.values()]))
        return msg

    run.net.receive = spy
    algo.train_epoch(0)
    assert seen
    for receiver, ptrs in seen:
        others = set().union(*(v for k, v in own.items() if k != receiver))
        assert not set(ptrs) & others


def test_party_repr_never_shows_data():
    run = _run()
    assert repr(run.algorithm.label_party) == "LabelParty('label')"
