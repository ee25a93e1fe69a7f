"""`secvfl reproduce vim`: communication to reach a target accuracy (Table 2 of Xie et al., VIM), the client
importance ranking (Fig. 3) and client summarisation (Table 3).

Setting ``mnist`` (the paper's, Appendix B): 60,000 training images split 54,000 / 6,000 (train / validation,
stratified, seed 0) and the 10,000 test images; standardised with one global mean and std; the rows of the 28x28
image cut into 14 horizontal strips of 2 rows x 28 pixels, one party each (``--image-split strips``); two-layer
fully connected bottoms (56 -> 120 -> 60, the authors' ``ConMLP`` width; ``d_f`` = 60); batch 1024 (53 rounds an
epoch); the parties' SGD has momentum 0.9 in every method (the paper's setting; ``vafl``/``fdml`` parties get it here,
the CLI's ``--optimizer sgd`` has none); VAFL's head is linear on the mean embedding.

Methods and step sizes (Table 1): VAFL 0.3, FDML 0.1, VIMSGD 0.3, VIMADMM rho 2 tau 20, VIMADMM-J rho 0.5 tau 20.
VIMSGD uses the authors' code's weight decay 0.001 (the paper's beta 0.005, on batch means, holds VIMSGD at
94.8 %); VIMADMM-J the paper's eta 0.05 with weight decay 1e-4 (97.05 % after one epoch, seed 0; with 0.001 it
diverged at 0.05 and took 2-3 epochs at 0.02: the git history of BENCHMARKS.md, "Stabilising VIMADMM"). VIMADMM runs the paper's eta 0.05,
rho 2, tau 20 with the residual of the authors' code (``--vim-residual round-start``: s^k from the heads W^t the
round's z came from; with eq. 9 as printed, W^{t+1}, it diverges in the first epoch) and weight decay 1e-4 (closer to
the paper's beta on a batch sum, 0.005 / 1024; at 0.001 it levels off at 96.7 %) (the git history of BENCHMARKS.md, "VIMADMM: the
residual"). ``--lr METHOD=ETA`` sets any step size. A run that diverges is recorded (``diverged``: epoch and
reason) and the others go on.

What is recorded, per method and seed, after every epoch: the test accuracy (evaluated every epoch; the validation
accuracy too) and the exact cumulative bytes of *training* messages (the network's byte counter around
``train_epoch``; evaluation messages are not counted). Bytes to target: the cumulative MB (10^6 bytes) at the end of
the first epoch whose test accuracy is at or above the target (96.5 %), not interpolated within the epoch; ``None``
when no epoch reached it. Per-round bytes: what party0 sent and received in the first training round.

Summarisation: VIMADMM retrained with only the top / bottom u % of the parties (u = 50, 20) ranked by the mean head
norm ``||W_k||_F`` of the full VIMADMM runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from secvfl.algorithms import get_algorithm
from secvfl.algorithms.base import RunContext
from secvfl.algorithms.vim.explain import plot_importance
from secvfl.cli.registries import REPRODUCTIONS
from secvfl.config import TrainConfig
from secvfl.data import Dataset, Partition, load_dataset, make_partition
from secvfl.errors import ConfigError, TrainingDiverged
from secvfl.handles import local_party
from secvfl.io import save_figure_atomic, write_json_atomic, write_text_atomic
from secvfl.plotting import new_figure
from secvfl.rundir import runs_root
from secvfl.runner import limit_threads
from secvfl.transport.network import Network

__all__ = ["Setting", "SETTINGS", "METHODS", "PAPER", "run_task", "bytes_to_target", "aggregate", "markdown"]

MB = 1e6


@dataclass(frozen=True)
class Setting:
    dataset: str
    parties: int
    hidden: tuple[int, ...]
    embedding_dim: int
    batch_size: int
    target: float  # test accuracy of the bytes-to-target table
    epochs: dict[str, int]  # per method: enough for the target within this machine's time (see BENCHMARKS.md)
    summary_epochs: int
    image_split: str = "strips"


SETTINGS: dict[str, Setting] = {
    "mnist": Setting("mnist", 14, (120,), 60, 1024, 0.965,
                     {"vafl": 30, "fdml": 30, "vimsgd": 20, "vimadmm": 10, "vimadmm-j": 5}, summary_epochs=5),
    # a fast check on the bundled digits (8x8 images, 4 strips of 2 rows)
    "digits": Setting("digits", 4, (32,), 16, 64, 0.9,
                      {"vafl": 20, "fdml": 20, "vimsgd": 10, "vimadmm": 5, "vimadmm-j": 5}, summary_epochs=5),
}

# The VIM methods on MNIST (the git history of BENCHMARKS.md, "Stabilising VIMADMM", "VIMADMM: the residual"): the authors' code's weight
# decay 0.001 (the paper's beta 0.005, applied to batch means, holds VIMSGD at 94.8 %). VIMADMM: the paper's step size
# with the authors' code's residual (round-start heads; eq. 9 as printed diverges in epoch 1 without the proximal
# term) and weight decay 1e-4 (0.001 holds it at 96.7 %); no proximal term. VIMADMM-J needs no proximal term.
VIM_BETA = {"vim_beta": 0.001}
ADMM_STABLE = {"vim_beta": 1e-4, "vim_residual": "round-start"}
# method -> (algorithm, step size eta, extra VIM options): the step sizes of the paper's Table 1
METHODS: dict[str, tuple[str, float, dict[str, Any]]] = {
    "vafl": ("vafl", 0.3, {}),
    "fdml": ("fdml", 0.1, {}),
    "vimsgd": ("vimsgd", 0.3, VIM_BETA),
    "vimadmm": ("vimadmm", 0.05, {"vim_rho": 2.0, "vim_local_steps": 20, **ADMM_STABLE}),
    "vimadmm-j": ("vimadmm-j", 0.05, {"vim_rho": 0.5, "vim_local_steps": 20, "vim_beta": 1e-4}),
}
LABELS = {"vafl": "VAFL", "fdml": "FDML", "vimsgd": "VIMSGD", "vimadmm": "VIMADMM", "vimadmm-j": "VIMADMM-J"}
PARTY_MOMENTUM = 0.9

# The paper's MNIST numbers (Tables 2 and 3): MB to 96.5 %, MB per round and party, summarisation accuracy (%).
PAPER = {
    "mb_to_target": {"vafl": 6954.02, "vimsgd": 3824.71, "vimadmm": 700.08},
    "mb_per_round": {"vafl": (0.23, 0.23), "vimsgd": (0.23, 0.23), "vimadmm": (0.23, 0.08)},
    "summarisation": {"all": 97.12, "top50": 96.58, "bottom50": 78.11, "top20": 88.72, "bottom20": 29.11},
}


# -- one training run ---------------------------------------------------------------------------------------------
_DATA: dict[tuple[str, str | None], Dataset] = {}


def _data(dataset: str, data_dir: str | None) -> Dataset:
    if (dataset, data_dir) not in _DATA:
        _DATA[(dataset, data_dir)] = load_dataset(dataset, data_dir, seed=0, val_fraction=0.1)
    return _DATA[(dataset, data_dir)]


def _config(setting: Setting, method: str, seed: int, lr: float, epochs: int) -> TrainConfig:
    algo, _, extra = METHODS[method]
    common = dict(algo=algo, dataset=setting.dataset, parties=setting.parties, epochs=epochs,
                  batch_size=setting.batch_size, seed=seed, hidden=setting.hidden,
                  embedding_dim=setting.embedding_dim, image_split=setting.image_split, threads=1)
    if algo.startswith("vim"):
        return TrainConfig(**common, options={"vim_lr": lr, **extra})
    return TrainConfig(**common, lr=lr, optimizer="sgd", head_hidden=())


def build(setting: Setting, method: str, seed: int, lr: float, epochs: int, data_dir: str | None,
          keep: list[int] | None = None):  # noqa: ANN201 - an Algorithm
    """The method's algorithm on all parties, or on the parties ``keep`` only (summarisation)."""
    cfg = _config(setting, method, seed, lr, epochs)
    data = _data(setting.dataset, data_dir)
    part = make_partition(data.n_features, setting.parties, image_shape=data.image_shape,
                          image_split=setting.image_split, channels=data.image_channels)
    if keep is not None:
        part = Partition(tuple(part.blocks[k] for k in keep), tuple(part.block_shapes[k] for k in keep),
                         part.channels)
        cfg = replace(cfg, parties=len(keep))
    K = part.n_blocks
    masks = {s: np.ones((len(getattr(data, f"y_{s}")), K), dtype=bool) for s in ("train", "val", "test")}
    ctx = RunContext(cfg, data, part, masks, torch.device("cpu"), torch.float32)
    cls = get_algorithm(cfg.algo)
    torch.manual_seed(seed)
    algo = cls(ctx, Network(cls.party_roles(K), traits=cls.traits))
    if not cfg.algo.startswith("vim"):  # the paper's parties' SGD (the VIM family builds it itself)
        for h in algo.feature_handles:
            party = local_party(h)
            party.optimizer = torch.optim.SGD(party.model.parameters(), lr=lr, momentum=PARTY_MOMENTUM)
    return algo


