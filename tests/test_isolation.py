"""Parties must only see what crossed the transport, and reach nothing of another party's.

Isolation as object-graph reachability: a party (and every hook a protocol installs on it) must not reach another
party's state through ANY chain of references. "Another party's state", from party P:

1. another party object (any value of ``algorithm.parties()`` but P);
2. the coordinators, which hold every party: the Algorithm, its RunContext and Dataset (every party's features
   and the labels), the Run, the party handles (the algorithm's way to its parties: each one holds its party and the
   Network), the Network, its transport (every party's undelivered messages) and its layers and
   aggregation (per-party protocol state of every party: error-feedback memories, DP mechanisms with the models
   they protect, CKKS contexts with the secret key, masking and channel keys);
3. a private object of another party: a tensor, array, module, optimiser, random generator, key object (TenSEAL,
   SEAL, ``cryptography``) or byte string (16 bytes or more: keys, ciphertexts) that is reachable from another
   party as well (no such object may be reachable from two parties), or that the network keeps for other parties
   only (reachable from their entries in per-party tables of layers and aggregations: CKKS contexts, channel
   identity and session keys, DP mechanisms, masking keys; an entry nested in a party's entry under a peer's name,
   like a session with that peer, counts for both ends; what every party's entry reaches, like the pinned public
   keys, is public);
4. another party's memory: a tensor or array whose buffer is that of a tensor or array another party reaches
   (views and zero-copy conversions are different objects over the same memory).

Public facts a party may reach: its own name, the configuration, a BatchSchedule (seed, batch size, public row
ids, epoch) and step numbers.

The walk: breadth first over ``gc.get_referents`` (instance dicts and slots, containers, closures), and also

* bound methods: ``__self__`` and ``__func__`` (a hook that is a bound method of the layer reaches the layer);
* functions: closure cells, defaults and ``__dict__``, but not ``__globals__`` or ``__code__``: module namespaces
  are code and constants shared by everything in the process (on its own host a party has its own copy), and
  secvfl keeps no party state in them; for the same reason modules and classes are not entered;
* tensors: ``.grad``, ``._base`` (a view's base) and the autograd graph behind ``.grad_fn`` (next functions,
  saved tensors, the parameters of AccumulateGrad nodes): a tensor computed in process from another party's
  tensor reaches that party's parameters this way;
* weak references, dereferenced (a party could).

The walk does not go through forbidden objects (it reports them) and is bounded: a walk that exceeds
MAX_OBJECTS fails instead of passing unchecked. The network holds no party itself, but its layers do (DP's label
installers, every party's CKKS context, channel and masking keys), so a party holding it would reach them all.
Parties never send or receive themselves (their handles move their messages through the network), so no party
needs the network, nor a per-party endpoint of it, nor a handle (its own holds the network).
"""

from __future__ import annotations

import gc
import types
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from secvfl.algorithms import settings_for
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError, PartyIsolationError
from secvfl.messages import Message, decode, encode
from secvfl.runner import build_run


def _run():
    return build_run(TrainConfig(dataset="wine", parties=2, epochs=1, batch_size=16, val_fraction=0, device="cpu"))


def test_party_refuses_a_message_handed_over_directly():
    run = _run()
    fp = run.algorithm.feature_parties[0]
    fp.forward(0, "train", [0, 1], "label")
    with pytest.raises(PartyIsolationError, match="handed over directly"):
        fp.backward(Message("gradient", "label", fp.name, 0, {"gradient": torch.zeros(2, 16)}))
    lp = run.algorithm.label_party
    with pytest.raises(PartyIsolationError):
        lp.train_step(0, [0, 1], [fp.forward(0, "train", [0, 1], "label")], [fp.name])


