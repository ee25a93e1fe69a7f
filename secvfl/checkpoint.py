"""Checkpoints of a run: every party's state, the network's and the run's, once per epoch, committed by a pointer.

Layout of ``RUN/checkpoints/``::

    latest.json      {"epoch": N, "dir": "epoch-NNNN"}: the commit point, written last and atomically
    epoch-NNNN/      party-<name>.pt   one file per party (each party keeps its own state: model, optimiser,
                                       generators, counters)
                     network.pt        byte counters, protocol layers' and aggregation's state
                     rng.pt            the process-wide torch and numpy generators
                     run.json          epoch, step, metrics history, wall time, the SHA-256 of every file above,
                                       and a checksum of its own content

The digests and the checksum detect corruption (a damaged disk, a truncated copy, an edited byte), not tampering:
they are unkeyed, so whoever can write the run directory can rewrite a file and its digests alike. A checkpoint is
as trustworthy as the directory it is read from (a party's own state files likewise, whose digests the coordinator's
checkpoint records).

A checkpoint is written into a hidden staging directory that is renamed to ``epoch-NNNN`` once every file is on
disk; only then does ``latest.json`` name it. A crash at any point therefore leaves ``latest.json`` naming a
complete directory. The previous checkpoint is kept beside the latest (older ones are deleted), so a latest that
was damaged on disk afterwards can be replaced by it: ``secvfl train --resume RUN --from-epoch N`` (``--from-epoch 0``
starts the run again from its beginning, in its directory). Every damaged,
truncated or missing file is reported with its path and what to do, never as a traceback.

Nothing secret beyond a party's own model and optimiser is written: session keys of the secure channel and
masking keys are renewed at every epoch boundary instead (see :meth:`secvfl.transport.layers.Layer.start_epoch`),
and the secure DP generator's key never leaves the process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from secvfl.errors import ConfigError, SecvflError
from secvfl.io import fsync_dir, jsonable, torch_bytes, torch_load, write_bytes_atomic, write_json_atomic
from secvfl.runlock import resume_command

if TYPE_CHECKING:
    from secvfl.runner import Run

__all__ = [
    "Restored",
    "save_checkpoint",
    "load_checkpoint",
    "latest_epoch",
    "has_checkpoint",
    "discard_after",
    "NoCheckpointError",
    "read_party_states",
]

_PREFIX = "epoch-"
_STAGING = ".staging-"


class NoCheckpointError(ConfigError):
    """The run directory holds no checkpoint at all (the run stopped before its first epoch ended)."""


@dataclass
class Restored:
    epoch: int
    history: list[dict]
    wall_seconds: float


def _dir_name(epoch: int) -> str:
    return f"{_PREFIX}{epoch:04d}"


def _epoch_dirs(ck: Path) -> dict[int, Path]:
    out = {}
    for p in ck.glob(f"{_PREFIX}*"):
        suffix = p.name.removeprefix(_PREFIX)
        if p.is_dir() and suffix.isdigit():
            out[int(suffix)] = p
    return out


def has_checkpoint(run_dir: Path) -> bool:
    ck = Path(run_dir) / "checkpoints"
    return (ck / "latest.json").exists() or bool(_epoch_dirs(ck))


# -- saving -------------------------------------------------------------------------------------------------------
def _global_rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)),
                                                      "pos": int(pos), "has_gauss": int(has_gauss),
                                                      "cached_gaussian": float(cached)}}


def _set_global_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))


def _checksum(meta: dict[str, Any]) -> str:
    """SHA-256 of run.json's content (without this field), so that a damaged run.json is detected too (not a
    tampered one: the digest is unkeyed, see the module docstring)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def save_checkpoint(run_dir: Path, epoch: int, run: Run, history: list[dict], wall: float) -> None:
    """Write the state after ``epoch`` finished epochs and commit it (see the module docstring)."""
    ck = Path(run_dir) / "checkpoints"
    final = ck / _dir_name(epoch)
    staging = ck / f"{_STAGING}{_dir_name(epoch)}"
    shutil.rmtree(staging, ignore_errors=True)
    state = run.algorithm.state_dict()
    blobs = {f"party-{name}.pt": torch_bytes(pstate) for name, pstate in state["parties"].items()}
    blobs["network.pt"] = torch_bytes(run.net.state_dict())
    blobs["rng.pt"] = torch_bytes(_global_rng_state())
    for name, data in blobs.items():
        write_bytes_atomic(staging / name, data)
    extra = {k: v for k, v in state.items() if k not in ("parties", "step")}
    meta = json.loads(json.dumps({
        "epoch": epoch, "step": state["step"], "history": history, "wall_seconds": wall, "extra": extra,
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()},
    }, default=jsonable))
    write_json_atomic(staging / "run.json", {**meta, "checksum": _checksum(meta)})
    if final.exists():  # a stale directory of an epoch trained again (after --from-epoch): never committed now
        shutil.rmtree(final)
    os.replace(staging, final)
    fsync_dir(ck)
    write_json_atomic(ck / "latest.json", {"epoch": epoch, "dir": final.name})  # the commit point
    earlier = [e for e in _epoch_dirs(ck) if e < epoch]
    keep = {epoch, max(earlier)} if earlier else {epoch}
    for e, path in _epoch_dirs(ck).items():
        if e not in keep:
            shutil.rmtree(path, ignore_errors=True)
    for path in ck.glob(f"{_STAGING}*"):
        shutil.rmtree(path, ignore_errors=True)


