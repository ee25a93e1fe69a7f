"""The online family's fast paths (issue 17, speed): the federated DLR computes the model a monolithic DLR loop
computes, the closed-form gradient of a Linear -> ReLU party is autograd's, and the window's in-place forms are its
plain forms."""

from __future__ import annotations

import copy

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.algorithms.online.buffers import GradientWindow
from secvfl.algorithms.online.parties import _linear_relu_grads, bottom_model
from secvfl.bench.online import MonolithicOnline
from secvfl.config import TrainConfig
from secvfl.handles import local_party
from secvfl.runner import build_run


def test_federated_dlr_learns_the_model_of_one_monolithic_dlr_loop() -> None:
    """Same samples, same initial weights: the parties' windows side by side are one window over all parameters."""
    cfg = TrainConfig(algo="dlr", dataset="digits", parties=4, seed=2, device="cpu",
                      options={"samples": 10, "online_window": 4, "online_alpha": 0.8, "online_lr": 0.05,
                               "online_embedding": 8, "online_head": 16})
    run = build_run(cfg)
    run.net.start_epoch(0)
    alg = run.algorithm
    parties = [local_party(h) for h in alg.feature_handles]
    label = local_party(alg.label_handle)
    mono = MonolithicOnline([copy.deepcopy(p.model) for p in parties], copy.deepcopy(label.head), 4, 0.8, 0.05)
    initial = [p.detach().clone() for p in mono.params]
    cols = [np.asarray(c) for c in alg.stream._columns]
    for t in range(150):
        x, y, _ = alg.stream.draw()
        for feed, c in zip(alg.feeds, cols, strict=True):
            feed.put(t, x[c])
        alg.label_feed.put(t, y)
        alg.run_round()
        mono.round([torch.from_numpy(x[c])[None] for c in cols], torch.tensor([y]))
    federated = [p for q in parties for p in q.params] + label.params
    # both learnt (so agreeing is not agreeing on the initial weights), and learnt the same
    assert max(float((a.detach() - b).abs().max()) for a, b in zip(federated, initial, strict=True)) > 1e-3
    for a, b in zip(federated, mono.params, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    assert alg.meter.samples == 150


@settings(max_examples=30, deadline=None)
@given(n_in=st.integers(1, 12), n_out=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_the_closed_form_gradient_of_linear_relu_is_autograds(n_in: int, n_out: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = bottom_model(n_in, n_out).double()
    x, v = torch.randn(1, n_in, dtype=torch.float64), torch.randn(1, n_out, dtype=torch.float64)
    out = model(x)
    want = torch.cat([g.reshape(-1) for g in torch.autograd.grad(out, list(model.parameters()), v)])
    got = torch.empty_like(want)
    _linear_relu_grads(x, out.detach(), v, got)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_in_place_window_forms_equal_the_plain_ones() -> None:
    torch.manual_seed(0)
    plain, parts, slot = (GradientWindow(3, 0.7, 5, dtype=torch.float64) for _ in range(3))
    out = torch.empty(5, dtype=torch.float64)
    for _ in range(7):
        g = torch.randn(5, dtype=torch.float64)
        plain.push(g)
        parts.push_parts([g[:2].view(2, 1), g[2:]])
        slot.push_slot().copy_(g)
        want = plain.average()
        torch.testing.assert_close(parts.average(out=out), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(slot.average(), want, rtol=1e-12, atol=1e-12)
