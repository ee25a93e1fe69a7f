"""What the three VIM algorithms share: building the bottom models, the public batch schedule, the rounds' loop,
prediction and party importance. Each algorithm says how a party and the label party are built and what a round
does after the parties' outputs reached the label party (:meth:`VIMAlgorithm.round`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from secvfl.algorithms.base import (
    LABEL_PARTY,
    BatchSchedule,
    FeatureLabelAlgorithm,
    ProgressFn,
    RunContext,
    feature_party_names,
)
from secvfl.algorithms.vim.explain import explain_report
from secvfl.algorithms.vim.options import VIMOptions
from secvfl.errors import ConfigError
from secvfl.handles import FeatureHandle, LabelHandle
from secvfl.models import make_bottom, output_dim
from secvfl.parties import optimizer_kernels
from secvfl.transport.network import Network

__all__ = ["VIMAlgorithm", "party_sgd", "label_sgd", "INDIVIDUAL_EMBEDDINGS", "SGD_NEEDS_FEEDBACK",
           "ADMM_NEEDS_FEEDBACK", "ADMM_EXACT_LOGITS"]

# AlgorithmTraits.individual_outputs of vimsgd and vimadmm (why CKKS and masking refuse them)
INDIVIDUAL_EMBEDDINGS = ("the label party needs each party's embedding h^k to step that party's head W_k; use "
                         "--algo vimadmm-j, whose label party needs only the sum of the parties' logits")

# AlgorithmTraits.needs_error_feedback / exact_outputs (why compression without error feedback, or of the outputs,
# is refused); the figures are `secvfl train --dataset breast_cancer --compress SPEC` with the defaults
SGD_NEEDS_FEEDBACK = ("every party and the label party step with SGD at --vim-lr (0.3) on each gradient as it arrives, "
                      "and without memory a sparsified gradient's error (for rand-k n/k - 1 times its size) makes the "
                      "steps diverge (randk:0.1: non-finite gradients in the first epoch); add +ef (randk:0.1+ef: "
                      "0.93 test accuracy) or use a codec (quant:8, fp16)")
ADMM_NEEDS_FEEDBACK = ("the parties take --vim-local-steps steps towards each round's dual and residual, so a "
                       "sparsified dual or residual without memory is a wrong target every round (randk:0.1: 0.47 "
                       "test accuracy, below the majority class); add +ef (randk:0.1+ef) or use a codec (quant:8, "
                       "fp16)")
ADMM_EXACT_LOGITS = ("the label party solves each row's z-update from the sum of the parties' logits, and a per-batch "
                     "output keeps no error-feedback memory, so a sparsified logit row is a wrong sum (binary tasks: "
                     "top-k keeps one row in ten; breast_cancer, topk:0.1+ef: 0.62 test accuracy); compress the "
                     "backward direction only (--compress-backward randk:0.1+ef: 0.99) or use a codec (quant:8, fp16)")

def party_sgd(params, options: VIMOptions, lr: float, beta: float,  # noqa: ANN001 - parameters
              device: torch.device | None = None) -> torch.optim.Optimizer:
    """The parties' optimiser: SGD with momentum and weight decay beta (the paper's setting); ``device``: where the
    parameters are (fused kernels on CUDA, :func:`~secvfl.parties.optimizer_kernels`)."""
    return torch.optim.SGD(params, lr=lr, momentum=options.vim_momentum, weight_decay=beta,
                           **optimizer_kernels(device))


def label_sgd(params, options: VIMOptions, lr: float, beta: float,  # noqa: ANN001 - parameters
              device: torch.device | None = None) -> torch.optim.Optimizer:
    """The label party's optimiser: plain SGD with weight decay beta."""
    return torch.optim.SGD(params, lr=lr, weight_decay=beta, **optimizer_kernels(device))


