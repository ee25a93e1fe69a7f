"""VIM at the command line's defaults does not diverge, on image sets cut into few and many strips and on tabular
data, and its ADMM methods stay stable at step sizes far above the default (CPU).

The runs go through ``secvfl bench vim-defaults``'s own trainer (:func:`secvfl.bench.vim_defaults.run_method`): only
``--algo``, ``--dataset``, ``--parties`` and ``--seed`` are set, every other setting is the default a user gets, and
each epoch stops after ``BATCHES`` batches (enough rounds to show the first epoch's instabilities: VIMADMM-J at 10x
its step size on digits blew up after 65 rounds before its local steps undid blown-up steps). A run must neither
diverge (a non-finite loss, or a party's divergence check) nor stay at chance: its test accuracy must clear the
majority-class rate by a margin, a fifth of the way to 1 (binary credit: a test AUC of at least 0.65).
"""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from secvfl.bench.vim_defaults import Case, run_method
from secvfl.data import Dataset, load_dataset

ALGOS = ("vimsgd", "vimadmm", "vimadmm-j")


@pytest.fixture(autouse=True)
def _one_blas_thread():
    with threadpool_limits(1, user_api="blas"):
        yield


_DATA: dict[str, Dataset] = {}  # each dataset loaded once for all its runs (MNIST takes seconds)


def _data(dataset: str, data_dir) -> Dataset:  # noqa: ANN001 - a path or None
    if dataset not in _DATA:
        _DATA[dataset] = load_dataset(dataset, data_dir, seed=0)
    return _DATA[dataset]


def _check(case: Case, algo: str, data_dir, *, batches: int, epochs: int = 1, options=None) -> None:  # noqa: ANN001
    data = _data(case.dataset, data_dir)
    run = run_method(case, algo, epochs=epochs, options=options, max_batches=batches, data=data, log=lambda *_: None)
    assert not run["diverged"], f"{algo} on {case.label} {options or ''}: {run.get('reason')}"
    last = run["curve"][-1]
    if "test_auc" in last:  # binary (credit: 78 % negatives, and a good model's accuracy is only 0.82)
        assert last["test_auc"] >= 0.65, (algo, case.label, last)
        return
    majority = float(np.bincount(data.y_test).max() / len(data.y_test))
    assert last["test_accuracy"] >= majority + 0.2 * (1 - majority), (algo, case.label, last, majority)


@pytest.mark.slow
@pytest.mark.parametrize("parties", [4, 7, 14])
@pytest.mark.parametrize("algo", ALGOS)
def test_vim_defaults_do_not_diverge_on_mnist_strips(algo: str, parties: int, data_dir) -> None:
    _check(Case("mnist", parties), algo, data_dir, batches=40)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_vim_defaults_do_not_diverge_on_credit(algo: str, data_dir) -> None:
    _check(Case("credit", 4), algo, data_dir, batches=60)


@pytest.mark.parametrize("algo", ALGOS)
def test_vim_defaults_do_not_diverge_on_digits(algo: str) -> None:
    _check(Case("digits", 4), algo, None, batches=23, epochs=2)  # two epochs of 23 batches


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "step"), [("vimadmm-j", 0.1), ("vimadmm", 0.3)])
def test_the_admm_methods_stay_stable_far_above_their_default_step_size(algo: str, step: float) -> None:
    # digits, 4 strips: vimadmm-j at 10x its default step size blew up after 65 rounds, vimadmm at 30x after 19
    # (non-finite outputs), before blown-up local steps were undone and the label party's head step backtracked
    _check(Case("digits", 4), algo, None, batches=23, epochs=4, options={"vim_lr": step})


def test_the_bench_writes_its_table_and_finds_the_first_epoch_at_the_target(tmp_path) -> None:
    import json

    from secvfl.cli.main import main

    code = main(["bench", "vim-defaults", "--cases", "wine:2", "--methods", "vafl", "vimadmm", "--epochs", "2",
                 "--out-dir", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "defaults.json").read_text())
    runs = {r["algo"]: r for r in result["runs"]}
    best = {a: max(p["test_accuracy"] for p in r["curve"]) for a, r in runs.items()}
    (row,) = result["summary"]
    assert row["target"] == pytest.approx(min(best.values()))
    for algo, r in runs.items():  # the first epoch at or above the target, and its cumulative training MB
        first = next(p for p in r["curve"] if p["test_accuracy"] >= row["target"] - 1e-12)
        assert row["methods"][algo]["to_target"] == {"epoch": first["epoch"], "mb": first["train_mb"]}
        assert r["curve"][1]["train_mb"] == pytest.approx(2 * r["curve"][0]["train_mb"], rel=0.01)  # same bytes/epoch
    ratio = row["methods"]["vafl"]["to_target"]["mb"] / row["methods"]["vimadmm"]["to_target"]["mb"]
    assert row["vafl_over_vimadmm_mb"] == pytest.approx(ratio, abs=1e-3)
    assert "| wine:2 |" in (tmp_path / "defaults.md").read_text()
