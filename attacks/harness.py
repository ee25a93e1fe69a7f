"""The attack harness: train (or load) a run while recording the attacker's view, run an attack, score it.

A training run here is exactly ``secvfl train`` (:func:`secvfl.runner.run_training`) with one addition: the network
records the attacker party's view (every message it sent and received, after the protocol layers), which is
annotated with the row ids of each batch -- the attacker computes those itself from the shared batch seed -- and
saved next to the run as ``attack-view-<party>.svfl`` (the project's wire format, no pickle), so ``--run DIR`` can
attack a finished run again.

Ground truth (labels, the target party's features) is read from the run's dataset only to *score* attacks.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attacks.base import AttackResult
from attacks.feature_reconstruction import EquationSolving, GenerativeRegressionNetwork, GRNConfig
from attacks.label_inference import DirectionScoring, DirectLabelInference, NormScoring, sample_known_labels
from attacks.malicious_optimizer import MaliciousOptimizer
from attacks.metrics import randomized_response_ceiling
from attacks.model_completion import CompletionConfig, PassiveModelCompletion
from attacks.observations import GradientBatch, observe_gradients
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError, DataError, UnsupportedError
from secvfl.messages import decode, encode
from secvfl.transport.network import View

__all__ = [
    "RecordedRun",
    "train_recorded",
    "load_recorded",
    "save_view",
    "load_view",
    "defence_options",
    "undefended",
    "main_task",
    "gradient_observations",
    "label_inference",
    "model_completion",
    "feature_reconstruction",
    "LABEL_ATTACKS",
]

LABEL_ATTACKS = ("norm", "direction", "direct", "model-completion", "active-model-completion")
_VIEW_MAGIC = b"SVFLVIEW"


# --- defences as train options -----------------------------------------------------------------------------------------


def defence_options(spec: str) -> dict[str, Any]:
    """Train options of a defence given as ``none``, ``dp:EPS``, ``rr:EPS``, ``dpf:EPS`` (feature DP), ``ckks``,
    ``mask``, ``topk:RATIO``."""
    name, _, arg = spec.partition(":")

    def number() -> float:
        try:
            value = float(arg)
        except ValueError:
            raise ConfigError(f"defence {spec!r} needs a number after the colon, e.g. {name}:3") from None
        if not value > 0:
            raise ConfigError(f"defence {spec!r}: the number must be positive")
        return value

    if name == "none" and not arg:
        return {}
    if name == "dp":
        return {"privacy": "dp", "epsilon": number()}
    if name == "rr":
        return {"privacy": "dp", "epsilon": number(), "dp_mechanism": "rr"}
    if name == "dpf":
        return {"privacy": "dp", "epsilon": number(), "dp_protect": "features"}
    if name == "ckks" and not arg:
        return {"he": "ckks"}
    if name == "mask" and not arg:
        return {"secagg": "mask"}
    if name == "topk":
        return {"compress": f"topk:{number()}"}  # both directions: the gradients the attacker sees are top-k
    raise ConfigError(f"unknown defence {spec!r}; use none, dp:EPS, rr:EPS, dpf:EPS, ckks, mask or topk:RATIO")


def _plugin_defaults() -> dict[str, dict[str, Any]]:
    """Protocol plugin name -> {option dest: default}."""
    from protocols.plugins import PROTOCOLS, load_plugins

    load_plugins()
    out = {}
    for name in PROTOCOLS.names():
        p = argparse.ArgumentParser(add_help=False)
        PROTOCOLS.get(name).add_arguments(p)
        out[name] = {a.dest: a.default for a in p._actions}
    return out


_NOT_DEFENCES = {"missing-features"}  # plugins that change the algorithm, not what crosses the boundaries


def check_defence_available(options: dict[str, Any], spec: str) -> None:
    known = {dest for d in _plugin_defaults().values() for dest in d}
    missing = sorted(k for k in options if k not in known)
    if missing:
        raise UnsupportedError(f"defence {spec!r} needs train options {missing}, which no protocol in this build "
                               f"provides")


def undefended(cfg: TrainConfig) -> TrainConfig:
    """The same run with every protocol (defence) option at its default: the MP* reference."""
    options = dict(cfg.options)
    for name, defaults in _plugin_defaults().items():
        if name not in _NOT_DEFENCES:
            for dest, default in defaults.items():
                if dest in options:
                    options[dest] = default
    return replace(cfg, options=options)


def is_defended(cfg: TrainConfig) -> bool:
    return undefended(cfg).options != cfg.options


def main_task(metrics: dict[str, float]) -> tuple[str, float]:
    """The main-task performance (MP): test ROC AUC for binary tasks, accuracy otherwise."""
    auc = metrics.get("auc")
    if auc is not None and math.isfinite(auc):
        return "auc", float(auc)
    if "accuracy" in metrics:
        return "accuracy", float(metrics["accuracy"])
    raise DataError(f"the run reported no accuracy or AUC (metrics {sorted(metrics)})")


# --- recorded views ---------------------------------------------------------------------------------------------------


def save_view(view: View, path: Path) -> None:
    """Write a view as length-prefixed wire-format messages (direction byte: 0 sent, 1 received)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        party = view.party.encode()
        f.write(_VIEW_MAGIC + struct.pack("<H", len(party)) + party)
        for direction, messages in ((0, view.sent), (1, view.received)):
            for m in messages:
                data = encode(m)
                f.write(struct.pack("<BQ", direction, len(data)))
                f.write(data)
    tmp.replace(path)


