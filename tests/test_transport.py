import numpy as np
import torch

from secvfl.config import TrainConfig
from secvfl.messages import Message, encode, header_size
from secvfl.runner import build_run
from secvfl.transport import Network
from secvfl.transport.layers import Layer, Role


class Recorder(Layer):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def outbound(self, messages, party):
        self.log.append(("out", self.name))
        return [m.replace(meta={**m.meta, "path": [*m.meta.get("path", []), self.name]}) for m in messages]

    def inbound(self, message, party):
        self.log.append(("in", self.name))
        assert message.meta["path"][-1] == self.name  # undo in reverse order
        return message.replace(meta={**message.meta, "path": message.meta["path"][:-1]})


def test_layers_run_like_an_onion():
    log = []
    net = Network({"a": Role.FEATURE, "b": Role.LABEL}, layers=[Recorder("compress", log), Recorder("encrypt", log)])
    net.send(Message("embedding", "a", "b", tensors={"x": torch.ones(2)}))
    got = net.receive("b")
    assert log == [("out", "compress"), ("out", "encrypt"), ("in", "encrypt"), ("in", "compress")]
    assert got.meta["path"] == []


def test_byte_accounting_is_exact_for_a_training_run():
    cfg = TrainConfig(device="cpu", dataset="breast_cancer", parties=3, epochs=1, batch_size=32, embedding_dim=8, val_fraction=0)
    run = build_run(cfg)
    sizes = []
    put = run.net.transport.put

    def spy(sender, receiver, kind, data):
        sizes.append((sender, kind, len(data)))
        put(sender, receiver, kind, data)

    run.net.transport.put = spy
    run.algorithm.train_epoch(0)
    stats = run.net.stats
    assert stats.bytes_total == sum(s for _, _, s in sizes)
    n = len(run.ctx.data.y_train)
    batches = -(-n // 32)
    assert stats.messages_total == batches * 3 * 2  # one embedding and one gradient per party per step
    # embedding bytes of one full step: batch x dim x 4 + header, per feature party
    emb = Message("embedding", "party0", "label", 0, {"embedding": torch.zeros(32, 8)})
    per_party = 32 * 8 * 4 + header_size(emb)
    first_step = [s for p, k, s in sizes[:3] if k == "embedding"]
    assert first_step == [per_party] * 3 == [len(encode(emb))] * 3
    for p in ("party0", "party1", "party2"):
        assert stats.bytes_sent[p] == sum(s for q, _, s in sizes if q == p)


def test_view_records_what_a_party_saw_after_its_layers():
    net = Network({"a": Role.FEATURE, "b": Role.LABEL})
    view = net.record("a")
    net.send(Message("embedding", "a", "b", tensors={"x": torch.ones(2)}))
    net.send(Message("gradient", "b", "a", tensors={"gradient": torch.full((2,), 3.0)}))
    net.receive("b")
    net.receive("a")
    assert [m.kind for m in view.sent] == ["embedding"]
    assert torch.equal(view.received_of("gradient")[0].tensors["gradient"], torch.full((2,), 3.0))
    assert np.isclose(net.stats.bytes_total, sum(len(encode(m)) for m in [*view.sent, *view.received]))