# -- loading ------------------------------------------------------------------------------------------------------
# run.json's fields before checksums were written; a run.json without a checksum may hold only these
_LEGACY_FIELDS = frozenset({"epoch", "step", "history", "wall_seconds", "extra", "files"})


class _Damaged(Exception):
    def __init__(self, path: Path, why: str) -> None:
        super().__init__(why)
        self.path, self.why = path, why


def _read_meta(target: Path) -> dict[str, Any]:
    meta_path = target / "run.json"
    try:
        meta = json.loads(meta_path.read_text())
        if not (isinstance(meta["epoch"], int) and isinstance(meta["step"], int) and isinstance(meta["history"], list)):
            raise TypeError
    except FileNotFoundError:
        raise _Damaged(meta_path, "missing") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise _Damaged(meta_path, "not a valid run.json") from None
    if "checksum" in meta:
        if meta.pop("checksum") != _checksum(meta):
            raise _Damaged(meta_path, "corrupt: its content does not match its checksum")
    elif set(meta) - _LEGACY_FIELDS:  # older checkpoints have no checksum, but only these fields: a renamed field
        raise _Damaged(meta_path, "corrupt: its checksum field is missing")  # (one damaged byte) is not one of them
    for name, digest in meta.get("files", {}).items():
        path = target / name
        try:
            data = path.read_bytes()
        except OSError:
            raise _Damaged(path, "missing or unreadable") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise _Damaged(path, "corrupt or truncated: its SHA-256 does not match run.json")
    return meta