def load_view(path: Path) -> View:
    data = memoryview(Path(path).read_bytes())
    if bytes(data[: len(_VIEW_MAGIC)]) != _VIEW_MAGIC:
        raise DataError(f"{path} is not a recorded secvfl view")
    off = len(_VIEW_MAGIC)
    (n,) = struct.unpack_from("<H", data, off)
    off += 2
    view = View(bytes(data[off : off + n]).decode())
    off += n
    while off < len(data):
        direction, length = struct.unpack_from("<BQ", data, off)
        off += struct.calcsize("<BQ")
        msg = decode(data[off : off + length])
        off += length
        (view.sent if direction == 0 else view.received).append(msg)
    return view


# --- training and loading runs ----------------------------------------------------------------------------------------


@dataclass
class RecordedRun:
    """A trained run and what its attacker saw."""

    cfg: TrainConfig
    run: Any  # secvfl.runner.Run
    attacker: str
    view: View | None
    summary: dict[str, Any]
    run_dir: Path | None

    @property
    def mp(self) -> tuple[str, float]:
        return main_task(self.summary["metrics"]["test"])

    @property
    def party_index(self) -> int:
        names = [fp.name for fp in getattr(self.run.algorithm, "feature_parties", [])]
        if self.attacker not in names:
            raise ConfigError(f"{self.attacker!r} is not a feature party of this run; feature parties are {names}")
        return names.index(self.attacker)


def _batch_ids(run: Any, cfg: TrainConfig) -> list[np.ndarray]:
    """The row ids of every training batch, as the attacker computes them from the shared batch seed."""
    from secvfl.algorithms.base import batch_ids

    algo = run.algorithm
    rows = algo.train_rows() if hasattr(algo, "train_rows") else run.ctx.rows("train")
    return [b for epoch in range(cfg.epochs) for b in batch_ids(rows, cfg.batch_size, cfg.seed, epoch)]


def _annotate(view: View, ids: list[np.ndarray]) -> View:
    """The attacker's own annotation of its view: which rows each received gradient belongs to."""
    grads = view.received_of("gradient")
    if len(grads) != len(ids):
        raise DataError(f"the attacker received {len(grads)} gradient messages over {len(ids)} batches; the harness "
                        "pairs them one to one and cannot attack this algorithm's gradients")
    it = iter(ids)
    received = [m.replace(meta={**m.meta, "ids": next(it).tolist()}, wire_size=m.wire_size) if m.kind == "gradient"
                else m for m in view.received]
    return View(view.party, list(view.sent), received)


def _view_path(run_dir: Path, attacker: str) -> Path:
    return run_dir / f"attack-view-{attacker}.svfl"