def test_a_wire_size_is_no_proof_of_crossing_the_transport():
    """A message built (or copied) in process is refused even when it claims a wire size: only decoding bytes, or
    the network delivering a message, marks it as received."""
    run = _run()
    fp = run.algorithm.feature_parties[0]
    grad = torch.ones(2, 16)
    fp.forward(0, "train", [0, 1], "label")
    with pytest.raises(PartyIsolationError, match="handed over directly"):
        fp.backward(Message("gradient", "label", fp.name, 0, {"gradient": grad}, wire_size=128))
    received = decode(encode(Message("gradient", "label", fp.name, 0, {"gradient": grad})))
    with pytest.raises(PartyIsolationError, match="handed over directly"):
        fp.backward(received.replace(tensors={"gradient": grad}, wire_size=received.wire_size))
    before = [p.detach().clone() for p in fp.model.parameters()]
    fp.backward(received)  # the same message as read from bytes is accepted
    assert max(float((a - p.detach()).abs().max()) for a, p in zip(before, fp.model.parameters(), strict=True)) > 1e-4


def test_a_party_refuses_a_message_delivered_to_another_party():
    run = _run()
    party0, party1 = run.algorithm.feature_parties
    party0.forward(0, "train", [0, 1], "label")
    run.net.send(Message("gradient", "label", party1.name, 0, {"gradient": torch.zeros(2, 16)}))
    for_party1 = run.net.receive(party1.name, kind="gradient", sender="label")
    with pytest.raises(PartyIsolationError, match="addressed to party1"):
        party0.backward(for_party1)


# -- party isolation as object-graph reachability (what is checked: see the module docstring) -------------------
MAX_OBJECTS = 200_000
_ATOMS = (str, int, float, complex, bool, type(None), types.ModuleType, type, types.CodeType, types.FrameType)
_KEY_MODULES = ("tenseal", "_tenseal_cpp", "_sealapi_cpp", "cryptography")


def _forbidden_types() -> tuple[type, ...]:
    from secvfl.algorithms.base import Algorithm, RunContext
    from secvfl.data import Dataset
    from secvfl.handles import PartyHandle
    from secvfl.runner import Run
    from secvfl.transport import Network, Transport
    from secvfl.transport.layers import Aggregation, Layer

    return (Algorithm, RunContext, Dataset, Run, PartyHandle, Network, Transport, Layer, Aggregation)


def _autograd_children(node: Any) -> list[Any]:
    out: list[Any] = [f for f, _ in getattr(node, "next_functions", ()) if f is not None]
    if hasattr(node, "variable"):
        out.append(node.variable)
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                out.append(getattr(node, name))
            except (RuntimeError, AttributeError):  # freed after backward: nothing left to reach
                pass
    return out


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, types.FunctionType):
        return [c for c in (obj.__closure__, obj.__defaults__, obj.__kwdefaults__, obj.__dict__) if c is not None]
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.CellType):
        try:
            return [obj.cell_contents]
        except ValueError:  # an empty cell
            return []
    if isinstance(obj, weakref.ReferenceType):
        target = obj()
        return [] if target is None else [target]
    out = list(gc.get_referents(obj))
    if isinstance(obj, torch.Tensor):
        grad = obj.grad if obj.is_leaf or obj.retains_grad else None  # else there is none (reading it warns)
        out += [t for t in (grad, obj._base, obj.grad_fn) if t is not None]
    elif hasattr(obj, "next_functions") and hasattr(obj, "register_hook"):  # an autograd node
        out += _autograd_children(obj)
    return out


def reachable(root: Any, stop: Callable[[Any], bool]) -> dict[int, Any]:
    """Every object reachable from ``root`` (id -> object); objects for which ``stop`` is true are included but
    not walked through."""
    seen = {id(root): root}
    queue = deque([root])
    while queue:
        for child in _children(queue.popleft()):
            if isinstance(child, _ATOMS) or id(child) in seen:
                continue
            seen[id(child)] = child
            if len(seen) > MAX_OBJECTS:
                raise AssertionError(f"the walk from {root!r} passed {MAX_OBJECTS} objects; raise the bound")
            if not stop(child):
                queue.append(child)
    return seen


def _private(obj: Any) -> bool:
    if isinstance(obj, np.ndarray):
        return obj.size > 0
    if isinstance(obj, (bytes, bytearray)):
        return len(obj) >= 16
    if isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, torch.Generator,
                        np.random.Generator, np.random.BitGenerator)):
        return True
    return type(obj).__module__.split(".")[0] in _KEY_MODULES


