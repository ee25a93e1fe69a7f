"""OGD and DLR learn from a replayed stream of tabular data (issue 17, point 8): the held-out test accuracy beats the
majority class on digits (by half the way to 1, as tests/test_every_algorithm.py asks) and on credit (with an AUC
well above chance), from the family's defaults."""

from __future__ import annotations

import numpy as np
import pytest

from secvfl.config import TrainConfig
from secvfl.data import load_dataset
from secvfl.runner import run_training


def _test_metrics(algo: str, dataset: str, data_dir=None, **options) -> tuple[dict, float]:
    y = load_dataset(dataset, data_dir, seed=0).y_test
    majority = float(np.bincount(y).max() / len(y))
    cfg = TrainConfig(algo=algo, dataset=dataset, parties=4, seed=0, data_dir=None if data_dir is None else str(data_dir),
                      device="cpu", options=options)
    return run_training(cfg, progress=False, log=lambda *_: None)["metrics"]["test"], majority


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ogd", "dlr"])
def test_online_algorithms_beat_the_majority_class_on_digits(algo: str) -> None:
    test, majority = _test_metrics(algo, "digits")
    assert test["accuracy"] >= majority + 0.5 * (1 - majority), test


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ogd", "dlr"])
def test_online_algorithms_beat_the_majority_class_on_credit(algo: str, data_dir) -> None:
    test, majority = _test_metrics(algo, "credit", data_dir, samples=500)  # 5,000 stream samples
    assert test["accuracy"] > majority + 0.01 and test["auc"] > 0.7, (test, majority)
