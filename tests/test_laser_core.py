"""LASER-VFL math: subset enumeration, task sampling, unbiased weights, batched subset-mean fusion."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import secvfl.algorithms.missing.subsets as subsets_mod
from secvfl.algorithms.missing.subsets import (
    TaskTable,
    averaging_matrix,
    full_objective,
    nonempty_subsets,
    sample_tasks,
    sampled_objective,
    subset_means,
    subsets_containing,
    task_weight,
    task_weights,
    weighted_task_loss,
)
from secvfl.errors import ConfigError


def all_observed_sets(K: int) -> list[tuple[int, ...]]:
    return nonempty_subsets(range(K))


# --- enumeration -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5])
def test_enumeration_counts(K):
    subs = nonempty_subsets(range(K))
    assert len(subs) == 2**K - 1 and len(set(subs)) == len(subs)
    for k in range(K):
        containing = subsets_containing(k, range(K))
        assert len(containing) == 2 ** (K - 1)
        assert all(k in J for J in containing)
        for j in range(1, K + 1):
            assert len(subsets_containing(k, range(K), j)) == math.comb(K - 1, j - 1)


def test_weights_values():
    assert task_weights(1) == pytest.approx([1.0])
    assert task_weights(4) == pytest.approx([1.0, 1.5, 1.0, 0.25])
    with pytest.raises(ConfigError):
        task_weight(3, 4)


def test_bad_inputs_are_refused():
    with pytest.raises(ConfigError, match="not in the observed set"):
        sample_tasks(2, (0, 1), np.random.default_rng(0))
    with pytest.raises(ConfigError, match="not observed"):
        averaging_matrix([(0, 3)], (0, 1))
    with pytest.raises(ConfigError, match="distinct"):
        TaskTable(0, (0, 0, 1))
    with pytest.raises(ConfigError, match="do not match"):
        subset_means(torch.zeros(3, 2, 4), torch.zeros(2, 2))


# --- task sampling: uniform within each size class, unbiased in expectation -------------------------------------


@pytest.mark.parametrize("K", [2, 3, 4])
def test_task_sampler_is_uniform_within_each_size(K):
    rng = np.random.default_rng(123)
    draws = 6000
    for observed in all_observed_sets(K):
        for k in observed:
            counts: dict[tuple[int, ...], int] = {}
            for _ in range(draws):
                tasks = sample_tasks(k, observed, rng)
                assert [len(J) for J in tasks] == list(range(1, len(observed) + 1))
                assert all(k in J and set(J) <= set(observed) for J in tasks)
                for J in tasks:
                    counts[J] = counts.get(J, 0) + 1
            for j in range(1, len(observed) + 1):
                cls = subsets_containing(k, observed, j)
                p = 1 / len(cls)
                sd = math.sqrt(draws * p * (1 - p)) or 1.0
                for J in cls:  # every subset of the class is drawn, at the uniform rate (5 sigma)
                    assert abs(counts.get(J, 0) - draws * p) < 5 * sd, (observed, k, J, counts.get(J, 0))


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_sampled_loss_is_unbiased_monte_carlo(K):
    """Mean of many sampled objectives matches the full objective, for every observed set of K <= 4 parties."""
    rng = np.random.default_rng(7)
    draws = 4000
    for observed in all_observed_sets(K):
        table = {(k, J): float(v) for k in observed for J, v in
                 zip(subsets_containing(k, observed), rng.gamma(2.0, 1.0, 2 ** (len(observed) - 1)), strict=True)}

        def loss_of(k, J, table=table):
            return table[(k, J)]

        exact = full_objective(loss_of, observed)
        samples = np.array([sampled_objective(loss_of, observed, rng) for _ in range(draws)])
        stderr = samples.std() / math.sqrt(draws)
        assert abs(samples.mean() - exact) <= 5 * stderr + 1e-9, (observed, samples.mean(), exact)
        if len(observed) >= 3:
            # The check has power: without the a_j factors the estimate is clearly off.
            naive = np.mean([sum(loss_of(k, J) for k in observed for J in sample_tasks(k, observed, rng))
                             for _ in range(500)])
            assert abs(naive - exact) > 10 * stderr


class TinyParty(torch.nn.Module):
    def __init__(self, d_in: int, d: int, n_classes: int) -> None:
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Linear(d_in, d), torch.nn.Tanh())
        self.g = torch.nn.Linear(d, n_classes)


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_estimator_expectation_equals_full_objective_exhaustively(K):
    """Exact expectation: average the sampled loss over EVERY possible draw (the product of the size classes) and
    compare value and gradients (heads and representation models) with the full objective over all subsets."""
    torch.manual_seed(K)
    B, d_in, d, C = 6, 3, 4, 3
    parties = [TinyParty(d_in, d, C).double() for _ in range(K)]
    xs = [torch.randn(B, d_in, dtype=torch.float64) for _ in range(K)]
    y = torch.randint(0, C, (B,))
    params = [p for m in parties for p in m.parameters()]
    for observed in all_observed_sets(K):
        reps = torch.stack([parties[i].f(xs[i]) for i in observed])

        def loss_of(k, J, reps=reps, observed=observed):
            mean = torch.stack([reps[observed.index(i)] for i in J]).mean(0)
            return F.cross_entropy(parties[k].g(mean), y)

        exact = full_objective(loss_of, observed)
        g_exact = torch.autograd.grad(exact, params, allow_unused=True, retain_graph=True)

        expected = 0.0
        for k in observed:
            table = TaskTable.of(k, observed)
            classes = [subsets_containing(k, observed, j) for j in range(1, len(observed) + 1)]
            combos = list(itertools.product(*classes))
            for tasks in combos:
                M = averaging_matrix(list(tasks), observed, dtype=torch.float64)
                loss, _ = weighted_task_loss(parties[k].g, reps, M, table.weights.double(), y)
                expected = expected + loss / len(combos)
        g_expected = torch.autograd.grad(expected, params, allow_unused=True)
        torch.testing.assert_close(expected, exact)
        for a, b in zip(g_expected, g_exact, strict=True):
            if a is None or b is None:
                assert a is None and b is None
            else:
                torch.testing.assert_close(a, b)


def test_large_observed_sets_are_sampled_without_enumeration(monkeypatch):
    """Above MAX_ENUMERATED the companion-drawing path is used; it has the same uniform distribution."""
    monkeypatch.setattr(subsets_mod, "MAX_ENUMERATED", 2)
    observed = (0, 2, 3, 5)
    table = TaskTable(3, observed)
    assert not table.enumerated
    rng = np.random.default_rng(0)
    counts: dict[tuple[int, ...], int] = {}
    draws = 6000
    for _ in range(draws):
        tasks, M = table.draw(rng)
        torch.testing.assert_close(M, averaging_matrix(tasks, observed))
        for J in tasks:
            counts[J] = counts.get(J, 0) + 1
    for J in subsets_containing(3, observed, 2):
        assert abs(counts[J] - draws / 3) < 5 * math.sqrt(draws * 2 / 9)


def test_task_table_draw_matches_its_tasks():
    rng = np.random.default_rng(1)
    observed = (4, 1, 2)  # representation order need not be sorted
    table = TaskTable.of(1, observed)
    assert len(table.subsets) == 4 and table.enumerated
    for _ in range(20):
        tasks, M = table.draw(rng)
        torch.testing.assert_close(M, averaging_matrix(tasks, observed))
        assert [len(J) for J in tasks] == [1, 2, 3]


# --- batched fusion equals the per-subset loop -----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    B=st.integers(1, 5),
    d=st.integers(1, 4),
    data=st.data(),
)
def test_subset_means_equal_loop(n, B, d, data):
    observed = data.draw(st.permutations(list(range(8))))[:n]
    subsets = data.draw(
        st.lists(st.sets(st.sampled_from(observed), min_size=1).map(lambda s: tuple(sorted(s))), min_size=1, max_size=7)
    )
    reps = torch.randn(n, B, d, dtype=torch.float64)
    M = averaging_matrix(subsets, observed, dtype=torch.float64)
    fused = subset_means(reps, M)
    loop = torch.stack([torch.stack([reps[observed.index(p)] for p in J]).mean(0) for J in subsets])
    torch.testing.assert_close(fused, loop)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_weighted_task_loss_equals_loop_value_and_gradient(n, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    B, d, C = 5, 3, 4
    observed = tuple(int(p) for p in rng.permutation(7)[:n])
    k = observed[int(rng.integers(n))]
    head = torch.nn.Linear(d, C).double()
    reps = torch.randn(n, B, d, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, C, (B,))
    tasks, M = TaskTable.of(k, observed).draw(rng)
    weights = torch.tensor(task_weights(n), dtype=torch.float64)

    batched, logits = weighted_task_loss(head, reps, M.double(), weights, y)
    assert logits.shape == (n, B, C)
    loop = sum(
        task_weight(n, len(J)) * F.cross_entropy(head(torch.stack([reps[observed.index(p)] for p in J]).mean(0)), y)
        for J in tasks
    )
    torch.testing.assert_close(batched, loop)
    g1 = torch.autograd.grad(batched, [reps, *head.parameters()])
    g2 = torch.autograd.grad(loop, [reps, *head.parameters()])
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_binary_one_logit_loss_matches_bce():
    from secvfl.algorithms.missing.subsets import per_sample_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(3, 1).double()
    reps = torch.randn(2, 7, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (7,))
    M = averaging_matrix([(0,), (0, 1)], (0, 1), dtype=torch.float64)
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    loss, logits = weighted_task_loss(head, reps, M, w, y, per_sample_loss(2))
    assert logits.shape == (2, 7, 1)
    ref = F.binary_cross_entropy_with_logits(head(reps[0]).squeeze(1), y.double()) + 0.5 * (
        F.binary_cross_entropy_with_logits(head(reps.mean(0)).squeeze(1), y.double())
    )
    torch.testing.assert_close(loss, ref)


@pytest.mark.parametrize("skip_every", [0, 3])
@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_flat_optimizer_matches_torch_optim_with_skipped_groups(name, skip_every):
    import copy

    from secvfl.algorithms.missing.base import FlatOptimizer

    torch.manual_seed(0)
    ref_mods = [torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)]
    mods = copy.deepcopy(ref_mods)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
    ref = cls([p for m in ref_mods for p in m.parameters()], lr=0.01, weight_decay=0.1)
    flat = FlatOptimizer([list(m.parameters()) for m in mods], name, 0.01, 0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(25):
        use = [True, not skip_every or step % skip_every != 0]  # the second group may miss every third step
        for i, m in enumerate(ref_mods):
            grads = [torch.randn(p.shape, generator=gen) for p in m.parameters()]
            for p, g in zip(m.parameters(), grads, strict=True):
                p.grad = g.clone() if use[i] else None
            if use[i]:
                flat.set_grads(i, grads)
        ref.step()
        flat.step()
    for a, b in zip(ref_mods, mods, strict=True):
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    # The state survives a round trip.
    state = flat.state_dict()
    other = FlatOptimizer([list(copy.deepcopy(m).parameters()) for m in mods], name, 0.01, 0.1)
    other.load_state_dict(state)
    assert torch.equal(other.steps, flat.steps)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5), C=st.sampled_from([1, 3]), with_bias=st.booleans(), seed=st.integers(0, 10_000))
def test_closed_form_linear_head_step_equals_autograd(n, C, with_bias, seed):
    from secvfl.algorithms.missing.subsets import linear_head_task_grads, per_sample_loss

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    B, d = 6, 4
    observed = tuple(range(n))
    k = int(rng.integers(n))
    head = torch.nn.Linear(d, C, bias=with_bias).double()
    reps = torch.randn(n, B, d, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 2 if C == 1 else C, (B,))
    _, M = TaskTable.of(k, observed).draw(rng)
    w = torch.tensor(task_weights(n), dtype=torch.float64)
    loss, _ = weighted_task_loss(head, reps, M.double(), w, y, per_sample_loss(2 if C == 1 else C))
    params = [reps, head.weight] + ([head.bias] if with_bias else [])
    expected = torch.autograd.grad(loss, params)
    got_loss, d_reps, d_w, d_b = linear_head_task_grads(head.weight.detach(), head.bias.detach() if with_bias else None,
                                                        reps.detach(), M.double(), w, y)
    torch.testing.assert_close(got_loss, loss.detach())
    torch.testing.assert_close(d_reps, expected[0])
    torch.testing.assert_close(d_w, expected[1])
    if with_bias:
        torch.testing.assert_close(d_b, expected[2])
    else:
        assert d_b is None
