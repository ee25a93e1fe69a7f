"""Label inference attacks on constructed split-learning runs where the answer is known."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attacks import (
    ATTACKS,
    DirectionScoring,
    DirectLabelInference,
    NormScoring,
    direction_scores,
    observe_gradients,
    sample_known_labels,
)
from secvfl.errors import ConfigError, DataError
from secvfl.messages import Message
from secvfl.transport.layers import Role
from secvfl.transport.network import Network


def split_training(x: np.ndarray, y: np.ndarray, *, n_out: int = 1, head_hidden: int = 0, emb: int = 8,
                   batch: int = 64, epochs: int = 2, lr: float = 0.1, head_scale: float = 1.0,
                   bias: float = 0.0, seed: int = 0) -> list[tuple[torch.Tensor, np.ndarray]]:
    """Train a one-feature-party split network with SGD; return what the feature party receives per batch:
    d loss / d embedding (the gradient message) and the batch's row ids."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    bottom = nn.Linear(x.shape[1], emb)
    head: nn.Module = (nn.Sequential(nn.Linear(emb, head_hidden), nn.ReLU(), nn.Linear(head_hidden, n_out))
                       if head_hidden else nn.Linear(emb, n_out))
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(head_scale)
        last = head[-1] if isinstance(head, nn.Sequential) else head
        last.bias.fill_(bias)
    opt = torch.optim.SGD([*bottom.parameters(), *head.parameters()], lr=lr)
    xt, yt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g).numpy()
        for i in range(0, len(y) - batch + 1, batch):
            ids = perm[i : i + batch]
            h = bottom(xt[ids])
            h_received = h.detach().requires_grad_(True)  # the label party's copy of the embedding
            logits = head(h_received)
            if n_out == 1:
                loss = F.binary_cross_entropy_with_logits(logits[:, 0], yt[ids].float())
            else:
                loss = F.cross_entropy(logits, yt[ids])
            opt.zero_grad()
            loss.backward()
            h.backward(h_received.grad)
            opt.step()
            out.append((h_received.grad.clone(), ids))
    return out


def imbalanced_data(n: int = 1024, d: int = 6, rate: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < rate).astype(np.int64)
    x = rng.normal(size=(n, d)) + 0.8 * y[:, None]
    return x.astype(np.float32), y


def test_registry_lists_every_attack() -> None:
    assert {"norm", "direction", "direct", "model-completion", "active-model-completion", "grn", "equation"} <= set(
        ATTACKS.names())
    with pytest.raises(ConfigError, match="valid names"):
        ATTACKS.get("nrom")
    assert "feature party" in NormScoring.threat_model


def test_direction_scoring_is_perfect_for_a_single_logit_head_with_one_known_positive() -> None:
    # Linear single-logit head: every gradient row is (p_i - y_i) w / B, so positives and negatives point in
    # exactly opposite directions. One known positive orients the whole run (it is in a single batch only).
    x, y = imbalanced_data()
    batches = split_training(x, y)
    first_positive = int(next(i for i in batches[3][1] if y[i] == 1))
    res = DirectionScoring().run(gradients=batches, labels=y, known={first_positive: 1})
    assert res.metric == "auc" and res.chance == pytest.approx(0.5)
    # Perfect up to float rounding (one misordered pair in a batch would cost ~1e-3 of AUC).
    assert res.details["min_auc"] == pytest.approx(1.0, abs=1e-9) and res.ap == pytest.approx(1.0, abs=1e-9)
    assert res.details["batches"] + res.details["batches_skipped_single_class"] == len(batches)


def test_direction_scoring_with_a_hidden_layer_head_and_a_known_positive_per_batch() -> None:
    x, y = imbalanced_data(seed=1)
    batches = split_training(x, y, head_hidden=16, seed=1)
    obs = observe_gradients(batches)
    known = sample_known_labels(obs, y, per_batch=1, positives_only=True, seed=0)
    res = DirectionScoring().run(gradients=obs, labels=y, known=known)
    assert res.ap >= 0.95


def test_direction_scoring_falls_to_chance_under_heavy_gaussian_noise() -> None:
    x, y = imbalanced_data(seed=2)
    rng = np.random.default_rng(0)
    noisy = []
    for grad, ids in split_training(x, y, seed=2):
        scale = 50 * float(grad.norm(dim=1).max())
        noisy.append((grad + torch.as_tensor(rng.normal(scale=scale, size=grad.shape), dtype=torch.float32), ids))
    obs = observe_gradients(noisy)
    known = sample_known_labels(obs, y, per_batch=1, positives_only=True, seed=0)
    res = DirectionScoring().run(gradients=obs, labels=y, known=known)
    assert abs(res.ap - 0.5) < 0.08


def test_norm_scoring_is_perfect_when_the_head_predicts_the_base_rate() -> None:
    # Tiny head weights and bias = logit(0.2): every prediction is p ~ 0.2, so |p - y| is ~0.8 for positives and
    # ~0.2 for negatives, and the gradient norm |p - y| * |w| / B ranks every positive above every negative.
    x, y = imbalanced_data()
    batches = split_training(x, y, head_scale=1e-3, bias=float(np.log(0.2 / 0.8)), epochs=1, lr=1e-3)
    res = NormScoring().run(gradients=batches, labels=y)
    assert res.details["min_auc"] == pytest.approx(1.0, abs=1e-9)
    assert res.details["p95_abs_auc_minus_half"] == pytest.approx(0.5)


