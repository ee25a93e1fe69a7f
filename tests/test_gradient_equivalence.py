"""One training step through isolated parties gives the same parameter gradients as the monolithic model."""

import copy

import numpy as np
import pytest
import torch

from secvfl.config import TrainConfig
from secvfl.parties import task_loss
from secvfl.runner import build_run


def _grads_through_parties(run, ids):
    algo = run.algorithm
    captured = {}
    for fp in algo.feature_parties:  # capture gradients right before each optimiser step
        fp.optimizer.step = (lambda f: lambda *a, **k: captured.update(
            {f"{f.name}.{n}": p.grad.clone() for n, p in f.model.named_parameters()}))(fp)
    lp = algo.label_party
    lp.optimizer.step = lambda *a, **k: captured.update({f"head.{n}": p.grad.clone() for n, p in lp.head.named_parameters()})
    from secvfl.algorithms.base import LABEL_PARTY

    present = algo._forward_all("train", ids, train=True)
    algo.label_handle.train_step(0, ids, present, input_scale=algo._scale("train", ids))
    for h in algo.feature_handles:
        h.backward(sender=LABEL_PARTY)
    return captured


@pytest.mark.parametrize("algo", ["splitnn", "vafl", "fdml"])
@pytest.mark.parametrize("p_miss", ["0", "0.3"])
def test_gradients_equal_monolithic(algo, p_miss):
    cfg = TrainConfig(algo=algo, dataset="breast_cancer", parties=3, dtype="float64", hidden=(8,),
                      embedding_dim=4, head_hidden=(6,), val_fraction=0, p_miss_train=p_miss, device="cpu")
    run = build_run(cfg)
    a = run.algorithm
    bottoms = [copy.deepcopy(fp.model) for fp in a.feature_parties]
    head = copy.deepcopy(a.label_party.head)
    ids = a.train_rows()[:40]
    split_grads = _grads_through_parties(run, ids)

    X = torch.as_tensor(run.ctx.data.X_train[ids], dtype=torch.float64)
    y = torch.as_tensor(run.ctx.data.y_train[ids])
    mask = torch.as_tensor(run.ctx.masks["train"][ids], dtype=torch.float64)
    outs = [f(X[:, b]) * mask[:, k : k + 1] for k, (f, b) in enumerate(zip(bottoms, run.ctx.partition.blocks, strict=True))]
    if algo == "splitnn":
        logits = head(outs)
    elif algo == "vafl":
        logits = head(torch.stack(outs).sum(0) / mask.sum(1, keepdim=True))
    else:
        logits = head(torch.stack(outs).sum(0))
    task_loss(2)(logits, y).backward()
    mono = {f"party{k}.{n}": p.grad for k, f in enumerate(bottoms) for n, p in f.named_parameters()}
    mono.update({f"head.{n}": p.grad for n, p in head.named_parameters()})
    assert set(mono) == set(split_grads)
    for name, g in mono.items():
        torch.testing.assert_close(split_grads[name], g, rtol=1e-10, atol=1e-12, msg=name)
    # The comparison means something only if every party's and the head's gradients are finite and not all zero.
    for owner in [f"party{k}" for k in range(len(bottoms))] + ["head"]:
        size = sum(float(g.abs().sum()) for name, g in mono.items() if name.split(".")[0] == owner)
        assert np.isfinite(size) and size > 1e-6, owner
