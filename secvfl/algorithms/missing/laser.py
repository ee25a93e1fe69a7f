"""LASER-VFL (Valdeira, Wang, Chi: "Vertical Federated Learning with Missing Features During Training and
Inference"): one representation model and one fusion head per party, shared by all subsets of parties, trained by
task sampling, so that any set of observed parties can predict.

Party ``k`` holds its feature block, ``f_k``, ``g_k`` and the labels. Its predictor for an observed set ``J``
containing ``k`` is ``h_(k,J)(x_J) = g_k(mean_{i in J} f_i(x_i))`` (see :mod:`secvfl.algorithms.missing.subsets` for the
objective and why the task-sampling weights make it unbiased).

One training step on a batch whose samples share the observed set ``K_o`` (``n = |K_o|``)::

    every k in K_o:  r_k = f_k(x_k)                      computed once
                     --embedding r_k--> every other i in K_o          n(n-1) messages
    every k in K_o:  draw S_k1..S_kn (one subset per size, containing k)
                     L_k = sum_j a_j * loss(g_k(mean_{i in S_kj} r_i), y)   one head call on all n subset means
                     backward -> dL_k/dg_k and dL_k/dr_i for every i in K_o
                     --gradient dL_k/dr_i--> every other i in K_o          n(n-1) messages
    every k in K_o:  backprop (dL_k/dr_k + sum_i dL_i/dr_k) through f_k; optimiser step on f_k and g_k

Inference on rows with observed set ``K_o'``: each observed party broadcasts ``f_k(x_k)`` and predicts with
``h_(k,K_o')``. A party that has left never appears in ``K_o'``; the others predict without it.

Threat model: honest-but-curious parties. Each observed party sees the other observed parties' representations
of the batch and the gradients the others compute w.r.t. its own representation (as in split learning with
every party acting as a label party); nothing else. Protection of these messages is the protocol layers' job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
from secvfl.algorithms.missing.subsets import (
    Subset,
    TaskTable,
    averaging_matrix,
    linear_head_task_grads,
    per_sample_loss,
    weighted_task_loss,
)
from secvfl.data.pattern_sampler import PatternBatch
from secvfl.device import index_tensor, to_device
from secvfl.errors import ConfigError, PartyIsolationError
from secvfl.handles import LocalHandle, PartyHandle, local_party, request
from secvfl.messages import Message
from secvfl.models import MLP
from secvfl.parties import PlainRelease, ProtocolHooks, ReleaseRule, probabilities, require_wire
from secvfl.transport.layers import AlgorithmTraits
from secvfl.transport.network import Network

__all__ = ["LaserParty", "LaserHandle", "LaserVFL"]

_TASK_SALT = 0x1A5E4  # party k's private task-sampling stream: default_rng([seed, _TASK_SALT, k])


def _single_linear(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) when ``head`` is exactly one linear layer (an MLP without hidden layers), else None."""
    layers = [m for m in head.modules() if not isinstance(m, (nn.Sequential, MLP))]
    if len(layers) == 1 and isinstance(layers[0], nn.Linear):
        return layers[0].weight, layers[0].bias
    return None


