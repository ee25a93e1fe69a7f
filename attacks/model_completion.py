"""Model completion (Fu et al., "Label Inference Attacks Against Vertical Federated Learning", USENIX Security 2022).

Threat model (passive): an honest-but-curious feature party, after training. It holds its trained bottom model and
its own feature rows (training and, later, test rows), and knows the labels of a handful of training examples
(``known``: row id -> class; e.g. customers it can label itself). It adds an inference head on its bottom model and
trains the completed model on those few labels plus its unlabelled rows, semi-supervised. Two methods:

- ``label-spreading`` (default): pseudo-labels spread from the known labels over a nearest-neighbour graph of the
  trained bottom model's embeddings (Zhou et al. 2004), kept where confident and where a supervised-only completion
  agrees, then self-training from that supervised completion on labelled + pseudo-labelled rows.
- ``mixmatch`` (Berthelot et al. 2019, as in Fu et al.; image parties only): guessed, sharpened labels for shifted
  views of unlabelled rows, MixUp across labelled and unlabelled rows.

Label spreading is the default because it completed more of the unknown training rows correctly than MixMatch
(however tuned) and than both supervised-only baselines (MNIST quadrants: BENCHMARKS.md, "Attacks and defences").
Nothing of any other party is used. The active variant is the same attack on a bottom model trained with :class:`~attacks.malicious_optimizer.
MaliciousOptimizer`.

The attack is measured against two baselines on the same N labels: the completed model trained supervised-only
(isolates the semi-supervised gain) and a fresh model of the same architecture trained supervised-only from scratch
(what the attacker could do without having taken part in training).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attacks.base import ATTACKS, Attack, AttackResult, RunOutline
from attacks.metrics import accuracy, majority_rate
from secvfl.errors import ConfigError, DataError

__all__ = [
    "CompletionConfig",
    "CompletedModel",
    "complete_model",
    "predict",
    "PassiveModelCompletion",
    "ActiveModelCompletion",
]

METHODS = ("auto", "supervised", "label-spreading", "mixmatch")


@dataclass
class CompletionConfig:
    epochs: int = 30
    steps_per_epoch: int = 0  # 0: one pass over the unlabelled rows, capped at max_steps_per_epoch
    max_steps_per_epoch: int = 50
    batch_size: int = 64
    lr: float = 2e-3
    bottom_lr_scale: float = 0.1  # fine-tune the attacker's bottom model more gently than the new head; 0 freezes it
    weight_decay: float = 5e-4
    head_hidden: int = 64
    method: str = "auto"  # auto: label-spreading (measured better than MixMatch on MNIST quadrants, see module doc)
    # label spreading (tables): pseudo-labels propagated over a kNN graph of the bottom model's embeddings
    neighbours: int = 10
    spreading_alpha: float = 0.99
    threshold: float = 0.8  # keep pseudo-labels whose propagated class share is at least this
    lambda_u: float = 1.0
    noise: float = 0.05  # table augmentation: Gaussian noise, in units of each feature's standard deviation
    # MixMatch (images)
    mixmatch_lambda_u: float = 10.0  # the paper's 75 needs far longer schedules than an attack run has
    temperature: float = 0.5
    alpha: float = 0.75
    k_augment: int = 2
    shift: int = 2
    rampup_fraction: float = 0.4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown completion method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError("completion needs epochs >= 1, batch_size >= 1 and lr > 0")
        if self.bottom_lr_scale < 0:
            raise ConfigError(f"bottom_lr_scale must be >= 0 (0 freezes the bottom), got {self.bottom_lr_scale}")


class CompletedModel(nn.Module):
    """The attacker's bottom model with an inference head on top."""

    def __init__(self, bottom: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.bottom, self.head = bottom, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bottom(x).flatten(1))