class VIMAlgorithm(FeatureLabelAlgorithm):
    """A VIM algorithm: feature party k runs a bottom model (``--hidden``, output ``--embedding-dim`` = the paper's
    ``d_f``); the prediction is ``sum_k h^k W_k + b``. ``aggregated``: whether the label party receives the sum of
    the parties' outputs through the network's aggregation (VIMADMM-J) or each party's output (VIMSGD, VIMADMM)."""

    options_type = VIMOptions
    aggregated: ClassVar[bool] = False
    unused_settings = {
        "lr": "it trains with SGD at its own step size, --vim-lr",
        "optimizer": "it trains with SGD (momentum --vim-momentum at the parties); its step size is --vim-lr",
        "weight_decay": "its L2 weight is --vim-beta",
        "head_hidden": "its label party's heads are linear, one W_k per party (--embedding-dim sets their input d_f)",
    }

    def message_widths(self) -> dict[str, int]:
        # the parties' outputs: embeddings h^k (VIMSGD, VIMADMM) or local logits h^k W_k (VIMADMM-J)
        return {kind: self.d_f if kind == "embedding" else self.d_c for kind in self.traits.forward_kinds}

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        cfg, data, part = ctx.config, ctx.data, ctx.partition
        self.options = cfg.options_for(VIMOptions)
        self.lr = self.options.lr_for(self.name)
        self.beta = self.options.beta_for(self.name)
        self.d_f, self.d_c = cfg.embedding_dim, output_dim(data.n_classes)
        self.feature_handles: list[FeatureHandle] = []
        for k, name in enumerate(feature_party_names(part.n_blocks)):
            bottom = make_bottom(cfg.bottom, len(part.blocks[k]), self.d_f, list(cfg.hidden), part.block_shapes[k],
                                 channels=part.channels).to(device=ctx.device, dtype=ctx.dtype)
            blocks = {s: part.take(getattr(data, f"X_{s}"), k) for s in ("train", "val", "test")}
            observed = {s: ctx.masks[s][:, k] for s in ("train", "val", "test")}
            self.feature_handles.append(self.make_party(name, bottom, blocks, observed))
        self._add_denoising_noise(seed=cfg.seed)
        labels = {s: getattr(data, f"y_{s}") for s in ("train", "val", "test")}
        self.label_handle = self.make_label(labels, data.n_classes)
        self.names = [h.name for h in self.feature_handles]
        # the public batch order, and the epoch being trained (None outside train_epoch), for protocol hooks
        self.schedule = BatchSchedule(self.train_rows(), cfg.batch_size, cfg.seed)

    def _add_denoising_noise(self, seed: int) -> None:
        """``--vim-noise-party K``: party K adds noise to its own features of every split (:mod:`.noise`)."""
        o = self.options
        if o.vim_noise_party is None:
            if o.vim_noise_std != VIMOptions.vim_noise_std:
                raise ConfigError("--vim-noise-std applies only with --vim-noise-party K (the party whose features "
                                  "are noised); add it or drop --vim-noise-std")
            return
        if o.vim_noise_party >= len(self.feature_handles):
            raise ConfigError(f"--vim-noise-party {o.vim_noise_party}: there are {len(self.feature_handles)} feature "
                              f"parties (0 to {len(self.feature_handles) - 1}); pick one of them")
        handle = self.feature_handles[o.vim_noise_party]
        for split in ("train", "val", "test"):
            handle.add_feature_noise(split, o.vim_noise_std, seed)

    def report(self, run_dir: Path | None) -> dict[str, Any]:
        return explain_report(self, run_dir)

    # -- what each algorithm builds and does ----------------------------------------------------------------------
    def make_party(self, name: str, bottom: nn.Module, blocks: dict[str, np.ndarray],
                   observed: dict[str, np.ndarray]) -> FeatureHandle:
        raise NotImplementedError

    def make_label(self, labels: dict[str, np.ndarray], n_classes: int) -> LabelHandle:
        raise NotImplementedError

    def round(self, ids: np.ndarray, present: list[str]) -> float:
        """The rest of a training round once the parties' outputs on rows ``ids`` reached the label party; returns
        the batch loss."""
        raise NotImplementedError

    def party_importance(self) -> dict[str, float]:
        """Party name -> ``||W_k||_F`` of its linear head (the paper's client importance), from the party holding it."""
        raise NotImplementedError

    # -- parties ---------------------------------------------------------------------------------------------------
    def step_size(self) -> tuple[str, float]:
        return "--vim-lr", self.lr

    # -- rows and rounds --------------------------------------------------------------------------------------------
    def train_rows(self) -> np.ndarray:
        """Training rows with at least one observed block: a party without the row contributes zeros for it."""
        return np.flatnonzero(self.ctx.masks["train"].any(axis=1))

    def batches_per_epoch(self) -> int:
        return -(-len(self.train_rows()) // self.cfg.batch_size)

    def _forward_all(self, split: str, ids: np.ndarray, train: bool) -> list[str]:
        for h in self.feature_handles:
            h.forward(self.step, split, ids, to=LABEL_PARTY, train=train, aggregated=self.aggregated)
        return self.label_handle.receive(self.names, aggregated=self.aggregated)

    def train_epoch(self, epoch: int, progress: ProgressFn | None = None) -> dict[str, float]:
        self.current_epoch = epoch
        try:
            losses = []
            for ids in self.schedule.batches(epoch):
                present = self._forward_all("train", ids, train=True)
                losses.append(self.round(ids, present))
                self.step += 1
                if progress is not None:
                    progress(losses[-1])
            return {"loss": float(np.mean(losses)) if losses else float("nan")}
        finally:
            self.current_epoch = None

    def predict_proba(self, split: str) -> np.ndarray:
        n = self.ctx.rows(split)
        out = []
        for start in range(0, n, self.cfg.eval_batch_size):
            ids = np.arange(start, min(n, start + self.cfg.eval_batch_size))
            self._forward_all(split, ids, train=False)
            out.append(self.label_handle.predict().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, max(2, self.ctx.data.n_classes)))

    def evaluate(self, split: str) -> dict[str, float]:
        if self.ctx.rows(split) == 0:
            return {}
        return self.label_handle.score(split, self.predict_proba(split))
