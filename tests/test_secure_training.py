"""Training with the secure-computation protocols switched on: ``--he ckks``, ``--secagg mask``, ``--secure-channel``."""

from __future__ import annotations

import json
import logging

import pytest

from protocols.channel import SecureChannelLayer
from protocols.ckks import CIPHERTEXT_KIND, SUM_KIND
from protocols.secagg import MASKED_KIND
from protocols.secure_plugins import generate_channel_keys
from secvfl.cli.main import main
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError, UnsupportedError
from secvfl.runner import run_training

LABEL = "label"
FEATURE_PARTIES = [f"party{i}" for i in range(3)]
TOL = 0.005


def _cfg(algo: str, options: dict | None = None, dataset: str = "breast_cancer") -> TrainConfig:
    return TrainConfig(algo=algo, dataset=dataset, parties=3, epochs=2, seed=3, options=dict(options or {}))


def _train(algo: str, options: dict | None = None, on_build=None, dataset: str = "breast_cancer") -> dict:
    return run_training(_cfg(algo, options, dataset), progress=False, log=lambda *_: None, on_build=on_build)


_plain_cache: dict[tuple[str, str], dict] = {}


def _plain(algo: str, dataset: str = "breast_cancer") -> dict:
    if (algo, dataset) not in _plain_cache:
        _plain_cache[algo, dataset] = _train(algo, dataset=dataset)
    return _plain_cache[algo, dataset]


def _assert_close(secure: dict, plain: dict) -> None:
    got, want = secure["metrics"]["test"], plain["metrics"]["test"]
    assert set(got) == set(want)
    for key in want:
        assert abs(got[key] - want[key]) <= TOL, (key, got[key], want[key])


@pytest.mark.parametrize("algo", ["vafl", "fdml"])
def test_ckks_training_matches_plaintext(algo: str) -> None:
    secure = _train(algo, {"he": "ckks"})
    _assert_close(secure, _plain(algo))
    agg = secure["protocols"]["aggregation"]
    assert agg["aggregation"] == "ckks" and agg["sums_delivered"] > 0
    assert agg["aggregator"] == "aggregator" and agg["key_holder"] == LABEL
    assert secure["comm"]["bytes_total"] > 10 * _plain(algo)["comm"]["bytes_total"]  # ciphertexts are big


@pytest.mark.parametrize("algo", ["vafl", "fdml"])
def test_masked_training_matches_plaintext(algo: str) -> None:
    secure = _train(algo, {"secagg": "mask"}, dataset="wine")
    _assert_close(secure, _plain(algo, "wine"))
    agg = secure["protocols"]["aggregation"]
    assert agg["aggregation"] == "mask" and agg["rounds_completed"] > 0 and agg["rounds_failed"] == 0
    assert secure["secagg"]["frac_bits"] == 24


def test_label_party_never_receives_an_individual_ciphertext() -> None:
    views = {}
    summary = _train("vafl", {"he": "ckks"}, on_build=lambda run: views.update(
        label=run.net.record(LABEL), agg=run.net.record("aggregator")))
    label, agg = views["label"], views["agg"]
    assert label.received_of(SUM_KIND), "the label party should receive the aggregated ciphertext"
    assert not label.received_of(CIPHERTEXT_KIND)
    assert {m.sender for m in label.received_of(SUM_KIND)} == {"aggregator"}
    # nothing a feature party released reaches the label party in the clear during training
    assert not [m for m in label.received if m.sender in FEATURE_PARTIES and m.kind == "embedding"]
    # the aggregator gets one ciphertext per feature party and round, and never a plaintext embedding
    assert {m.sender for m in agg.received_of(CIPHERTEXT_KIND)} == set(FEATURE_PARTIES)
    assert not agg.received_of("embedding")
    assert summary["protocols"]["aggregation"]["ciphertexts_added"] == len(agg.received_of(CIPHERTEXT_KIND))


