"""Label inference from the gradients a feature party receives (attacker: one feature party).

Threat model shared by every attack here: the attacker is an honest-but-curious feature party. It runs the protocol
faithfully and sees only its own view -- its features, its bottom model, the row ids of each batch, and the
gradients it received for its outputs (after every protocol layer, i.e. exactly what the transport handed it). Some
attacks additionally assume it knows the labels of a few examples (``known``: row id -> class). It never reads the
label party's labels, head or messages.

- :class:`NormScoring` and :class:`DirectionScoring` follow Li et al., "Label Leakage and Protection in Two-party
  Split Learning", ICLR 2022.
- :class:`DirectLabelInference` follows Fu et al., "Label Inference Attacks Against Vertical Federated Learning",
  USENIX Security 2022 (parties send logits, as in ``fdml``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from attacks.base import ATTACKS, Attack, AttackResult, RunOutline
from attacks.metrics import accuracy, best_label_matching, majority_rate, per_batch_auc
from attacks.observations import GradientBatch, observe_gradients
from secvfl.errors import ConfigError, DataError, UnsupportedError

__all__ = [
    "norm_scores",
    "direction_scores",
    "direction_cluster_predictions",
    "direct_predictions",
    "sample_known_labels",
    "NormScoring",
    "DirectionScoring",
    "DirectLabelInference",
]


def _unit_rows(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return np.divide(rows, norms, out=np.zeros_like(rows), where=norms > 0)


def _unit(v: np.ndarray) -> np.ndarray | None:
    n = float(np.linalg.norm(v))
    return v / n if n > 1e-12 else None


def _truth(labels: np.ndarray, ids: np.ndarray) -> np.ndarray:
    if ids.size and (ids.min() < 0 or ids.max() >= len(labels)):
        raise DataError(f"gradient batches refer to row ids up to {int(ids.max())} but only {len(labels)} labels were given")
    return labels[ids]


def _scored_rows(batch: GradientBatch, known: Mapping[int, int]) -> np.ndarray:
    """Rows the attack is scored on: those whose label the attacker did not already know."""
    if not known:
        return np.ones(len(batch.ids), dtype=bool)
    return ~np.isin(batch.ids, np.fromiter(known.keys(), dtype=np.int64, count=len(known)))


# --- attacker-side computations: use only the view and the attacker's own knowledge ---------------------------------


def norm_scores(batches: Sequence[GradientBatch]) -> list[np.ndarray]:
    """L2 norm of each received gradient row.

    Under class imbalance the rare (positive) class is fitted worse, so |p - y| and hence the gradient norm is larger
    for positives: the norm is a label score without any known label.
    """
    return [np.linalg.norm(b.rows, axis=1) for b in batches]


def direction_scores(batches: Sequence[GradientBatch], known_positives: Iterable[int], *,
                     smoothing: float = 0.5) -> list[np.ndarray]:
    """Cosine similarity of each row to the gradient direction of known positive examples.

    With a binary head, d loss / d h_i = (p_i - y_i) J_i: positives and negatives point in opposite directions
    along (nearly) one axis per step. In a batch that contains known positives the reference is the mean of their
    unit gradients (Li et al.). Batches without one use the batch's principal axis (top singular vector of the unit
    rows), oriented to agree with a direction tracked from the nearest batch that had a known positive, so a single
    known positive orients the whole run as long as the head changes little between consecutive steps.
    """
    known = set(int(i) for i in known_positives)
    if not known:
        raise ConfigError("direction scoring needs at least one known positive example (e.g. --known-positives 1)")
    units = [_unit_rows(b.rows) for b in batches]
    principal: list[np.ndarray] = []
    anchors: list[np.ndarray | None] = []
    for b, u in zip(batches, units, strict=True):
        principal.append(np.linalg.svd(u, full_matrices=False)[2][0])
        mask = np.isin(b.ids, list(known))
        anchors.append(_unit(u[mask].mean(axis=0)) if mask.any() else None)
    first = next((t for t, a in enumerate(anchors) if a is not None), None)
    if first is None:
        raise ConfigError(
            "none of the observed batches contains a known positive example, so the gradient direction of the "
            "positive class cannot be oriented; give the attacker a positive example that was trained on"
        )
    refs: list[np.ndarray | None] = [None] * len(batches)

    def follow(order: Iterable[int], track: np.ndarray) -> None:
        for t in order:
            anchor = anchors[t]
            if anchor is not None:
                refs[t] = anchor
                sign = 1.0 if principal[t] @ anchor >= 0 else -1.0
                track = sign * principal[t]
            else:
                sign = 1.0 if principal[t] @ track >= 0 else -1.0
                refs[t] = sign * principal[t]
                track = _unit(smoothing * track + (1 - smoothing) * refs[t])
                if track is None:  # opposite, equal-weight directions cancelled: restart from this batch
                    track = refs[t]

    follow(range(first, len(batches)), anchors[first])
    follow(range(first - 1, -1, -1), anchors[first])
    return [u @ r for u, r in zip(units, refs, strict=True)]


def _spherical_kmeans(u: np.ndarray, k: int, rng: np.random.Generator, iters: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """k-means on the unit sphere (cosine similarity), k-means++ seeding. Returns (assignment, unit centres)."""
    n = len(u)
    centres = [u[rng.integers(n)]]
    for _ in range(1, k):
        dist = np.clip(1.0 - np.max(u @ np.stack(centres).T, axis=1), 0.0, None) ** 2
        total = dist.sum()
        centres.append(u[rng.choice(n, p=dist / total)] if total > 0 else u[rng.integers(n)])
    c = np.stack(centres)
    assign = np.argmax(u @ c.T, axis=1)
    for _ in range(iters):
        new_c = c.copy()
        for j in range(k):
            members = u[assign == j]
            if len(members):
                unit = _unit(members.sum(axis=0))
                if unit is not None:
                    new_c[j] = unit
        c = new_c
        new_assign = np.argmax(u @ c.T, axis=1)
        if np.array_equal(new_assign, assign):
            break
        assign = new_assign
    return assign, c


def direction_cluster_predictions(batches: Sequence[GradientBatch], known: Mapping[int, int], n_classes: int, *,
                                  seed: int = 0, prior_weight: float = 0.5) -> list[np.ndarray]:
    """Multi-class direction attack: cluster each batch's rows by cosine similarity, then name the clusters.

    Under softmax cross-entropy d loss / d h_i = J_i^T (p_i - e_{y_i}), dominated by -J_i^T e_{y_i}: rows of one
    class share a direction. Clusters are matched to classes by the Hungarian method on the known labels in the batch
    (:func:`best_label_matching`), with ties and unlabelled batches resolved by cosine similarity to class prototypes
    (mean matched cluster centres over the batches that had known labels).
    """
    if n_classes < 2:
        raise ConfigError(f"n_classes must be >= 2, got {n_classes}")
    if not known:
        raise ConfigError("clustering direction attack needs known labels to name the clusters (e.g. --known-labels 10)")
    rng = np.random.default_rng(seed)
    clustered = []
    for b in batches:
        u = _unit_rows(b.rows)
        k = min(n_classes, len(u))
        assign, centres = _spherical_kmeans(u, k, rng)
        kn = np.array([int(i) in known for i in b.ids])
        kn_labels = np.array([known[int(i)] for i in b.ids[kn]], dtype=np.int64)
        clustered.append((assign, centres, kn, kn_labels))
    # Class prototypes from batches with known labels (known labels decide the matching there).
    proto_sum = np.zeros((n_classes, batches[0].rows.shape[1]))
    for assign, centres, kn, kn_labels in clustered:
        if kn.any():
            mapping = best_label_matching(assign[kn], kn_labels, len(centres), n_classes)
            for cluster, cls in enumerate(mapping):
                proto_sum[cls] += centres[cluster]
    protos = _unit_rows(proto_sum)
    out = []
    for assign, centres, kn, kn_labels in clustered:
        prior = prior_weight * (centres @ protos.T)
        mapping = best_label_matching(assign[kn], kn_labels, len(centres), n_classes, prior=prior)
        out.append(mapping[assign])
    return out


def direct_predictions(batches: Sequence[GradientBatch]) -> list[np.ndarray]:
    """Labels read off gradients with respect to logits (Fu et al.'s direct label inference).

    Softmax cross-entropy gives d loss / d z = (softmax(z) - e_y) / B: the true class is the only negative entry,
    so it is the arg-min of the row. With a single logit and binary cross-entropy, d loss / d z = (sigmoid(z) - y) / B
    is negative exactly for positives.
    """
    out = []
    for b in batches:
        if b.rows.shape[1] == 1:
            out.append((b.rows[:, 0] < 0).astype(np.int64))
        else:
            out.append(np.argmin(b.rows, axis=1).astype(np.int64))
    return out


def sample_known_labels(batches: Sequence[GradientBatch], labels: np.ndarray, *, per_batch: int = 0, total: int = 0,
                        positives_only: bool = False, seed: int = 0) -> dict[int, int]:
    """Simulate the attacker's prior knowledge: which examples' labels it knows (an evaluation decision).

    ``per_batch``: that many labelled examples in every batch (Li et al.'s setting for direction scoring); ``total``:
    that many distinct examples drawn from all observed rows. ``positives_only`` restricts to class 1.
    """
    labels = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(seed)
    known: dict[int, int] = {}
    if per_batch > 0:
        for b in batches:
            y = _truth(labels, b.ids)
            pool = b.ids[y == 1] if positives_only else b.ids
            if len(pool):
                for i in rng.choice(pool, size=min(per_batch, len(pool)), replace=False):
                    known[int(i)] = int(labels[i])
    if total > 0:
        all_ids = np.unique(np.concatenate([b.ids for b in batches]))
        pool = all_ids[labels[all_ids] == 1] if positives_only else all_ids
        if len(pool) < total:
            raise DataError(f"asked for {total} known examples but only {len(pool)} eligible rows were observed")
        for i in rng.choice(pool, size=total, replace=False):
            known[int(i)] = int(labels[i])
    return known


# --- attacks: run on the view, then score against the truth -----------------------------------------------------------

_FEATURE_PARTY = (
    "attacker: one honest-but-curious feature party; sees its own features, bottom model, batch row ids and the "
    "gradients it received (after every protocol layer); never the label party's labels, head or messages."
)


def _binary_truth(labels: Any) -> np.ndarray:
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    if not np.isin(np.unique(y), (0, 1)).all():
        raise DataError("norm and direction scoring are binary attacks (labels 0/1); use n_classes>2 direction "
                        "clustering or direct inference for multi-class tasks")
    return y


@ATTACKS.register("norm")
class NormScoring(Attack):
    name = "norm"
    metric = "auc"
    threat_model = _FEATURE_PARTY + " Needs no known labels; assumes the positive class is the rarer one."
    binary_only = True

    def run(self, *, gradients: Any, labels: Any, ids: Sequence[Any] | None = None, **_: Any) -> AttackResult:
        """``gradients``: a View or batches (see :func:`observe_gradients`); ``labels``: truth indexed by row id."""
        batches = observe_gradients(gradients, ids=ids)
        y = _binary_truth(labels)
        scores = norm_scores(batches)
        truth = [_truth(y, b.ids) for b in batches]
        summary = per_batch_auc(scores, truth)
        self.scored = {"scores": scores, "truth": truth, "aucs": summary.aucs}  # for plots
        if not summary.aucs:
            raise DataError("every batch had a single class; AUC is undefined (use larger batches)")
        return self.result(summary.mean, 0.5, **summary.as_dict())


@ATTACKS.register("direction")
class DirectionScoring(Attack):
    name = "direction"
    metric = "auc"
    threat_model = (_FEATURE_PARTY + " Knows the labels of a few examples (binary: known positives, in every batch "
                    "or only a few overall; multi-class: a few labelled rows to name gradient clusters).")

    @classmethod
    def check(cls, run: RunOutline, *, known_positives: int = 1, **options: Any) -> None:
        super().check(run, **options)
        if known_positives < 1:
            raise ConfigError(f"--known-positives must be at least 1 (direction scoring orients the gradients by known "
                              f"{'positives' if run.n_classes == 2 else 'labels'}), got {known_positives}")

    def run(self, *, gradients: Any, labels: Any, known: Mapping[int, int], n_classes: int = 2,
            ids: Sequence[Any] | None = None, seed: int = 0, **_: Any) -> AttackResult:
        """Binary: per-batch AUC of cosine scores. Multi-class: accuracy of matched gradient clusters."""
        batches = observe_gradients(gradients, ids=ids)
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
        known = {int(k): int(v) for k, v in known.items()}
        if n_classes == 2:
            y = _binary_truth(y)
            scores = direction_scores(batches, [i for i, c in known.items() if c == 1])
            masks = [_scored_rows(b, known) for b in batches]
            scored = [s[m] for s, m in zip(scores, masks, strict=True)]
            truth = [_truth(y, b.ids)[m] for b, m in zip(batches, masks, strict=True)]
            summary = per_batch_auc(scored, truth)
            self.scored = {"scores": scored, "truth": truth, "aucs": summary.aucs}  # for plots
            if not summary.aucs:
                raise DataError("every batch had a single class among unknown rows; AUC is undefined")
            return self.result(summary.mean, 0.5, known_examples=len(known), **summary.as_dict())
        preds = direction_cluster_predictions(batches, known, n_classes, seed=seed)
        masks = [_scored_rows(b, known) for b in batches]
        pred = np.concatenate([p[m] for p, m in zip(preds, masks, strict=True)])
        truth = np.concatenate([_truth(y, b.ids)[m] for b, m in zip(batches, masks, strict=True)])
        result = AttackResult(self.name, self.threat_model, accuracy(pred, truth), "accuracy", majority_rate(truth),
                              {"known_examples": len(known), "scored_rows": int(truth.size), "n_classes": n_classes})
        return result


@ATTACKS.register("direct")
class DirectLabelInference(Attack):
    name = "direct"
    metric = "accuracy"
    threat_model = (_FEATURE_PARTY + " Its outputs are logits that the label party adds up (fdml), so it receives "
                    "d loss / d logits. Needs no known labels.")

    @classmethod
    def check(cls, run: RunOutline, **options: Any) -> None:
        super().check(run, **options)
        if run.traits.forward_kinds != ("logits",):
            raise UnsupportedError(f"direct label inference reads gradients w.r.t. logits; {run.algo} parties send "
                                   f"{', '.join(run.traits.forward_kinds) or 'nothing'} (use --algo fdml)")

    def run(self, *, gradients: Any, labels: Any, ids: Sequence[Any] | None = None, **_: Any) -> AttackResult:
        batches = observe_gradients(gradients, ids=ids)
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
        pred = np.concatenate(direct_predictions(batches))
        truth = np.concatenate([_truth(y, b.ids) for b in batches])
        return self.result(accuracy(pred, truth), majority_rate(truth), scored_rows=int(truth.size),
                           logit_width=int(batches[0].rows.shape[1]))