def _load_file(path: Path) -> Any:
    try:
        return torch_load(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read a checkpoint file means it is damaged
        raise _Damaged(path, f"unreadable ({type(exc).__name__})") from None


def _intact(ck: Path) -> list[int]:
    """Epochs whose checkpoint directory passes the integrity check, newest first."""
    good = []
    for e, path in sorted(_epoch_dirs(ck).items(), reverse=True):
        try:
            _read_meta(path)
        except _Damaged:
            continue
        good.append(e)
    return good


def _advice(run_dir: Path, others: list[int], which: str = "the previous checkpoint") -> str:
    if others:
        return (f"{which} (epoch {others[0]}) is intact: resume from it with "
                f"`{resume_command(run_dir, '--from-epoch', str(others[0]))}`")
    # never "remove the directory": it may hold a DP release ledger, the only record of the privacy already spent
    return (f"no intact checkpoint is left: start the run again from its beginning, in its directory, with "
            f"`{resume_command(run_dir, '--from-epoch', '0')}`")


def latest_epoch(run_dir: Path) -> int:
    """The epoch ``latest.json`` commits (clear errors when there is none or it is damaged)."""
    run_dir = Path(run_dir)
    ck = run_dir / "checkpoints"
    latest = ck / "latest.json"
    if not latest.exists():
        intact = _intact(ck)
        if intact:
            raise ConfigError(f"{latest} is missing, but checkpoints exist: resume one with "
                              f"`{resume_command(run_dir, '--from-epoch', str(intact[0]))}`")
        if _epoch_dirs(ck):
            raise ConfigError(f"{latest} is missing and every checkpoint in {ck} is damaged; " + _advice(run_dir, []))
        raise NoCheckpointError(
            f"{run_dir}: no checkpoint yet (the run stopped before finishing its first epoch); "
            f"`{resume_command(run_dir)}` starts it again from its beginning"
        )
    try:
        pointer = json.loads(latest.read_text())
        epoch = int(pointer["epoch"])
        if pointer["dir"] != _dir_name(epoch):
            raise ValueError
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise ConfigError(f"checkpoint pointer {latest} is damaged (not the JSON this run wrote); "
                          + _advice(run_dir, _intact(ck), "the newest checkpoint")) from None
    return epoch


def load_checkpoint(run_dir: Path, run: Run, *, epoch: int | None = None, count_since_build: bool = False) -> Restored:
    """Restore ``run`` from the checkpoint after ``epoch`` finished epochs (default: the one ``latest.json`` names).

    ``count_since_build``: add what the rebuilt run already sent (a secure-channel handshake) to the restored byte
    counters instead of overwriting it, so that a resumed run counts every byte it sent.
    """
    run_dir = Path(run_dir)
    ck = run_dir / "checkpoints"
    if epoch is None:
        epoch = latest_epoch(run_dir)
    target = ck / _dir_name(epoch)
    if not target.is_dir():
        available = sorted(_intact(ck))
        raise ConfigError(f"--from-epoch {epoch}: {run_dir} has no checkpoint of epoch {epoch}; intact checkpoints: "
                          f"{available or 'none'}")
    try:
        meta = _read_meta(target)
        names = list(meta.get("files") or [p.name for p in target.glob("*.pt")])
        parties = {n.removeprefix("party-").removesuffix(".pt"): _load_file(target / n)
                   for n in names if n.startswith("party-")}
        network = _load_file(target / "network.pt")
        rng = _load_file(target / "rng.pt") if "rng.pt" in names else None
    except _Damaged as exc:
        others = [e for e in _intact(ck) if e != epoch]
        which = "the previous checkpoint" if others and others[0] < epoch else "the checkpoint"
        raise ConfigError(f"checkpoint file {exc.path} is damaged ({exc.why}); "
                          + _advice(run_dir, others, which)) from None
    try:
        run.algorithm.load_state_dict({"step": meta["step"], "parties": parties, **meta.get("extra", {})})
        sent_since_build = run.net.stats.state_dict()
        run.net.load_state_dict(network)
        if count_since_build:
            restored = run.net.stats.state_dict()
            run.net.stats.load_state_dict({
                field: {k: restored[field].get(k, 0) + sent_since_build[field].get(k, 0)
                        for k in restored[field].keys() | sent_since_build[field].keys()}
                for field in restored
            })
        if rng is not None:
            _set_global_rng_state(rng)
    except SecvflError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checkpoint of another configuration: say so, not a traceback
        raise ConfigError(f"checkpoint {target} does not fit this run's configuration ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160] if str(exc) else 'no detail'}); was config.toml edited?"
                          ) from None
    return Restored(int(meta["epoch"]), list(meta["history"]), float(meta.get("wall_seconds", 0.0)))


def read_party_states(run_dir: Path) -> tuple[int, dict[str, Any]]:
    """The epoch of the committed checkpoint and every party's state in it (checked like :func:`load_checkpoint`),
    without a run to load them into: what serving a trained run reads (secvfl.serve)."""
    run_dir = Path(run_dir)
    ck = run_dir / "checkpoints"
    epoch = latest_epoch(run_dir)
    target = ck / _dir_name(epoch)
    try:
        meta = _read_meta(target)
        names = list(meta.get("files") or [p.name for p in target.glob("*.pt")])
        parties = {n.removeprefix("party-").removesuffix(".pt"): _load_file(target / n)
                   for n in names if n.startswith("party-")}
    except _Damaged as exc:
        raise ConfigError(f"checkpoint file {exc.path} is damaged ({exc.why}); restore the run directory from a "
                          "backup") from None
    return epoch, parties


def discard_after(run_dir: Path, epoch: int) -> None:
    """Make ``epoch`` the committed checkpoint and delete later ones (resuming from an earlier epoch; 0: from the
    beginning, every checkpoint deleted)."""
    ck = Path(run_dir) / "checkpoints"
    if epoch == 0:
        (ck / "latest.json").unlink(missing_ok=True)
    else:
        write_json_atomic(ck / "latest.json", {"epoch": epoch, "dir": _dir_name(epoch)})
    for e, path in _epoch_dirs(ck).items():
        if e > epoch:
            shutil.rmtree(path, ignore_errors=True)
