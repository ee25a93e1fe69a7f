"""The online family's fast paths (issue 17, speed): the federated DLR computes the model a monolithic DLR loop
computes, the closed-form gradient of a Linear -> ReLU party is autograd's, and the window's in-place forms are its
plain forms; the federated SLR (closed-form and autograd paths) computes the model and the predictions of a
monolithic SLR loop, its windows are the last l rows newest first, and its state resumes the run exactly; the
federated OGD/DLR (the label party's closed form and its autograd path) computes the model and the predictions of a
monolithic loop with per-party windows, passive and missing parties included."""

from __future__ import annotations

import copy
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.algorithms.online.buffers import GradientWindow
from secvfl.algorithms.online.parties import RecentRows, _linear_relu_grads, bottom_model
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
    _linear_relu_grads(x, out.detach(), v, got[: n_in * n_out].view(n_out, n_in), got[n_in * n_out :])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_in_place_window_forms_equal_the_plain_ones() -> None:
    torch.manual_seed(0)
    plain, parts, slot = (GradientWindow(3, 0.7, 5, dtype=torch.float64) for _ in range(3))
    shaped = GradientWindow(3, 0.7, 5, dtype=torch.float64, shapes=[torch.Size([2, 1]), torch.Size([3])])
    out = torch.empty(5, dtype=torch.float64)
    for _ in range(7):
        g = torch.randn(5, dtype=torch.float64)
        plain.push(g)
        parts.push_parts([g[:2].view(2, 1), g[2:]])
        slot.push_slot().copy_(g)
        weight, bias = shaped.push_slot_parts()
        weight.copy_(g[:2].view(2, 1))
        bias.copy_(g[2:])
        want = plain.average()
        torch.testing.assert_close(parts.average(out=out), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(slot.average(), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(shaped.average(), want, rtol=1e-12, atol=1e-12)


# -- SLR ----------------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 6), pushes=st.lists(st.integers(-50, 50), max_size=40),
       clear_at=st.one_of(st.none(), st.integers(0, 40)))
def test_recent_rows_are_the_last_l_rows_newest_first(length: int, pushes: list, clear_at: int | None) -> None:
    """Against a deque: any number of pushes, the buffer's slide and its copies back included, and a clear."""
    rows, reference = RecentRows(length, (2,), torch.float64), deque(maxlen=length)
    for i, v in enumerate(pushes):
        if i == clear_at:
            rows.clear()
            reference.clear()
        rows.push().copy_(torch.tensor([v, -v], dtype=torch.float64))
        reference.appendleft([v, -v])
        assert len(rows) == len(reference)
        assert rows.window().tolist() == [list(map(float, r)) for r in reference]


class _MonolithicSLR:
    """SLR as one program (the reference): the window's inputs and labels in deques, every embedding and the head in
    one autograd graph, (1/l) sum of the window's cross-entropies, a plain step of the active parties and the head."""

    def __init__(self, models: list, head: torch.nn.Module, activations: list, length: int, lr: float) -> None:
        self.models, self.head, self.activations, self.length, self.lr = models, head, activations, length, lr
        self.inputs = [deque(maxlen=length) for _ in models]
        self.labels: deque[int] = deque(maxlen=length)

    def round(self, xs: list, y: int) -> int:
        active = [x is not None and a.active(x) for x, a in zip(xs, self.activations, strict=True)]
        embeddings = []
        for model, window, x in zip(self.models, self.inputs, xs, strict=True):
            window.appendleft(x)
            dim = model[0].in_features
            rows = torch.stack([torch.zeros(dim, dtype=torch.float64) if v is None else torch.as_tensor(v).double()
                                for v in window])
            held = torch.tensor([[0.0 if v is None else 1.0] for v in window], dtype=torch.float64)
            embeddings.append(model(rows) * held)
        self.labels.appendleft(y)
        logits = self.head(torch.cat(embeddings, dim=1))
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(list(self.labels)), reduction="sum")
        params = [p for m, a in zip(self.models, active, strict=True) if a for p in m.parameters()]
        params += list(self.head.parameters())
        grads = torch.autograd.grad(loss / self.length, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= self.lr * g
        return int(logits[0].argmax())


def _slr_run(activation: str, window: int, seed: int = 3):
    cfg = TrainConfig(algo="slr", dataset="digits", parties=4, seed=seed, device="cpu", dtype="float64",
                      options={"samples": 10, "online_window": window, "online_lr": 0.05, "activation": activation,
                               "online_embedding": 8, "online_head": 16})
    run = build_run(cfg)
    run.net.start_epoch(0)
    return run


def _feed_round(alg, t: int, x: np.ndarray, y: int, cols: list, missing: int | None) -> list:
    parts = [None if k == missing else x[c] for k, c in enumerate(cols)]
    for feed, part in zip(alg.feeds, parts, strict=True):
        feed.put(t, part)
    alg.label_feed.put(t, y)
    return parts


@pytest.mark.parametrize("closed_form", [True, False], ids=["closed-form", "autograd"])
@pytest.mark.parametrize("activation", ["full", "random:0.5"])
def test_federated_slr_learns_the_model_of_one_monolithic_slr_loop(closed_form: bool, activation: str) -> None:
    """Same samples, same initial weights, the same activation draws, a party missing its block now and then (its
    window row is zeros and gets no gradient): same predictions every round, same parameters at the end."""
    length, rounds = 5, 60
    run = _slr_run(activation, length)
    alg = run.algorithm
    parties = [local_party(h) for h in alg.feature_handles]
    label = local_party(alg.label_handle)
    assert all(p._closed_form for p in [*parties, label])  # the paper's models take the closed form by default
    for p in [*parties, label]:
        p._closed_form = closed_form  # False: the autograd path, as any other model takes
    mono = _MonolithicSLR([copy.deepcopy(p.model) for p in parties], copy.deepcopy(label.head),
                          [copy.deepcopy(p.activation) for p in parties], length, 0.05)
    initial = [p.detach().clone() for m in [*mono.models, mono.head] for p in m.parameters()]
    cols = [np.asarray(c) for c in alg.stream._columns]
    for t in range(rounds):
        x, y, _ = alg.stream.draw()
        parts = _feed_round(alg, t, x, y, cols, missing=t % 4 if t % 7 == 3 else None)
        errors = alg.meter.errors
        alg.run_round()
        assert alg.meter.errors - errors == int(mono.round(parts, y) != y)
    federated = [p for q in [*parties, label] for p in q.params]
    mono_params = [p for m in [*mono.models, mono.head] for p in m.parameters()]
    moved = [float((a.detach() - b).abs().max()) for a, b in zip(federated, initial, strict=True)]
    assert min(max(moved[i : i + 2]) for i in range(0, 8, 2)) > 1e-4  # every party learnt (so agreeing means something)
    for a, b in zip(federated, mono_params, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-9, atol=1e-10)
    assert alg.meter.samples == rounds


def test_slr_resumes_from_its_state_with_the_windows_of_an_uninterrupted_run() -> None:
    """Parties restored from a state taken mid-stream (windows full, a missing row inside) continue exactly as the
    uninterrupted parties do: same predictions, same parameters."""
    length = 6
    whole, resumed = _slr_run("random:0.7", length), _slr_run("random:0.7", length)
    cols = [np.asarray(c) for c in whole.algorithm.stream._columns]
    stream = whole.algorithm.stream
    samples = [stream.draw()[:2] for _ in range(25)]

    def play(run, ts) -> list[int]:
        seen = []
        for t in ts:
            x, y = samples[t]
            _feed_round(run.algorithm, t, x, y, cols, missing=2 if t == 12 else None)
            before = run.algorithm.meter.errors
            run.algorithm.run_round()
            seen.append(run.algorithm.meter.errors - before)
        return seen

    play(whole, range(15))
    parties = {n: local_party(h) for n, h in whole.algorithm.handles().items()}
    state = {n: copy.deepcopy(p.state_dict()) for n, p in parties.items()}
    assert len(state["party2"]["inputs"]) == length and state["party2"]["inputs"][2] is None  # the row of round 12
    assert len(state["label"]["labels"]) == length
    for n, h in resumed.algorithm.handles().items():
        local_party(h).load_state_dict(state[n])
    resumed.algorithm.step = whole.algorithm.step
    assert play(resumed, range(15, 25)) == play(whole, range(15, 25))
    for n, h in resumed.algorithm.handles().items():
        for a, b in zip(local_party(h).params, parties[n].params, strict=True):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-12)