def test_norm_scoring_on_label_independent_gradients_is_at_chance() -> None:
    rng = np.random.default_rng(0)
    y = (rng.random(64 * 200) < 0.3).astype(np.int64)
    grads = [torch.as_tensor(rng.normal(size=(64, 8))) for _ in range(200)]
    res = NormScoring().run(gradients=grads, labels=y)
    assert abs(res.ap - 0.5) < 0.03
    assert 0.05 < res.details["p95_abs_auc_minus_half"] < 0.3


def test_norm_scoring_refuses_multiclass_labels() -> None:
    with pytest.raises(DataError, match="binary"):
        NormScoring().run(gradients=[torch.ones(4, 2)], labels=np.array([0, 1, 2, 1]))


def test_direction_scoring_needs_a_known_positive() -> None:
    x, y = imbalanced_data()
    batches = observe_gradients(split_training(x, y, epochs=1))
    with pytest.raises(ConfigError, match="known positive"):
        direction_scores(batches, [])
    negatives = {int(i): 0 for i in np.flatnonzero(y == 0)[:3]}
    with pytest.raises(ConfigError, match="known positive"):
        DirectionScoring().run(gradients=batches, labels=y, known=negatives)


def test_multiclass_direction_clustering_names_the_classes() -> None:
    rng = np.random.default_rng(3)
    n, c = 1024, 4
    y = rng.integers(0, c, n)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    batches = split_training(x, y, n_out=c, head_scale=0.3, epochs=1, lr=0.01, seed=3)
    obs = observe_gradients(batches)
    known = sample_known_labels(obs, y, total=20, seed=1)
    res = DirectionScoring().run(gradients=obs, labels=y, known=known, n_classes=c)
    assert res.metric == "accuracy" and res.chance < 0.3
    assert res.ap >= 0.95


def fdml_gradients(n_classes: int, seed: int = 0) -> tuple[list[tuple[torch.Tensor, np.ndarray]], np.ndarray]:
    """Three parties send logits, the label party adds them and returns d loss / d logits (fdml)."""
    rng = np.random.default_rng(seed)
    n, batch = 512, 32
    y = rng.integers(0, n_classes, n)
    n_out = 1 if n_classes == 2 else n_classes
    out = []
    for i in range(0, n, batch):
        ids = np.arange(i, i + batch)
        party_logits = [torch.as_tensor(rng.normal(scale=3, size=(batch, n_out))) for _ in range(3)]
        z = torch.stack(party_logits).sum(0).requires_grad_(True)
        yb = torch.as_tensor(y[ids])
        loss = (F.binary_cross_entropy_with_logits(z[:, 0], yb.double()) if n_out == 1
                else F.cross_entropy(z, yb))
        loss.backward()
        out.append((z.grad.float(), ids))
    return out, y


@pytest.mark.parametrize("n_classes", [2, 5])
def test_direct_label_inference_is_exact_for_fdml(n_classes: int) -> None:
    grads, y = fdml_gradients(n_classes)
    res = DirectLabelInference().run(gradients=grads, labels=y)
    assert res.ap == pytest.approx(1.0, abs=1e-9)  # every row (one wrong row would cost 1/512)
    assert res.chance < 1.0 and res.details["scored_rows"] == len(y)


def test_attacks_read_a_recorded_view_through_the_transport() -> None:
    """The attacker's view (decoded messages) is all the attack needs; ids come from its own sent messages."""
    grads, y = fdml_gradients(4, seed=1)
    net = Network({"label": Role.LABEL, "bank": Role.FEATURE})
    view = net.record("bank")
    for step, (g, ids) in enumerate(grads):
        net.send(Message("logits", "bank", "label", step, {"logits": torch.zeros(len(ids), 4)},
                         meta={"ids": ids.tolist()}))
        net.receive("label", kind="logits")
        net.send(Message("gradient", "label", "bank", step, {"gradient": g}))
        net.receive("bank", kind="gradient")
    obs = observe_gradients(view)
    assert len(obs) == len(grads) and np.array_equal(obs[5].ids, grads[5][1])
    res = DirectLabelInference().run(gradients=view, labels=y)
    assert res.ap == pytest.approx(1.0, abs=1e-9)


def test_a_view_without_row_ids_is_refused_with_a_fix() -> None:
    net = Network({"label": Role.LABEL, "bank": Role.FEATURE})
    view = net.record("bank")
    net.send(Message("gradient", "label", "bank", 0, {"gradient": torch.ones(3, 2)}))
    net.receive("bank")
    with pytest.raises(DataError, match="ids="):
        observe_gradients(view)
    assert observe_gradients(view, ids=[[4, 5, 6]])[0].ids.tolist() == [4, 5, 6]
    with pytest.raises(DataError, match="gradient"):
        observe_gradients(net.record("label"))


def test_row_ids_are_read_from_message_meta_in_either_form() -> None:
    g = torch.ones(3, 2)
    plain = Message("gradient", "label", "bank", 0, {"gradient": g}, meta={"ids": [7, 8, 9]})
    with_split = Message("gradient", "label", "bank", 1, {"gradient": g}, meta={"rows": ["train", 1, 2, 3]})
    obs = observe_gradients([plain, with_split])
    assert obs[0].ids.tolist() == [7, 8, 9] and obs[1].ids.tolist() == [1, 2, 3] and obs[1].step == 1
    with pytest.raises(DataError, match="row ids"):
        observe_gradients([Message("gradient", "label", "bank", 0, {"gradient": g}, meta={"ids": ["a", "b"]})])


def test_labels_must_cover_the_observed_ids() -> None:
    with pytest.raises(DataError, match="row ids"):
        DirectLabelInference().run(gradients=[torch.ones(4, 3)], labels=np.array([0, 1]))
