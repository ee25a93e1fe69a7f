"""Every PNG secvfl writes goes through secvfl.plotting: no pyplot, and the host program's backend left alone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

# Draws each kind of plot in a fresh interpreter whose program chose its own backend (as a notebook or a GUI that
# imports secvfl would), then reports what matplotlib state the plots left behind.
_DRAW = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import matplotlib
    matplotlib.use("pdf")
    import numpy as np
    from attacks import plots
    from secvfl.algorithms.saddle.monitor import Trace
    from secvfl.cli.privacy_sweep import plot_sweep
    from secvfl.config import TrainConfig
    from secvfl.experiments.saddle import plot_traces
    from secvfl.rundir import write_curves

    out = Path(sys.argv[1])
    write_curves(out / "curves.png", [{"epoch": e, "train_loss": 1 / e, "val_auc": 0.5 + e / 10} for e in (1, 2)],
                 TrainConfig())
    pts = [{"epsilon": e, "mean": 0.5, "std": 0.1} for e in (1, 8)]
    plot_sweep({"algo": "vafl", "dataset": "wine", "parties": 2, "epochs": 1, "batch_size": 8, "seeds": [0],
                "curves": [{"mechanism": "rr", "points": pts}], "summary": []}, out / "sweep.png")
    trace = Trace("eg", [{"iter": i, "subopt": 0.5 ** i, "test_accuracy": 0.8, "floats": 10.0 * i} for i in range(4)])
    plot_traces([trace], out / "saddle.png", "saddle", 0.8)
    rows = [{"defence": "none", "mp": {"mean": 0.7, "std": 0.0}, "ap": {"norm": {"mean": 0.9, "std": 0.0}}}]
    plots.plot_grid(out / "grid.png", rows, ["norm"], "auc", "grid")
    y = [np.array([0, 1, 0, 1])]
    plots.plot_label_scores(out / "scores.png", [np.array([0.1, 0.9, 0.2, 0.8])], y, [1.0], "scores")
    print(json.dumps({"backend": matplotlib.get_backend(), "pyplot": "matplotlib.pyplot" in sys.modules}))
""")


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_plots_leave_the_programs_backend_and_pyplot_alone(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _DRAW, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert state == {"backend": "pdf", "pyplot": False}
    # figure size in inches times the dpi each plot is saved at
    assert _png_size(tmp_path / "curves.png") == (round(2 * 4.5 * 120), round(3.4 * 120))
    assert _png_size(tmp_path / "sweep.png") == (round(6.4 * 120), round(4.2 * 120))
    assert _png_size(tmp_path / "saddle.png") == (13 * 110, 9 * 110)
    assert _png_size(tmp_path / "grid.png") == (7 * 120, 5 * 120)
    assert _png_size(tmp_path / "scores.png") == (9 * 120, 4 * 120)
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporary file left beside them
