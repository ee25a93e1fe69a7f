"""Acceptance numbers of the attacks on real data (slow: each trains a full run; needs the shared datasets)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attacks.harness import feature_reconstruction, label_inference, model_completion, train_recorded
from attacks.metrics import randomized_response_ceiling
from attacks.model_completion import CompletionConfig
from secvfl.config import TrainConfig

pytestmark = pytest.mark.slow


def credit(data_dir, **options) -> TrainConfig:  # noqa: ANN001
    return TrainConfig(algo="splitnn", dataset="credit", data_dir=str(data_dir), parties=4, epochs=5, device="cpu",
                       options=options)


def quiet(_msg: str) -> None:
    pass


def test_credit_label_leakage_without_defence_and_under_label_dp(data_dir) -> None:  # noqa: ANN001
    plain = train_recorded(credit(data_dir), "party0", log=quiet)
    direction, _ = label_inference(plain, "direction", known_positives=1)
    norm, _ = label_inference(plain, "norm")
    one_overall, _ = label_inference(plain, "direction", known_positives=1, known_scope="run")
    assert direction.ap >= 0.95 and one_overall.ap >= 0.95
    assert norm.ap >= 0.85

    # seeded noise: with the secure source the utility drop varied run to run (0.04-0.072 against the 0.07 bar)
    dp = train_recorded(credit(data_dir, privacy="dp", epsilon=3.0, dp_mechanism="gradient", dp_reproducible=True),
                        "party0", log=quiet)
    assert label_inference(dp, "direction", known_positives=1)[0].ap <= 0.55
    assert label_inference(dp, "norm")[0].ap <= 0.55
    assert plain.mp[1] - dp.mp[1] <= 0.07


def test_credit_randomized_response_meets_its_ceiling(data_dir) -> None:  # noqa: ANN001
    rr = train_recorded(credit(data_dir, privacy="dp", epsilon=3.0, dp_mechanism="rr"), "party0", log=quiet)
    result, _ = label_inference(rr, "direction", known_positives=1)
    ceiling = randomized_response_ceiling(3.0)
    assert result.details["rr_ceiling"] == pytest.approx(ceiling)
    # the gradients reveal the randomised labels: the attack reaches (about) the ceiling, not below it
    assert abs(result.ap - ceiling) < 0.05


def test_mnist_passive_completion_beats_supervised_only(data_dir) -> None:  # noqa: ANN001
    cfg = TrainConfig(algo="splitnn", dataset="mnist", data_dir=str(data_dir), parties=4, epochs=2, bottom="cnn",
                      device="cpu")
    rec = train_recorded(cfg, "party0", log=quiet)
    (res,) = model_completion(rec, [40], config=CompletionConfig(epochs=20))
    assert res.ap > res.details["supervised_bottom_train_accuracy"]
    assert res.ap > res.details["scratch_train_accuracy"] + 0.03


def test_credit_grn_beats_random_guessing(data_dir) -> None:  # noqa: ANN001
    rec = train_recorded(replace(credit(data_dir), epochs=3), "label", log=quiet)
    result = feature_reconstruction(rec, "grn", "party0", rows=1000)
    assert result.details["mse"] < 0.8 * result.details["random_guess_mse"]
    # AP is 1 - MSE in unit scale, so it beats chance (1 - the random guess's MSE) by the same margin
    assert result.ap == pytest.approx(1 - result.details["mse"]) and result.ap > result.chance
