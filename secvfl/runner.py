"""`run_training`: the one entry point that turns a :class:`TrainConfig` into a finished, checkpointed run.

It does the seeding and the I/O; algorithms and protocol layers do neither. Run directory layout::

    config.toml       resolved configuration          metrics.jsonl   one line per finished epoch
    summary.json      final metrics, bytes, timing    checkpoints/    latest.json -> epoch-NNNN/ (see secvfl.checkpoint)
    curves.png        loss and validation metric per epoch

A resumed run restores every party's, layer's and generator's state from the last checkpoint and ends with the
metrics and byte counts of an uninterrupted run; keys that must not be written to disk are renewed at every epoch
boundary by both (``Network.start_epoch``). A training loss that is not finite stops the run at once.
``$SECVFL_KILL_AT_BATCH=N`` (a test hook) makes the process SIGKILL itself after the N-th training batch.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import torch

from secvfl.algorithms import get_algorithm
from secvfl.algorithms.base import Algorithm, RunContext
from secvfl.checkpoint import (
    NoCheckpointError,
    discard_after,
    has_checkpoint,
    latest_epoch,
    load_checkpoint,
    save_checkpoint,
)
from secvfl.config import TrainConfig
from secvfl.data import Dataset, block_miss_probabilities, draw_masks, load_dataset, make_partition
from secvfl.data.partition import Partition
from secvfl.errors import ConfigError, TrainingDiverged
from secvfl.io import write_json_atomic, write_text_atomic
from secvfl.plugins import ProtocolSetup, configure_protocols
from secvfl.rundir import check_out_dir, check_run_contents, write_curves, writing
from secvfl.runlock import lock_run_dir, resume_command
from secvfl.transport.network import Network

__all__ = [
    "run_training",
    "build_run",
    "Run",
    "resolve_device",
    "load_config_file",
    "read_run_config",
    "RESUME_CHANGES",
    "KILL_AT_BATCH_ENV",
    "limit_threads",
]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA GPU is available; use --device cpu or auto")
    return torch.device(name)


def limit_threads(n: int) -> None:
    """``--threads`` bounds torch's intra-op pool and numpy/scipy's BLAS pools alike.

    The linear algorithms spend their time in BLAS, which otherwise starts one thread per core and, on a machine
    shared with other jobs, runs far slower than with one (an a9a ExtraGradient run on 2 shared cores: 299 s with
    BLAS's default threads, 26 s with one).
    """
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    threadpool_limits(limits=n)  # process-wide, like torch.set_num_threads (not used as a context manager)


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


def build_run(cfg: TrainConfig, prepared: tuple[Dataset, Partition] | None = None, *, local: str | None = None
              ) -> Run:
    """Load data, draw masks, assemble the protocol stack and build the algorithm's parties (no training).

    ``prepared``: the data and its partition, instead of loading ``cfg.dataset`` (a deployed party whose columns
    come from its own file, secvfl.deploy.data). ``local``: the one party this process acts for when the parties
    run in separate processes (secvfl.deploy); the protocol layers then set up that party's state only (its own
    keys)."""
    limit_threads(cfg.threads)
    _seed_everything(cfg.seed)
    algo_cls = get_algorithm(cfg.algo)
    if prepared is None:
        data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, val_fraction=cfg.val_fraction,
                            nan_policy=cfg.nan_policy)
        partition = make_partition(data.n_features, cfg.parties, image_shape=data.image_shape,
                                   image_split=cfg.image_split, channels=data.image_channels)
    else:
        data, partition = prepared
    data, masks, notes = _masks(data, cfg, partition.n_blocks)
    data.notes.extend(notes)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    ctx = RunContext(cfg, data, partition, masks, resolve_device(cfg.device), dtype)
    setups = configure_protocols(cfg, algo_cls.traits, ctx)
    layers = [layer for _, layer in sorted((lp for s in setups for lp in s.layers), key=lambda t: t[0])]
    aggregation = next((s.aggregation for s in setups if s.aggregation is not None), None)
    roles = algo_cls.party_roles(partition.n_blocks)
    if aggregation is not None:
        roles.update(aggregation.extra_roles())
    net = Network(roles, layers=layers, aggregation=aggregation, traits=algo_cls.traits, local=local)
    torch.manual_seed(cfg.seed)
    algorithm = algo_cls(ctx, net)
    net.guard.declare_widths(algorithm.message_widths())
    # a party's own non-finite output is stopped before it is sent, with the cause a non-finite loss would give
    net.guard.divergence_cause = lambda: _divergence_cause(algorithm.step_size(), _non_finite_cells(ctx.data))
    for s in setups:
        for hook in s.attach:
            hook(algorithm)
    return Run(cfg, ctx, net, algorithm, setups)


# -- checkpoints (secvfl.checkpoint) ----------------------------------------------------------------------------
def _load_checkpoint(run_dir: Path, run: Run) -> tuple[int, list[dict], float]:
    """Restore ``run`` from the latest checkpoint of ``run_dir`` (for reading a finished run: predict, attacks)."""
    restored = load_checkpoint(Path(run_dir), run)
    return restored.epoch, restored.history, restored.wall_seconds


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


# -- run directories -------------------------------------------------------------------------------------------
# What a resumed run may change (README, Training, "Resuming"): more epochs extend it; where the data lives, how
# many threads it uses and which device it trains on are properties of the machine, not of the run (a run trained on
# a GPU goes on on a machine without one, and back); a DP run may be allowed a larger epsilon than planned when
# releases repeated after a crash would exceed the plan. Every other setting is refused.
RESUME_CHANGES = ("epochs", "data_dir", "threads", "device", "dp_accept_epsilon")
# Test hook (tests/test_resume_kill.py): the process sends itself SIGKILL right after this training batch, counted
# from the first batch of the run (batches before a resume point included), to test recovery from a real crash.
KILL_AT_BATCH_ENV = "SECVFL_KILL_AT_BATCH"


def read_run_config(run_dir: Path) -> TrainConfig:
    path = run_dir / "config.toml"
    if not path.is_file():
        if not run_dir.is_dir():
            raise ConfigError(f"--resume {run_dir}: no such directory; give the directory of the run to continue")
        if any(run_dir.iterdir()):
            raise ConfigError(f"--resume {run_dir}: not a run directory (no config.toml), and it holds other files; "
                              "give the directory of the run to continue, or start a new run in a new directory "
                              "(--out)")
        raise ConfigError(f"--resume {run_dir}: not a run directory (no config.toml: it is empty); start a new run "
                          f"with `secvfl train --out {run_dir}`")
    return TrainConfig.from_dict(load_config_file(path))


def _resumable(run_dir: Path, from_epoch: int | None, changes: dict[str, Any]) -> tuple[TrainConfig, int]:
    """The configuration a resumed run continues with, and the epochs it has done (0: it starts again from its
    beginning, having stopped before its first checkpoint, or ``--from-epoch 0``); refuses what cannot resume."""
    saved = read_run_config(run_dir)
    unknown = sorted(set(changes) - set(RESUME_CHANGES))
    if unknown:
        raise ConfigError(f"a resumed run can change only {', '.join(RESUME_CHANGES)}, not {', '.join(unknown)}")
    core = {k: v for k, v in changes.items() if k in TrainConfig.__dataclass_fields__}
    options = {k: v for k, v in changes.items() if k not in core}  # a protocol's flag
    cfg = replace(saved, **core, options={**saved.options, **options}) if changes else saved
    if from_epoch is not None:
        done = int(from_epoch)
    else:
        try:
            done = latest_epoch(run_dir)
        except NoCheckpointError:  # killed before its first checkpoint: it starts again from its beginning (in its
            done = 0  # directory, where a DP release ledger counts what the killed process released)
    if done > cfg.epochs:
        raise ConfigError(f"--epochs {cfg.epochs}: {run_dir} has already trained {done} epochs; a resumed run can "
                          f"only train longer (--epochs {done} or more)")
    if from_epoch is None and done == cfg.epochs and (run_dir / "summary.json").is_file():
        raise ConfigError(f"--resume {run_dir}: the run already finished its {done} epoch{'s' * (done != 1)} (see "
                          f"summary.json); to train it longer, give more epochs: "
                          f"`{resume_command(run_dir, '--epochs', str(2 * done))}`")
    return cfg, done


def _kill_at_batch() -> int | None:
    text = os.environ.get(KILL_AT_BATCH_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ConfigError(f"${KILL_AT_BATCH_ENV} must be a batch number, got {text!r}; unset it")
    return int(text)


def _non_finite_inputs(run: Run) -> int:
    """Cells of the training data that are not finite after preprocessing (a diverged run blames them, not a step
    size: e.g. values near +-1e308 overflow when standardised)."""
    return _non_finite_cells(run.ctx.data)


def _non_finite_cells(data: Dataset) -> int:
    return int(np.size(data.X_train) - np.count_nonzero(np.isfinite(data.X_train)))


def _divergence_cause(step_size: tuple[str, float] | None, bad_cells: int = 0) -> str:
    """Why a run's own computation diverged, and the fix. It names a step-size flag only when the algorithm has one
    and the training data were finite; peers' non-finite messages are refused by the receiving party, naming the
    sender, before any loss sees them. Used for a non-finite loss (:func:`_diverged`) and for a party's own
    non-finite output, which it refuses to send (:meth:`secvfl.transport.guard.ReceiveGuard.check_sent`)."""
    if bad_cells:
        return (f"The training data hold {bad_cells} non-finite value(s) after preprocessing (values near +-1e308 "
                "overflow when the columns are standardised); fix or remove them in the data")
    if step_size is None:
        return ("Its step sizes follow from the problem, so the data probably hold huge values or the problem is "
                "badly conditioned; check the data")
    flag, lr = step_size
    return (f"The step size is probably too large ({flag} {lr:g}) or the data hold huge values; start again "
            f"with a smaller {flag} (e.g. {lr / 10:g}) or check the data")


def _diverged(step_size: tuple[str, float] | None, run_dir: Path | None, epoch: int, batch: int | None,
              loss: float, bad_cells: int = 0) -> TrainingDiverged:
    """The one line a run whose loss became non-finite stops with (see :func:`_divergence_cause`)."""
    where = f"epoch {epoch + 1}" + (f", batch {batch}" if batch is not None else "")
    kept = f"; {run_dir} keeps the metrics and checkpoint of epoch {epoch}" if run_dir is not None and epoch else ""
    return TrainingDiverged(f"training stopped: the loss became {loss} at {where}. "
                            f"{_divergence_cause(step_size, bad_cells)}{kept}")


# -- the run -------------------------------------------------------------------------------------------------
def run_training(cfg: TrainConfig, out: str | Path | None = None, *, resume: str | Path | None = None,
                 from_epoch: int | None = None, changes: dict[str, Any] | None = None, progress: bool = True,
                 log=print, on_build=None, build: Callable[[TrainConfig], Run] | None = None,
                 summary_extra: Callable[[], dict[str, Any]] | None = None, resume_as: str | None = None
                 ) -> dict[str, Any]:
    """Train, evaluate and write the run directory ``out`` (None: write nothing); returns the summary dictionary.

    ``resume``: continue the run in that directory from its latest checkpoint (``from_epoch``: from the one after
    that many epochs; later ones are discarded). ``cfg`` is then ignored: the run's own config.toml is used, with
    ``changes`` (keys of :data:`RESUME_CHANGES`) applied; a larger ``epochs`` extends the run, also a finished one.
    ``on_build(run)``, if given, is called once the run is assembled (and restored, on resume), before training:
    e.g. to record a party's view for an attack. ``build`` assembles the run (default :func:`build_run`; the parties
    in separate processes of :mod:`secvfl.deploy` build it with remote handles); ``summary_extra()`` adds entries to
    the summary. ``resume_as``: the command that continues this run, for the hints the run prints (default
    ``secvfl train --resume DIR``; a deployed label party's is its ``secvfl party`` or ``secvfl launch`` command).

    The run directory is locked for the run's life (:mod:`secvfl.runlock`): a second process writing it is refused.
    """
    changes = dict(changes or {})
    run_dir = Path(resume) if resume is not None else Path(out) if out is not None else None
    if resume is None and from_epoch is not None:
        raise ConfigError("--from-epoch applies only with --resume DIR")
    if resume is None and changes:
        raise ConfigError("changes apply only to a resumed run (resume=DIR)")
    train = dict(resume=resume is not None, from_epoch=from_epoch, changes=changes, progress=progress, log=log,
                 on_build=on_build, build=build, summary_extra=summary_extra)
    if run_dir is None:
        return _train(cfg, None, **train)
    if resume is not None:
        read_run_config(run_dir)  # a directory that holds no run is refused before anything is created in it
    else:
        check_out_dir(run_dir, cfg, resume_as)
    # one process at a time writes a run directory, for the run's whole life (secvfl.runlock)
    with lock_run_dir(run_dir, resume_as, flag="--resume" if resume is not None else "--out"):
        if resume is not None:
            cfg, _ = _resumable(run_dir, from_epoch, changes)
        else:
            check_run_contents(run_dir, cfg, resume_as)  # again, under the lock: another process may have written it
        return _train(cfg, run_dir, **train)


def _train(cfg: TrainConfig, run_dir: Path | None, *, resume: bool, from_epoch: int | None, changes: dict[str, Any],
           progress: bool, log, on_build, build: Callable[[TrainConfig], Run] | None,  # noqa: ANN001
           summary_extra: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    """:func:`run_training` once the run directory (if any) is locked and checked."""
    run = (build or build_run)(cfg)
    start_epoch, history, wall_before = 0, [], 0.0
    # a resumed run with no checkpoint (stopped before its first one, or --from-epoch 0) starts from its beginning
    again = resume and (from_epoch == 0 or (from_epoch is None and not has_checkpoint(run_dir)))
    if resume and not again:
        restored = load_checkpoint(run_dir, run, epoch=from_epoch, count_since_build=True)
        start_epoch, history, wall_before = restored.epoch, restored.history, restored.wall_seconds
    for hook in (h for s in run.setups for h in s.on_start):
        hook(run_dir, start_epoch)  # may refuse to go on; nothing in the run directory has been written yet
    if resume:
        with writing(run_dir):
            if from_epoch is not None:
                discard_after(run_dir, from_epoch)
            if changes:
                write_text_atomic(run_dir / "config.toml", tomli_w.dumps(_toml_safe(cfg.to_dict())))
            write_text_atomic(run_dir / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
        if again:
            log(f"resuming {run_dir} from its beginning (no checkpoint to continue from), {cfg.epochs} epochs")
        else:
            log(f"resuming {run_dir} after epoch {start_epoch} of {cfg.epochs}")
    elif run_dir is not None:
        with writing(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(run_dir / "config.toml", tomli_w.dumps(_toml_safe(cfg.to_dict())))
        log(f"run directory: {run_dir} (continue an interrupted run with `{resume_command(run_dir)}`)")
    if on_build is not None:
        on_build(run)
    for note in run.ctx.data.notes:
        log(f"  data: {note}")

    t0 = time.perf_counter()
    kill_at = _kill_at_batch()
    per_epoch = run.algorithm.batches_per_epoch()
    # a training loss only one party may read (label DP: computed from the true labels) is handed to it, shown nowhere
    keepers = [s.private_loss for s in run.setups if s.private_loss is not None]
    bar = None
    if progress and sys.stderr.isatty():  # a redirected log gets one line per epoch, not carriage returns
        from tqdm import tqdm

        bar = tqdm(total=cfg.epochs * per_epoch, initial=start_epoch * per_epoch, desc=f"{cfg.algo} {cfg.dataset}",
                   unit="batch", file=sys.stderr, dynamic_ncols=True, leave=False)
    try:
        for epoch in range(start_epoch, cfg.epochs):
            torch.manual_seed(cfg.seed * 100_003 + epoch)  # each epoch's randomness depends on (seed, epoch) only
            run.net.start_epoch(epoch)
            if bar is not None:
                bar.set_description(f"{cfg.algo} epoch {epoch + 1}/{cfg.epochs}")
            batch = 0

            def tick(loss: float, epoch: int = epoch) -> None:
                nonlocal batch
                batch += 1
                if not math.isfinite(loss):
                    raise _diverged(run.algorithm.step_size(), run_dir, epoch, batch, loss, _non_finite_inputs(run))
                if bar is not None:
                    bar.update(1)
                    if not keepers:
                        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                if kill_at is not None and epoch * per_epoch + batch == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            for hook in (h for s in run.setups for h in s.before_epoch):
                hook(epoch)
            train = run.algorithm.train_epoch(epoch, tick)
            if not math.isfinite(train["loss"]):
                raise _diverged(run.algorithm.step_size(), run_dir, epoch, None, train["loss"],
                                _non_finite_inputs(run))
            val = run.algorithm.evaluate("val")
            row = {"epoch": epoch + 1, "train_loss": None if keepers else train["loss"],
                   **{f"val_{k}": v for k, v in val.items()}, "bytes_total": run.net.stats.bytes_total}
            row.update(run.algorithm.epoch_record())
            for keep in keepers:
                keep(epoch + 1, train["loss"])
            history.append(row)
            key, value = _primary(val)
            shown = "private" if keepers else f"{train['loss']:.4f}"
            val_name = run.algorithm.val_name  # "val", or "prequential" for an online run's block
            if bar is not None:
                bar.set_postfix(loss=shown, **{f"{val_name}_{key}": f"{value:.4f}"})
            else:
                log(f"epoch {epoch + 1}/{cfg.epochs} loss {shown} {val_name} {key} {value:.4f}")
            if run_dir is not None:
                elapsed = wall_before + time.perf_counter() - t0
                with writing(run_dir):
                    write_text_atomic(run_dir / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
                    save_checkpoint(run_dir, epoch + 1, run, history, elapsed)
    finally:
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
    summary.update(run.algorithm.report(run_dir))
    for s in run.setups:
        summary.update(s.summary() if callable(s.summary) else s.summary)
    for hook in (h for s in run.setups for h in s.on_summary):
        hook(summary)
    if summary_extra is not None:
        summary.update(summary_extra())
    if run_dir is not None:
        with writing(run_dir):
            write_json_atomic(run_dir / "summary.json", summary)
            write_curves(run_dir / "curves.png", history, cfg, run.algorithm.val_name)
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
