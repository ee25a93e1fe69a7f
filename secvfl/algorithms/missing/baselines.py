"""Baselines for training and inference with missing feature blocks (as in Valdeira et al.), on the same data,
masks, batches and models as LASER-VFL.

All of them are families of independent *split predictors*. A predictor ``P`` has a set of member parties and a
holder: every member ``i`` runs its own representation model ``f^P_i`` (one per predictor it belongs to), the
holder (a member; it has the labels, as every party does in this setting) runs the predictor's head ``g^P`` on the
concatenation of the members' representations, and sends back the gradients. Per step a member sends each holder
ONE embedding message carrying all its representations for that holder's predictors, and receives one gradient
message back; a party's own predictors (holder = itself) exchange nothing.

- **Local**: predictor ``{k}`` held by ``k``; trained on the batches ``k`` observes; ``k`` predicts alone.
- **Ensemble**: the Local predictors; at inference the observed parties exchange their predicted labels and all
  output the majority vote (ties broken at random with the shared seed, so every party outputs the same label).
- **Standard VFL**: one predictor over all K parties held by the last party, trained on fully observed batches
  only; a test row with a missing block cannot be predicted and gets a random label.
- **Combinatorial**: one predictor per non-empty subset (``2^K - 1``), held by its smallest member; a batch trains
  every predictor whose set is contained in the observed set; inference uses the predictor of the observed set.
  Refused for K > 8 (exponential cost).
- **PlugVFL**: one predictor over all K parties held by the active party (the last one); representations of missing
  blocks are zeros, and during training each observed passive party is dropped (zeroed) with probability
  ``--p-drop`` per batch (a shared-seed draw, so a dropped party skips its computation). Batches without the
  active party are skipped; test rows without it get a random label (nobody holds the head).

Threat model: as in :mod:`secvfl.algorithms.missing.laser`: a holder sees its members' representations and the members
see the gradients w.r.t. their own; Ensemble parties see each other's predicted labels at inference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from secvfl.algorithms import ALGORITHMS
from secvfl.algorithms.base import RunContext
from secvfl.algorithms.missing.base import (
    SPLITS,
    FlatOptimizer,
    MissingAlgorithm,
    fusion_head,
    representation_model,
)
from secvfl.algorithms.missing.eval import majority_vote, random_predictions
from secvfl.algorithms.missing.flags import MissingOptions
from secvfl.algorithms.missing.subsets import Subset, nonempty_subsets
from secvfl.data.pattern_sampler import PatternBatch
from secvfl.errors import ConfigError, PartyIsolationError, UnsupportedError
from secvfl.handles import LocalHandle, PartyHandle, local_party, request
from secvfl.messages import Message
from secvfl.models import MLP
from secvfl.parties import require_wire, task_loss
from secvfl.transport.layers import AlgorithmTraits
from secvfl.transport.network import Network

__all__ = [
    "PredictorSpec",
    "PredictorParty",
    "PredictorHandle",
    "PredictorFamily",
    "LocalBaseline",
    "Ensemble",
    "StandardVFL",
    "Combinatorial",
    "PlugVFL",
    "MAX_COMBINATORIAL_PARTIES",
]

MAX_COMBINATORIAL_PARTIES = 8
_VOTE_SALT, _RANDOM_SALT, _DROP_SALT = 0x707E, 0x4A4D, 0xD409


@dataclass(frozen=True)
class PredictorSpec:
    """A split predictor: its member parties (sorted; concatenation order) and the party holding its head."""

    members: Subset
    holder: int

    @property
    def key(self) -> str:
        return "p" + "-".join(map(str, self.members))


def _mlp_layers(models: nn.ModuleDict) -> tuple[dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None, list[bool]]:
    """Per model, its (weight, bias) per layer, if all models are Linear(+ReLU) stacks of identical shapes."""
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    pattern: list[bool] | None = None
    shapes: list[tuple[int, ...]] | None = None
    for key, model in models.items():
        mods = list(model.net) if isinstance(model, MLP) else []
        if not mods:
            return None, []
        lins, relu_after = [], []
        for m in mods:
            if isinstance(m, nn.Linear) and m.bias is not None:
                lins.append((m.weight, m.bias))
                relu_after.append(False)
            elif isinstance(m, nn.ReLU) and relu_after and not relu_after[-1]:
                relu_after[-1] = True
            else:
                return None, []
        these = [tuple(w.shape) for w, _ in lins]
        if (pattern is not None and relu_after != pattern) or (shapes is not None and these != shapes):
            return None, []
        pattern, shapes, layers[key] = relu_after, these, lins
    return (layers, pattern or []) if len(layers) > 1 else (None, [])


class PredictorParty:
    """Party ``index`` of a predictor family: ``f^P_k`` for every predictor ``P`` it belongs to, ``g^P`` for every
    predictor it holds, its feature block and the labels, and one optimiser over all of its parameters."""

    def __init__(
        self,
        name: str,
        index: int,
        blocks: dict[str, np.ndarray],
        labels: dict[str, np.ndarray],
        representations: dict[str, nn.Module],
        heads: dict[str, nn.Module],
        n_classes: int,
        optimizer_spec: tuple[str, float, float],
        *,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.name, self.index, self.device, self.dtype = name, int(index), device, dtype
        self._x = {s: torch.as_tensor(b, dtype=dtype, device=device) for s, b in blocks.items()}
        # A copy (torch.tensor, not as_tensor): every party is given the same label arrays and must not share memory.
        self._y = {s: torch.tensor(v, dtype=torch.long, device=device) for s, v in labels.items()}
        self.f = nn.ModuleDict(representations).to(device=device, dtype=dtype)
        self.g = nn.ModuleDict(heads).to(device=device, dtype=dtype)
        opt_name, lr, wd = optimizer_spec
        # One flat optimiser group per model: predictors not trained on a batch are left alone.
        self._groups = {("f", k): i for i, k in enumerate(self.f)}
        self._groups.update({("g", k): len(self.f) + i for i, k in enumerate(self.g)})
        # Parameter lists cached once: Module.parameters() walks the module tree on every call.
        self._f_params = {k: list(self.f[k].parameters()) for k in self.f}
        self._g_params = {k: list(self.g[k].parameters()) for k in self.g}
        self.optimizer = FlatOptimizer([self._f_params[k] for k in self.f] + [self._g_params[k] for k in self.g],
                                       opt_name, lr, wd)
        self._stepped = False
        self.n_classes = n_classes
        self.loss_fn = task_loss(n_classes)
        self._pending: dict[str, torch.Tensor] = {}  # this step's f^P_k outputs, with their graphs
        self._own_grads: dict[str, torch.Tensor] = {}
        self._expected_from: set[str] = set()
        self._eval: dict[str, torch.Tensor] = {}
        self._training: bool | None = None
        # A party with several representation models of one MLP shape (Combinatorial) runs them as one batched
        # model: (weight, bias) per layer and key, and which layers are followed by a ReLU.
        self._stacked: tuple[list[str], torch.Tensor] | None = None
        self._layers, self._relu_after = _mlp_layers(self.f)

    def __repr__(self) -> str:
        return f"PredictorParty({self.name!r})"

    def _mode(self, train: bool) -> None:
        if self._training is not train:
            self.f.train(train)
            self.g.train(train)
            self._training = train

    # -- member side ------------------------------------------------------------------------------------------
    def represent(
        self, step: int, split: str, ids: np.ndarray, by_holder: dict[str, list[str]], *, train: bool
    ) -> list[Message]:
        """Run ``f^P_k`` for the predictors listed per holder name; one embedding message per other holder."""
        x = self._x[split][torch.as_tensor(ids, device=self.device)]
        self._mode(train)
        out: list[Message] = []
        store = self._pending if train else self._eval
        store.clear()
        if train:
            self._own_grads.clear()
            self._expected_from = {h for h in by_holder if h != self.name}
        all_keys = [key for keys in by_holder.values() for key in keys]
        with torch.set_grad_enabled(train):
            if self._layers is not None and len(all_keys) > 1:
                stacked = self._stacked_forward(x, all_keys)
                store.update(zip(all_keys, stacked.unbind(0), strict=True))
                if train:
                    self._stacked = (all_keys, stacked)
            else:
                store.update((key, self.f[key](x)) for key in all_keys)
                if train:
                    self._stacked = None
        for holder, keys in by_holder.items():
            if holder != self.name:
                out.append(Message("embedding", self.name, holder, step, {key: store[key].detach() for key in keys}))
        return out

    def _stacked_forward(self, x: torch.Tensor, keys: list[str]) -> torch.Tensor:
        """All listed MLPs on the same rows at once: one batched matrix product per layer -> (len(keys), B, d)."""
        h = x.unsqueeze(0).expand(len(keys), *x.shape)
        layers = [self._layers[k] for k in keys]
        for depth, relu in enumerate(self._relu_after):
            w = torch.stack([ls[depth][0] for ls in layers])  # (S, out, in)
            b = torch.stack([ls[depth][1] for ls in layers])  # (S, out)
            h = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
            if relu:
                h = torch.relu(h)
        return h

    def apply_gradients(self, received: Sequence[Message]) -> None:
        """Backprop the holders' gradients (and its own, as holder) through its ``f^P_k``; one optimiser step."""
        grads = dict(self._own_grads)
        senders = set()
        for m in received:
            require_wire(m, self.name)
            senders.add(m.sender)
            for key, g in m.tensors.items():
                if key not in self._pending:
                    raise PartyIsolationError(f"{self.name} received a gradient for {key}, which it did not send")
                grads[key] = g.to(device=self.device, dtype=self.dtype)
        if senders != self._expected_from:
            raise PartyIsolationError(f"{self.name} expected gradients from {sorted(self._expected_from)}, "
                                      f"got {sorted(senders)}")
        keys = [k for k in self._pending if k in grads]  # a dropped/unused representation gets no gradient
        if keys and self._stacked is not None:
            all_keys, stacked = self._stacked
            zero = torch.zeros_like(stacked[0])
            flat = [p for k in all_keys for p in self._f_params[k]]
            got = torch.autograd.grad(stacked, flat, torch.stack([grads.get(k, zero) for k in all_keys]))
            offset = 0
            for k in all_keys:
                n = len(self._f_params[k])
                if k in grads:
                    self.optimizer.set_grads(self._groups[("f", k)], list(got[offset : offset + n]))
                offset += n
            self._stepped = True
        elif keys:
            params = [self._f_params[k] for k in keys]
            flat = [p for ps in params for p in ps]
            outs = [self._pending[k] for k in keys]
            got = torch.autograd.grad(outs, flat, [grads[k] for k in keys])
            offset = 0
            for k, ps in zip(keys, params, strict=True):
                self.optimizer.set_grads(self._groups[("f", k)], list(got[offset : offset + len(ps)]))
                offset += len(ps)
            self._stepped = True
        if self._stepped:
            self.optimizer.step()
        self._stepped = False
        self._pending.clear()
        self._own_grads.clear()
        self._stacked = None

    # -- holder side ------------------------------------------------------------------------------------------
    def _inputs(self, spec: PredictorSpec, present: Sequence[int], names: Sequence[str],
                received: dict[str, Message], store: dict[str, torch.Tensor], train: bool
                ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """The head's inputs in member order: leaves for present members, zeros for absent ones."""
        leaves: dict[int, torch.Tensor] = {}
        inputs: list[torch.Tensor] = []
        template = store[spec.key] if self.index in present else None
        for m in spec.members:
            if m not in present:
                inputs.append(None)  # type: ignore[arg-type] # filled with zeros below
                continue
            if m == self.index:
                t = store[spec.key].detach()
            else:
                t = require_wire(received[names[m]], self.name).tensor(spec.key).to(device=self.device, dtype=self.dtype)
            if train:
                t = t.requires_grad_(True)
                leaves[m] = t
            template = t if template is None else template
            inputs.append(t)
        if template is None:
            raise ConfigError(f"predictor {spec.key} has no present member in this batch")
        return [torch.zeros_like(template) if t is None else t for t in inputs], leaves

    def holder_step(
        self, step: int, ids: np.ndarray, work: Sequence[tuple[PredictorSpec, Sequence[int]]], names: Sequence[str],
        received: dict[str, Message],
    ) -> tuple[float, list[Message]]:
        """Losses of the held predictors (summed: their parameters are disjoint); gradient messages per member."""
        y = self._y["train"][torch.as_tensor(ids, device=self.device)]
        total = None
        leaf_of: list[tuple[str, int, torch.Tensor]] = []
        for spec, present in work:
            inputs, leaves = self._inputs(spec, present, names, received, self._pending, True)
            loss = self.loss_fn(self.g[spec.key](torch.cat(inputs, dim=1)), y)
            total = loss if total is None else total + loss
            leaf_of.extend((spec.key, m, t) for m, t in leaves.items())
        head_params = [self._g_params[spec.key] for spec, _ in work]
        grads = torch.autograd.grad(total, [t for _, _, t in leaf_of] + [p for ps in head_params for p in ps])
        offset = len(leaf_of)
        for (spec, _), ps in zip(work, head_params, strict=True):
            self.optimizer.set_grads(self._groups[("g", spec.key)], list(grads[offset : offset + len(ps)]))
            offset += len(ps)
        self._stepped = True
        per_member: dict[int, dict[str, torch.Tensor]] = {}
        for (key, m, _), g in zip(leaf_of, grads[: len(leaf_of)], strict=True):
            if m == self.index:
                self._own_grads[key] = g
            else:
                per_member.setdefault(m, {})[key] = g
        msgs = [Message("gradient", self.name, names[m], step, tensors) for m, tensors in per_member.items()]
        return float(total.detach()) / max(1, len(work)), msgs

    @torch.no_grad()
    def holder_predict(self, spec: PredictorSpec, present: Sequence[int], names: Sequence[str],
                       received: dict[str, Message]) -> torch.Tensor:
        """Predicted labels of predictor ``spec`` for the rows of the last evaluation :meth:`represent`."""
        self._mode(False)
        inputs, _ = self._inputs(spec, present, names, received, self._eval, False)
        logits = self.g[spec.key](torch.cat(inputs, dim=1))
        return (logits.squeeze(1) > 0).long() if self.n_classes == 2 else logits.argmax(dim=1)

    def prediction_messages(self, step: int, labels: torch.Tensor, receivers: Sequence[str]) -> list[Message]:
        """Predicted labels shared with ``receivers`` (a joint predictor's output, an Ensemble vote)."""
        return [Message("prediction", self.name, r, step, {"labels": labels}) for r in receivers]

    def shared_prediction(self, message: Message) -> np.ndarray:
        """The labels another party predicted and shared with this one, which it outputs."""
        return require_wire(message, self.name).tensor("labels").numpy()

    def state_dict(self) -> dict[str, Any]:
        return {"f": self.f.state_dict(), "g": self.g.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.f.load_state_dict(state["f"])
        self.g.load_state_dict(state["g"])
        self.optimizer.load_state_dict(state["optimizer"])


class PredictorHandle(LocalHandle):
    """A :class:`PredictorParty`: as a member it sends its representations to the holders and applies the gradients
    they return; as a holder it trains and runs its heads on what the members sent; everything through the network."""

    _party: PredictorParty

    @request
    def represent(self, step: int, split: str, ids: np.ndarray, by_holder: dict[str, list[str]], *, train: bool
                  ) -> None:
        """``f^P_k`` on rows ``ids`` for the predictors listed per holder; one embedding message per other holder."""
        self._send(self._party.represent(step, split, ids, by_holder, train=train))

    @request
    def holder_step(self, step: int, ids: np.ndarray, work: Sequence[tuple[PredictorSpec, Sequence[int]]],
                    names: Sequence[str], senders: Sequence[str]) -> float:
        """Train the held predictors in ``work`` on the representations ``senders`` sent; send each member its
        gradients. Returns the mean loss."""
        received = {s: self._receive("embedding", s) for s in senders}
        loss, grads = self._party.holder_step(step, ids, work, names, received)
        self._send(grads)
        return loss

    @request
    def apply_gradients(self, holders: Sequence[str]) -> None:
        """Take the gradients the other ``holders`` sent and step the representation models."""
        self._party.apply_gradients([self._receive("gradient", h) for h in holders if h != self.name])

    @request
    def predict(self, step: int, spec: PredictorSpec, present: Sequence[int], names: Sequence[str], *,
                share_with: Sequence[str] = ()) -> np.ndarray:
        """Predicted labels of the held predictor ``spec`` on the rows of the members' last evaluation
        :meth:`represent`, shared with the parties ``share_with``; returned for the experimenter to score."""
        received = {names[m]: self._receive("embedding", names[m]) for m in present if names[m] != self.name}
        labels = self._party.holder_predict(spec, present, names, received)
        self._send(self._party.prediction_messages(step, labels, share_with))
        return labels.cpu().numpy()

    @request
    def prediction(self, *, sender: str) -> np.ndarray:
        """The labels ``sender`` predicted and shared, which this party outputs (for the experimenter to score)."""
        return self._party.shared_prediction(self._receive("prediction", sender))


class PredictorFamily(MissingAlgorithm):
    """A missing-features baseline made of independent split predictors (see the module docstring)."""

    traits: ClassVar[AlgorithmTraits]

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        self.check_parties(self.K)
        cfg, data, part = ctx.config, ctx.data, ctx.partition
        self.specs = self.make_specs(self.K)
        d = cfg.embedding_dim
        reps: list[dict[str, nn.Module]] = [{} for _ in range(self.K)]
        heads: list[dict[str, nn.Module]] = [{} for _ in range(self.K)]
        for spec in self.specs:  # fixed construction order: identical initial weights for a given seed
            for m in spec.members:
                reps[m][spec.key] = representation_model(ctx, m)
            heads[spec.holder][spec.key] = fusion_head(ctx, d * len(spec.members))
        self.predictor_handles = [
            PredictorHandle(PredictorParty(
                name, k, {s: part.take(getattr(data, f"X_{s}"), k) for s in SPLITS},
                {s: getattr(data, f"y_{s}") for s in SPLITS}, reps[k], heads[k], data.n_classes,
                (cfg.optimizer, cfg.lr, cfg.weight_decay), device=ctx.device, dtype=ctx.dtype,
            ), net)
            for k, name in enumerate(self.names)
        ]
        self._by_members = {s.members: s for s in self.specs}

    # -- what a family is ---------------------------------------------------------------------------------------
    def check_parties(self, k: int) -> None:
        pass

    def make_specs(self, k: int) -> list[PredictorSpec]:
        raise NotImplementedError

    def train_work(self, observed: tuple[int, ...], step: int) -> list[tuple[PredictorSpec, tuple[int, ...]]]:
        """Predictors trained on a batch with this observed set, each with its present (non-zeroed) members."""
        raise NotImplementedError

    def predict_spec(self, observed: tuple[int, ...]) -> PredictorSpec | None:
        """The joint predictor for rows with this observed set (None: it cannot predict them)."""
        raise NotImplementedError

    def trains_on(self, observed: tuple[int, ...]) -> bool:
        return bool(self.train_work(observed, 0))

    def handles(self) -> dict[str, PartyHandle]:
        return {h.name: h for h in self.predictor_handles}

    @property
    def predictor_parties(self) -> list[PredictorParty]:
        """The party objects, in process only (tests; see :meth:`parties`)."""
        return [local_party(h) for h in self.predictor_handles]

    # -- training -------------------------------------------------------------------------------------------
    def train_batch(self, batch: PatternBatch) -> float:
        step, ids = self.step, batch.indices
        work = self.train_work(batch.observed, step)
        members: dict[int, dict[str, list[str]]] = {}
        for spec, present in work:
            for m in present:
                members.setdefault(m, {}).setdefault(self.names[spec.holder], []).append(spec.key)
        for m, by_holder in members.items():
            self.predictor_handles[m].represent(step, "train", ids, by_holder, train=True)
        losses = []
        by_holder_work: dict[int, list[tuple[PredictorSpec, tuple[int, ...]]]] = {}
        for spec, present in work:
            by_holder_work.setdefault(spec.holder, []).append((spec, present))
        for h, hw in by_holder_work.items():
            senders = [self.names[m] for m in sorted({m for _, present in hw for m in present if m != h})]
            losses.append(self.predictor_handles[h].holder_step(step, ids, hw, self.names, senders))
        for m, by_holder in members.items():
            self.predictor_handles[m].apply_gradients(list(by_holder))
        return float(np.mean(losses))

    # -- inference ------------------------------------------------------------------------------------------
    def _joint_predict(self, split: str, ids: np.ndarray, spec: PredictorSpec, present: tuple[int, ...],
                       share_with: tuple[int, ...] = ()) -> np.ndarray:
        """The holder's predicted labels of predictor ``spec`` on rows ``ids``, from its ``present`` members; the
        holder shares them with the parties ``share_with``."""
        holder = self.names[spec.holder]
        for m in present:
            self.predictor_handles[m].represent(self.step, split, ids, {holder: [spec.key]}, train=False)
        return self.predictor_handles[spec.holder].predict(self.step, spec, present, self.names,
                                                           share_with=[self.names[k] for k in share_with])

    def _shared_predictions(self, sender: int, receivers: tuple[int, ...]) -> dict[int, np.ndarray]:
        """What each of ``receivers`` outputs: the labels ``sender`` shared with it."""
        return {k: self.predictor_handles[k].prediction(sender=self.names[sender]) for k in receivers}

    def _random(self, ids: np.ndarray, observed: tuple[int, ...]) -> dict[int, np.ndarray]:
        # Shared-seed guess: every observed party outputs the same random label for a row nobody can predict.
        rng = np.random.default_rng([self.cfg.seed, _RANDOM_SALT, int(ids[0]), len(ids)])
        guess = random_predictions(len(ids), self.n_classes, rng)
        return {k: guess for k in observed}

    def predict_group(self, split: str, ids: np.ndarray, observed: tuple[int, ...]) -> dict[int, np.ndarray]:
        spec = self.predict_spec(observed)
        if spec is None:
            return self._random(ids, observed)
        present = tuple(m for m in spec.members if m in observed)
        others = tuple(k for k in observed if k != spec.holder)
        labels = self._joint_predict(split, ids, spec, present, share_with=others)
        out = {spec.holder: labels} if spec.holder in observed else {}
        return {**out, **self._shared_predictions(spec.holder, others)}


@ALGORITHMS.register("local-missing")
class LocalBaseline(PredictorFamily):
    """Local: party k trains ``g_k(f_k(x_k))`` on the batches it observes and predicts alone."""

    name = "local-missing"
    traits = AlgorithmTraits("local-missing", "none", forward_kinds=(), backward_kinds=())

    def make_specs(self, k: int) -> list[PredictorSpec]:
        return [PredictorSpec((i,), i) for i in range(k)]

    def train_work(self, observed, step):  # noqa: ANN001, ANN201
        return [(self.specs[i], (i,)) for i in observed]

    def predict_spec(self, observed):  # noqa: ANN001, ANN201
        return None  # not used: each party predicts alone

    def predict_group(self, split: str, ids: np.ndarray, observed: tuple[int, ...]) -> dict[int, np.ndarray]:
        return {k: self._joint_predict(split, ids, self.specs[k], (k,)) for k in observed}


@ALGORITHMS.register("ensemble")
class Ensemble(LocalBaseline):
    """Ensemble: the Local predictors; observed parties exchange labels and output the majority vote."""

    name = "ensemble"
    traits = AlgorithmTraits("ensemble", "none", forward_kinds=("prediction",), backward_kinds=())

    vote = True  # False: score the Local predictors alone (the same training, without the vote)

    def predict_group(self, split: str, ids: np.ndarray, observed: tuple[int, ...]) -> dict[int, np.ndarray]:
        if not self.vote:
            return super().predict_group(split, ids, observed)
        # k's vote reaches every other observed party
        local = {k: self._joint_predict(split, ids, self.specs[k], (k,), share_with=tuple(o for o in observed if o != k))
                 for k in observed}
        votes = np.zeros((len(ids), self.K), dtype=np.int64)
        mask = np.zeros((len(ids), self.K), dtype=bool)
        for k in observed:
            self._shared_predictions(k, tuple(o for o in observed if o != k))
            votes[:, k], mask[:, k] = local[k], True
        # Every party computes the same vote: same votes, same shared-seed tie-breaking.
        rng = np.random.default_rng([self.cfg.seed, _VOTE_SALT, int(ids[0]), len(ids)])
        winner = majority_vote(votes, mask, max(2, self.n_classes), rng)
        return {k: winner for k in observed}


@ALGORITHMS.register("svfl")
class StandardVFL(PredictorFamily):
    """Standard VFL: concatenation head at the last party, trained on fully observed batches only."""

    name = "svfl"
    traits = AlgorithmTraits("svfl", "concat")

    def make_specs(self, k: int) -> list[PredictorSpec]:
        return [PredictorSpec(tuple(range(k)), k - 1)]

    def train_work(self, observed, step):  # noqa: ANN001, ANN201
        return [(self.specs[0], observed)] if len(observed) == self.K else []

    def predict_spec(self, observed):  # noqa: ANN001, ANN201
        return self.specs[0] if len(observed) == self.K else None


@ALGORITHMS.register("combinatorial")
class Combinatorial(PredictorFamily):
    """Combinatorial: one independent predictor per non-empty subset of parties."""

    name = "combinatorial"
    traits = AlgorithmTraits("combinatorial", "concat")

    def check_parties(self, k: int) -> None:
        if k > MAX_COMBINATORIAL_PARTIES:
            raise UnsupportedError(
                f"combinatorial trains one predictor per subset of parties: 2^{k} - 1 = {2**k - 1:,} predictors for "
                f"{k} parties is too many; use at most {MAX_COMBINATORIAL_PARTIES} parties, or --algo laser, which "
                "shares one model per party across all subsets"
            )

    def make_specs(self, k: int) -> list[PredictorSpec]:
        return [PredictorSpec(J, J[0]) for J in nonempty_subsets(range(k))]

    def train_work(self, observed, step):  # noqa: ANN001, ANN201
        obs = set(observed)
        return [(s, s.members) for s in self.specs if obs.issuperset(s.members)]

    def predict_spec(self, observed):  # noqa: ANN001, ANN201
        return self._by_members[tuple(observed)]


@ALGORITHMS.register("plugvfl")
class PlugVFL(PredictorFamily):
    """PlugVFL: concatenation head at the active (last) party, missing blocks zeroed, party-wise dropout."""

    name = "plugvfl"
    traits = AlgorithmTraits("plugvfl", "concat")

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        self.p_drop = self.cfg.options_for(MissingOptions).p_drop  # in [0, 1): checked with the options

    def make_specs(self, k: int) -> list[PredictorSpec]:
        return [PredictorSpec(tuple(range(k)), k - 1)]

    def train_work(self, observed, step):  # noqa: ANN001, ANN201
        active = self.K - 1
        if active not in observed:
            return []
        rng = np.random.default_rng([self.cfg.seed, _DROP_SALT, step])
        keep = rng.random(self.K) >= self.p_drop
        present = tuple(m for m in observed if m == active or keep[m])
        return [(self.specs[0], present)]

    def predict_spec(self, observed):  # noqa: ANN001, ANN201
        return self.specs[0] if self.K - 1 in observed else None