# -- OGD/DLR: every party in closed form ----------------------------------------------------------------------------
class _MonolithicWindowed:
    """OGD/DLR as one program (the reference): every embedding and the head in one autograd graph, the round's
    cross-entropy; each party and the head keep their last l flat gradients in a deque (a passive party's are zeros)
    and, when active, step with (1/W) sum_i alpha^i g^{t-i} summed in Python; the head steps every round."""

    def __init__(self, models: list, head: torch.nn.Module, activations: list, length: int, alpha: float,
                 lr: float) -> None:
        self.models, self.head, self.activations, self.lr = models, head, activations, lr
        self.windows = [deque(maxlen=length) for _ in [*models, head]]
        raw = [alpha**i for i in range(length)]
        self.weights = [w / sum(raw) for w in raw]

    def round(self, xs: list, y: int) -> int:
        active = [x is not None and a.active(x) for x, a in zip(xs, self.activations, strict=True)]
        embeddings = [torch.zeros(1, m[0].out_features, dtype=torch.float64) if x is None
                      else m(torch.as_tensor(x, dtype=torch.float64)[None]) for m, x in zip(self.models, xs, strict=True)]
        logits = self.head(torch.cat(embeddings, dim=1))
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([y]))
        modules, stepping = [*self.models, self.head], [*active, True]
        params = [list(m.parameters()) for m in modules]
        grads = torch.autograd.grad(loss, [p for ps in params for p in ps], allow_unused=True)
        with torch.no_grad():
            for ps, window, steps in zip(params, self.windows, stepping, strict=True):
                mine, grads = grads[: len(ps)], grads[len(ps):]
                window.appendleft([g.clone() if steps and g is not None else torch.zeros_like(p)
                                   for g, p in zip(mine, ps, strict=True)])
                if steps:
                    for i, p in enumerate(ps):
                        # (before l rounds the window is shorter: its missing entries count as zeros)
                        p -= self.lr * sum(w * g[i] for w, g in zip(self.weights, window, strict=False))
        return int(logits[0].argmax())