def _buffer(obj: Any) -> tuple[int, int] | None:
    """The memory a tensor or array lives in, ``(start, end)`` addresses: its whole storage, or its root array's
    bytes (views and zero-copy conversions share it)."""
    if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.untyped_storage().nbytes():
        storage = obj.untyped_storage()
        return storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    if isinstance(obj, np.ndarray) and obj.nbytes:
        while isinstance(obj.base, np.ndarray):
            obj = obj.base
        return np.lib.array_utils.byte_bounds(obj)
    return None


def _overlaps(a: set[tuple[int, int]], b: set[tuple[int, int]]) -> int:
    return sum(1 for lo, hi in a if any(lo < hi2 and lo2 < hi for lo2, hi2 in b))


def _wire_tables(run: Any, stop: Callable[[Any], bool]) -> dict[int, tuple[Any, set[str]]]:
    """Private objects the network keeps for parties (id -> the object and the parties whose entries reach it): what
    the values of every dict keyed by party names (the run's roles, the aggregator included) inside the layers and
    the aggregation reach."""
    names = set(run.net.topology.roles)
    owners: dict[int, tuple[Any, set[str]]] = {}
    for root in [*run.net.layers, run.net.aggregation]:
        inside = reachable(root, lambda o, root=root: o is not root and stop(o))
        for table in (o for o in inside.values() if isinstance(o, dict) and o and set(o) <= names):
            for party, value in table.items():
                for i, o in reachable(value, stop).items():
                    if _private(o):
                        owners.setdefault(i, (o, set()))[1].add(party)
    return owners


def _stop_at(parties: dict[str, Any]) -> Callable[[Any], bool]:
    """Where walks end: at party objects and coordinators (reported when a party reaches them, never walked)."""
    forbidden, party_ids = _forbidden_types(), {id(p) for p in parties.values()}
    return lambda o: id(o) in party_ids or isinstance(o, forbidden)


def isolation_violations(run: Any) -> list[str]:
    """Every way a party of ``run`` reaches another party's state (see above); empty when isolated."""
    forbidden = _forbidden_types()
    parties = dict(run.algorithm.parties())
    party_ids = {id(p): n for n, p in parties.items()}
    stop = _stop_at(parties)
    owners = {i: who for i, (_, who) in _wire_tables(run, stop).items()}
    seen = {n: reachable(p, lambda o, p=p: o is not p and stop(o)) for n, p in parties.items()}
    private = {n: {i for i, o in s.items() if _private(o)} for n, s in seen.items()}
    buffers = {n: {b for o in s.values() if (b := _buffer(o)) is not None} for n, s in seen.items()}
    problems = []
    for n, objs in seen.items():
        for i, o in objs.items():
            if i in party_ids and party_ids[i] != n:
                problems.append(f"{n} reaches party {party_ids[i]}")
            elif isinstance(o, forbidden):
                problems.append(f"{n} reaches the coordinating {type(o).__name__}")
        kept: dict[str, set[str]] = {}  # owners -> types of what the network keeps for them and n reaches
        for i in private[n]:
            if i in owners and n not in owners[i]:
                kept.setdefault(",".join(sorted(owners[i])), set()).add(type(objs[i]).__name__)
        problems += [f"{n} reaches what the network keeps for {who} ({', '.join(sorted(t))})" for who, t in kept.items()]
        for other in parties:
            if other == n:
                continue
            shared = private[n] & private[other] if other > n else set()
            if shared:
                kinds = sorted({type(seen[n][i]).__name__ for i in shared})
                problems.append(f"{n} and {other} both reach {len(shared)} private object(s) ({', '.join(kinds)})")
            if other > n and (overlap := _overlaps(buffers[n], buffers[other])):
                problems.append(f"{n} and {other} reach the same memory ({overlap} buffers)")
    return problems


