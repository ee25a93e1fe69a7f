"""What only one party may read stays in that party's own files: ``RUN/parties/<party>/`` (in a deployment, that
party's disk; here, a directory nothing else in the run reads).

Under label DP with the gradient mechanism the training loss is computed from the true labels: it is not a
private release, so it is kept by the label party alone (:class:`TrainLossKeeper`, ``train-loss.jsonl``) and left out
of ``metrics.jsonl``, ``summary.json``, ``curves.png`` and the log. The release ledger (:mod:`protocols.dp.ledger`) and
rr-prior's stored stage-2 release live beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from secvfl.io import write_text_atomic

__all__ = ["PARTY_DIRS", "STAGE2_FILE", "party_dir", "TrainLossKeeper"]

PARTY_DIRS = "parties"
STAGE2_FILE = "rr-prior-stage2.json"  # rr-prior's stage-2 release (randomised labels and priors), kept before use


def party_dir(run_dir: Path, party: str) -> Path:
    return Path(run_dir) / PARTY_DIRS / party


class TrainLossKeeper:
    """The label party's own record of its training loss per epoch (in memory until :meth:`open`)."""

    FILE = "train-loss.jsonl"

    def __init__(self) -> None:
        self.path: Path | None = None
        self.losses: dict[int, float] = {}

    def open(self, directory: Path, *, trained_epochs: int) -> None:
        """Write to ``directory`` (the label party's own); keep what earlier processes of this run recorded there for
        the epochs the checkpoint holds."""
        self.path = Path(directory) / self.FILE
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    epoch, loss = int(row["epoch"]), float(row["train_loss"])
                except (ValueError, KeyError, TypeError):
                    continue  # the label party's own bookkeeping: a damaged line loses that number only
                if epoch <= trained_epochs:
                    self.losses[epoch] = loss

    def __call__(self, epoch: int, loss: float) -> None:
        self.losses[int(epoch)] = float(loss)
        if self.path is not None:
            write_text_atomic(self.path, "".join(json.dumps({"epoch": e, "train_loss": v}) + "\n"
                                                 for e, v in sorted(self.losses.items())))