def run_task(dataset: str, method: str, seed: int, lr: float, epochs: int, data_dir: str | None,
             keep: list[int] | None = None) -> dict[str, Any]:
    """Train one method for one seed; test accuracy and cumulative training bytes after every epoch."""
    limit_threads(1)
    setting = SETTINGS[dataset]
    algo = build(setting, method, seed, lr, epochs, data_dir, keep)
    stats = algo.net.stats
    first_round: dict[str, int] = {}

    def after_round(_loss: float) -> None:
        if not first_round:
            first_round.update(up=stats.bytes_sent.get("party0", 0), down=stats.bytes_received.get("party0", 0))

    curve, train_bytes, wall, diverged = [], 0, [], None
    for epoch in range(epochs):
        torch.manual_seed(seed * 100_003 + epoch)
        before, t0 = stats.bytes_total, time.perf_counter()
        try:
            loss = algo.train_epoch(epoch, after_round)["loss"]
        except TrainingDiverged as e:  # recorded, so that one seed's divergence does not lose the other runs
            diverged = {"epoch": epoch + 1, "error": str(e)}
            break
        wall.append(time.perf_counter() - t0)
        train_bytes += stats.bytes_total - before
        test = algo.evaluate("test")["accuracy"]
        val = algo.evaluate("val")["accuracy"]
        curve.append({"epoch": epoch + 1, "loss": loss, "test_accuracy": test, "val_accuracy": val,
                      "train_bytes": train_bytes})
        if not math.isfinite(loss):
            diverged = {"epoch": epoch + 1, "error": f"training loss {loss}"}
            break
    out = {"dataset": dataset, "method": method, "seed": seed, "lr": lr, "options": METHODS[method][2],
           "epochs": epochs, "keep": keep,
           "curve": curve, "final_accuracy": curve[-1]["test_accuracy"] if curve else float("nan"),
           "diverged": diverged, "round_bytes_party0": first_round,
           "rounds_per_epoch": algo.batches_per_epoch(), "epoch_wall_s": float(np.mean(wall)) if wall else float("nan")}
    if hasattr(algo, "party_importance"):
        out["importance"] = algo.party_importance()
    return out