# -- every accepted algorithm x protocol combination --------------------------------------------------------------
_DP = {"privacy": "dp", "epsilon": 3.0}
PROTOCOL_CONFIGS: dict[str, dict[str, Any]] = {
    "none": {},
    "compress": {"compress": "topk:0.1+ef"},
    "dp-labels-rr": {**_DP, "dp_mechanism": "rr"},
    "dp-labels-rr-prior": {**_DP, "dp_mechanism": "rr-prior"},
    "dp-labels-gradient": {**_DP, "dp_mechanism": "gradient"},
    "dp-labels-gradient-denoised": {**_DP, "dp_mechanism": "gradient", "dp_denoise": "posterior"},
    "dp-labels-alibi": {**_DP, "dp_mechanism": "alibi"},
    "dp-features": {**_DP, "dp_protect": "features"},
    "ckks": {"he": "ckks"},
    "mask": {"secagg": "mask"},
    "channel": {"secure_channel": True},
    "dp-features+compress+channel": {**_DP, "dp_protect": "features", "compress": "topk:0.1+ef",
                                     "secure_channel": True},
    "dp-labels-gradient+compress": {**_DP, "dp_mechanism": "gradient", "compress": "topk:0.1+ef"},
    "ckks+compress-backward+channel": {"he": "ckks", "compress_backward": "topk:0.1+ef", "secure_channel": True},
    "mask+dp-features": {"secagg": "mask", **_DP, "dp_protect": "features"},
}
_SADDLE = {"eg", "gd", "nesterov", "admm"}


def _algorithms() -> list[str]:
    from secvfl.algorithms import algorithm_names

    return algorithm_names()


def _build(algo: str, protocols: dict[str, Any], parties: int = 3) -> Any:
    options = dict(protocols)
    if algo in _SADDLE:
        options["saddle_iters"] = 3  # isolation does not depend on how long it trains
    cfg = TrainConfig(algo=algo, dataset="wine", parties=parties, epochs=2, val_fraction=0.2, device="cpu",
                      options=options, **settings_for(algo, {"batch_size": 32}))
    try:
        return build_run(cfg)
    except ConfigError as exc:  # UnsupportedError included: a combination the run refuses is not covered
        pytest.skip(f"{algo} refuses {protocols}: {str(exc).splitlines()[0]}")


def _train_one_epoch(run: Any) -> None:
    run.net.start_epoch(0)
    run.algorithm.train_epoch(0)
    run.algorithm.evaluate("val")


@pytest.mark.parametrize("protocol", list(PROTOCOL_CONFIGS))
@pytest.mark.parametrize("algo", _algorithms())
def test_no_party_reaches_another_partys_state(algo: str, protocol: str) -> None:
    """From every party, no reference chain reaches another party, a coordinator or another party's private
    objects or memory: once the protocols are attached, and again after an epoch and an evaluation (CKKS contexts
    handed out, error-feedback memories filled, pending forward state). A combination the run refuses must be
    refused with one clear line (a ConfigError), which is all there is to check for it."""
    try:
        run = _build(algo, PROTOCOL_CONFIGS[protocol])
    except pytest.skip.Exception as refused:
        assert "\n" not in str(refused.msg) and " refuses " in str(refused.msg)
        return
    assert isolation_violations(run) == []
    _train_one_epoch(run)
    assert isolation_violations(run) == []


def test_the_isolation_check_covers_every_algorithm_under_protocols() -> None:
    """Every algorithm is built and checked under at least two protocol configurations (refusals are skipped by
    the test above, so this keeps the cross product from silently shrinking to nothing)."""
    covered = {}
    for algo in _algorithms():
        accepted = []
        for name, protocols in PROTOCOL_CONFIGS.items():
            try:
                _build(algo, protocols)
            except pytest.skip.Exception:
                continue
            accepted.append(name)
        covered[algo] = accepted
    assert all({"none", "channel"} <= set(v) for v in covered.values()), covered
    assert sum(map(len, covered.values())) >= 40, covered


# -- the check catches a planted reference -------------------------------------------------------------------------
def _trained(algo: str = "vafl", protocols: dict[str, Any] | None = None) -> Any:
    run = _build(algo, protocols or {}, parties=2)
    _train_one_epoch(run)
    assert isolation_violations(run) == []
    return run


def test_a_hook_holding_another_party_is_caught() -> None:
    run = _trained()
    party0, party1 = run.algorithm.feature_parties
    party0.tagger.leak = party1
    assert "party0 reaches party party1" in isolation_violations(run)