def train_recorded(cfg: TrainConfig, attacker: str = "party0", *, run_dir: Path | None = None,
                   malicious_gamma: float | None = None, log: Callable[[str], None] = print) -> RecordedRun:
    """Train like ``secvfl train`` while recording ``attacker``'s view; optionally make it malicious (active MC)."""
    from secvfl.runner import run_training

    held: dict[str, Any] = {}

    def on_build(run: Any) -> None:
        if attacker not in run.net.topology.roles:
            raise ConfigError(f"--attacker {attacker!r} is not a party of this run; parties are "
                              f"{sorted(run.net.topology.roles)}")
        held["run"], held["view"] = run, run.net.record(attacker)
        if malicious_gamma is not None:
            party = run.algorithm.parties()[attacker]
            if not hasattr(party, "optimizer"):
                raise UnsupportedError(f"{attacker} has no optimiser to make malicious")
            party.optimizer = MaliciousOptimizer(party.optimizer, gamma=malicious_gamma)

    summary = run_training(cfg, out=run_dir, progress=False, log=log, on_build=on_build)
    run, view = held["run"], held["view"]
    if view.received_of("gradient"):
        view = _annotate(view, _batch_ids(run, cfg))
    if run_dir is not None:
        save_view(view, _view_path(run_dir, attacker))
    return RecordedRun(cfg, run, attacker, view, summary, run_dir)


def load_recorded(run_dir: Path, attacker: str = "party0") -> RecordedRun:
    """A finished run directory: its configuration, restored parties, summary and (if recorded) attacker view."""
    from secvfl.runner import _load_checkpoint, build_run, load_config_file

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file() or not (run_dir / "summary.json").is_file():
        raise ConfigError(f"--run {run_dir}: not a finished run directory (needs config.toml and summary.json)")
    cfg = TrainConfig.from_dict(load_config_file(run_dir / "config.toml"))
    run = build_run(cfg)
    _load_checkpoint(run_dir, run)
    summary = json.loads((run_dir / "summary.json").read_text())
    path = _view_path(run_dir, attacker)
    view = load_view(path) if path.is_file() else None
    return RecordedRun(cfg, run, attacker, view, summary, run_dir)


# --- running attacks --------------------------------------------------------------------------------------------------


def gradient_observations(rec: RecordedRun) -> list[GradientBatch]:
    if rec.view is None or not rec.view.received_of("gradient"):
        where = f" in {rec.run_dir}" if rec.run_dir else ""
        raise DataError(f"no recorded gradients of {rec.attacker}{where}: gradient attacks need a run trained by "
                        "`secvfl attack` (which records the attacker's view); train one with --dir instead of --run")
    return observe_gradients(rec.view)


def _rr_ceiling(cfg: TrainConfig, n_classes: int) -> float | None:
    if cfg.option("privacy") == "dp" and cfg.option("dp_mechanism") == "rr" and cfg.option("epsilon"):
        return randomized_response_ceiling(float(cfg.option("epsilon")), max(n_classes, 2))
    return None


def label_inference(rec: RecordedRun, attack: str, *, known_positives: int = 1, known_scope: str = "batch",
                    seed: int = 0) -> tuple[AttackResult, Any]:
    """Run a gradient-based label inference attack; returns the result and the attack object (for plots)."""
    data = rec.run.ctx.data
    y = data.y_train
    obs = gradient_observations(rec)
    if attack == "norm":
        if data.n_classes != 2:
            raise UnsupportedError("norm scoring is a binary attack; use --attack direction or direct for "
                                   f"{data.n_classes} classes")
        obj: Any = NormScoring()
        result = obj.run(gradients=obs, labels=y)
    elif attack == "direction":
        if known_scope not in ("batch", "run"):
            raise ConfigError(f"--known-scope must be batch or run, got {known_scope!r}")
        count = {"per_batch": known_positives} if known_scope == "batch" else {"total": known_positives}
        known = sample_known_labels(obs, y, positives_only=data.n_classes == 2, seed=seed, **count)
        obj = DirectionScoring()
        result = obj.run(gradients=obs, labels=y, known=known, n_classes=data.n_classes, seed=seed)
        result.details.update(known_scope=known_scope, known_per_scope=known_positives)
    elif attack == "direct":
        if rec.run.algorithm.traits.forward_kinds != ("logits",):
            raise UnsupportedError(f"direct label inference reads gradients w.r.t. logits; {rec.cfg.algo} parties send "
                                   f"{list(rec.run.algorithm.traits.forward_kinds)} (use --algo fdml)")
        obj = DirectLabelInference()
        result = obj.run(gradients=obs, labels=y)
    else:
        raise ConfigError(f"unknown gradient attack {attack!r}; choose norm, direction or direct")
    ceiling = _rr_ceiling(rec.cfg, data.n_classes)
    if ceiling is not None:
        result.details["rr_ceiling"] = ceiling
    result.details["attacker"] = rec.attacker
    return result, obj


