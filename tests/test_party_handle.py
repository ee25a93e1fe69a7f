"""The coordinator reaches parties only through party handles (issue 15, point 5).

Every algorithm is trained twice from the same seed: once with its in-process handles, once with each handle swapped
for a stand-in that passes the handle's requests on and nothing else -- no party object behind it, no network, no
other attribute -- as a handle of a party in another process would. Both runs must give the same losses, metrics,
party states and byte counts, so training, evaluation and checkpoints use requests only. The stand-in also records
every request and checks that it carries public facts only and returns no message or party object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from secvfl.algorithms import algorithm_names, settings_for
from secvfl.algorithms.missing.baselines import PredictorSpec
from secvfl.config import TrainConfig
from secvfl.errors import MessageError, UnsupportedError
from secvfl.handles import FeatureHandle, LabelHandle, LocalHandle, PartyHandle, local_party
from secvfl.messages import Message
from secvfl.runner import build_run
from secvfl.transport.layers import Role
from secvfl.transport.network import Network

_SADDLE = {"eg", "gd", "nesterov", "admm", "eg-mlp"}
# The saddle family's label party holds the dual half of the optimiser and runs in the coordinator's process, which
# holds it directly (secvfl/algorithms/saddle/federation.py); every other party of every algorithm is behind a handle.
_LABEL_HELD_DIRECTLY = _SADDLE
# Requests whose arguments are not public facts, and why they may carry them.
_OWN_STATE = {"load_state_dict"}  # the party's own state, read back from its checkpoint
_LABEL_REQUESTS = {"train_step", "predict", "score"}  # the coordinator's own party: its probabilities, row factors


class RequestOnlyHandle:
    """A handle of a party elsewhere: only ``inner``'s requests pass, each one recorded and checked."""

    def __init__(self, inner: PartyHandle, log: list[tuple[str, str]]) -> None:
        self.name = inner.name
        self._requests = type(inner).requests()
        self._inner = inner
        self._log = log
        self._label = isinstance(inner, LabelHandle)

    def requests(self) -> tuple[str, ...]:
        return self._requests

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        if attr.startswith("_") or attr not in self._requests:
            raise AttributeError(f"{self.name}: {attr!r} is not a request ({', '.join(self._requests)})")
        method = getattr(self._inner, attr)

        def call(*args: Any, **kwargs: Any) -> Any:
            if attr not in _OWN_STATE and not (self._label and attr in _LABEL_REQUESTS):
                for value in [*args, *kwargs.values()]:
                    _require_public(value, f"{self.name}.{attr}")
            self._log.append((self.name, attr))
            result = method(*args, **kwargs)
            _require_no_message(result, f"{self.name}.{attr}")
            return result

        return call


def _require_public(value: Any, where: str) -> None:
    """Public facts: names, numbers, flags, row ids (integer arrays), predictor specs, and containers of them."""
    if value is None or isinstance(value, (bool, int, float, str, np.integer, np.floating, PredictorSpec)):
        return
    if isinstance(value, np.ndarray):
        assert value.dtype.kind in "iub", f"{where} got an array of {value.dtype}: party data, not row ids"
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _require_public(v, where)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _require_public(k, where)
            _require_public(v, where)
        return
    raise AssertionError(f"{where} got a {type(value).__name__}: a request carries public facts only")


def _require_no_message(value: Any, where: str) -> None:
    assert not isinstance(value, (Message, LocalHandle, torch.nn.Module)), f"{where} returned a {type(value).__name__}"
    if isinstance(value, (list, tuple)):
        for v in value:
            _require_no_message(v, where)


def _swap(obj: Any, swap: Callable[[LocalHandle], Any], parties: set[type], seen: set[int], depth: int = 0) -> list[str]:
    """Replace every handle held by ``obj`` (an algorithm, or an object of the algorithms' own modules it holds)
    with ``swap(handle)``; returns the party objects found held outside handles."""
    held = []
    if id(obj) in seen or depth > 2:
        return held
    seen.add(id(obj))
    for key, value in list(vars(obj).items()):
        if isinstance(value, LocalHandle):
            setattr(obj, key, swap(value))
        elif isinstance(value, list):
            value[:] = [swap(v) if isinstance(v, LocalHandle) else v for v in value]
            held += [f"{key}[{i}]" for i, v in enumerate(value) if type(v) in parties]
        elif isinstance(value, dict):
            for k, v in list(value.items()):
                if isinstance(v, LocalHandle):
                    value[k] = swap(v)
                held += [f"{key}[{k!r}]"] if type(v) in parties else []
        elif type(value) in parties:
            held.append(key)
        elif type(value).__module__.startswith("secvfl.algorithms"):
            held += [f"{key}.{h}" for h in _swap(value, swap, parties, seen, depth + 1)]
    return held


def _config(algo: str, protocols: dict[str, Any]) -> TrainConfig:
    options = {"saddle_iters": 3, **protocols} if algo in _SADDLE - {"eg-mlp"} else dict(protocols)
    return TrainConfig(algo=algo, dataset="wine", parties=3, epochs=2, val_fraction=0.2, seed=3,
                       **settings_for(algo, {"batch_size": 32}),
                       p_miss_train=0.0 if algo in _SADDLE else 0.3, device="cpu", options=options)


def _train(run: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"loss": []}
    for epoch in range(2):
        run.net.start_epoch(epoch)
        out["loss"].append(run.algorithm.train_epoch(epoch)["loss"])
        out[f"val{epoch}"] = run.algorithm.evaluate("val")
    out["test"] = run.algorithm.evaluate("test")
    out["state"] = run.algorithm.state_dict()
    out["comm"] = run.net.stats.to_dict()
    return out


