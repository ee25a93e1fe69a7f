"""The lock a process holds on a run directory for the life of its run, and the command that continues that run.

Why ``flock`` on a lock file inside the directory: the kernel releases the lock when the process ends, however it
ends (``kill -9`` and power loss included), so a crashed run never leaves a stale lock that a user would have to
find and delete, as a PID file created with ``O_EXCL`` would; and a second process learns at once, without waiting,
that the directory is taken. The holder writes its process id into the file, so the one line the second writer gets
names it. The lock is advisory: it keeps secvfl processes apart (readers such as ``secvfl predict`` need none). On
network file systems ``flock`` works where the server supports locks (NFSv4, or NLM on Linux since 2.6.12).

A run that holds its lock also says how it continues (:func:`resume_command`): ``secvfl train --resume DIR`` for a
run in one process, ``secvfl launch --resume BASE`` for a launched federation, ... Every hint secvfl prints about
continuing a run asks this module, so that each hint is a command that works as printed.

Deliberately small (no torch, no numpy): the CLI's interrupt handler imports it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from secvfl.errors import ConfigError

__all__ = ["LOCK_FILE", "RunLock", "lock_run_dir", "resume_command", "held_runs", "interrupted_hint"]

LOCK_FILE = ".secvfl.lock"


class RunLock:
    """An exclusive lock on ``run_dir``, held until :meth:`release` (or the process's end)."""

    def __init__(self, run_dir: Path, fd: int, created: list[Path], resume: str, started: Path | None = None) -> None:
        self.run_dir = run_dir
        self.resume = resume  # the command that continues this run
        self.started = started or run_dir  # the directory whose config.toml says that the run has started
        self._fd: int | None = fd
        self._created = created  # directories this lock created (deepest first), removed again if left unused

    def release(self) -> None:
        """Give the lock up. Directories it created are removed again while the run wrote nothing into them (the
        run's settings were refused before it started): an invalid command leaves no trace."""
        if self._fd is None:
            return
        _held.pop(self.run_dir.absolute(), None)
        try:
            if self._created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
                (self.run_dir / LOCK_FILE).unlink()
                for folder in self._created:
                    folder.rmdir()
        except OSError:
            pass  # left in place: an empty directory, harmless
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        global _interrupted
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            _interrupted = self  # the CLI's interrupt message says how this run continues
        self.release()


_held: dict[Path, RunLock] = {}
_interrupted: RunLock | None = None


def lock_run_dir(run_dir: Path, resume: str | None = None, *, flag: str = "--out", started: Path | None = None
                 ) -> RunLock:
    """Create ``run_dir`` if needed and lock it for this process; a ConfigError naming the holder's process id if
    another process holds it. ``resume``: the command that continues the run (default ``secvfl train --resume``);
    ``started``: where the run's config.toml appears once it has started (default ``run_dir``; a launch: its label
    party's directory)."""
    run_dir = Path(run_dir)
    created = []
    folder = run_dir.absolute()
    while not folder.exists():
        created.append(folder)
        folder = folder.parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"{flag} {run_dir}: cannot create its lock file ({exc.strerror or exc}); use a writable "
                          "location") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        who = f"process {holder}" if holder.isdigit() else "another process"
        raise ConfigError(f"{flag} {run_dir} is in use: secvfl {who} is writing a run there (it holds "
                          f"{run_dir / LOCK_FILE}); wait for it to end (or stop it: kill {holder or 'PID'}), or "
                          "choose another directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    lock = RunLock(run_dir, fd, created, resume or f"secvfl train --resume {run_dir}", started)
    _held[run_dir.absolute()] = lock
    return lock


def resume_command(run_dir: Path, *flags: str) -> str:
    """The command that continues the run in ``run_dir`` (with ``flags`` added), as the process running it said when
    it took the lock; ``secvfl train --resume DIR`` otherwise."""
    lock = _held.get(Path(run_dir).absolute())
    base = lock.resume if lock is not None else f"secvfl train --resume {run_dir}"
    return " ".join([base, *flags])


def held_runs() -> list[RunLock]:
    """The runs this process holds the lock of (newest last)."""
    return list(_held.values())


def interrupted_hint() -> str:
    """What the CLI says after Ctrl-C: how the interrupted run continues, if one was interrupted after it started."""
    lock = _interrupted or (held_runs()[-1] if _held else None)
    if lock is None:
        return "interrupted"
    if not (lock.started / "config.toml").is_file():
        return f"interrupted before the run in {lock.run_dir} started; nothing to continue: run the command again"
    return (f"interrupted; `{lock.resume}` continues the run from its last checkpoint (from its beginning if it had "
            "none yet)")