class LaserParty:
    """Party ``index``: its feature block, labels, ``f_k``, ``g_k`` and one optimiser over both."""

    def __init__(
        self,
        name: str,
        index: int,
        blocks: dict[str, np.ndarray],
        labels: dict[str, np.ndarray],
        representation: nn.Module,
        head: nn.Module,
        n_classes: int,
        optimizer_spec: tuple[str, float, float],
        *,
        seed: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.name, self.index, self.device, self.dtype = name, int(index), device, dtype
        self._x = {s: torch.as_tensor(b, dtype=dtype, device=device) for s, b in blocks.items()}
        # A copy (torch.tensor, not as_tensor): every party is given the same label arrays and must not share memory.
        self._y = {s: torch.tensor(v, dtype=torch.long, device=device) for s, v in labels.items()}
        self.f = representation.to(device=device, dtype=dtype)
        self.g = head.to(device=device, dtype=dtype)
        opt_name, lr, wd = optimizer_spec
        self._f_params = [p for p in self.f.parameters() if p.requires_grad]
        self._g_params = [p for p in self.g.parameters() if p.requires_grad]
        self._linear_head = _single_linear(self.g)
        # f_k and g_k always step together: one flat group.
        self.optimizer = FlatOptimizer([[*self._f_params, *self._g_params]], opt_name, lr, wd)
        self._g_grads: tuple[torch.Tensor, ...] = ()
        self.n_classes = n_classes
        self.loss_fn = per_sample_loss(n_classes)
        self._rng = np.random.default_rng([int(seed), _TASK_SALT, self.index])
        # What leaves the party: f_k(x) as computed, unless a protocol (feature DP) installs another rule.
        self.release_rule: ReleaseRule = PlainRelease()
        self._rep: torch.Tensor | None = None  # f_k(x) of the current training batch, with its graph
        self._released: torch.Tensor | None = None  # what the peers received for it (the heads train on this)
        self._batch_x: torch.Tensor | None = None
        self._own_grad: torch.Tensor | None = None
        self._peers: tuple[str, ...] = ()
        self._training: bool | None = None
        self._rows: torch.Tensor | None = None

    def __repr__(self) -> str:  # never print data or models
        return f"LaserParty({self.name!r})"

    def rows(self, split: str) -> int:
        return int(self._x[split].shape[0])

    def install_release_rule(self, make: Callable[[nn.Module], ReleaseRule]) -> None:
        """A protocol's hook (:class:`~secvfl.parties.ReleasingParty`): release ``f_k``'s outputs through
        ``make(f_k)``."""
        self.release_rule = make(self.f)

    def _mode(self, train: bool) -> None:
        # Module.train() walks every submodule; switch only when the mode changes (it is per step otherwise).
        if self._training is not train:
            self.f.train(train)
            self.g.train(train)
            self._training = train

    # -- training step ----------------------------------------------------------------------------------------
    def represent(self, step: int, split: str, ids: np.ndarray, peers: Sequence[str], *, train: bool) -> list[Message]:
        """``f_k`` on rows ``ids``: one embedding message per peer (the other observed parties)."""
        rows = index_tensor(np.array(ids, dtype=np.int64), self.device)  # kept until the step ends: a copy
        x = self._x[split][rows]
        self._mode(train)
        if train:
            out = self.f(x)
            released = self.release_rule.release(self.name, step, split, out.detach(), train=True)
            self._rep, self._released, self._batch_x = out, released, x
            self._own_grad, self._peers, self._rows = None, tuple(peers), rows
        else:
            with torch.no_grad():
                out = self.f(x)
            released = self.release_rule.release(self.name, step, split, out, train=False)
            self._eval_rep = released  # its own predictions use what the peers see
        return [Message("embedding", self.name, p, step, {"embedding": released}) for p in peers]

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on this party's device and dtype. What arrives usually is already: skipping the no-op ``to`` saves
        a dispatch per received tensor, 2 (K - 1) per party and step."""
        return t if t.dtype is self.dtype and t.device == self.device else to_device(t, self.device, self.dtype)

    def _stack(self, own: torch.Tensor, observed: Sequence[int], names: Sequence[str],
               received: dict[str, Message]) -> torch.Tensor:
        parts = []
        for k, name in zip(observed, names, strict=True):
            if k == self.index:
                parts.append(own)
                continue
            t = self._local(require_wire(received[name], self.name).tensor("embedding"))
            if t.shape != own.shape:
                raise PartyIsolationError(f"{self.name}: embedding of shape {tuple(t.shape)} from {name}, "
                                          f"expected {tuple(own.shape)}")
            parts.append(t)
        return torch.stack(parts)

    def train_heads(
        self, step: int, ids: np.ndarray, observed: Sequence[int], names: Sequence[str], received: dict[str, Message]
    ) -> tuple[torch.Tensor, list[Message]]:
        """Sampled-task loss of ``g_k`` on the batch; returns the loss (a one-element tensor: read it once the
        messages are sent, see :mod:`secvfl.device`) and a gradient message per peer."""
        if self._rep is None:
            raise PartyIsolationError(f"{self.name} was asked to train its head without a representation step")
        table = TaskTable.of(self.index, tuple(observed))
        _, matrix = table.draw(self._rng)
        matrix = self._local(matrix)
        y = self._y["train"][self._rows]
        if self._linear_head is not None:
            # One linear layer: closed-form gradients, no autograd graph (the common, cheapest case).
            with torch.no_grad():
                reps = self._stack(self._released, observed, names, received)
                w, b = self._linear_head
                loss, rep_grads, d_w, d_b = linear_head_task_grads(w, b, reps, matrix, table.weights, y)
            self._g_grads = (d_w, d_b) if b is not None else (d_w,)
        else:
            reps = self._stack(self._released, observed, names, received).requires_grad_(True)
            loss, _ = weighted_task_loss(self.g, reps, matrix, to_device(table.weights, self.device), y, self.loss_fn)
            # autograd.grad instead of backward(): gradients are written, not accumulated, so no zero_grad pass.
            grads = torch.autograd.grad(loss, [reps, *self._g_params])
            self._g_grads = grads[1:]
            rep_grads = grads[0]
        out = []
        for k, name, grad in zip(observed, names, rep_grads.unbind(0), strict=True):
            if k == self.index:
                self._own_grad = grad
            else:
                out.append(Message("gradient", self.name, name, step, {"gradient": grad}))
        return loss.detach(), out

    def apply_gradients(self, received: Sequence[Message]) -> None:
        """Sum the peers' gradients w.r.t. ``f_k``'s output with its own, backprop, and step ``f_k`` and ``g_k``."""
        if self._rep is None or self._own_grad is None:
            raise PartyIsolationError(f"{self.name} received gradients without a pending training step")
        parts = [self._own_grad]
        for m in received:
            g = self._local(require_wire(m, self.name).tensor("gradient"))
            if g.shape != self._own_grad.shape:
                raise PartyIsolationError(f"{self.name}: gradient of shape {tuple(g.shape)} from {m.sender}, "
                                          f"expected {tuple(self._own_grad.shape)}")
            parts.append(g)
        if sorted(m.sender for m in received) != sorted(self._peers):
            raise PartyIsolationError(f"{self.name} expected gradients from {sorted(self._peers)}, "
                                      f"got {sorted(m.sender for m in received)}")
        total = torch.stack(parts).sum(dim=0) if len(parts) > 1 else parts[0]
        f_grads = self.release_rule.model_gradients(self.f, self._batch_x, self._rep, total)
        f_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self._f_params, f_grads, strict=True)]
        self.optimizer.set_grads(0, [*f_grads, *self._g_grads])
        self.optimizer.step()
        self._g_grads = ()
        self._rep = self._released = self._batch_x = self._own_grad = None

    # -- inference --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, observed: Sequence[int], names: Sequence[str], received: dict[str, Message]) -> torch.Tensor:
        """Class probabilities of ``h_(k, observed)`` for the rows of the last :meth:`represent` (train=False)."""
        reps = self._stack(self._eval_rep, observed, names, received)
        self._mode(False)
        return probabilities(self.g(reps.mean(dim=0)), self.n_classes)

    @torch.no_grad()
    def predictor_logits(self, subset: Subset, reps_by_party: dict[int, torch.Tensor]) -> torch.Tensor:
        """``g_k(mean_{i in subset} r_i)`` for given representations (used by tests and analysis)."""
        if self.index not in subset:
            raise ConfigError(f"party {self.index} has no predictor for {subset}: the set must contain it")
        matrix = averaging_matrix([subset], list(reps_by_party), dtype=self.dtype)
        stacked = torch.stack(list(reps_by_party.values()))
        self._mode(False)
        return self.g((matrix @ stacked.reshape(len(reps_by_party), -1)).reshape(stacked.shape[1:]))

    # -- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "f": self.f.state_dict(),
            "g": self.g.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.f.load_state_dict(state["f"])
        self.g.load_state_dict(state["g"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._rng.bit_generator.state = state["rng"]


class LaserHandle(LocalHandle):
    """A :class:`LaserParty`: broadcasts its representation to its peers (the batch's other observed parties), trains
    its head on theirs, and applies the gradients they send back, all through the network."""

    _party: LaserParty

    def _from_peers(self, kind: str, names: Sequence[str]) -> dict[str, Message]:
        return {o: self._receive(kind, o) for o in names if o != self.name}

    @request
    def represent(self, step: int, split: str, ids: np.ndarray, peers: Sequence[str], *, train: bool) -> None:
        """``f_k`` on rows ``ids`` of ``split``, sent to every one of ``peers``."""
        self._send(self._party.represent(step, split, ids, peers, train=train))

    @request
    def train_heads(self, step: int, ids: np.ndarray, observed: Sequence[int], names: Sequence[str]) -> float:
        """Train ``g_k`` on the peers' representations (``names``: the observed parties' names) and send each peer
        its gradient; returns the loss."""
        loss, grads = self._party.train_heads(step, ids, observed, names, self._from_peers("embedding", names))
        self._send(grads)
        return float(loss)  # after the send: on a GPU the step has run by now, so reading it does not wait

    @request
    def apply_gradients(self, names: Sequence[str]) -> None:
        """Take the gradients the peers among ``names`` sent and step ``f_k`` and ``g_k``."""
        self._party.apply_gradients([self._receive("gradient", o) for o in names if o != self.name])

    @request
    def predict(self, observed: Sequence[int], names: Sequence[str]) -> np.ndarray:
        """Class probabilities of ``h_(k, observed)`` on the rows of the last evaluation :meth:`represent`, for the
        experimenter to score."""
        return self._party.predict(observed, names, self._from_peers("embedding", names)).cpu().numpy()


@ALGORITHMS.register("laser")
class LaserVFL(MissingAlgorithm):
    """LASER-VFL: trains on every batch with at least one observed party; any observed set can predict."""

    name = "laser"
    # Each party averages its own subsets of the representations it receives: nothing goes through an aggregate.
    traits = AlgorithmTraits("laser", "broadcast", forward_kinds=("embedding",), backward_kinds=("gradient",),
                             labels_at_every_party=True)

    def __init__(self, ctx: RunContext, net: Network) -> None:
        super().__init__(ctx, net)
        cfg, data, part = ctx.config, ctx.data, ctx.partition
        self.laser_handles: list[LaserHandle] = []
        for k, name in enumerate(self.names):
            blocks = {s: part.take(getattr(data, f"X_{s}"), k) for s in SPLITS}
            labels = {s: getattr(data, f"y_{s}") for s in SPLITS}
            self.laser_handles.append(LaserHandle(LaserParty(
                name, k, blocks, labels, representation_model(ctx, k), fusion_head(ctx, cfg.embedding_dim),
                data.n_classes, (cfg.optimizer, cfg.lr, cfg.weight_decay), seed=cfg.seed,
                device=ctx.device, dtype=ctx.dtype,
            ), net))

    def handles(self) -> dict[str, PartyHandle]:
        return {h.name: h for h in self.laser_handles}

    def message_widths(self) -> dict[str, int]:
        return {"embedding": self.cfg.embedding_dim}

    @property
    def laser_parties(self) -> list[LaserParty]:
        """The party objects, in process only (protocol set-up, tests; see :meth:`parties`)."""
        return [local_party(h) for h in self.laser_handles]

    def protocol_hooks(self) -> ProtocolHooks:
        # every party releases its representation to its peers (feature DP); there is no label party to hook
        return ProtocolHooks(releasing=dict(self.parties()))  # type: ignore[arg-type]

    def _represent(self, step: int, split: str, ids: np.ndarray, observed: tuple[int, ...], train: bool
                   ) -> list[str]:
        """Every observed party sends its representation of rows ``ids`` to the others; returns their names."""
        names = [self.names[k] for k in observed]
        for k, name in zip(observed, names, strict=True):
            self.laser_handles[k].represent(step, split, ids, [n for n in names if n != name], train=train)
        return names

    def train_batch(self, batch: PatternBatch) -> float:
        observed, ids, step = batch.observed, batch.indices, self.step
        names = self._represent(step, "train", ids, observed, train=True)
        losses = [self.laser_handles[k].train_heads(step, ids, observed, names) for k in observed]
        for k in observed:
            self.laser_handles[k].apply_gradients(names)
        return float(np.mean(losses))

    def predict_group(self, split: str, ids: np.ndarray, observed: tuple[int, ...]) -> dict[int, np.ndarray]:
        return {k: p.argmax(axis=1) for k, p in self.predict_proba_parties(split, ids, observed).items()}

    def predict_proba_parties(self, split: str, ids: np.ndarray, observed: tuple[int, ...]) -> dict[int, np.ndarray]:
        """Class probabilities of each observed party's predictor ``h_(k, observed)`` on rows ``ids``."""
        names = self._represent(self.step, split, ids, observed, train=False)
        return {k: self.laser_handles[k].predict(observed, names) for k in observed}