# -- aggregation --------------------------------------------------------------------------------------------------
def bytes_to_target(curve: list[dict], target: float) -> tuple[int | None, int | None]:
    """(first epoch whose test accuracy is >= target, cumulative training bytes then); (None, None) if none."""
    for row in curve:
        if row["test_accuracy"] >= target:
            return row["epoch"], row["train_bytes"]
    return None, None


def _mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
            "n": len(values)}


def aggregate(results: list[dict], target: float) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for method in METHODS:
        runs = [r for r in results if r["method"] == method and r.get("keep") is None]
        if not runs:
            continue
        reached = [bytes_to_target(r["curve"], target) for r in runs]
        cell: dict[str, Any] = {
            "seeds": [r["seed"] for r in runs], "lr": runs[0]["lr"],
            "final_accuracy": _mean_std([100 * r["final_accuracy"] for r in runs]),
            "epochs_run": [len(r["curve"]) for r in runs],
            "mb_per_round_up": runs[0]["round_bytes_party0"]["up"] / MB,
            "mb_per_round_down": runs[0]["round_bytes_party0"]["down"] / MB,
            "bytes_per_round_party0": runs[0]["round_bytes_party0"],
            "epoch_wall_s": _mean_std([r["epoch_wall_s"] for r in runs]),
            "target_epoch": [e for e, _ in reached], "target_bytes": [b for _, b in reached],
        }
        if all(b is not None for _, b in reached):
            cell["mb_to_target"] = _mean_std([b / MB for _, b in reached])
        else:  # where the run stopped: its bytes and accuracy
            cell["stopped_at"] = [{"seed": r["seed"], "mb": r["curve"][-1]["train_bytes"] / MB if r["curve"] else 0.0,
                                   "best_accuracy": 100 * max((c["test_accuracy"] for c in r["curve"]),
                                                              default=float("nan")),
                                   "diverged_in_epoch": (r.get("diverged") or {}).get("epoch")}
                                  for r, (_, b) in zip(runs, reached, strict=True) if b is None]
        cell["diverged"] = [{"seed": r["seed"], **r["diverged"]} for r in runs if r.get("diverged")]
        table[method] = cell
    return table