def test_a_hook_holding_a_party_handle_is_caught() -> None:
    """A handle holds its party and the network: a party reaching one (another's, or its own) is reported."""
    run = _trained()
    party0 = run.algorithm.feature_parties[0]
    party0.tagger.leak = run.algorithm.feature_handles[1]
    assert "party0 reaches the coordinating FeatureHandle" in isolation_violations(run)
    party0.tagger.leak = run.algorithm.feature_handles[0].forward  # a bound request holds the handle
    assert "party0 reaches the coordinating FeatureHandle" in isolation_violations(run)


def test_a_hook_holding_the_algorithm_or_a_layer_through_a_method_or_closure_is_caught() -> None:
    run = _trained(protocols={"compress": "topk:0.1+ef"})
    party0 = run.algorithm.feature_parties[0]
    party0.tagger.epoch = lambda: run.algorithm.current_epoch  # the closure holds the run
    assert "party0 reaches the coordinating Run" in isolation_violations(run)
    party0.tagger.epoch = run.net.layers[0].describe  # a bound method holds the layer
    assert "party0 reaches the coordinating CompressionLayer" in isolation_violations(run)


def test_another_partys_tensor_or_its_memory_is_caught() -> None:
    run = _trained()
    party0, label = run.algorithm.feature_parties[0], run.algorithm.label_party
    labels = label.labels("train")
    party0.release_rule.labels = labels
    assert "label and party0 both reach 1 private object(s) (Tensor)" in isolation_violations(run)
    # another tensor object over the label party's memory (no ``_base`` leading back to the label party's tensor)
    party0.release_rule.labels = torch.empty(0, dtype=labels.dtype).set_(labels.untyped_storage(), 0, (4,), (1,))
    assert isolation_violations(run) == ["label and party0 reach the same memory (1 buffers)"]
    party0.release_rule.labels = labels.clone()  # a copy is party0's own object (how it got the values is not
    assert isolation_violations(run) == []       # a reference question: messages are checked by require_wire)


def test_a_tensor_computed_from_another_partys_model_is_caught_through_its_autograd_graph() -> None:
    run = _trained()
    party0, party1 = run.algorithm.feature_parties
    out = party1.model(torch.zeros(2, party1._x["train"].shape[1]))
    party0.release_rule.cached = out  # its graph leads to party1's parameters
    assert any(p.startswith("party0 and party1 both reach") and "Parameter" in p for p in isolation_violations(run))
    party0.release_rule.cached = out.detach()  # the values alone: party0's own tensor
    assert isolation_violations(run) == []


@pytest.mark.parametrize("protocols", [{"secure_channel": True}, {"secagg": "mask"}, {"he": "ckks"},
                                       {**_DP, "dp_protect": "features"}, {"compress": "topk:0.1+ef"}])
def test_anything_the_network_keeps_for_other_parties_is_caught(protocols: dict[str, Any]) -> None:
    """Keys, sessions, mechanisms, memories the protocol keeps for other parties (channel session keys of the
    other pairs included) are flagged once party0 holds one of them."""
    run = _trained(protocols=protocols)
    party0 = run.algorithm.feature_parties[0]
    kept = _wire_tables(run, _stop_at(run.algorithm.parties()))
    foreign = {",".join(sorted(who)): obj for obj, who in kept.values() if "party0" not in who}
    assert foreign, "the protocol keeps no private state for the other parties: nothing to plant"
    for who, obj in foreign.items():
        party0.tagger.planted = obj
        assert any(p.startswith(f"party0 reaches what the network keeps for {who} (") for p in isolation_violations(run))
    del party0.tagger.planted
    assert isolation_violations(run) == []


def test_the_label_partys_ckks_secret_key_is_caught_at_a_feature_party() -> None:
    run = _trained(protocols={"he": "ckks"})
    party0 = run.algorithm.feature_parties[0]
    party0.release_rule.key = run.net.aggregation.context_of("label")  # the context with the secret key
    assert "party0 reaches what the network keeps for label (Context, TenSEALContext)" in isolation_violations(run)
    party0.release_rule.key = run.net.aggregation.context_of("party1")
    assert "party0 reaches what the network keeps for party1 (Context, TenSEALContext)" in isolation_violations(run)


def test_party_repr_never_shows_data():
    run = _run()
    assert repr(run.algorithm.label_party) == "LabelParty('label')"
