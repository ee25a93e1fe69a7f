"""Prequential metrics of a stream: every sample is scored by the model that has not yet learnt from it.

``error`` of a block or of a window of ``W`` samples is the fraction of wrong predictions in it; the accumulated
error is the fraction over every sample so far (the paper's "accumulated error"); the windowed series (one value per
``W`` samples, default 20,000) is the paper's run-time error curve. All state is plain numbers (checkpointed).
"""

from __future__ import annotations

from pathlib import Path

from secvfl.plotting import new_figure, save_figure_atomic

__all__ = ["PrequentialMeter", "plot_error"]


class PrequentialMeter:
    def __init__(self, window: int) -> None:
        self.window = int(window)
        self.samples = 0
        self.errors = 0
        self.loss_sum = 0.0
        self._block = [0, 0, 0.0]  # samples, errors, loss sum of the current block
        self._win = [0, 0]  # samples, errors of the current W-window
        self.curve: list[list[float]] = []  # [samples at the window's end, its error]

    def add(self, correct: bool, loss: float) -> None:
        wrong = 0 if correct else 1
        self.samples += 1
        self.errors += wrong
        self.loss_sum += loss
        self._block[0] += 1
        self._block[1] += wrong
        self._block[2] += loss
        self._win[0] += 1
        self._win[1] += wrong
        if self._win[0] == self.window:
            self.curve.append([self.samples, self._win[1] / self.window])
            self._win = [0, 0]

    @property
    def accumulated_error(self) -> float:
        return self.errors / self.samples if self.samples else float("nan")

    def close_block(self) -> dict[str, float]:
        """The block's prequential metrics; starts the next block."""
        n, wrong, loss = self._block
        self._block = [0, 0, 0.0]
        err = wrong / n if n else float("nan")
        return {"samples": n, "error": err, "accuracy": 1.0 - err, "loss": loss / n if n else float("nan")}

    def state_dict(self) -> dict:
        return {"samples": self.samples, "errors": self.errors, "loss_sum": self.loss_sum, "block": list(self._block),
                "win": list(self._win), "curve": [list(c) for c in self.curve]}

    def load_state_dict(self, state: dict) -> None:
        self.samples, self.errors = int(state["samples"]), int(state["errors"])
        self.loss_sum = float(state["loss_sum"])
        self._block = [int(state["block"][0]), int(state["block"][1]), float(state["block"][2])]
        self._win = [int(v) for v in state["win"]]
        self.curve = [[float(a), float(b)] for a, b in state["curve"]]


def plot_error(path: Path, series: dict[str, list[list[float]]], title: str) -> Path:
    """Run-time (windowed prequential) error against samples seen, one line per series (like the paper's Fig. 2/3)."""
    fig = new_figure((6.0, 3.8))
    ax = fig.subplots()
    for label, points in series.items():
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 40 else None,
                    label=label)
    ax.set(xlabel="samples seen", ylabel="run-time error (prequential)", title=title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return save_figure_atomic(fig, path)