def _reset(module: nn.Module) -> None:
    for m in module.modules():
        if m is not module and hasattr(m, "reset_parameters"):
            m.reset_parameters()
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _build(bottom: nn.Module, n_classes: int, sample: torch.Tensor, hidden: int, scratch: bool) -> CompletedModel:
    own = copy.deepcopy(bottom).to("cpu", torch.float32)  # never touch the attacker's live model
    if scratch:
        _reset(own)
    with torch.no_grad():
        width = own(sample[:1]).flatten(1).shape[1]
    head: nn.Module = (nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))
                       if hidden > 0 else nn.Linear(width, n_classes))
    return CompletedModel(own, head)


class _Augment:
    """Augmentations of the attacker's own rows (row shape preserved): pixel shifts for images, noise for tables."""

    def __init__(self, x: torch.Tensor, image_shape: tuple[int, int] | None, cfg: CompletionConfig,
                 gen: torch.Generator) -> None:
        self.image_shape, self.cfg, self.gen = image_shape, cfg, gen
        self.std = x.reshape(x.shape[0], -1).std(dim=0).nan_to_num(0.0).clamp_min(1e-6)

    def shift(self, x: torch.Tensor) -> torch.Tensor:
        """Random translation by up to ``shift`` pixels (zero padding), independently per image (every channel of a
        colour image alike: its rows are channel-major)."""
        assert self.image_shape is not None
        s, (h, w) = self.cfg.shift, self.image_shape
        channels = x[0].numel() // (h * w) if x.shape[0] else 1
        img = F.pad(x.reshape(x.shape[0], channels, h, w), (s, s, s, s))
        dy = torch.randint(0, 2 * s + 1, (x.shape[0],), generator=self.gen)
        dx = torch.randint(0, 2 * s + 1, (x.shape[0],), generator=self.gen)
        out = torch.stack([img[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(x.shape[0])])
        return out.reshape(x.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.image_shape is not None:
            return self.shift(x)
        flat = x.reshape(x.shape[0], -1)
        noise = torch.randn(flat.shape, generator=self.gen) * (self.cfg.noise * self.std)
        return (flat + noise).reshape(x.shape)


def _sharpen(p: torch.Tensor, t: float) -> torch.Tensor:
    p = p ** (1.0 / t)
    return p / p.sum(dim=1, keepdim=True)


def complete_model(bottom: nn.Module, n_classes: int, x_labelled: Any, y_labelled: Any, x_unlabelled: Any = None, *,
                   config: CompletionConfig | None = None, image_shape: tuple[int, int] | None = None,
                   scratch: bool = False) -> CompletedModel:
    """Train a completed model (a copy of ``bottom`` + a new head) on few labels and, optionally, unlabelled rows.

    ``method="supervised"`` or no unlabelled rows gives the supervised-only baseline; ``scratch=True`` re-initialises
    the copied bottom model (the no-participation baseline) and trains it at the full learning rate.
    """
    cfg = config or CompletionConfig()
    x_l = torch.as_tensor(np.asarray(x_labelled), dtype=torch.float32)
    y_l = torch.as_tensor(np.asarray(y_labelled), dtype=torch.int64).reshape(-1)
    if x_l.shape[0] != y_l.shape[0] or x_l.shape[0] == 0:
        raise DataError(f"need one label per labelled row and at least one row; got {x_l.shape[0]} rows, "
                        f"{y_l.shape[0]} labels")
    if y_l.min() < 0 or y_l.max() >= n_classes:
        raise DataError(f"labels must be in 0..{n_classes - 1}")
    method = cfg.method
    if method == "auto":
        method = "label-spreading"
    x_u = None if x_unlabelled is None else torch.as_tensor(np.asarray(x_unlabelled), dtype=torch.float32)
    if x_u is None or x_u.shape[0] == 0:
        method = "supervised"
    # The number of steps depends on how many rows the attacker holds, not on the method, so that supervised-only
    # baselines given the same rows train exactly as long as the attack.
    if method == "mixmatch" and image_shape is None:
        raise ConfigError("MixMatch augments images; pass image_shape=(h, w) or use method='label-spreading'")

    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = _build(bottom, n_classes, x_l, cfg.head_hidden, scratch)
    bottom_lr = cfg.lr if scratch else cfg.lr * cfg.bottom_lr_scale
    groups = [{"params": model.head.parameters(), "lr": cfg.lr}]
    if bottom_lr > 0:
        groups.append({"params": model.bottom.parameters(), "lr": bottom_lr})
    else:
        model.bottom.requires_grad_(False)
    opt = torch.optim.Adam(groups, weight_decay=cfg.weight_decay)
    aug = _Augment(x_u if x_u is not None else x_l, image_shape, cfg, gen)

    pseudo_x = pseudo_y = None
    if method == "label-spreading":
        assert x_u is not None
        spread, confident = _spread_labels(model.bottom, x_l, y_l, x_u, cfg)  # the copy, before any update
        # Keep a pseudo-label only where the graph and a supervised-only completion agree: the graph brings the
        # cluster structure, the agreement filter keeps its mistakes near class boundaries out.
        supervised = complete_model(bottom, n_classes, x_l, y_l, x_u, config=replace(cfg, method="supervised"),
                                    image_shape=image_shape, scratch=scratch)
        keep = confident & (predict(supervised, x_u) == spread)
        pseudo_x, pseudo_y = x_u[torch.as_tensor(keep)], torch.as_tensor(spread[keep], dtype=torch.int64)
        if pseudo_x.shape[0] == 0:
            return supervised  # nothing confident to add
        # Class-balanced sampling: the graph reaches some classes better than others; do not let that skew the model.
        pseudo_w = 1.0 / torch.bincount(pseudo_y, minlength=n_classes).clamp_min(1)[pseudo_y].double()
        # Self-training: continue from the supervised completion with the pseudo-labelled rows added.
        model = supervised
        model.train()
        groups = [{"params": model.head.parameters(), "lr": cfg.lr}]
        if bottom_lr > 0:
            groups.append({"params": model.bottom.parameters(), "lr": bottom_lr})
        opt = torch.optim.Adam(groups, weight_decay=cfg.weight_decay)
    n_u = 0 if x_u is None else x_u.shape[0]
    steps = cfg.steps_per_epoch or max(1, min(cfg.max_steps_per_epoch, math.ceil(max(n_u, x_l.shape[0]) / cfg.batch_size)))
    total = cfg.epochs * steps
    bl = min(cfg.batch_size, x_l.shape[0]) if method == "supervised" else cfg.batch_size
    model.train()
    for step in range(total):
        li = torch.randint(0, x_l.shape[0], (bl,), generator=gen)
        xb, yb = x_l[li], y_l[li]
        if method == "mixmatch":
            assert x_u is not None
            ub = x_u[torch.randint(0, n_u, (cfg.batch_size,), generator=gen)]
            ramp = min(1.0, (step + 1) / max(1.0, cfg.rampup_fraction * total))
            loss = _mixmatch_loss(model, aug, xb, yb, ub, n_classes, cfg, ramp, gen)
        else:
            loss = F.cross_entropy(model(aug(xb)), yb)
            if method == "label-spreading":
                assert pseudo_x is not None and pseudo_y is not None
                pi = torch.multinomial(pseudo_w, cfg.batch_size, replacement=True, generator=gen)
                loss = loss + cfg.lambda_u * F.cross_entropy(model(aug(pseudo_x[pi])), pseudo_y[pi])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return model


@torch.no_grad()
def _embed(bottom: nn.Module, x: torch.Tensor, batch_size: int = 4096) -> np.ndarray:
    was_training = bottom.training
    bottom.eval()
    try:
        return torch.cat([bottom(x[i : i + batch_size]).flatten(1) for i in range(0, x.shape[0], batch_size)]).numpy()
    finally:
        bottom.train(was_training)


def _spread_labels(bottom: nn.Module, x_l: torch.Tensor, y_l: torch.Tensor, x_u: torch.Tensor,
                   cfg: CompletionConfig) -> tuple[np.ndarray, np.ndarray]:
    """Labels for unlabelled rows spread from the known ones in the bottom's embedding space, and which are confident.

    The trained bottom model maps rows of one class close together (that is what training asked of it), so labels
    travel along its nearest-neighbour graph far better than in raw feature space.
    """
    from sklearn.semi_supervised import LabelSpreading

    emb = _embed(bottom, torch.cat([x_l, x_u]))
    emb = (emb - emb.mean(axis=0)) / np.maximum(emb.std(axis=0), 1e-6)
    targets = np.concatenate([y_l.numpy(), np.full(x_u.shape[0], -1)])
    spread = LabelSpreading(kernel="knn", n_neighbors=min(cfg.neighbours, len(targets) - 1),
                            alpha=cfg.spreading_alpha, max_iter=1000)
    with np.errstate(divide="ignore", invalid="ignore"):
        spread.fit(emb, targets)
    dist = np.nan_to_num(spread.label_distributions_[x_l.shape[0] :])
    return spread.classes_[dist.argmax(axis=1)].astype(np.int64), dist.max(axis=1) >= cfg.threshold


def _mixmatch_loss(model: nn.Module, aug: _Augment, xb: torch.Tensor, yb: torch.Tensor, ub: torch.Tensor,
                   n_classes: int, cfg: CompletionConfig, ramp: float, gen: torch.Generator) -> torch.Tensor:
    """MixMatch (Berthelot et al. 2019): guessed, sharpened labels for K views of U, then MixUp over X and U."""
    xl = aug(xb)
    pl = F.one_hot(yb, n_classes).float()
    views = [aug(ub) for _ in range(cfg.k_augment)]
    with torch.no_grad():
        guess = torch.stack([F.softmax(model(v), dim=1) for v in views]).mean(dim=0)
        guess = _sharpen(guess, cfg.temperature)
    all_x = torch.cat([xl, *views])
    all_p = torch.cat([pl, guess.repeat(cfg.k_augment, 1)])
    lam = float(np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen))).beta(cfg.alpha, cfg.alpha))
    lam = max(lam, 1.0 - lam)  # keep each mixed row closer to its own origin (X stays mostly labelled)
    perm = torch.randperm(all_x.shape[0], generator=gen)
    mixed_x = lam * all_x + (1 - lam) * all_x[perm]
    mixed_p = lam * all_p + (1 - lam) * all_p[perm]
    logits = model(mixed_x)
    n = xl.shape[0]
    loss_x = -(mixed_p[:n] * F.log_softmax(logits[:n], dim=1)).sum(dim=1).mean()
    loss_u = ((F.softmax(logits[n:], dim=1) - mixed_p[n:]) ** 2).mean()
    return loss_x + cfg.mixmatch_lambda_u * ramp * loss_u


