"""The options of the VIM family (``--vim-*``): one typed :class:`VIMOptions` (:mod:`secvfl.options`) that vimsgd,
vimadmm and vimadmm-j declare as their ``options_type``; read with ``cfg.options_for(VIMOptions)``.

None means "not given": the algorithm's own default applies (:meth:`VIMOptions.lr_for`, :meth:`VIMOptions.beta_for`,
:meth:`VIMOptions.rho_for`); see :data:`DEFAULT_LR` for where they come from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from secvfl.options import Options, option

__all__ = ["VIMOptions", "DEFAULT_LR", "DEFAULT_BETA", "DEFAULT_RHO", "ADMM_ALGOS"]

ADMM_ALGOS = ("vimadmm", "vimadmm-j")
# The defaults at the command line's batch 64 (BENCHMARKS.md, VIM, "At the command line's defaults"; docs/vim/defaults.md).
# Tuned on digits (4 and 8 strips, 10 epochs: `secvfl bench vim-defaults --cases digits:4 digits:8 --options ...`),
# checked on MNIST (7 strips; 4 and 14 for divergence), credit and a9a, which the tuning did not see.
# Weight decay beta: the paper's 0.005 weighs a batch's summed loss (0.005 / 64 = 8e-5 on our batch means); at 0.005
# on batch means the ADMM methods plateau (MNIST, 7 strips: vimadmm 0.95, where VAFL climbs to 0.97). 1e-4, what
# `secvfl reproduce vim` runs for them on MNIST at batch 1024, gained 1-3 points on digits and lifted vimadmm to 0.971
# after one MNIST epoch. vimsgd keeps 0.005: its head norms rank the parties (client importance) only while the
# weight decay balances the scale of bottom and head; at 0.001 it ranked the informative party last on the synthetic
# set of tests/test_vim_explain.py (and gained less than a point on digits).
# Step sizes: vimsgd the paper's 0.3 (0.1 was no better on digits); the ADMM methods 0.01. Digits preferred 0.03
# (0.5-1.5 points), but on MNIST 0.03 held vimadmm at 0.80-0.88 where 0.01 reached 0.97 (likely a stiffer local
# objective for a party with 112 inputs than for one with 16; not measured).
DEFAULT_LR = {"vimsgd": 0.3, "vimadmm": 0.01, "vimadmm-j": 0.01}
DEFAULT_BETA = {"vimsgd": 0.005, "vimadmm": 1e-4, "vimadmm-j": 1e-4}
DEFAULT_RHO = {"vimadmm": 2.0, "vimadmm-j": 0.5}


def _positive(v: float) -> bool:
    return 0 < v < math.inf


@dataclass(frozen=True)
class VIMOptions(Options):
    title = "VIM family (vimsgd, vimadmm, vimadmm-j)"
    description = (
        "When VIM pays off: a vimadmm round sends B (d_f + 2 d_c) + d_f d_c floats per party against vafl's 2 B d_f "
        "(B --batch-size, d_f --embedding-dim, d_c 1 for a binary task, else the classes), more than vafl with many "
        "classes and a small d_f (MNIST, d_f 16: 1.2x a round with its heads), so it pays off only by needing fewer rounds. At the "
        "defaults (secvfl bench vim-defaults, 5 epochs) vimadmm reached vafl's accuracy with 4.1x fewer bytes on "
        "MNIST in 7 strips and on digits, 1.65x fewer on credit, and the same bytes on a9a. vimadmm-j sends 3 B d_c "
        "(binary: about a tenth of vafl's) but stayed below vafl on MNIST (0.943 against 0.970). BENCHMARKS.md, "
        "VIM, \"At the command line's defaults\", has the table.")

    vim_lr: float | None = option(
        None, "vim*: step size eta of the label party's SGD and of the parties' SGD with momentum (default: vimsgd "
              "0.3 (the paper's), vimadmm and vimadmm-j 0.01; their local steps undo a step that blows up and halve "
              "the step size for the round, so a larger one does not diverge, though it may train worse); --lr/"
              "--optimizer do not apply",
        check=(lambda v: 0 < v <= 10, "in (0, 10]"))
    vim_rho: float | None = option(
        None, "vimadmm/vimadmm-j: ADMM penalty rho (default 2 for vimadmm, 0.5 for vimadmm-j)",
        check=(_positive, "a finite number > 0"), algos=ADMM_ALGOS)
    vim_local_steps: int = option(
        20, "vimadmm/vimadmm-j: local SGD steps tau a party takes on each batch per round",
        check=(lambda v: 1 <= v <= 1000, "an integer in [1, 1000]"), algos=ADMM_ALGOS)
    vim_prox: float = option(
        0.0, "vimadmm/vimadmm-j: proximal weight C of the parties' local steps: each adds gamma/2 ||o - o_0||^2, "
             "gamma = C (M - 1) rho, to eq. 10/19/20 so that M parties closing the same gap in parallel do not "
             "overshoot it (proximal Jacobian ADMM; 0: the paper's objective)", metavar="C",
        check=(lambda v: 0 <= v <= 100, "in [0, 100]"), algos=ADMM_ALGOS)
    vim_residual: Literal["new-heads", "round-start"] = option(
        "new-heads", "vimadmm: the other parties' heads in the residual s^k sent to party k: new-heads (eq. 9 as "
                     "printed: z - sum_{i != k} h^i W_i^{t+1}) or round-start (W_i^t, the heads the round's z came "
                     "from, as in the authors' code; trains on MNIST where new-heads diverges)",
        algos=("vimadmm",))
    vim_momentum: float = option(
        0.9, "vim*: momentum of the parties' SGD", check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    vim_beta: float | None = option(
        None, "vim*: L2 weight beta on every bottom model and linear head, as weight decay on batch-mean losses "
              "(default: vimsgd 0.005, vimadmm and vimadmm-j 1e-4: the paper's 0.005 weighs a batch's summed loss, "
              "and on batch means it holds the ADMM methods below VAFL; --weight-decay does not apply)",
        check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    vim_noise_party: int | None = option(
        None, "vim*: denoising (client explainability): this party (0-based index K, party K) adds N(0, S^2) noise, "
              "S = --vim-noise-std, to its own features in every split, training and test; its head's norm should "
              "fall (the paper's noisy client 7 on MNIST)", metavar="K",
        check=(lambda v: v >= 0, "a party index >= 0"))
    vim_noise_std: float = option(
        1.0, "vim*: standard deviation of the noise of --vim-noise-party (the paper's sigma~: 1 on MNIST)",
        metavar="S", check=(_positive, "a finite number > 0"))
    vim_validate_noise: float | None = option(
        None, "vim*: noise validation (client explainability): after training, each party in turn adds N(0, S^2) "
              "noise to its own test features and the test accuracy drop is reported per party beside its head "
              "norm (summary.json 'vim', vim_importance.png; the paper's sigma-bar: 10 on MNIST)", metavar="S",
        check=(_positive, "a finite number > 0"))
    vim_z_tol: float = option(
        1e-9, "vimadmm/vimadmm-j: the z-update stops when every sample's gradient is below this (max norm, float64)",
        check=(lambda v: 0 < v <= 1e-3, "in (0, 1e-3]"), algos=ADMM_ALGOS, cli=False)

    def lr_for(self, algo: str) -> float:
        return self.vim_lr if self.vim_lr is not None else DEFAULT_LR[algo]

    def beta_for(self, algo: str) -> float:
        return self.vim_beta if self.vim_beta is not None else DEFAULT_BETA[algo]

    def rho_for(self, algo: str) -> float:
        return self.vim_rho if self.vim_rho is not None else DEFAULT_RHO[algo]

    def prox_for(self, algo: str, parties: int) -> float:
        """gamma = C (M - 1) rho for M parties."""
        return self.vim_prox * max(parties - 1, 0) * self.rho_for(algo)
