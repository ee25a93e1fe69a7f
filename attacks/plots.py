"""Plots of attack results (PNG, drawn through :mod:`secvfl.plotting`)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from secvfl.plotting import new_figure, save_figure_atomic

__all__ = ["plot_label_scores", "plot_completion", "plot_reconstruction", "plot_grid"]


_TITLE_PT = 11


def _wrapped(text: str, width_in: float) -> str:
    """``text`` in lines that fit ``width_in`` inches at the title font (a character is about 0.55 em wide)."""
    chars = max(20, int(width_in * 72 / (0.55 * _TITLE_PT)))
    return "\n".join(textwrap.wrap(text, chars)) or text


def _title(fig, text: str, ax=None) -> None:  # noqa: ANN001 - matplotlib figure and axes
    """A title that fits: wrapped to the axes (or, for a figure title, the figure) width, never cut off."""
    if ax is None:
        fig.suptitle(_wrapped(text, 0.95 * fig.get_figwidth()), fontsize=_TITLE_PT)
    else:
        width = ax.get_position().width * fig.get_figwidth()
        ax.set_title(_wrapped(text, width), fontsize=_TITLE_PT)


def _mean_roc(scores: Sequence[np.ndarray], truth: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Vertical average of the per-batch ROC curves (its area is the mean per-batch AUC)."""
    from sklearn.metrics import roc_curve

    grid = np.linspace(0, 1, 201)
    curves = []
    for s, y in zip(scores, truth, strict=True):
        if len(np.unique(y)) == 2:
            fpr, tpr, _ = roc_curve(y, s)
            curves.append(np.interp(grid, fpr, tpr))
    return grid, (np.mean(curves, axis=0) if curves else np.full_like(grid, np.nan))


def plot_label_scores(path: Path, scores: Sequence[np.ndarray], truth: Sequence[np.ndarray], aucs: Sequence[float],
                      title: str, ceiling: float | None = None) -> Path:
    """Left: mean of the per-batch ROC curves. Right: histogram of per-batch AUCs."""
    fig = new_figure((9, 4))
    a, b = fig.subplots(1, 2)
    fpr, tpr = _mean_roc(scores, truth)
    a.plot(fpr, tpr, label=f"attack (mean per-batch AUC {np.mean(aucs):.3f})")
    a.plot([0, 1], [0, 1], "k--", lw=0.8, label="chance")
    a.set_xlabel("false positive rate")
    a.set_ylabel("true positive rate")
    a.set_title("mean per-batch ROC")
    a.legend(loc="lower right", fontsize=8)
    b.hist(aucs, bins=30, range=(0, 1), color="tab:blue")
    b.axvline(0.5, color="k", ls="--", lw=0.8)
    if ceiling is not None:
        b.axvline(ceiling, color="tab:red", ls=":", lw=1, label=f"randomized-response ceiling {ceiling:.3f}")
        b.legend(fontsize=8)
    b.set_xlabel("per-batch AUC")
    b.set_ylabel("batches")
    _title(fig, title)
    return save_figure_atomic(fig, path)


def plot_completion(path: Path, rows: Sequence[dict[str, Any]], title: str) -> Path:
    """Top-1 accuracy against the number of known labels: attack vs supervised-only baselines (train and test)."""
    fig = new_figure((6, 4))
    ax = fig.subplots()
    ns = [r["known_labels"] for r in rows]
    series = [
        ("attack (train rows)", "train_accuracy", "tab:red", "-"),
        ("attack (test rows)", "test_accuracy", "tab:red", "--"),
        ("supervised, same bottom", "supervised_bottom_train_accuracy", "tab:blue", "-"),
        ("supervised, from scratch", "scratch_train_accuracy", "tab:gray", "-"),
    ]
    for extra in ("passive_train_accuracy",):
        if any(extra in r for r in rows):
            series.append(("passive completion (honest run)", extra, "tab:green", "-"))
    for label, key, color, style in series:
        vals = [r.get(key) for r in rows]
        if all(v is not None for v in vals):
            ax.plot(ns, vals, style, marker="o", color=color, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("known labels N")
    ax.set_ylabel("top-1 accuracy")
    _title(fig, title, ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure_atomic(fig, path)


def plot_reconstruction(path: Path, details: dict[str, Any], title: str) -> Path:
    """Per-feature MSE of the reconstruction against the uniform-random and constant-0.5 baselines."""
    mse = np.asarray(details["mse_per_feature"])
    rand = np.asarray(details["random_guess_mse_per_feature"])
    x = np.arange(len(mse))
    fig = new_figure((max(5, 0.5 * len(mse) + 2), 4))
    ax = fig.subplots()
    ax.bar(x - 0.2, mse, width=0.4, label=f"attack (mean {details['mse']:.4f})", color="tab:red")
    ax.bar(x + 0.2, rand, width=0.4, label=f"uniform random guess (mean {details['random_guess_mse']:.4f})",
           color="tab:gray")
    ax.axhline(details["constant_half_mse"], color="k", ls=":", lw=1,
               label=f"always 0.5 (mean {details['constant_half_mse']:.4f})")
    if "mean_guess_mse_per_feature" in details:
        ax.plot(x, details["mean_guess_mse_per_feature"], "k_", markersize=18, mew=2,
                label=f"each feature's mean (mean {details['mean_guess_mse']:.4f})")
    ax.set_xlabel("target feature")
    ax.set_ylabel("MSE, features scaled to [0, 1]")
    _title(fig, title, ax)
    ax.legend(fontsize=8)
    return save_figure_atomic(fig, path)


def plot_grid(path: Path, rows: Sequence[dict[str, Any]], attacks: Sequence[str], mp_name: str, title: str) -> Path:
    """AP against MP per defence and attack (means over seeds, bars: standard deviations)."""
    fig = new_figure((7, 5))
    ax = fig.subplots()
    markers = "osD^v<>"
    for i, attack in enumerate(attacks):
        pts = [r for r in rows if r.get("ap", {}).get(attack) is not None]
        if not pts:
            continue
        xs = [r["mp"]["mean"] for r in pts]
        ys = [r["ap"][attack]["mean"] for r in pts]
        ax.errorbar(xs, ys, xerr=[r["mp"]["std"] for r in pts], yerr=[r["ap"][attack]["std"] for r in pts],
                    fmt=markers[i % len(markers)], capsize=2, label=attack)
        for r, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(r["defence"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(0.5, color="k", ls="--", lw=0.8)
    ax.set_xlabel(f"main-task performance MP (test {mp_name})")
    ax.set_ylabel("attack performance AP (mean per-batch AUC)")
    _title(fig, title, ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure_atomic(fig, path)
