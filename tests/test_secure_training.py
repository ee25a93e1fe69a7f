"""Training with the secure-computation protocols switched on: ``--he ckks``, ``--secagg mask``, ``--secure-channel``."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from protocols.channel import SecureChannelLayer
from protocols.ckks import CIPHERTEXT_KIND, SUM_KIND
from protocols.secagg import MASKED_KIND
from protocols.secure_plugins import ChannelKeysWarning, generate_channel_keys
from secvfl.cli.main import main
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError, UnsupportedError
from secvfl.runner import build_run, run_training

LABEL = "label"
FEATURE_PARTIES = [f"party{i}" for i in range(3)]
TOL = 0.005


# Epochs per dataset so that the plaintext model is far above the majority class (wine needs ~20 steps of
# Adam before vafl leaves the majority class); a protocol that breaks training then shows in the metrics.
EPOCHS = {"breast_cancer": 2, "wine": 20}


def _cfg(algo: str, options: dict | None = None, dataset: str = "breast_cancer") -> TrainConfig:
    return TrainConfig(device="cpu", algo=algo, dataset=dataset, parties=3, epochs=EPOCHS[dataset], seed=3,
                       options=dict(options or {}))


def _train(algo: str, options: dict | None = None, on_build=None, dataset: str = "breast_cancer") -> dict:
    return run_training(_cfg(algo, options, dataset), progress=False, log=lambda *_: None, on_build=on_build)


_plain_cache: dict[tuple[str, str], dict] = {}


def _plain(algo: str, dataset: str = "breast_cancer") -> dict:
    if (algo, dataset) not in _plain_cache:
        _plain_cache[algo, dataset] = _train(algo, dataset=dataset)
        # the reference itself must have learnt something, or matching it proves nothing
        assert _plain_cache[algo, dataset]["metrics"]["test"]["accuracy"] >= _majority_rate(dataset) + 0.2
    return _plain_cache[algo, dataset]


def _majority_rate(dataset: str) -> float:
    """Test accuracy of always predicting the most frequent test label."""
    y = build_run(_cfg("vafl", dataset=dataset)).ctx.data.y_test
    return float(np.bincount(y).max() / len(y))


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


# How party1's masked share goes missing in a faulty round: never sent, or sent as bytes that are no message /
# as a share whose payload claims another dtype (each must count as a drop, not crash the run).
_SHARE_FAULTS = {
    "withheld": None,
    "undecodable": lambda data: data[:-8],
    "wrong-dtype": lambda data: data.replace(b'"int64"', b'"float64"', 1),
}


@pytest.mark.parametrize("fault", sorted(_SHARE_FAULTS))
def test_masked_training_goes_on_when_a_party_drops_out_of_rounds(
        fault: str, caplog: pytest.LogCaptureFixture) -> None:
    faulty_training_calls = {2, 5}  # 0-based indices of training aggregations in which party1 fails
    state = {"training_calls": 0, "faulty": False}
    calls: list[tuple[dict[str, np.ndarray], np.ndarray, bool]] = []  # inputs, aggregate, faulty
    views = {}

    def on_build(run) -> None:  # noqa: ANN001
        aggregate, put = run.net.aggregate, run.net.transport.put

        def spy(messages, receiver, op="sum"):  # noqa: ANN001, ANN202
            training = run.algorithm.current_epoch is not None
            state["faulty"] = training and state["training_calls"] in faulty_training_calls
            state["training_calls"] += training
            out = aggregate(messages, receiver, op)
            calls.append(({m.sender: m.tensor("embedding").double().numpy() for m in messages},
                          out.tensor("embedding").double().numpy(), state["faulty"]))
            state["faulty"] = False
            return out

        def faulty_put(sender, receiver, kind, data):  # noqa: ANN001, ANN202
            if state["faulty"] and sender == "party1" and kind == MASKED_KIND:
                data = _SHARE_FAULTS[fault](data)
            put(sender, receiver, kind, data)

        run.net.aggregate = spy
        views.update(party0=run.net.record("party0"), party1=run.net.record("party1"))
        if fault == "withheld":
            run.net.aggregation.drop_hook = lambda party, phase, rnd: (
                state["faulty"] and party == "party1" and phase == "masked")
        else:
            run.net.transport.put = faulty_put

    with caplog.at_level(logging.WARNING, logger="protocols.secagg"):
        summary = _train("vafl", {"secagg": "mask"}, on_build=on_build, dataset="wine")

    # Every aggregate is the float64 sum of the parties that delivered, within the fixed-point bound (2^-25 per
    # party) plus the float32 cast of the result.
    assert sum(faulty for *_, faulty in calls) == 2
    for inputs, got, faulty in calls:
        delivered = [p for p in inputs if not (faulty and p == "party1")]
        exact = np.sum([inputs[p] for p in delivered], axis=0)
        bound = len(delivered) * 2.0**-25 + np.abs(exact) * 2.0**-23
        assert np.all(np.abs(got - exact) <= bound), (faulty, float(np.abs(got - exact).max()))
    secagg = summary["secagg"]
    assert [d["party"] for d in secagg["dropped"]] == ["party1", "party1"]
    assert secagg["retried_rounds"] == 2 and secagg["rounds_failed"] == 2
    assert len([r for r in caplog.records if r.name == "protocols.secagg"]) == 1  # logged once, not per drop
    # The steps that went on without party1 gave it no gradient (its output was not in the sum they trained on).
    grads = {p: len(views[p].received_of("gradient")) for p in ("party0", "party1")}
    assert grads["party1"] == grads["party0"] - 2 > 0
    # Training went on to a useful model (two batches without party1 change little).
    assert summary["metrics"]["test"]["accuracy"] >= _majority_rate("wine") + 0.2


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
def test_secure_channel_same_metrics_more_bytes(algo: str) -> None:
    nets = []
    with pytest.warns(ChannelKeysWarning, match="generated and pinned in this one process.*never use this for a "
                                                "deployment"):
        secure = _train(algo, {"secure_channel": True}, on_build=lambda run: nets.append(run.net))
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
    with pytest.warns(ChannelKeysWarning, match="identity keys come from the key files in .*deployment keys"):
        secure = _train("vafl", {"secure_channel": True, "channel_keys": str(tmp_path)})
    assert secure["metrics"]["test"] == _plain("vafl")["metrics"]["test"]
    assert secure["protocols"]["layers"][-1]["keys"] == str(tmp_path)
    (tmp_path / "party1.key.pem").unlink()
    with pytest.raises(ConfigError, match=r"lacks \['party1.key.pem'\]"):
        _train("vafl", {"secure_channel": True, "channel_keys": str(tmp_path)})
    generate_channel_keys(tmp_path / "other", ["party1"])
    (tmp_path / "other" / "party1.key.pem").rename(tmp_path / "party1.key.pem")  # not the key party1.pub.pem pins
    with pytest.raises(ConfigError, match="party1.key.pem does not match party1.pub.pem"):
        _train("vafl", {"secure_channel": True, "channel_keys": str(tmp_path)})


def test_cli_train_with_he_ckks(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    rc = main(["train", "--algo", "vafl", "--dataset", "breast_cancer", "--parties", "3", "--epochs", "1",
               "--he", "ckks", "--ckks-params", "compact", "--device", "cpu", "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["protocols"]["aggregation"]["aggregation"] == "ckks"
    assert summary["he"]["sums_delivered"] > 0
    rc = main(["train", "--algo", "vafl", "--dataset", "breast_cancer", "--he", "ckks", "--secagg", "mask",
               "--device", "cpu", "--no-progress"])
    assert rc == 2
    assert "cannot be combined" in capsys.readouterr().err