def ratios(table: dict[str, Any]) -> dict[str, Any]:
    """Bytes-to-target ratios the acceptance asks for (mean over seeds; None when a side never reached it)."""
    def mb(m: str) -> float | None:
        return table.get(m, {}).get("mb_to_target", {}).get("mean")

    out = {}
    for a, b in (("vafl", "vimadmm"), ("vimsgd", "vimadmm"), ("fdml", "vimadmm-j")):
        x, y = mb(a), mb(b)
        out[f"{a}/{b}"] = None if x is None or y is None else x / y
    return out


def importance_mean(results: list[dict]) -> dict[str, float]:
    runs = [r["importance"] for r in results if r["method"] == "vimadmm" and r.get("keep") is None]
    if not runs:
        return {}
    return {p: float(np.mean([r[p] for r in runs])) for p in runs[0]}


def summary_sets(importance: dict[str, float]) -> dict[str, list[int]]:
    order = sorted(range(len(importance)), key=lambda k: -importance[f"party{k}"])
    n = len(order)
    out = {}
    for u in (50, 20):
        m = max(1, round(n * u / 100))
        out[f"top{u}"], out[f"bottom{u}"] = sorted(order[:m]), sorted(order[-m:])
    return out


def markdown(setting: Setting, table: dict[str, Any], summ: dict[str, Any], importance: dict[str, float]) -> str:
    t = 100 * setting.target
    lines = [f"## Communication to {t:.1f} % test accuracy ({setting.dataset}, {setting.parties} parties, batch "
             f"{setting.batch_size})", "",
             "MB = 10^6 bytes of training messages, exact (headers included), first epoch at or above the target "
             "(not interpolated); mean ± std over seeds.", "",
             "| method | eta | MB up / round / party | MB down / round / party | MB to target | paper MB | "
             "epoch reached | final test acc. % | epochs |", "|---|---|---|---|---|---|---|---|---|"]
    for m, c in table.items():
        if "mb_to_target" in c:
            reach = f"{c['mb_to_target']['mean']:.1f} ± {c['mb_to_target']['std']:.1f}"
        else:
            stops = "; ".join(f"seed {s['seed']}: not reached, "
                              + (f"diverged in epoch {s['diverged_in_epoch']}, " if s["diverged_in_epoch"] else "")
                              + f"stopped at {s['mb']:.0f} MB, best {s['best_accuracy']:.2f} %"
                              for s in c["stopped_at"])
            reach = stops
        paper = PAPER["mb_to_target"].get(m)
        lines.append(f"| {LABELS[m]} | {c['lr']:g} | {c['mb_per_round_up']:.4f} | {c['mb_per_round_down']:.4f} | "
                     f"{reach} | {'' if paper is None else f'{paper:.0f}'} | {c['target_epoch']} | "
                     f"{c['final_accuracy']['mean']:.2f} ± {c['final_accuracy']['std']:.2f} | {c['epochs_run']} |")
    def flag(k: str, v: Any) -> str:
        return f"--{k.replace('_', '-')} {v if isinstance(v, str) else f'{v:g}'}"

    lines += ["", "Options beyond the step size: " + "; ".join(
        f"{LABELS[m]} " + ", ".join(flag(k, v) for k, v in METHODS[m][2].items())
        for m in table if METHODS[m][2]) + "."]
    r = ratios(table)
    lines += ["", "Ratios of MB to target: " + ", ".join(
        f"{k} = {'n/a' if v is None else f'{v:.1f}x'}" for k, v in r.items()) +
        " (paper: vafl/vimadmm 9.9x, vimsgd/vimadmm 5.5x)."]
    if importance:
        rank = sorted(importance, key=lambda p: -importance[p])
        lines += ["", "## Party importance (VIMADMM, mean ||W_k||_F over seeds; party k holds image rows 2k, 2k+1)", "",
                  "| party | " + " | ".join(p.removeprefix("party") for p in importance) + " |",
                  "|---|" + "---|" * len(importance),
                  "| norm | " + " | ".join(f"{v:.2f}" for v in importance.values()) + " |", "",
                  "Ranking: " + ", ".join(rank)]
    if summ:
        lines += ["", "## Summarisation (VIMADMM retrained on a subset of parties; test accuracy %)", "",
                  "| parties | kept | ours | paper |", "|---|---|---|---|"]
        for key, c in summ.items():
            lines.append(f"| {key} | {c['parties']} | {c['accuracy']['mean']:.2f} ± {c['accuracy']['std']:.2f} | "
                         f"{PAPER['summarisation'].get(key, '')} |")
    return "\n".join(lines) + "\n"