def known_label_ids(y: np.ndarray, n: int, n_classes: int, seed: int) -> dict[int, int]:
    """N training rows whose labels the attacker knows: stratified (N // C per class, rest at random)."""
    rng = np.random.default_rng([seed, 17])
    if n > len(y):
        raise DataError(f"asked for {n} known labels but the training split has {len(y)} rows")
    chosen: list[int] = []
    per_class = n // n_classes
    for c in range(n_classes):
        pool = np.flatnonzero(y == c)
        chosen += rng.choice(pool, size=min(per_class, len(pool)), replace=False).tolist()
    rest = np.setdiff1d(np.arange(len(y)), chosen)
    chosen += rng.choice(rest, size=n - len(chosen), replace=False).tolist()
    return {int(i): int(y[i]) for i in chosen}


def model_completion(rec: RecordedRun, known_sizes: Sequence[int], *, config: CompletionConfig | None = None,
                     seed: int = 0, baselines: bool = True, name: str = "model-completion") -> list[AttackResult]:
    """Passive model completion with each number of known labels, on the attacker's own bottom model and rows."""
    from attacks.model_completion import ActiveModelCompletion

    k = rec.party_index
    data, part = rec.run.ctx.data, rec.run.ctx.partition
    bottom = rec.run.algorithm.feature_parties[k].model
    cls = ActiveModelCompletion if name == "active-model-completion" else PassiveModelCompletion
    attack = cls(config or CompletionConfig(seed=seed), image_shape=part.block_shapes[k], baselines=baselines)
    x_train, x_test = part.take(data.X_train, k), part.take(data.X_test, k)
    results = []
    for n in known_sizes:
        known = known_label_ids(data.y_train, n, data.n_classes, seed)
        r = attack.run(bottom=bottom, features=x_train, known=known, labels=data.y_train, n_classes=data.n_classes,
                       test_features=x_test, test_labels=data.y_test)
        r.details["attacker"] = rec.attacker
        results.append(r)
    return results


# --- feature reconstruction -------------------------------------------------------------------------------------------


