"""The attack harness: train (or load) a run while recording the attacker's view, run an attack, score it.

A training run here is exactly ``secvfl train`` (:func:`secvfl.runner.run_training`) with one addition: the network
records the attacker party's view (every message it sent and received, after the protocol layers), which is
annotated with the row ids of each batch -- the attacker computes those itself from the shared batch seed -- and
saved next to the run as ``attack-view-<party>.svfl`` (the project's wire format, no pickle), so ``--run DIR`` can
attack a finished run again.

Ground truth (labels, the target party's features) is read from the run's dataset only to *score* attacks.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attacks.base import ATTACKS, LABEL_INFERENCE, Attack, AttackResult, RunOutline
from attacks.feature_reconstruction import NOT_LINEAR, EquationSolving, GenerativeRegressionNetwork, GRNConfig
from attacks.label_inference import DirectionScoring, DirectLabelInference, NormScoring, sample_known_labels
from attacks.malicious_optimizer import MaliciousOptimizer
from attacks.metrics import randomized_response_ceiling
from attacks.model_completion import CompletionConfig, PassiveModelCompletion
from attacks.observations import GradientBatch, observe_gradients
from secvfl.config import TrainConfig
from secvfl.device import device_here
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
    "outline_run",
    "outline_of",
    "check_attack",
    "check_run",
    "check_out_dir",
    "make_out_dir",
    "short_dataset_name",
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
    if name == "dp":  # the gradient mechanism, whatever --dp-mechanism auto would choose for the task
        return {"privacy": "dp", "epsilon": number(), "dp_mechanism": "gradient"}
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
    """Protocol plugin name -> {option dest: default} (the algorithm families' options are no defences)."""
    from secvfl.plugins import option_defaults

    return option_defaults()


def check_defence_available(options: dict[str, Any], spec: str) -> None:
    known = {dest for d in _plugin_defaults().values() for dest in d}
    missing = sorted(k for k in options if k not in known)
    if missing:
        raise UnsupportedError(f"defence {spec!r} needs train options {missing}, which no protocol in this build "
                               f"provides")


def undefended(cfg: TrainConfig) -> TrainConfig:
    """The same run with every protocol (defence) option at its default: the MP* reference."""
    options = dict(cfg.options)
    for defaults in _plugin_defaults().values():
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


# --- what attacks need of a run, known before it trains ----------------------------------------------------------------


def short_dataset_name(spec: str) -> str:
    """A dataset spec as a person reads it: ``csv:/data/2024/loans.csv:default`` -> ``loans.csv``."""
    kind, _, rest = spec.partition(":")
    if kind in ("csv", "idx", "svmlight") and rest:
        # Path(...).name drops the folders (and a Windows drive); what follows a ':' in the name is csv's label.
        return Path(rest.split(",")[0]).name.split(":")[0] or spec
    return spec


def _is_split_model(algo_cls: type) -> bool:
    from secvfl.algorithms.split import FDML, VAFL, SplitNN

    return issubclass(algo_cls, (SplitNN, VAFL, FDML))


def _linear_config(cfg: TrainConfig, aggregation: str) -> bool:
    # fdml's head ("sum") only adds a bias, so --head-hidden does not apply to it.
    return cfg.bottom == "mlp" and not cfg.hidden and (not cfg.head_hidden or aggregation == "sum")


def _feature_parties(algo_cls: type, n_blocks: int) -> tuple[str, ...]:
    from secvfl.transport.layers import Role

    return tuple(p for p, role in algo_cls.party_roles(n_blocks).items() if role == Role.FEATURE)


def outline_run(cfg: TrainConfig) -> RunOutline:
    """What attacks need to know of the run ``cfg`` describes, without building it: the algorithm's traits and, from
    the raw data (read once, without splitting, standardising or building a model), the number of classes."""
    from secvfl.algorithms import get_algorithm
    from secvfl.data import load_raw

    algo_cls = get_algorithm(cfg.algo)
    _, raw = load_raw(cfg.dataset, cfg.data_dir)
    return RunOutline(cfg.algo, algo_cls.traits, _is_split_model(algo_cls), short_dataset_name(cfg.dataset),
                      len(raw.classes), _feature_parties(algo_cls, cfg.parties),
                      linear=_linear_config(cfg, algo_cls.traits.aggregation),
                      image_parties=raw.image_shape is not None and cfg.image_split != "columns")


def outline_of(run: Any) -> RunOutline:
    """The outline of a built (e.g. loaded) run."""
    cfg, algo_cls, part = run.cfg, type(run.algorithm), run.ctx.partition
    return RunOutline(cfg.algo, algo_cls.traits, _is_split_model(algo_cls), short_dataset_name(cfg.dataset),
                      run.ctx.data.n_classes, _feature_parties(algo_cls, part.n_blocks),
                      linear=_linear_config(cfg, algo_cls.traits.aggregation),
                      image_parties=all(shape is not None for shape in part.block_shapes))


def attack_class(name: str) -> type[Attack]:
    """The attack registered as ``name`` (importing this module registers every built-in attack)."""
    if name not in ATTACKS:
        raise ConfigError(f"unknown attack {name!r}; choose one of {', '.join(ATTACKS.names())}")
    return ATTACKS.get(name)


def check_attack(outline: RunOutline, attack: str, *, attacker: str | None = None, target: str | None = None,
                 **options: Any) -> None:
    """Refuse (one line: why, what instead) an attack, with its options, attacker and target, that cannot serve the
    run. ``attacker``: the feature party of a label inference attack; ``target``: the feature party whose features
    a reconstruction attack wants."""
    cls = attack_class(attack)
    cls.check(outline, **options)
    parties = ", ".join(outline.feature_parties) or "(none)"
    if attacker is not None and cls.family == LABEL_INFERENCE and attacker not in outline.feature_parties:
        raise ConfigError(f"--attacker {attacker!r} is not a feature party; label inference attackers are the feature "
                          f"parties {parties}")
    if target is not None and target not in outline.feature_parties:
        raise ConfigError(f"--target {target!r} is not a feature party; the feature parties are {parties}")


def check_run(cfg: TrainConfig, attacks: Sequence[str], *, attacker: str | None = None, target: str | None = None,
              **options: Any) -> RunOutline:
    """Check, before anything is built or trained, that every attack can serve the run ``cfg`` describes."""
    outline = outline_run(cfg)
    for name in attacks:
        check_attack(outline, name, attacker=attacker, target=target, **options)
    return outline


# --- the output directory ---------------------------------------------------------------------------------------------


def check_out_dir(out: Path, what: str = "--out") -> None:
    """Refuse, without creating anything, an output directory that cannot be created or would overwrite results.

    ``what`` names the directory in the message: the flag that gave it, or e.g. "the default output directory".
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{what} {out} is a file; give a directory (--out DIR) to hold the runs, the summary and "
                          "the plots")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"{what} {out} already holds files; give a new or empty directory (--out DIR) so that "
                          "nothing is overwritten")
    ancestor = out.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{what} {out}: {ancestor} is a file, so the directory cannot be created there")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {out}: {ancestor} is not writable; give another directory with --out")


def make_out_dir(out: Path, what: str = "--out") -> Path:
    """Create the output directory (checked again: time may have passed since the first check)."""
    check_out_dir(out, what)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what} {out}: cannot create the directory ({exc.strerror or exc}); give another "
                          "directory with --out") from None
    return out


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
                   malicious_gamma: float | None = None, log: Callable[[str], None] = print,
                   attacks: Sequence[str] = (), attack_options: dict[str, Any] | None = None,
                   progress: bool = False) -> RecordedRun:
    """Train like ``secvfl train`` while recording ``attacker``'s view; optionally make it malicious (active MC).

    ``attacks`` (names, with ``attack_options``) are checked against the run before anything is built or written,
    so a combination they cannot serve costs no training. ``progress``: the runner's progress bar.
    """
    from secvfl.runner import run_training

    if attacks:
        outline = outline_run(cfg)
        for name in attacks:
            check_attack(outline, name, attacker=attacker, **(attack_options or {}))
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

    summary = run_training(cfg, out=run_dir, progress=progress, log=log, on_build=on_build)
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
    run = build_run(replace(cfg, device=device_here(cfg.device)))  # a run trained on a GPU, read on any machine
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


# Label mechanisms that are pure epsilon-label-DP: no attacker guesses a label better than randomized response at
# the same epsilon, e^eps / (e^eps + K - 1) (the gradient mechanism is (epsilon, delta)-DP and has no such ceiling).
_PURE_LABEL_DP = ("rr", "rr-prior", "alibi")


def _rr_ceiling(run: Any, n_classes: int) -> float | None:
    """The ceiling of the run's label-DP mechanism as the run resolved it (``auto`` included), or None."""
    for layer in run.net.describe().get("layers", []):
        if layer.get("layer") == "dp" and layer.get("protects") == "labels" and layer.get("mechanism") in _PURE_LABEL_DP:
            return randomized_response_ceiling(float(layer["epsilon"]), max(n_classes, 2))
    return None


def label_inference(rec: RecordedRun, attack: str, *, known_positives: int = 1, known_scope: str = "batch",
                    seed: int = 0) -> tuple[AttackResult, Any]:
    """Run a gradient-based label inference attack; returns the result and the attack object (for plots)."""
    if attack not in ("norm", "direction", "direct"):
        raise ConfigError(f"unknown gradient attack {attack!r}; choose norm, direction or direct")
    check_attack(outline_of(rec.run), attack, attacker=rec.attacker, known_positives=known_positives)
    data = rec.run.ctx.data
    y = data.y_train
    obs = gradient_observations(rec)
    if attack == "norm":
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
    else:
        obj = DirectLabelInference()
        result = obj.run(gradients=obs, labels=y)
    ceiling = _rr_ceiling(rec.run, data.n_classes)
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

    check_attack(outline_of(rec.run), name, attacker=rec.attacker, known_labels=tuple(known_sizes),
                 method=config.method if config else "auto")
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
    check_attack(outline_of(rec.run), attack, target=target)
    names = [fp.name for fp in rec.run.algorithm.feature_parties]
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
            raise UnsupportedError(NOT_LINEAR.format(algo=algo.name))
    weight = np.zeros((w_perm.shape[0], d))
    weight[:, order] = w_perm  # back to dataset column order
    return weight, b
