"""Run directories: their default name, the checks before a run starts, writes that fail clearly, and curves.png."""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from secvfl.checkpoint import has_checkpoint
from secvfl.config import TrainConfig
from secvfl.errors import ConfigError
from secvfl.plotting import new_figure, save_figure_atomic

__all__ = ["RUNS_DIR_ENV", "runs_root", "dataset_label", "default_run_dir", "check_out_dir", "writing", "write_curves"]


def dataset_label(name: str) -> str:
    """A short, file-name-safe name for a dataset spec: ``csv:/data/credit.csv.gz:default`` -> ``csv-credit``."""
    kind, sep, rest = name.partition(":")
    if sep:
        target = rest.split(",")[0]  # svmlight:PATH[,TEST]
        if kind == "csv":
            target = target.split(":")[0]  # csv:PATH[:LABEL]
        stem = Path(target.rstrip("/\\")).name.split(".")[0]
        name = f"{kind}-{stem}" if stem else kind
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._-")[:40] or "data"


RUNS_DIR_ENV = "SECVFL_RUNS_DIR"


def runs_root() -> Path:
    """Where commands put their output when no --out is given: ``$SECVFL_RUNS_DIR``, else ``runs`` here."""
    return Path(os.environ.get(RUNS_DIR_ENV) or "runs")


def default_run_dir(cfg: TrainConfig, root: str | Path | None = None) -> Path:
    """A fresh ``runs/<algo>-<dataset>-<YYYYmmdd-HHMMSS>`` directory name (suffixed -2, -3... if taken)."""
    stem = f"{dataset_label(cfg.algo)}-{dataset_label(cfg.dataset)}-{time.strftime('%Y%m%d-%H%M%S')}"
    base = (runs_root() if root is None else Path(root)) / stem
    path, n = base, 2
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def check_out_dir(run_dir: Path) -> None:
    """Refuse, before any data is loaded, a run directory that cannot be created or written."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} is an existing file; name a directory (it is created if needed)")
    if run_dir.is_dir() and has_checkpoint(run_dir):
        raise ConfigError(f"{run_dir} already holds a run; use --resume {run_dir} to continue it, or another --out")
    existing = run_dir.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {run_dir}: {existing} is a file, so no directory can be created under it; "
                          "choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {run_dir}: {existing} is not writable (read-only file system or no permission); "
                          "choose a writable directory")
    # Try it: /proc and the like pass the permission check (for root) but refuse.
    if existing == run_dir.absolute():
        try:
            fd, probe = tempfile.mkstemp(dir=run_dir, prefix=".secvfl-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(f"--out {run_dir}: cannot create files there ({exc.strerror}); choose a directory on "
                              "a writable disk") from None
        return
    try:
        run_dir.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(f"--out {run_dir}: cannot create a directory under {existing} ({exc.strerror}); "
                          "choose a directory on a writable disk") from None
    created = run_dir.absolute()
    while created != existing:  # removed again: the run creates it once its settings proved valid
        created.rmdir()
        created = created.parent


@contextmanager
def writing(run_dir: Path) -> Iterator[None]:
    """Turn a failed write into the run directory (disk full, read-only, /proc...) into one clear line."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ConfigError(f"cannot write the run directory {run_dir}: {exc.strerror or exc}{where}; "
                          "use a writable location (--out) with free space") from None


def write_curves(path: Path, history: list[dict], cfg: TrainConfig) -> None:
    """``curves.png``: the training loss and the validation metric per epoch (written atomically).

    A run whose training loss is private (label DP: it is computed from the true labels) has no loss panel.
    """
    epochs = [h["epoch"] for h in history]
    panels = []
    if history and all(h.get("train_loss") is not None for h in history):
        panels.append(("train_loss", "training loss (batch mean)", "training loss", "tab:blue"))
    metric = next((k for k in ("val_auc", "val_accuracy") if history and all(k in h for h in history)), None)
    if metric:
        panels.append((metric, metric[4:], f"validation {metric[4:]}", "tab:green"))
    fig = new_figure((4.5 * max(1, len(panels)), 3.4))
    axes = fig.subplots(1, max(1, len(panels)), squeeze=False)[0]
    for ax, (key, ylabel, title, colour) in zip(axes, panels, strict=False):
        ax.plot(epochs, [h[key] for h in history], marker="o", color=colour)
        ax.set(xlabel="epoch", ylabel=ylabel, title=title)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"{cfg.algo} on {dataset_label(cfg.dataset)}: {cfg.parties} parties, batch {cfg.batch_size}, "
                 f"lr {cfg.lr:g}, seed {cfg.seed}", fontsize=10)
    save_figure_atomic(fig, path)
