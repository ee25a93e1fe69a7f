"""`run_training`: the one entry point that turns a :class:`TrainConfig` into a finished, checkpointed run.

It does the seeding and the I/O; algorithms and protocol layers do neither. Run directory layout::

    config.toml       resolved configuration          metrics.jsonl   one line per finished epoch
    summary.json      final metrics, bytes, timing    checkpoints/    latest.json -> epoch-NNNN/ (one file per party)
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import torch

from protocols.plugins import ProtocolSetup, configure_protocols
from secvfl.algorithms import get_algorithm
from secvfl.algorithms.base import Algorithm, RunContext
from secvfl.config import TrainConfig
from secvfl.data import Dataset, block_miss_probabilities, draw_masks, load_dataset, make_partition
from secvfl.errors import ConfigError
from secvfl.io import torch_load, torch_save_atomic, write_json_atomic, write_text_atomic
from secvfl.transport.network import Network

__all__ = ["run_training", "build_run", "Run", "resolve_device", "load_config_file"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA GPU is available; use --device cpu or auto")
    return torch.device(name)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def _masks(data: Dataset, cfg: TrainConfig, k: int) -> tuple[Dataset, dict[str, np.ndarray], list[str]]:
    """Draw observed-block masks per split and drop rows with no observed block (counted in the notes)."""
    rng = np.random.default_rng([cfg.seed, 101])
    probs = {"train": block_miss_probabilities(k, cfg.p_miss_train, rng)}
    probs["test"] = block_miss_probabilities(k, cfg.p_miss_test, rng)
    probs["val"] = probs["test"]
    masks, notes = {}, []
    for split in ("train", "val", "test"):
        X, y = getattr(data, f"X_{split}"), getattr(data, f"y_{split}")
        m = draw_masks(len(y), k, probs[split], rng)
        keep = m.any(axis=1)
        if not keep.all():
            notes.append(f"missing blocks: dropped {int((~keep).sum())} {split} rows with no observed block")
            setattr(data, f"X_{split}", X[keep])
            setattr(data, f"y_{split}", y[keep])
        masks[split] = m[keep]
        if split != "val":
            notes.append(f"missing blocks ({split}): per-block p_miss {np.round(probs[split], 3).tolist()}")
    return data, masks, notes


@dataclass
class Run:
    cfg: TrainConfig
    ctx: RunContext
    net: Network
    algorithm: Algorithm
    setups: list[ProtocolSetup]


def build_run(cfg: TrainConfig) -> Run:
    """Load data, draw masks, assemble the protocol stack and build the algorithm's parties (no training)."""
    torch.set_num_threads(cfg.threads)
    _seed_everything(cfg.seed)
    algo_cls = get_algorithm(cfg.algo)
    data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, val_fraction=cfg.val_fraction,
                        nan_policy=cfg.nan_policy)
    partition = make_partition(data.n_features, cfg.parties, image_shape=data.image_shape, image_split=cfg.image_split)
    data, masks, notes = _masks(data, cfg, partition.n_blocks)
    data.notes.extend(notes)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    ctx = RunContext(cfg, data, partition, masks, resolve_device(cfg.device), dtype)
    setups = configure_protocols(cfg, algo_cls.traits, ctx)
    layers = [layer for _, layer in sorted((lp for s in setups for lp in s.layers), key=lambda t: t[0])]
    aggregation = next((s.aggregation for s in setups if s.aggregation is not None), None)
    roles = algo_cls.party_roles(partition.n_blocks)
    if aggregation is not None and hasattr(aggregation, "extra_roles"):
        roles.update(aggregation.extra_roles())
    net = Network(roles, layers=layers, aggregation=aggregation, traits=algo_cls.traits)
    torch.manual_seed(cfg.seed)
    algorithm = algo_cls(ctx, net)
    for s in setups:
        for hook in s.attach:
            hook(algorithm)
    return Run(cfg, ctx, net, algorithm, setups)


# -- checkpoints ---------------------------------------------------------------------------------------------
def _save_checkpoint(run_dir: Path, epoch: int, run: Run, history: list[dict], wall: float) -> None:
    ck = run_dir / "checkpoints"
    target = ck / f"epoch-{epoch:04d}"
    state = run.algorithm.state_dict()
    for name, pstate in state["parties"].items():  # one file per party: each party keeps its own state
        torch_save_atomic(target / f"party-{name}.pt", pstate)
    torch_save_atomic(target / "network.pt", run.net.state_dict())
    write_json_atomic(target / "run.json", {"epoch": epoch, "step": state["step"], "history": history,
                                            "wall_seconds": wall, "extra": {k: v for k, v in state.items()
                                                                            if k not in ("parties", "step")}})
    write_json_atomic(ck / "latest.json", {"epoch": epoch, "dir": target.name})  # the commit point
    for old in ck.glob("epoch-*"):
        if old.name != target.name:
            shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(run_dir: Path, run: Run) -> tuple[int, list[dict], float]:
    ck = run_dir / "checkpoints"
    latest = ck / "latest.json"
    if not latest.is_file():
        raise ConfigError(f"--resume {run_dir}: no checkpoint found (expected {latest})")
    target = ck / json.loads(latest.read_text())["dir"]
    meta = json.loads((target / "run.json").read_text())
    parties = {p.name.removeprefix("party-").removesuffix(".pt"): torch_load(p) for p in target.glob("party-*.pt")}
    run.algorithm.load_state_dict({"step": meta["step"], "parties": parties, **meta.get("extra", {})})
    run.net.load_state_dict(torch_load(target / "network.pt"))
    return int(meta["epoch"]), list(meta["history"]), float(meta.get("wall_seconds", 0.0))


