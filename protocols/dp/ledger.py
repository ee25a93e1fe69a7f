"""The release ledger: each releasing party's durable record of its DP releases, written *before* it releases.

Why: checkpoints are written once per epoch, so a process killed in the middle of an epoch has already released part
of that epoch (its messages left the party) though no checkpoint records it, and the resumed run releases the epoch
again. Counting from the checkpoint alone would charge those releases once; the ledger charges them every time.

Where: ``RUN/parties/<party>/dp-ledger.json``, one per releasing party (the label party under label DP, every
protected feature party under feature DP), rewritten atomically (written, fsync'd, renamed) each time it grows.

When an entry is written, always before the release it records:

* ``epoch`` (gradient mechanism, feature DP): when a process starts an epoch, before its first release of it. A process
  killed after the entry and before that release is charged as if it had released (the safe side).
* ``labels`` (rr, alibi) and ``stage1`` (rr-prior): when a process starts training on labels it randomised itself;
  a resumed process reuses the labels stored in the checkpoint and writes none.
* ``block`` (rr on a stream, :mod:`protocols.dp.stream`): when a process starts a block of stream samples, before
  it randomises the first label of the block. The samples of different blocks are distinct, so the most released
  sample's count is the most processes that started any one block (a resumed process replays the block it was
  interrupted in: the same stream samples, whose labels it randomises again).
* ``stage2`` (rr-prior): when stage 2 releases; the released labels are stored beside the ledger
  (``rr-prior-stage2.json``) before they are used, so a process resumed before the next checkpoint reuses them.

What the entries mean: one process releases each training sample at most once per epoch (each sample is in one
batch), so the most often any sample has been released is at most the sum, over epochs, of the processes that
started that epoch; with the shared batch order (seed, epoch) it is exactly that. A repeat that cannot differ from
the first is no new release: with ``--dp-reproducible`` on a CPU and the same ``--threads``, a resumed process starts
from the restored state and redraws the same noise at the same positions, so it sends the very same values again
(``tests/test_resume_kill.py`` checks that such a run ends bit for bit as an uninterrupted one); entries with the same
``replay`` key count once. The secure generator gets a fresh key in every process, so its repeats always count.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from protocols.dp.accounting import GaussianEvent, epsilon_of
from protocols.dp.config import LABEL_RELEASE_MECHANISMS, DPPlan
from protocols.dp.private import party_dir
from secvfl.errors import ConfigError
from secvfl.io import fsync_dir, write_json_atomic

__all__ = ["ReleaseLedger", "ledger_header", "releases_per_sample", "epsilon_spent", "repeated_releases",
           "replay_key", "LEDGER_FILE"]

LEDGER_FILE = "dp-ledger.json"
_FORMAT = "secvfl-dp-ledger/1"
# The parts of the training labels each label-release mechanism releases (disjoint, each label in one part).
_PARTS = {"rr": ("labels",), "alibi": ("labels",), "rr-prior": ("stage1", "stage2")}


def replay_key(*, secure: bool, device: str, threads: int) -> str | None:
    """Entries with the same key are the same release repeated bit for bit (seeded noise, same CPU computation)."""
    if secure or not device.startswith("cpu"):  # a fresh key, or GPU kernels that need not repeat their last bits
        return None
    return f"seeded/{device}/threads={threads}"


def ledger_header(plan: DPPlan, party: str) -> dict[str, Any]:
    """What a ledger's releases were made with: a ledger written under other settings is another run's."""
    pure = plan.mechanism in LABEL_RELEASE_MECHANISMS
    header = {"party": party, "mechanism": plan.mechanism, "protects": plan.protects, "n_train": plan.n_train,
              "noise_multiplier": None if pure else plan.noise_multiplier, "epsilon": plan.epsilon if pure else None}
    if plan.config.stream:  # (only then: the ledgers of earlier runs keep their header)
        header["stream"] = True
    return header


def _distinct(entries: Iterable[dict[str, Any]]) -> int:
    """Releases among ``entries``: every entry without a replay key, and each replay key once."""
    entries = list(entries)
    return sum(1 for e in entries if e.get("replay") is None) + len({e["replay"] for e in entries if e.get("replay")})


def releases_per_sample(plan: DPPlan, entries: Sequence[dict[str, Any]]) -> int:
    """How often the most released training sample has been released, per the ledger ``entries``."""
    if plan.config.stream:  # each block's samples are its own: the most repeated block counts
        blocks = {e["epoch"] for e in entries if e["release"] == "block"}
        return max((_distinct(e for e in entries if e["release"] == "block" and e["epoch"] == k) for k in blocks),
                   default=0)
    if plan.mechanism in LABEL_RELEASE_MECHANISMS:
        return max(_distinct(e for e in entries if e["release"] == part) for part in _PARTS[plan.mechanism])
    per_epoch = plan.releases_per_sample // plan.epochs  # 1 (labels) or 2 (features: the row and the model update)
    epochs = {e["epoch"] for e in entries if e["release"] == "epoch"}
    return per_epoch * sum(_distinct(e for e in entries if e["release"] == "epoch" and e["epoch"] == k) for k in epochs)


def epsilon_spent(plan: DPPlan, entries: Sequence[dict[str, Any]]) -> float:
    """Epsilon (at the plan's delta, under its accountant) of the releases the ledger ``entries`` record."""
    times = releases_per_sample(plan, entries)
    if times == 0:
        return 0.0
    if plan.mechanism in LABEL_RELEASE_MECHANISMS:
        return plan.epsilon * times  # basic composition of pure-DP releases of the same label
    return epsilon_of(GaussianEvent(float(plan.noise_multiplier or 0.0), times), plan.delta, plan.accountant)


def repeated_releases(entries: Sequence[dict[str, Any]]) -> dict[str, int]:
    """What was released more than once, and how often: ``{"epoch 2": 2}``, ``{"stage2": 2}``."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        name = f"{e['release']} {e['epoch'] + 1}" if e["release"] in ("epoch", "block") else e["release"]
        groups.setdefault(name, []).append(e)
    return {name: n for name, group in groups.items() if (n := _distinct(group)) > 1}


class ReleaseLedger:
    """One party's ledger; in memory only until :meth:`open` gives it a run directory."""

    def __init__(self, party: str, header: dict[str, Any], replay: str | None) -> None:
        self.party = party
        self.header = header
        self.replay = replay
        self.entries: list[dict[str, Any]] = []
        self.path: Path | None = None
        self.process = 1  # this process's number among those that trained the run

    def open(self, run_dir: Path, *, trained_epochs: int) -> None:
        """Read the run's ledger (if any) and write to it from now on; refuse one that cannot be trusted."""
        path = party_dir(run_dir, self.party) / LEDGER_FILE
        entries: list[dict[str, Any]] = []
        if path.exists():
            try:
                data = json.loads(path.read_text())
                if data.get("format") != _FORMAT or not isinstance(data.get("entries"), list):
                    raise ValueError
                entries = [{"release": str(e["release"]), "epoch": int(e["epoch"]), "process": int(e["process"]),
                            "replay": e.get("replay")} for e in data["entries"]]
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
                raise ConfigError(f"the DP release ledger {path} is damaged, so what this run released cannot be "
                                  f"counted; start a new run (another --out)") from None
            theirs = {k: data.get(k) for k in self.header}
            if theirs != self.header:
                changed = ", ".join(f"{k} {theirs[k]!r} (now {v!r})" for k, v in self.header.items() if theirs[k] != v)
                raise ConfigError(f"{run_dir} holds the DP release ledger of a run with other settings ({changed}); "
                                  "use another --out")
        elif trained_epochs > 0:
            raise ConfigError(f"{run_dir} has trained {trained_epochs} epoch(s) but has no DP release ledger ({path}), "
                              "so what it released cannot be counted; start a new run (another --out)")
        self.entries = entries + self.entries
        self.process = 1 + max((e["process"] for e in entries), default=0)
        for e in self.entries[len(entries):]:
            e["process"] = self.process
        self.path = path
        if len(self.entries) > len(entries):
            self._write()

    def entry(self, release: str, epoch: int) -> dict[str, Any]:
        """The entry this process would write for ``release`` of ``epoch`` (for projections)."""
        return {"release": release, "epoch": int(epoch), "process": self.process, "replay": self.replay}

    def record(self, release: str, epoch: int) -> None:
        """Add an entry and make it durable; call it before the release it records."""
        self.entries.append(self.entry(release, epoch))
        if self.path is not None:
            self._write()

    def recorded(self, release: str) -> bool:
        """Whether this process has recorded ``release`` already."""
        return any(e["release"] == release and e["process"] == self.process for e in self.entries)

    def _write(self) -> None:
        assert self.path is not None
        first = not self.path.exists()
        write_json_atomic(self.path, {"format": _FORMAT, **self.header, "entries": self.entries})
        if first:  # the directories it created must survive a power cut too, not only the file's name in them
            fsync_dir(self.path.parent.parent)
            fsync_dir(self.path.parent.parent.parent)
