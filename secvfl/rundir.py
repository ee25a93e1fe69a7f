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
from secvfl.runlock import LOCK_FILE, resume_command

__all__ = ["RUNS_DIR_ENV", "runs_root", "dataset_label", "default_run_dir", "check_out_dir", "check_run_contents",
           "writing", "write_curves"]


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


# Settings that say where a run reads its data, how many threads it uses and on which device: properties of the
# machine, not of the run (a resumed run may change them too, secvfl.runner.RESUME_CHANGES).
_MACHINE_SETTINGS = ("data_dir", "threads", "device")


def _settings(cfg: TrainConfig) -> dict:
    d = {k: v for k, v in cfg.to_dict().items() if k not in _MACHINE_SETTINGS and v is not None}
    d["options"] = {k: v for k, v in d["options"].items() if v is not None}
    return d


# Written while a run is set up, before its config.toml (a deployed label party's row alignment); a run that failed
# then left nothing else, and starting it again rewrites them.
_SETUP_FILES = ("alignment.json",)


def _flat(settings: dict) -> dict:
    return {**{k: v for k, v in settings.items() if k != "options"}, **settings["options"]}


def check_run_contents(run_dir: Path, cfg: TrainConfig | None = None, resume: str | None = None) -> None:
    """Refuse to start a run in ``run_dir`` unless it is new, empty, or holds this very run (``cfg``) stopped before
    its first checkpoint. A run never writes into a directory that holds other files, nor over another run.
    ``resume``: the command that continues a run there, for the hints (default: :func:`secvfl.runlock.resume_command`)."""
    if not run_dir.is_dir():
        return

    def continuing(*flags: str) -> str:  # the command that continues the run in run_dir
        return " ".join([resume, *flags]) if resume else resume_command(run_dir, *flags)

    if has_checkpoint(run_dir):
        how = f"continue it with `{continuing()}`"
        if (run_dir / "summary.json").is_file():
            from secvfl.runner import read_run_config  # (the runner imports this module)

            try:
                epochs = read_run_config(run_dir).epochs
                how = f"it has finished; train it longer with `{continuing('--epochs', str(2 * epochs))}`"
            except ConfigError:
                how = "it has finished"
        raise ConfigError(f"--out {run_dir} already holds a run; {how}, or choose another --out")
    entries = sorted(p.name for p in run_dir.iterdir()
                     if p.name not in (LOCK_FILE, *_SETUP_FILES) and not p.name.startswith(".secvfl-"))
    if not entries:
        return
    if "config.toml" in entries:
        from secvfl.runner import read_run_config  # (the runner imports this module)

        try:
            saved = read_run_config(run_dir)
        except ConfigError:
            saved = None
        if saved is not None and (cfg is None or _settings(saved) == _settings(cfg)):
            return  # this run, stopped before its first checkpoint: it starts again (a DP ledger counts its releases)
        if saved is not None:
            a, b = _flat(_settings(saved)), _flat(_settings(cfg))
            changed = ", ".join(f"--{k.replace('_', '-')} {b.get(k)!r} (it has {a.get(k)!r})"
                                for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k))
            raise ConfigError(f"--out {run_dir} holds a run with other settings ({changed}); continue that run with "
                              f"`{continuing()}`, or choose another --out")
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    raise ConfigError(f"--out {run_dir} is not empty ({shown}) and holds no run of these settings; a run never writes "
                      "into a directory that holds other files: choose a new or empty directory")


def check_out_dir(run_dir: Path, cfg: TrainConfig | None = None, resume: str | None = None) -> None:
    """Refuse, before any data is loaded, a run directory that cannot be created or written, or that holds anything
    but this run (:func:`check_run_contents`)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} is an existing file; name a directory (it is created if needed)")
    check_run_contents(run_dir, cfg, resume)
    # Try it: /proc and the like pass the permission check (for root) but refuse. The probe is a private temporary
    # entry in the deepest directory that exists, never the path's own directories: the run creates those once its
    # settings proved valid, and the parties of a launch check sibling directories under one new parent at the same
    # moment (creating and removing the parent raced them). If another process removes the directory found, the
    # walk starts over, a bounded number of times.
    for _ in range(5):
        existing = run_dir.absolute()
        while not existing.exists():
            existing = existing.parent
        if existing.exists() and not existing.is_dir():
            raise ConfigError(f"--out {run_dir}: {existing} is a file, so no directory can be created under it; "
                              "choose another path")
        if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"--out {run_dir}: {existing} is not writable (read-only file system or no "
                              "permission); choose a writable directory")
        try:
            if existing == run_dir.absolute():
                fd, probe = tempfile.mkstemp(dir=existing, prefix=".secvfl-probe-")
                os.close(fd)
                os.unlink(probe)
            else:
                os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".secvfl-probe-"))
            return
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and not existing.exists():
                continue  # removed between the walk and the probe
            what = "files there" if existing == run_dir.absolute() else f"a directory under {existing}"
            raise ConfigError(f"--out {run_dir}: cannot create {what} ({exc.strerror}); choose a directory on a "
                              "writable disk") from None
    raise ConfigError(f"--out {run_dir}: its parent directories keep disappearing while it is checked; choose a "
                      "directory no other process removes")


@contextmanager
def writing(run_dir: Path) -> Iterator[None]:
    """Turn a failed write into the run directory (disk full, read-only, /proc...) into one clear line."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ConfigError(f"cannot write the run directory {run_dir}: {exc.strerror or exc}{where}; "
                          "use a writable location (--out) with free space") from None


def write_curves(path: Path, history: list[dict], cfg: TrainConfig, val_name: str = "val") -> None:
    """``curves.png``: the training loss and the validation metric per epoch (written atomically); ``val_name``: what
    the validation metric is (``prequential``: an online run's block score, each sample scored before learning).

    A run whose training loss is private (label DP: it is computed from the true labels) has no loss panel.
    """
    epochs = [h["epoch"] for h in history]
    panels = []
    if history and all(h.get("train_loss") is not None for h in history):
        panels.append(("train_loss", "training loss (batch mean)", "training loss", "tab:blue"))
    metric = next((k for k in ("val_auc", "val_accuracy") if history and all(k in h for h in history)), None)
    if metric:
        what = "validation" if val_name == "val" else val_name
        panels.append((metric, metric[4:], f"{what} {metric[4:]}", "tab:green"))
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