def load_config_file(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None


def _primary(metrics: dict[str, float]) -> tuple[str, float]:
    for key in ("auc", "accuracy"):
        if key in metrics:
            return key, metrics[key]
    return "loss", float("nan")


# -- the run -------------------------------------------------------------------------------------------------
def run_training(cfg: TrainConfig, out: str | Path | None = None, *, resume: str | Path | None = None,
                 progress: bool = True, log=print, on_build=None) -> dict[str, Any]:
    """Train, evaluate and write the run directory; returns the summary dictionary.

    ``on_build(run)``, if given, is called once the run is assembled (and restored, on resume), before training:
    e.g. to record a party's view for an attack.
    """
    run_dir = Path(resume or out) if (resume or out) else None
    if resume is not None:
        run_dir = Path(resume)
        saved = load_config_file(run_dir / "config.toml")
        cfg = TrainConfig.from_dict(saved)
    run = build_run(cfg)
    start_epoch, history, wall_before = 0, [], 0.0
    if resume is not None:
        start_epoch, history, wall_before = _load_checkpoint(run_dir, run)
        log(f"resuming {run_dir} after epoch {start_epoch}")
    elif run_dir is not None:
        if (run_dir / "checkpoints" / "latest.json").exists():
            raise ConfigError(f"{run_dir} already holds a run; use --resume {run_dir} to continue it or another --out")
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.toml", tomli_w.dumps(_toml_safe(cfg.to_dict())))
    if on_build is not None:
        on_build(run)
    for note in run.ctx.data.notes:
        log(f"  data: {note}")

    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.epochs * run.algorithm.batches_per_epoch(), initial=start_epoch * run.algorithm.batches_per_epoch(),
                   desc=f"{cfg.algo} {cfg.dataset}", unit="batch", file=sys.stderr, dynamic_ncols=True, leave=False)
    for epoch in range(start_epoch, cfg.epochs):
        torch.manual_seed(cfg.seed * 100_003 + epoch)  # each epoch's randomness depends on (seed, epoch) only
        if bar is not None:
            bar.set_description(f"{cfg.algo} epoch {epoch + 1}/{cfg.epochs}")

        def tick(loss: float) -> None:
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

        train = run.algorithm.train_epoch(epoch, tick)
        val = run.algorithm.evaluate("val")
        row = {"epoch": epoch + 1, "train_loss": train["loss"], **{f"val_{k}": v for k, v in val.items()},
               "bytes_total": run.net.stats.bytes_total}
        history.append(row)
        key, value = _primary(val)
        if bar is not None:
            bar.set_postfix(loss=f"{train['loss']:.4f}", **{f"val_{key}": f"{value:.4f}"})
        else:
            log(f"epoch {epoch + 1}/{cfg.epochs} loss {train['loss']:.4f} val {key} {value:.4f}")
        if run_dir is not None:
            elapsed = wall_before + time.perf_counter() - t0
            write_text_atomic(run_dir / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
            _save_checkpoint(run_dir, epoch + 1, run, history, elapsed)
    if bar is not None:
        bar.close()
    test = run.algorithm.evaluate("test")
    wall = wall_before + time.perf_counter() - t0
    summary: dict[str, Any] = {
        "algo": cfg.algo,
        "dataset": cfg.dataset,
        "parties": cfg.parties,
        "seed": cfg.seed,
        "epochs": cfg.epochs,
        "metrics": {"test": test, "val": history[-1] if history else {}},
        "comm": run.net.stats.to_dict(),
        "protocols": run.net.describe(),
        "data": run.ctx.data.describe(),
        "device": str(run.ctx.device),
        "torch_threads": torch.get_num_threads(),
        "wall_seconds": round(wall, 3),
    }
    for s in run.setups:
        summary.update(s.summary() if callable(s.summary) else s.summary)
    if run_dir is not None:
        write_json_atomic(run_dir / "summary.json", summary)
    texts = [t for s in run.setups for hook in s.on_finish if (t := hook(run_dir))]
    shown = ", ".join(f"{k} {v:.4f}" for k, v in test.items())
    log(f"test: {shown}")
    log(f"communication: {summary['comm']['bytes_total']:,} bytes in {summary['comm']['messages_total']:,} messages; "
        f"wall time {wall:.1f} s" + (f"; results in {run_dir}" if run_dir else ""))
    for t in texts:
        log(t)
    return summary


def _toml_safe(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if v is None:
            continue
        out[k] = _toml_safe(v) if isinstance(v, dict) else v
    return out
