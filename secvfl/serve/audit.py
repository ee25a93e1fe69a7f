"""Each party's append-only audit log of serving: which ids it was asked to score, when, and by whom.

A party that serves must be able to tell what was done with its data. Every serving process appends one JSON line
per request it handles to ``RUN_DIR/audit/serving.jsonl`` in its own run directory: the time (UTC), who asked (the
coordinator's federation name; at the label party, the client certificate's name), the request number, what was
done and the entity ids. The file is opened for appending only and never rewritten; each line carries the SHA-256
of the line before it (``prev``), so a line removed or changed afterwards breaks the chain, which
:func:`verify_audit_log` reports (tamper-evident, not tamper-proof: whoever controls the host can rewrite the
whole file; ship it elsewhere if that matters). Lines are flushed as they are written and synced to disk at most
every second and when serving stops, so a crash loses at most the last second of lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from secvfl.errors import ConfigError

__all__ = ["AuditLog", "verify_audit_log", "AUDIT_FILE"]

AUDIT_FILE = Path("audit") / "serving.jsonl"
_GENESIS = "0" * 64
_SYNC_SECONDS = 1.0


def _digest(line: bytes) -> str:
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


class AuditLog:
    """Append-only JSON lines with a hash chain (see the module docstring). Thread-safe."""

    def __init__(self, run_dir: Path, party: str) -> None:
        self.path = Path(run_dir) / AUDIT_FILE
        self.party = party
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._prev = self._last_digest()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open the audit log {self.path}: {exc.strerror or exc}; serve from a run "
                              "directory this party can write") from None
        self._lock = threading.Lock()
        self._synced = time.monotonic()

    def _last_digest(self) -> str:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return _GENESIS
        with self.path.open("rb") as fh:  # the last line only: seek back from the end
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - (1 << 20)))
            tail = fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
        return _digest(tail)

    def write(self, **record: Any) -> None:
        entry = {"time": datetime.now(UTC).isoformat(timespec="microseconds"), "party": self.party, **record}
        with self._lock:
            line = json.dumps({**entry, "prev": self._prev}, separators=(",", ":")).encode() + b"\n"
            os.write(self._fd, line)
            self._prev = _digest(line)
            now = time.monotonic()
            if now - self._synced >= _SYNC_SECONDS:
                os.fsync(self._fd)
                self._synced = now

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1


def verify_audit_log(path: Path) -> int:
    """The number of lines of an intact audit log; a :class:`ConfigError` naming the first line whose chain breaks."""
    prev = _GENESIS
    n = 0
    with Path(path).open("rb") as fh:
        for n, line in enumerate(fh, start=1):
            try:
                got = json.loads(line)["prev"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{path} line {n} is not an audit record") from None
            if got != prev:
                raise ConfigError(f"{path} line {n}: its chain does not follow line {n - 1} (a line was removed or "
                                  "changed)")
            prev = _digest(line)
    return n