@torch.no_grad()
def predict(model: nn.Module, x: Any, batch_size: int = 2048) -> np.ndarray:
    x = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    model.eval()
    return torch.cat([model(x[i : i + batch_size]).argmax(dim=1) for i in range(0, x.shape[0], batch_size)]).numpy()


_PASSIVE = (
    "attacker: one honest-but-curious feature party after training; holds its trained bottom model, its own feature "
    "rows (training and test) and the labels of N training examples it knows; completes its bottom model with an "
    "inference head, semi-supervised; uses nothing of any other party."
)


@ATTACKS.register("model-completion")
class PassiveModelCompletion(Attack):
    name = "model-completion"
    metric = "accuracy"
    threat_model = _PASSIVE
    reads = "it completes its party's trained bottom model"

    @classmethod
    def check(cls, run: RunOutline, *, known_labels: tuple[int, ...] = (40,), method: str = "auto",
              **options: Any) -> None:
        super().check(run, **options)
        if not known_labels or min(known_labels) < 1:
            raise ConfigError(f"--known-labels needs numbers of known labels >= 1, got {list(known_labels)}")
        if method == "mixmatch" and not run.image_parties:
            raise ConfigError(f"--completion-method mixmatch augments images and {run.dataset} gives its parties no "
                              "image regions; use --completion-method label-spreading (or auto)")

    def __init__(self, config: CompletionConfig | None = None, image_shape: tuple[int, int] | None = None,
                 baselines: bool = True) -> None:
        self.config = config or CompletionConfig()
        self.image_shape = image_shape
        self.baselines = baselines

    def run(self, *, bottom: nn.Module, features: Any, known: Mapping[int, int], labels: Any, n_classes: int,
            test_features: Any = None, test_labels: Any = None, **_: Any) -> AttackResult:
        """``features``: the attacker's training rows, row id = index; ``labels``: truth for those rows (scoring);
        ``known``: row id -> label the attacker knows. AP = top-1 accuracy on the training rows it did not know."""
        x = np.asarray(features, dtype=np.float32)
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
        if x.shape[0] != y.shape[0]:
            raise DataError(f"{x.shape[0]} feature rows but {y.shape[0]} labels")
        if not known:
            raise ConfigError("model completion needs at least one known label (e.g. --known-labels 40)")
        ids = np.fromiter((int(i) for i in known), dtype=np.int64)
        if ids.min() < 0 or ids.max() >= x.shape[0]:
            raise DataError(f"known row ids must index the {x.shape[0]} training rows")
        y_known = np.array([int(known[int(i)]) for i in ids], dtype=np.int64)
        unknown = np.ones(x.shape[0], dtype=bool)
        unknown[ids] = False
        has_test = test_features is not None and test_labels is not None
        x_test = np.asarray(test_features, dtype=np.float32) if has_test else None
        y_test = np.asarray(test_labels, dtype=np.int64).reshape(-1) if has_test else None

        def scores(model: nn.Module) -> dict[str, float | None]:
            out: dict[str, float | None] = {"train": accuracy(predict(model, x[unknown]), y[unknown]), "test": None}
            if has_test:
                out["test"] = accuracy(predict(model, x_test), y_test)
            return out

        attack = scores(complete_model(bottom, n_classes, x[ids], y_known, x[unknown], config=self.config,
                                       image_shape=self.image_shape))
        details: dict[str, Any] = {
            "known_labels": len(ids),
            "train_accuracy": attack["train"],
            "test_accuracy": attack["test"],
            "config": asdict(self.config),
        }
        if self.baselines:
            sup_cfg = replace(self.config, method="supervised")
            # Unlabelled rows are passed only so that the baselines train for as many steps as the attack.
            sup = scores(complete_model(bottom, n_classes, x[ids], y_known, x[unknown], config=sup_cfg,
                                        image_shape=self.image_shape))
            scratch = scores(complete_model(bottom, n_classes, x[ids], y_known, x[unknown], config=sup_cfg,
                                            image_shape=self.image_shape, scratch=True))
            details.update(supervised_bottom_train_accuracy=sup["train"], supervised_bottom_test_accuracy=sup["test"],
                           scratch_train_accuracy=scratch["train"], scratch_test_accuracy=scratch["test"])
        return self.result(attack["train"], majority_rate(y[unknown]), **details)


@ATTACKS.register("active-model-completion")
class ActiveModelCompletion(PassiveModelCompletion):
    """Passive completion on a bottom model trained with :class:`~attacks.malicious_optimizer.MaliciousOptimizer`.

    The attack step is identical; what differs is the training run that produced ``bottom`` (the harness trains it
    with the malicious optimizer) -- so the result is only meaningful next to the passive one on an honest run.
    """

    name = "active-model-completion"
    threat_model = (
        "attacker: one malicious feature party; during training it scales its own gradient updates "
        "(r = clamp(1 + gamma g_t / g_(t-1), 1, 5)) so its bottom model carries more of the prediction, and "
        "otherwise follows the protocol; afterwards as in passive model completion. " + _PASSIVE
    )

    @classmethod
    def check(cls, run: RunOutline, *, gamma: float = 1.0, **options: Any) -> None:
        super().check(run, **options)
        if not (math.isfinite(gamma) and gamma >= 0):
            raise ConfigError(f"--gamma must be a finite number >= 0 (0: an honest run), got {gamma}")
