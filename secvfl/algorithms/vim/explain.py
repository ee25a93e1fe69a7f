"""VIM's client-level explainability at the end of a run: party importance, noise validation and their plot.

Design: flags of ``secvfl train`` (``--vim-validate-noise S``, ``--vim-noise-party K --vim-noise-std S``), not a
separate command, because importance and noise validation are evaluations of the model the run has just trained and
belong in its ``summary.json``; summarisation needs several trainings and is part of ``secvfl reproduce vim``.

* importance: ``||W_k||_F`` per party (:meth:`VIMAlgorithm.party_importance`), and its rank (0 = most important);
* noise validation (``--vim-validate-noise S``): each party in turn adds ``N(0, S^2)`` to its own test features
  (:mod:`.noise`), the label party scores the test split, the party restores its features; reported as the test
  accuracy and its drop from the clean model's, per party;
* ``vim_importance.png``: the head norms as bars, beside the accuracy drops when noise validation ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from secvfl.algorithms.vim.noise import NoisyFeatureHandle
from secvfl.io import save_figure_atomic
from secvfl.plotting import new_figure

if TYPE_CHECKING:
    from secvfl.algorithms.vim.base import VIMAlgorithm

__all__ = ["explain_report", "noise_validation", "plot_importance", "ranking", "VALIDATION_SEED"]

IMPORTANCE_PNG = "vim_importance.png"
VALIDATION_SEED = 7_001  # added to the run seed: the validation noise differs from --vim-noise-party's


def ranking(importance: dict[str, float]) -> list[str]:
    """Party names, most important (largest head norm) first; ties keep party order."""
    return sorted(importance, key=lambda name: -importance[name])


def _accuracy(algo: VIMAlgorithm) -> float:
    return float(algo.evaluate("test")["accuracy"])


def noise_validation(algo: VIMAlgorithm, std: float, seed: int) -> dict[str, Any]:
    """Test accuracy with each party's test features noised by that party in turn (the others clean)."""
    clean = _accuracy(algo)
    per_party = {}
    for handle in algo.feature_handles:
        if not isinstance(handle, NoisyFeatureHandle):
            raise TypeError(f"{handle!r} cannot add noise to its features")
        handle.add_feature_noise("test", std, seed)
        try:
            noisy = _accuracy(algo)
        finally:
            handle.restore_features("test")
        per_party[handle.name] = {"accuracy": noisy, "drop": clean - noisy}
    return {"std": std, "clean_accuracy": clean, "parties": per_party}


def plot_importance(path: Path, importance: dict[str, float], drops: dict[str, float] | None, title: str) -> None:
    """Bars of ``||W_k||_F`` per party and, when given, of the test accuracy drop under noise beside them."""
    names = list(importance)
    fig = new_figure((max(6.0, 0.55 * len(names) + 2), 3.6 if drops is None else 6.0))
    axes = fig.subplots(1 if drops is None else 2, 1, squeeze=False)[:, 0]
    ticks = [n.removeprefix("party") for n in names]
    axes[0].bar(ticks, [importance[n] for n in names], color="tab:blue")
    axes[0].set_ylabel("||W_k||_F")
    axes[0].set_title(title)
    if drops is not None:
        axes[1].bar(ticks, [100 * drops[n] for n in names], color="tab:red")
        axes[1].set_ylabel("test accuracy drop (points)")
    axes[-1].set_xlabel("party")
    fig.tight_layout()
    save_figure_atomic(fig, path)


def explain_report(algo: VIMAlgorithm, run_dir: Path | None) -> dict[str, Any]:
    """The ``vim`` entry of summary.json; writes ``vim_importance.png`` into ``run_dir`` when given."""
    options = algo.options
    importance = algo.party_importance()
    out: dict[str, Any] = {"importance": importance, "ranking": ranking(importance)}
    if options.vim_noise_party is not None:
        out["noisy_party"] = {"party": algo.names[options.vim_noise_party], "std": options.vim_noise_std}
    drops = None
    if options.vim_validate_noise is not None and algo.ctx.rows("test"):
        out["noise_validation"] = noise_validation(algo, options.vim_validate_noise, algo.cfg.seed + VALIDATION_SEED)
        drops = {n: v["drop"] for n, v in out["noise_validation"]["parties"].items()}
    if run_dir is not None:
        plot_importance(run_dir / IMPORTANCE_PNG, importance, drops,
                        f"{algo.name} on {algo.cfg.dataset}: party importance")
        out["plot"] = IMPORTANCE_PNG
    return {"vim": out}