@pytest.mark.parametrize("closed_form", [True, False], ids=["closed-form", "autograd"])
@pytest.mark.parametrize("activation", ["full", "random:0.5"])
@pytest.mark.parametrize("algo", ["ogd", "dlr"])
def test_federated_ogd_dlr_learn_the_model_of_one_monolithic_loop(algo: str, activation: str,
                                                                  closed_form: bool) -> None:
    """The label party's closed form for OGD/DLR (and the autograd path any other head takes): same predictions
    every round and same parameters at the end as the reference, with passive parties (zeros in their windows, no
    step) and a party missing its block now and then (its embedding is zeros)."""
    length, rounds = 4, 60
    options = {"samples": 10, "online_lr": 0.05, "activation": activation, "online_embedding": 8, "online_head": 16}
    if algo == "dlr":
        options |= {"online_window": length, "online_alpha": 0.8}
    cfg = TrainConfig(algo=algo, dataset="digits", parties=4, seed=5, device="cpu", dtype="float64", options=options)
    run = build_run(cfg)
    run.net.start_epoch(0)
    alg = run.algorithm
    parties = [local_party(h) for h in alg.feature_handles]
    label = local_party(alg.label_handle)
    assert all(p._closed_form for p in [*parties, label])  # the paper's models take the closed form by default
    label._closed_form = closed_form
    mono = _MonolithicWindowed([copy.deepcopy(p.model) for p in parties], copy.deepcopy(label.head),
                               [copy.deepcopy(p.activation) for p in parties], length if algo == "dlr" else 1,
                               0.8 if algo == "dlr" else 1.0, 0.05)
    initial = [p.detach().clone() for m in [*mono.models, mono.head] for p in m.parameters()]
    cols = [np.asarray(c) for c in alg.stream._columns]
    for t in range(rounds):
        x, y, _ = alg.stream.draw()
        parts = _feed_round(alg, t, x, y, cols, missing=t % 4 if t % 7 == 3 else None)
        errors = alg.meter.errors
        alg.run_round()
        assert alg.meter.errors - errors == int(mono.round(parts, y) != y)
    federated = [p for q in [*parties, label] for p in q.params]
    reference = [p for m in [*mono.models, mono.head] for p in m.parameters()]
    moved = [float((a.detach() - b).abs().max()) for a, b in zip(federated, initial, strict=True)]
    assert min(max(moved[i : i + 2]) for i in range(0, 10, 2)) > 1e-4  # every party and the head learnt
    for a, b in zip(federated, reference, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-9, atol=1e-10)
    assert alg.meter.samples == rounds
