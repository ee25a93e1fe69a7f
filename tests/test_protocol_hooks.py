"""Protocols touch parties and algorithms through public hooks only.

``protocols/`` may not find parties by probing objects (``getattr``/``hasattr``/``vars``/``__dict__``), replace
another object's methods, or write its private state (``lp._y[...] = ...``): an AST scan over every module refuses
each of these. The hooks they use instead (``Algorithm.protocol_hooks()``, ``LabelParty.use_training_labels``, the
batch rows a backward rule gets, ``ProtocolSetup.before_epoch``) are tested here against independent references.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from secvfl.algorithms.base import batch_ids
from secvfl.config import TrainConfig
from secvfl.errors import PartyIsolationError
from secvfl.parties import standard_backward
from secvfl.runner import build_run, run_training

REPO = Path(__file__).resolve().parents[1]
_PROBES = {"getattr", "hasattr", "setattr", "delattr", "vars"}
# (file relative to the repository, stripped line text) -> why that use is unavoidable. Empty: every protocol reaches
# parties through ProtocolHooks; an entry needs a reason a reviewer accepts, and goes when its line goes.
ALLOWED: dict[tuple[str, str], str] = {}


def _receiver(node: ast.expr) -> ast.expr:
    """The object an attribute/subscript chain starts from (``a`` of ``a.b[c].d``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _private_write(target: ast.expr) -> str | None:
    """``x._p = v`` or ``x._p[k] = v`` on an object ``x`` other than self."""
    node = target
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
            and not _is_self(node.value):
        return f"writes the private {node.attr} of another object"
    return None


def violations(source: str, name: str) -> list[str]:
    """Every probe, method replacement or private write in ``source`` (a module of ``protocols/``)."""
    tree = ast.parse(source, name)
    functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in _PROBES:
                found.append((line, f"calls {func.id}()"))
            elif isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__") \
                    and not (node.args and _is_self(node.args[0])):
                found.append((line, f"calls {func.attr} on another object"))
        elif isinstance(node, ast.Attribute) and node.attr == "__dict__":
            found.append((line, "reads __dict__"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                why = _private_write(t)
                if why:
                    found.append((line, why))
                elif isinstance(t, ast.Attribute) and not _is_self(_receiver(t)) and (
                        isinstance(node.value, ast.Lambda)
                        or (isinstance(node.value, ast.Name) and node.value.id in functions)):
                    found.append((line, f"replaces {t.attr} of another object with a function"))
    lines = source.splitlines()
    return [f"{name}:{line}: {why}" for line, why in sorted(found)
            if (name, lines[line - 1].strip()) not in ALLOWED]


def _protocol_modules() -> list[Path]:
    return sorted((REPO / "protocols").rglob("*.py"))


def test_the_scan_sees_every_kind_of_reach(tmp_path: Path) -> None:
    sample = (
        "def attach(algo, lp, rule):\n"
        "    lp2 = getattr(algo, 'label_party', None)\n"
        "    if hasattr(lp, 'backward_rule'):\n"
        "        pass\n"
        "    original = lp.train_step\n"
        "    def train_step(*a):\n"
        "        return original(*a)\n"
        "    lp.train_step = train_step\n"
        "    algo.train_epoch = lambda e: None\n"
        "    lp._y['train'] = 0\n"
        "    lp._pending = None\n"
        "    object.__setattr__(lp, 'x', 1)\n"
        "    print(vars(lp), lp.__dict__)\n"
        "    lp.backward_rule = rule\n"  # a public hook: allowed
        "class Own:\n"
        "    def __init__(self):\n"
        "        self._state = {}\n"  # its own state: allowed
        "        self._state['a'] = 1\n"
        "        object.__setattr__(self, 'frozen', 1)\n"
    )
    found = [v.split(": ", 1)[1] for v in violations(sample, "sample.py")]
    assert found == ["calls getattr()", "calls hasattr()", "replaces train_step of another object with a function",
                     "replaces train_epoch of another object with a function", "writes the private _y of another object",
                     "writes the private _pending of another object", "calls __setattr__ on another object",
                     "calls vars()", "reads __dict__"]


def test_protocols_reach_parties_through_public_hooks_only() -> None:
    modules = _protocol_modules()
    assert len(modules) > 20  # the scan found the package
    bad = [v for p in modules for v in violations(p.read_text(), str(p.relative_to(REPO)))]
    assert not bad, "protocols/ must use the public hooks (see secvfl.parties.ProtocolHooks):\n" + "\n".join(bad)


# -- the hooks -------------------------------------------------------------------------------------------------
def _cfg(**options) -> TrainConfig:
    return TrainConfig(algo="splitnn", dataset="wine", parties=2, epochs=2, batch_size=32, embedding_dim=4,
                       hidden=(8,), head_hidden=(), device="cpu", options=options)


def test_a_backward_rule_gets_each_training_batch_rows() -> None:
    run = build_run(_cfg())
    seen: list[np.ndarray] = []

    def recording(head, forward, inputs, labels, loss_fn, *, rows=None):  # noqa: ANN001, ANN202
        seen.append(np.array(rows))
        return standard_backward(head, forward, inputs, labels, loss_fn)

    hooks = run.algorithm.protocol_hooks()
    hooks.label.backward_rule = recording
    run.algorithm.train_epoch(1)
    # the independent reference: the shared-seed batch order of the rows every party holds
    expected = list(batch_ids(np.arange(run.ctx.rows("train")), 32, 0, 1))
    assert len(seen) == len(expected) and all(np.array_equal(a, b) for a, b in zip(seen, expected, strict=True))


def test_training_labels_are_replaced_through_the_label_partys_hook() -> None:
    run = build_run(_cfg())
    lp = run.algorithm.protocol_hooks().label
    val = lp.labels("val").clone()
    n = lp.labels("train").shape[0]
    lp.use_training_labels(np.zeros(n, dtype=np.int64))
    assert lp.labels("train").dtype == torch.long and int(lp.labels("train").sum()) == 0
    targets = np.full((n, 3), 1 / 3)
    lp.use_training_labels(targets)  # float rows: targets, in the party's dtype
    assert lp.labels("train").dtype == lp.dtype and lp.labels("train").shape == (n, 3)
    assert torch.equal(lp.labels("val"), val)  # evaluation keeps the true labels
    with pytest.raises(PartyIsolationError, match="training labels for"):
        lp.use_training_labels(np.zeros(n + 1, dtype=np.int64))


@pytest.mark.parametrize("mechanism, extra", [("rr-prior", {}), ("gradient", {"dp_denoise": "posterior"}),
                                              ("rr", {}), ("alibi", {})])
def test_dp_replaces_no_method_of_the_algorithm_or_its_parties(mechanism: str, extra: dict) -> None:
    run = build_run(_cfg(privacy="dp", epsilon=3.0, dp_mechanism=mechanism, dp_reproducible=True, **extra))
    algo = run.algorithm
    objects = [algo, *algo.parties().values()]
    # an instance attribute that shadows a method of the class is a replaced method
    shadowed = [(type(o).__name__, name) for o in objects for name, value in vars(o).items()
                if callable(value) and callable(getattr(type(o), name, None))]
    assert shadowed == []


def test_rr_prior_releases_stage_two_before_its_epoch_through_the_runner() -> None:
    seen: list = []
    summary = run_training(_cfg(privacy="dp", epsilon=3.0, dp_mechanism="rr-prior", dp_reproducible=True),
                           progress=False, log=lambda *_: None, on_build=seen.append)
    layer = next(layer for layer in seen[0].net.layers if layer.name == "dp")
    assert layer.staged.stage2_done and layer.staged.stage2_epoch == 1
    assert summary["privacy"]["released"]["stages"]["stage2_released"] is True