def plot_curves(path: Path, results: list[dict], setting: Setting) -> None:
    fig = new_figure((7.5, 4.5))
    ax = fig.subplots()
    for i, method in enumerate(METHODS):
        runs = [r for r in results if r["method"] == method and r.get("keep") is None]
        for j, r in enumerate(runs):
            ax.plot([c["train_bytes"] / MB for c in r["curve"]], [100 * c["test_accuracy"] for c in r["curve"]],
                    color=f"C{i}", alpha=0.8, marker=".", label=LABELS[method] if j == 0 else None)
    ax.axhline(100 * setting.target, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_ylim(80, 100)
    ax.set_xlabel("cumulative training communication (MB, log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{setting.dataset}: accuracy vs communication ({setting.parties} parties, one line per seed)")
    ax.legend()
    save_figure_atomic(fig, path)


# -- the command --------------------------------------------------------------------------------------------------
def _method_value(text: str, cast=float) -> tuple[str, Any]:  # noqa: ANN001
    method, sep, value = text.partition("=")
    if not sep or method not in METHODS:
        raise argparse.ArgumentTypeError(f"expected METHOD=VALUE with METHOD one of {', '.join(METHODS)}, got {text!r}")
    try:
        v = cast(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a finite number > 0")
    return method, v


def _task_file(out_dir: Path, dataset: str, method: str, seed: int, lr: float, epochs: int,
               keep: list[int] | None) -> Path:
    sub = "" if keep is None else "_keep" + "-".join(map(str, keep))
    return out_dir / "runs" / f"{dataset}_{method}_seed{seed}_lr{lr:g}_e{epochs}{sub}.json"


def _run_all(tasks: list[tuple], jobs: int, data_dir: str | None, force: bool) -> list[dict]:
    results, todo = [], []
    for dataset, method, seed, lr, epochs, keep, f in tasks:
        cached = json.loads(f.read_text()) if f.is_file() and not force else None
        if cached is not None and cached.get("options", METHODS[method][2]) == METHODS[method][2]:
            results.append(cached)
        else:
            todo.append((dataset, method, seed, lr, epochs, keep, f))
    # longest first (measured seconds per MNIST epoch), so the pool does not end on one straggler
    cost = {"vimadmm-j": 60, "vimadmm": 40, "vimsgd": 7, "vafl": 7, "fdml": 6}
    todo.sort(key=lambda t: -cost[t[1]] * t[4])

    def done(r: dict, f: Path) -> None:
        write_json_atomic(f, r)
        results.append(r)
        print(f"  done {r['method']} seed={r['seed']} keep={r['keep']} final {100 * r['final_accuracy']:.2f} % "
              f"({r['epoch_wall_s']:.1f} s/epoch)", flush=True)

    if jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futs = {pool.submit(run_task, d, m, s, lr, e, data_dir, k): f for d, m, s, lr, e, k, f in todo}
            for fut in as_completed(futs):
                done(fut.result(), futs[fut])
    else:
        for d, m, s, lr, e, k, f in todo:
            done(run_task(d, m, s, lr, e, data_dir, k), f)
    return results


@REPRODUCTIONS.register("vim")
class VIMReproduction:
    help = ("VIM (Xie et al.): MB to a target test accuracy for VAFL, FDML, VIMSGD, VIMADMM, VIMADMM-J, party "
            "importance and summarisation (mnist, digits)")
    writes_own_output = True

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--dataset", default="mnist", choices=sorted(SETTINGS), help="the setting to run")
        p.add_argument("--data-dir", default=None, help="folder of the real datasets (default $SECVFL_DATA_DIR)")
        p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
        p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="methods to train")
        p.add_argument("--epochs", type=lambda t: _method_value(t, int), nargs="+", default=[], metavar="METHOD=N",
                       help="epochs of a method (default: the setting's, e.g. mnist vimadmm=6 vafl=30)")
        p.add_argument("--lr", type=_method_value, nargs="+", default=[], metavar="METHOD=ETA",
                       help="step size of a method (default: the paper's Table 1)")
        p.add_argument("--summarise", choices=("first-seed", "all-seeds", "none"), default="first-seed",
                       help="VIMADMM retrained on the top/bottom 50 %% and 20 %% of the parties: for the first seed "
                            "only, every seed, or not at all")
        p.add_argument("--jobs", type=int, default=1, help="training runs in parallel (each on one thread)")
        p.add_argument("--out-dir", type=Path, default=None,
                       help="where runs/, results.json, table.md and the plots go (default runs/reproduce-vim-DATASET)")
        p.add_argument("--force", action="store_true", help="retrain runs whose result file exists")

    def run(self, args: argparse.Namespace) -> dict:
        if args.jobs < 1:
            raise ConfigError(f"--jobs must be at least 1, got {args.jobs}")
        data_dir = args.data_dir or os.environ.get("SECVFL_DATA_DIR")
        setting = SETTINGS[args.dataset]
        epochs = {**setting.epochs, **dict(args.epochs)}
        lrs = {m: METHODS[m][1] for m in METHODS} | dict(args.lr)
        out_dir = args.out_dir or runs_root() / f"reproduce-vim-{args.dataset}"
        _data(setting.dataset, data_dir)  # fail early on a missing dataset
        t0 = time.perf_counter()
        tasks = [(args.dataset, m, s, lrs[m], epochs[m], None,
                  _task_file(out_dir, args.dataset, m, s, lrs[m], epochs[m], None))
                 for s in args.seeds for m in args.methods]
        results = _run_all(tasks, args.jobs, data_dir, args.force)
        importance = importance_mean(results)
        summ: dict[str, Any] = {}
        if importance and args.summarise != "none":
            seeds = args.seeds[:1] if args.summarise == "first-seed" else args.seeds
            sets = summary_sets(importance)
            e, lr = setting.summary_epochs, lrs["vimadmm"]
            sub_tasks = [(args.dataset, "vimadmm", s, lr, e, keep,
                          _task_file(out_dir, args.dataset, "vimadmm", s, lr, e, keep))
                         for s in seeds for keep in sets.values()]
            sub = _run_all(sub_tasks, args.jobs, data_dir, args.force)
            full = [r for r in results if r["method"] == "vimadmm" and r["seed"] in seeds]
            summ["all"] = {"parties": list(range(setting.parties)),
                           "accuracy": _mean_std([100 * r["final_accuracy"] for r in full])}
            for key, keep in sets.items():
                accs = [100 * r["final_accuracy"] for r in sub if r["keep"] == keep]
                summ[key] = {"parties": keep, "accuracy": _mean_std(accs)}
            summ["note"] = (f"'all': the full VIMADMM runs ({setting.epochs['vimadmm']} epochs unless --epochs); "
                            f"subsets trained {e} epochs, seeds {seeds}")
        table = aggregate(results, setting.target)
        note = summ.pop("note", None)
        md = markdown(setting, table, summ, importance)
        out_dir.mkdir(parents=True, exist_ok=True)
        plot_curves(out_dir / "accuracy_vs_mb.png", results, setting)
        if importance:
            plot_importance(out_dir / "importance.png", importance, None,
                            f"VIMADMM on {setting.dataset}: party importance (mean over seeds)")
        summary = {"dataset": args.dataset, "setting": asdict(setting) | {"epochs": epochs}, "lr": lrs,
                   "seeds": args.seeds, "table": table, "ratios": ratios(table), "paper": PAPER,
                   "importance": importance, "summarisation": summ, "summarisation_note": note,
                   "runs": len(results), "wall_seconds": round(time.perf_counter() - t0, 1), "out_dir": str(out_dir)}
        write_text_atomic(out_dir / "table.md", md)
        write_json_atomic(out_dir / "results.json", summary)
        print(md)
        print(f"results in {out_dir}")
        return summary