def _close(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.allclose(a.double(), b.double(), rtol=1e-12, atol=1e-12, equal_nan=True), where
    elif isinstance(a, np.ndarray):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=where)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12, nan_ok=True), where
    else:
        assert a == b, where


_CASES = [pytest.param(a, {}, id=a) for a in algorithm_names()] + [
    pytest.param("vafl", {"secagg": "mask"}, id="vafl-mask"),
    pytest.param("splitnn", {"compress": "topk:0.1+ef"}, id="splitnn-compress-ef"),
    pytest.param("splitnn", {"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "rr-prior", "dp_reproducible": True},
                 id="splitnn-dp-rr-prior"),
    pytest.param("fdml", {"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "gradient", "dp_reproducible": True},
                 id="fdml-dp-gradient"),
    pytest.param("laser", {"privacy": "dp", "epsilon": 3.0, "dp_protect": "features", "dp_reproducible": True},
                 id="laser-dp-features"),
    pytest.param("svfl", {"secure_channel": True}, id="svfl-channel"),
    pytest.param("eg", {"saddle_participation": 0.5, "compress": "randk:0.1+ef"}, id="eg-partial-compress"),
    pytest.param("eg", {"saddle_batch": 16}, id="eg-minibatch"),
    pytest.param("gd", {"secagg": "mask"}, id="gd-mask"),
    pytest.param("vimadmm-j", {"secagg": "mask", "vim_local_steps": 2}, id="vimadmm-j-mask"),
    pytest.param("vimadmm", {"compress": "topk:0.1+ef", "vim_local_steps": 2}, id="vimadmm-compress-ef"),
]


@pytest.mark.parametrize(("algo", "protocols"), _CASES)
def test_training_through_request_only_handles_matches_the_local_handles(algo: str, protocols: dict[str, Any]) -> None:
    local = build_run(_config(algo, protocols))
    remote = build_run(_config(algo, protocols))
    parties = {type(p) for p in remote.algorithm.parties().values()}
    log: list[tuple[str, str]] = []
    held = _swap(remote.algorithm, lambda h: RequestOnlyHandle(h, log), parties, set())
    labels = {type(p) for n, p in local.algorithm.parties().items() if n == "label"}
    if algo in _LABEL_HELD_DIRECTLY:
        held = [h for h in held if type(_get(remote.algorithm, h)) not in labels]
    assert held == [], f"{algo} holds party objects outside handles: {held}"
    assert remote.algorithm.handles().keys() == local.algorithm.handles().keys()
    with pytest.raises(UnsupportedError, match="not in this process"):
        remote.algorithm.parties()  # nothing of a party is reachable but its requests

    expected, got = _train(local), _train(remote)
    _close(expected, got)
    assert got["comm"]["bytes_total"] > 0 or algo == "local-missing"  # local-missing exchanges nothing
    requested = {name for _, name in log}
    assert {"state_dict"} < requested, requested  # training requests besides the checkpoint's
    swapped = {n for n, _ in log}
    directly = {"label"} if algo in _LABEL_HELD_DIRECTLY else set()
    assert swapped | directly == set(remote.algorithm.handles()), "every party was reached through its handle"

    # a checkpoint restores through the requests as well: the stand-ins load the local run's states
    remote.algorithm.load_state_dict(expected["state"])
    _close(remote.algorithm.state_dict(), expected["state"])


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        name, _, index = part.partition("[")
        obj = getattr(obj, name)
        if index:
            key = index.rstrip("]")
            obj = obj[int(key)] if key.isdigit() else obj[key.strip("'")]
    return obj


def test_the_cases_cover_every_algorithm() -> None:
    assert {p.values[0] for p in _CASES} == set(algorithm_names())


def test_a_handle_of_a_party_elsewhere_gives_no_party_object() -> None:
    run = build_run(_config("splitnn", {}))
    handle = RequestOnlyHandle(run.algorithm.feature_handles[0], [])
    with pytest.raises(UnsupportedError) as refused:
        local_party(handle)  # type: ignore[arg-type]
    assert str(refused.value) == ("party party0 is not in this process; only its requests (backward, forward, "
                                  "load_state_dict, state_dict) reach it")
    with pytest.raises(AttributeError, match="'_party' is not a request"):
        handle._party  # noqa: B018


def test_the_split_handles_offer_small_explicit_request_sets() -> None:
    assert FeatureHandle.requests() == ("backward", "forward", "load_state_dict", "state_dict")
    assert LabelHandle.requests() == ("load_state_dict", "predict", "receive", "score", "state_dict", "train_step")


def test_submitted_inputs_travel_only_when_the_receiver_aggregates() -> None:
    net = Network({"a": Role.FEATURE, "b": Role.FEATURE, "label": Role.LABEL})
    rng = np.random.default_rng(0)
    xs = {p: rng.standard_normal((5, 3)) for p in ("a", "b")}
    for p, x in xs.items():
        net.submit(Message("embedding", p, "label", 0, {"embedding": torch.as_tensor(x, dtype=torch.float32)}))
    assert net.stats.bytes_total == 0 and net.transport.pending() == 0
    total = net.aggregate_submitted("label", "embedding")
    reference = (xs["a"].astype(np.float32).astype(np.float64) + xs["b"].astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(total.tensor("embedding").double().numpy(), reference, rtol=1e-6)
    assert net.stats.messages_total == 2 and net.stats.bytes_total > 2 * 5 * 3 * 4
    with pytest.raises(MessageError, match="no embedding inputs were submitted for label"):
        net.aggregate_submitted("label", "embedding")  # taken once