def test_label_party_receives_only_masked_vectors_under_secagg() -> None:
    views = {}
    _train("vafl", {"secagg": "mask"}, on_build=lambda run: views.update(label=run.net.record(LABEL)))
    label = views["label"]
    assert label.received_of(MASKED_KIND)
    assert not [m for m in label.received if m.sender in FEATURE_PARTIES and m.kind == "embedding"]


@pytest.mark.parametrize("options", [{"he": "ckks"}, {"secagg": "mask"}])
def test_splitnn_refuses_secure_aggregation(options: dict) -> None:
    with pytest.raises(UnsupportedError, match=r"(?s)splitnn.*concat.*vafl"):
        _train("splitnn", options)


def test_ckks_and_mask_together_are_refused() -> None:
    with pytest.raises(UnsupportedError, match="cannot be combined; choose one"):
        _train("vafl", {"he": "ckks", "secagg": "mask"})


def test_orphan_flags_are_refused() -> None:
    with pytest.raises(UnsupportedError, match="--secagg-frac-bits only applies with --secagg mask"):
        _train("vafl", {"secagg_frac_bits": 16})
    with pytest.raises(UnsupportedError, match="--channel-keys only applies with --secure-channel"):
        _train("vafl", {"channel_keys": "/nonexistent"})


@pytest.mark.parametrize("algo", ["vafl", "splitnn"])
def test_secure_channel_same_metrics_more_bytes(algo: str, caplog: pytest.LogCaptureFixture) -> None:
    nets = []
    with caplog.at_level(logging.WARNING, logger="protocols.secure_plugins"):
        secure = _train(algo, {"secure_channel": True}, on_build=lambda run: nets.append(run.net))
    assert "generated for this run only" in caplog.text
    plain = _plain(algo)
    assert secure["metrics"]["test"] == plain["metrics"]["test"]  # sealing is lossless
    assert secure["comm"]["bytes_total"] > plain["comm"]["bytes_total"]
    layer = nets[0].layers[-1]
    assert isinstance(layer, SecureChannelLayer)
    assert layer.sealed > 0 and layer.opened == layer.sealed and layer.rejected == 0
    desc = secure["protocols"]["layers"][-1]
    assert desc["layer"] == "secure-channel" and desc["keys"].startswith("ephemeral")
    assert secure["security"]["secure_channel"] is True


def test_secure_channel_with_ckks_seals_ciphertexts() -> None:
    views = {}
    secure = _train("fdml", {"secure_channel": True, "he": "ckks"},
                    on_build=lambda run: views.update(agg=run.net.record("aggregator")))
    _assert_close(secure, _plain("fdml"))
    assert views["agg"].received_of(CIPHERTEXT_KIND)  # opened by the channel, then summed
    assert "aggregator" in json.dumps(secure["protocols"]["layers"][-1]["identities"])


def test_secure_channel_with_pinned_key_directory(tmp_path) -> None:
    generate_channel_keys(tmp_path, [*FEATURE_PARTIES, LABEL])
    secure = _train("vafl", {"secure_channel": True, "channel_keys": str(tmp_path)})
    assert secure["metrics"]["test"] == _plain("vafl")["metrics"]["test"]
    assert secure["protocols"]["layers"][-1]["keys"] == str(tmp_path)
    (tmp_path / "party1.key.pem").unlink()
    with pytest.raises(ConfigError, match=r"lacks \['party1.key.pem'\]"):
        _train("vafl", {"secure_channel": True, "channel_keys": str(tmp_path)})


def test_cli_train_with_he_ckks(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    rc = main(["train", "--algo", "vafl", "--dataset", "breast_cancer", "--parties", "3", "--epochs", "1",
               "--he", "ckks", "--ckks-params", "compact", "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["protocols"]["aggregation"]["aggregation"] == "ckks"
    assert summary["he"]["sums_delivered"] > 0
    rc = main(["train", "--algo", "vafl", "--dataset", "breast_cancer", "--he", "ckks", "--secagg", "mask",
               "--no-progress"])
    assert rc == 2
    assert "cannot be combined" in capsys.readouterr().err