def _white_box_model(rec: RecordedRun, target: int, dtype: torch.dtype = torch.float32):  # noqa: ANN202
    """model(x_known, x_target) -> class probabilities, built from every party's trained model (Luo et al.)."""
    import copy

    from secvfl.parties import probabilities

    algo = rec.run.algorithm
    part = rec.run.ctx.partition
    bottoms = [copy.deepcopy(fp.model).to("cpu", dtype).eval() for fp in algo.feature_parties]
    head = copy.deepcopy(algo.label_party.head).to("cpu", dtype).eval()
    n_classes = rec.run.ctx.data.n_classes
    aggregation = algo.traits.aggregation
    known_blocks = [k for k in range(part.n_blocks) if k != target]
    widths = [len(part.blocks[k]) for k in known_blocks]

    def model(x_known: torch.Tensor, x_target: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(x_known.to(dtype), widths, dim=1)
        inputs: list[torch.Tensor] = [None] * part.n_blocks  # type: ignore[list-item]
        for k, piece in zip(known_blocks, pieces, strict=True):
            inputs[k] = piece
        inputs[target] = x_target.to(dtype)
        outs = [b(x) for b, x in zip(bottoms, inputs, strict=True)]
        if aggregation == "concat":
            logits = head(outs)
        elif aggregation in ("sum", "mean"):
            total = torch.stack(outs).sum(dim=0)
            logits = head(total / len(outs) if aggregation == "mean" else total)
        else:
            raise UnsupportedError(f"feature reconstruction needs a split model (splitnn, vafl, fdml), not {rec.cfg.algo}")
        return probabilities(logits, n_classes)

    return model, known_blocks


def feature_reconstruction(rec: RecordedRun, attack: str, target: str, *, grn: GRNConfig | None = None,
                           rows: int = 0, seed: int = 0) -> AttackResult:
    """Reconstruct ``target``'s test-split features from the federation's prediction scores (attacker: label party,
    white-box, holding every other party's features)."""
    names = [fp.name for fp in rec.run.algorithm.feature_parties]
    if target not in names:
        raise ConfigError(f"--target {target!r} is not a feature party; feature parties are {names}")
    t = names.index(target)
    data, part = rec.run.ctx.data, rec.run.ctx.partition
    scores = rec.run.algorithm.predict_proba("test")  # what the federation returns to the label party
    x = data.X_test
    idx = np.arange(len(x))
    if rows and rows < len(idx):
        idx = np.sort(np.random.default_rng([seed, 29]).choice(len(idx), rows, replace=False))
    tgt_cols = part.blocks[t]
    known_cols = np.concatenate([part.blocks[k] for k in range(part.n_blocks) if k != t])
    truth = x[idx][:, tgt_cols]
    # Assumed attacker knowledge: each target feature's range (min/max over training rows) to scale to [0, 1].
    bounds = (data.X_train[:, tgt_cols].min(axis=0), data.X_train[:, tgt_cols].max(axis=0))
    if attack == "grn":
        model, _ = _white_box_model(rec, t)
        result = GenerativeRegressionNetwork(grn or GRNConfig(seed=seed)).run(
            model=model, x_adv=x[idx][:, known_cols], scores=scores[idx], target_features=truth, bounds=bounds)
    elif attack == "equation":
        weight, bias = _linear_model(rec, part.n_blocks)
        n_out = weight.shape[0]
        v = scores[idx][:, 1:2] if n_out == 1 else scores[idx]
        result = EquationSolving().run(weight=weight, bias=bias, x_adv=x[idx][:, known_cols], scores=v,
                                       adv_columns=known_cols.tolist(), target_columns=tgt_cols.tolist(),
                                       target_features=truth, bounds=bounds)
    else:
        raise ConfigError(f"unknown feature reconstruction attack {attack!r}; choose grn or equation")
    result.details.update(target=target, target_columns=int(len(tgt_cols)), rows=int(len(idx)))
    return result


def _linear_model(rec: RecordedRun, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The effective (weight, bias) of the whole model on the full feature vector; refuses a non-linear model."""
    model, _ = _white_box_model(rec, n_blocks - 1, dtype=torch.float64)
    part = rec.run.ctx.partition
    order = np.concatenate([part.blocks[k] for k in range(n_blocks)])  # model input order: known blocks, then target
    d = len(order)
    last = len(part.blocks[n_blocks - 1])
    algo = rec.run.algorithm
    n_classes = rec.run.ctx.data.n_classes

    def logits(z: np.ndarray) -> np.ndarray:
        p = model(torch.as_tensor(z[:, : d - last]), torch.as_tensor(z[:, d - last :])).detach().numpy()
        p = np.clip(p, 1e-300, None)
        if n_classes == 2:
            return (np.log(p[:, 1]) - np.log(p[:, 0]))[:, None]
        return np.log(p) - np.log(p[:, -1:])  # softmax logits up to a per-row constant

    with torch.no_grad():
        basis = np.vstack([np.zeros((1, d)), 1e-2 * np.eye(d)])
        z = logits(basis)
        w_perm = (z[1:] - z[0]).T / 1e-2
        b = z[0]
        probe = np.random.default_rng(0).normal(size=(16, d))
        if not np.allclose(logits(probe), probe @ w_perm.T + b, atol=1e-6 * (1 + np.abs(z).max())):
            raise UnsupportedError(
                f"equation solving needs a logistic-regression-type (linear) model; this {algo.name} model is not "
                "linear. Train with --hidden '' --head-hidden '' (linear bottoms and head), or use --attack grn"
            )
    weight = np.zeros((w_perm.shape[0], d))
    weight[:, order] = w_perm  # back to dataset column order
    return weight, b
