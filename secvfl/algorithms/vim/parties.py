"""The parties of VIMADMM and VIMADMM-J, and the two message kinds they add.

* :class:`ADMMFeatureParty` (a :class:`~secvfl.parties.FeatureParty`: same forward pass, release rule, tagger and
  missing-block handling) adds the local update of eq. 10 (VIMADMM: its head ``W_k`` arrives from the label party)
  or eqs. 19/20 (VIMADMM-J: its own head, stepped before its bottom model at every local step).
* :class:`ADMMLabelParty` (a :class:`~secvfl.parties.LabelParty`: same labels, prediction and tagger) keeps the dual
  variable of every training row and runs the z-, lambda- and (VIMADMM) head updates of a round.

Rows a party does not hold (missing blocks) enter its output as zeros, inside the autograd graph, so they give its
model no gradient in any local step, and its head ``W_k`` none at the label party (``h = 0``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from secvfl.algorithms.vim.model import BOTTOM, HEAD, PartyHeads
from secvfl.algorithms.vim.noise import NoisyFeatureParty
from secvfl.algorithms.vim.zsolve import solve_z
from secvfl.device import index_tensor, to_device
from secvfl.errors import PartyIsolationError, ProtocolError, UnsupportedError
from secvfl.messages import Message, register_kind
from secvfl.parties import (
    BackwardRule,
    LabelParty,
    ReleaseRule,
    require_wire,
    standard_backward,
)

__all__ = ["ADMMFeatureParty", "ADMMLabelParty", "DUAL_KIND", "HEAD_KIND", "RESIDUALS", "admm_objective"]

DUAL_KIND = register_kind("dual")  # label party -> party k: lambda_B and the residual s^k_B (VIMADMM-J: z - sum o)
HEAD_KIND = register_kind("head")  # label party -> party k (VIMADMM): its linear head W_k
RESIDUALS = ("new-heads", "round-start")  # VIMADMM's residual s^k: see ADMMLabelParty

_NO_FEATURE_DP = (
    "feature DP accounts one clipped, noised gradient per row and epoch through the party's release rule, but a "
    "{algo} party takes --vim-local-steps steps on each batch from the label party's dual and residual, which that "
    "accounting does not cover; --dp-protect features is refused for it (use --algo vimsgd)"
)
_NO_BACKWARD_RULE = (
    "the {algo} label party sends no gradients: it solves each row's z-update (eq. 6) on its own loss and sends the "
    "dual and residual, so a mechanism that replaces its backward pass (label DP's gradient, rr-prior, alibi) cannot "
    "apply; use --dp-mechanism rr (labels randomised once, before training: everything sent later is "
    "post-processing) or --algo vimsgd"
)


def admm_objective(out: torch.Tensor, lam: torch.Tensor, residual: torch.Tensor, rho: float, *,
                   anchor: torch.Tensor | None = None, prox: float = 0.0) -> torch.Tensor:
    """Eq. 10/19/20 without the regulariser (weight decay): ``lam^T o + rho/2 ||s - o||^2``, averaged over the batch;
    with ``prox`` > 0 also ``prox/2 ||o - anchor||^2`` (the proximal Jacobian term, see :class:`ADMMFeatureParty`)."""
    n = max(out.shape[0], 1)
    value = (lam * out).sum() + 0.5 * rho * ((residual - out) ** 2).sum()
    if prox > 0 and anchor is not None:
        value = value + 0.5 * prox * ((out - anchor) ** 2).sum()
    return value / n


class _LocalSteps:
    """The parties' local SGD-with-momentum steps, safeguarded by adaptive restart (O'Donoghue and Candes, 2015):
    when the local objective rises from one step to the next, the momentum is reset and the step size halved for the
    rest of the round (restored after it). On a round whose objective only falls it is plain SGD with momentum, the
    paper's local solver; it stops the tau steps from blowing up a party's parameters when the step size is too large
    for the curvature of its objective (rho ||W_k||^2 times that of its bottom model)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.lrs = [g["lr"] for g in optimizer.param_groups]
        self.previous = math.inf
        self.restarts = 0

    def step(self, value: float) -> None:
        if value > self.previous:
            self.restarts += 1
            blow_up = value - self.previous > abs(self.previous)  # not momentum's ripple: the step is too large
            for group in self.optimizer.param_groups:
                if blow_up:
                    group["lr"] *= 0.5
                for p in group["params"]:
                    buffer = self.optimizer.state.get(p, {}).get("momentum_buffer")
                    if buffer is not None:
                        buffer.zero_()
        self.previous = value
        self.optimizer.step()

    def restore(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.lrs, strict=True):
            group["lr"] = lr


class _DeviceLocalSteps:
    """:class:`_LocalSteps` decided on the parties' device: the objective is never read on the host, so on a GPU the
    tau steps queue without a wait between them (:mod:`secvfl.device`).

    The momentum reset multiplies the buffers by 0 or 1; the halved step size is carried as a factor on the
    gradients instead of the learning rate (the weight decay is added to the gradient first, as torch's SGD does,
    and taken out of the optimiser for the round). The factor is a power of two and the reset zeroes the buffer
    whenever it changes, so the parameters move exactly as with :class:`_LocalSteps` (one reads the other's steps
    bit for bit on the CPU: ``tests/test_vim_algorithms.py``)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.decays = [g["weight_decay"] for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["weight_decay"] = 0.0
        self.previous: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self._restarts: torch.Tensor | None = None

    @property
    def restarts(self) -> int:
        return 0 if self._restarts is None else int(self._restarts)  # (read on the host: a wait, outside the steps)

    def step(self, value: torch.Tensor) -> None:
        value = value.detach()
        if self.previous is None:
            self.previous = torch.full_like(value, math.inf)
            self.scale = torch.ones_like(value)
            self._restarts = torch.zeros((), dtype=torch.int64, device=value.device)
        rising = value > self.previous
        blow_up = rising & (value - self.previous > self.previous.abs())
        self._restarts += rising
        self.scale = torch.where(blow_up, self.scale * 0.5, self.scale)
        keep = (~rising).to(value.dtype)
        for group, decay in zip(self.optimizer.param_groups, self.decays, strict=True):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if decay:
                    p.grad.add_(p.detach(), alpha=decay)
                p.grad.mul_(self.scale)
                buffer = self.optimizer.state.get(p, {}).get("momentum_buffer")
                if buffer is not None:
                    buffer.mul_(keep)
        self.previous = value
        self.optimizer.step()

    def restore(self) -> None:
        for group, decay in zip(self.optimizer.param_groups, self.decays, strict=True):
            group["weight_decay"] = decay


class ADMMFeatureParty(NoisyFeatureParty):
    """A feature party of VIMADMM (``joint=False``: sends embeddings ``h^k``) or VIMADMM-J (``joint=True``: its model
    is ``Sequential(bottom, head)`` and it sends logits ``o^k``; ``head_optimizer`` steps its head).

    ``prox`` (gamma >= 0) adds ``gamma/2 ||o^k - o^k_0||^2`` to the local objective, ``o^k_0`` being the party's output
    when the round began: the proximal Jacobian ADMM of Deng, Lai, Peng and Yin (J. Sci. Comput. 2017). Without it
    all M parties close the same gap ``z - sum_i o^i`` in parallel, so their sum overshoots it up to M times, and
    enough local progress per round (tau momentum steps at a large step size) makes the rounds diverge; with gamma =
    (M - 1) rho a party that solves its objective exactly moves 1/M of the gap. gamma = 0 is the paper's eq. 10/19/20.
    """

    def __init__(self, name: str, blocks: dict[str, np.ndarray], model: nn.Module, optimizer: torch.optim.Optimizer,
                 *, rho: float, local_steps: int, joint: bool, algo: str,
                 head_optimizer: torch.optim.Optimizer | None = None, prox: float = 0.0, device: torch.device,
                 dtype: torch.dtype = torch.float32, observed: dict[str, np.ndarray] | None = None) -> None:
        super().__init__(name, blocks, model, optimizer, device=device, dtype=dtype,
                         output_kind="logits" if joint else "embedding", observed=observed)
        self.rho, self.local_steps, self.joint, self.algo = rho, local_steps, joint, algo
        self.head_optimizer = head_optimizer
        self.prox = float(prox)
        # the local steps' safeguard decided on the device (no host read per step) wherever that is not the CPU
        self.steps_on_device = device.type != "cpu"

    def install_release_rule(self, make: Callable[[nn.Module], ReleaseRule]) -> None:
        raise UnsupportedError(_NO_FEATURE_DP.format(algo=self.algo))

    def local_update(self, dual: Message, head: Message | None) -> None:
        """``local_steps`` SGD steps on the batch of the last training output, from the label party's ``dual``
        message (and, for VIMADMM, its ``head`` message with ``W_k``)."""
        require_wire(dual, self.name)
        if self._pending is None:
            raise PartyIsolationError(f"{self.name} received a dual without a pending forward pass")
        x, out, held = self._pending
        self._pending = None
        lam = to_device(dual.tensor("dual"), self.device, out.dtype)
        residual = to_device(dual.tensor("residual"), self.device, out.dtype)
        if lam.dim() != 2 or lam.shape[0] != out.shape[0] or residual.shape != lam.shape or \
                (self.joint and lam.shape != out.shape):
            raise PartyIsolationError(f"{self.name}: dual {tuple(lam.shape)} / residual {tuple(residual.shape)} for "
                                      f"output {tuple(out.shape)}")
        weight = None
        if self.joint:  # the label party sent z - sum_i o^i to every party: s^k adds back this party's own o^k
            residual = residual + out.detach()
        else:
            if head is None:
                raise PartyIsolationError(f"{self.name}: VIMADMM's local update needs its head W_k")
            weight = to_device(require_wire(head, self.name).tensor("weight"), self.device, out.dtype)
            if weight.shape != (out.shape[1], lam.shape[1]):
                raise PartyIsolationError(f"{self.name}: head of shape {tuple(weight.shape)} for output "
                                          f"{tuple(out.shape)} and dual {tuple(lam.shape)}")
        self.model.train()

        def held_rows(o: torch.Tensor) -> torch.Tensor:
            return o if held is None else o * held

        with torch.no_grad():  # the output when the round began: the proximal term's anchor
            anchor = held_rows(out.detach()) if self.joint else held_rows(out.detach()) @ weight

        def objective(o: torch.Tensor) -> torch.Tensor:
            return admm_objective(o, lam, residual, self.rho, anchor=anchor, prox=self.prox)

        steps = _DeviceLocalSteps(self.optimizer) if self.steps_on_device else _LocalSteps(self.optimizer)
        try:
            for _ in range(self.local_steps):
                if self.joint:
                    assert self.head_optimizer is not None
                    bottom, own_head = self.model[BOTTOM], self.model[HEAD]
                    with torch.no_grad():
                        h = bottom(x)
                    self.head_optimizer.zero_grad(set_to_none=True)  # eq. 19: W_k with the bottom model fixed
                    objective(held_rows(own_head(h))).backward()
                    self.head_optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)  # eq. 20: the bottom model with the new W_k
                    value = objective(held_rows(own_head(bottom(x))))
                    value.backward()
                    for p in own_head.parameters():
                        p.grad = None  # (the head took its step above)
                else:
                    self.optimizer.zero_grad(set_to_none=True)
                    value = objective(held_rows(self.model(x)) @ weight)
                    value.backward()
                steps.step(value.detach() if self.steps_on_device else float(value.detach()))
        finally:
            steps.restore()

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.head_optimizer is not None:
            state["head_optimizer"] = self.head_optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.head_optimizer is not None:
            self.head_optimizer.load_state_dict(state["head_optimizer"])


class ADMMLabelParty(LabelParty):
    """The label party of VIMADMM (``head``: the parties' linear heads, :class:`PartyHeads`, stepped by
    ``optimizer``) or VIMADMM-J (``head``: the identity on the sum of the logits; ``optimizer`` None).

    Keeps ``lam`` (training rows x outputs), the dual variable of every training row; ``z`` needs no state (eq. 6
    recomputes it from ``lam`` and the round's outputs).

    ``residual`` (VIMADMM): which heads of the other parties the residual ``s^k`` of eq. 9 holds. ``"new-heads"``:
    ``z - sum_{i != k} h^i W_i^{t+1}``, eq. 9 as printed. ``"round-start"``: ``z - sum_{i != k} h^i W_i^t`` (and the
    bias of the round's start), the other parties' outputs that z was computed from, as in the authors' code
    (AI-secure/VFL-ADMM ``fedclient/admmsplit.py``: the residual is built from the logits of the forward pass) and as
    eq. 8 holds the other heads: party k's block (W_k, theta_k) is then stepped against the others' round-start
    outputs. With ``"new-heads"`` the starting gradient of every party's eq. 10 also holds ``rho sum_i h^i (W_i^{t+1}
    - W_i^t)``, the move of all 14 heads together, and on MNIST (14 parties, eta 0.05-0.1) the rounds blow up within
    the first epoch; with ``"round-start"`` they train (the git history of BENCHMARKS.md, "VIMADMM: the residual")."""

    def __init__(self, name: str, labels: dict[str, np.ndarray], head: nn.Module,
                 optimizer: torch.optim.Optimizer | None, n_classes: int, *, outputs: int, rho: float, tol: float,
                 algo: str, device: torch.device, dtype: torch.dtype = torch.float32,
                 input_kind: str = "embedding", residual: str = "new-heads") -> None:
        self.algo = algo
        if residual not in RESIDUALS:
            raise UnsupportedError(f"{algo}: residual {residual!r}; choose one of {', '.join(RESIDUALS)}")
        self.residual = residual
        super().__init__(name, labels, head, optimizer, n_classes, device=device, dtype=dtype,  # type: ignore[arg-type]
                         input_kind=input_kind)
        self.rho, self.tol = rho, tol
        self.lam = torch.zeros(len(labels["train"]), outputs, dtype=dtype, device=device)
        self.newton_steps = 0  # the z-updates' Newton steps so far (all rounds), for benchmarks

    @property
    def backward_rule(self) -> BackwardRule:
        return standard_backward

    @backward_rule.setter
    def backward_rule(self, rule: BackwardRule) -> None:
        if rule is not standard_backward:
            raise UnsupportedError(_NO_BACKWARD_RULE.format(algo=self.algo))

    def use_training_labels(self, labels: np.ndarray | torch.Tensor) -> None:
        if torch.as_tensor(labels).is_floating_point():
            raise UnsupportedError(_NO_BACKWARD_RULE.format(algo=self.algo))
        super().use_training_labels(labels)

    def train_step(self, *args, **kwargs):  # noqa: ANN002, ANN003 - the split algorithms' step, not VIM's
        raise UnsupportedError(f"the {self.algo} label party trains by admm_step, not by a backward pass")

    def admm_step(self, step: int, ids: np.ndarray, inputs: Sequence[Message], senders: Sequence[str], *,
                  aggregated: bool) -> tuple[torch.Tensor, list[Message]]:
        """One round at the label party: z (eq. 6/16), lambda (eq. 7/17), for VIMADMM one SGD step of the heads
        (eq. 8) and the residuals (eq. 9); returns the batch loss before the round (a one-element tensor, to read
        once the messages are sent) and the messages to send."""
        xs = [to_device(require_wire(m, self.name).tensor(self.input_kind), self.device, self.dtype) for m in inputs]
        y = self.labels("train", ids)
        if y.is_floating_point():
            raise ProtocolError(f"{self.algo}: the label party's training labels are not class labels")
        rows = index_tensor(np.asarray(ids), self.device)
        self.head.train()
        with torch.no_grad():
            v = self._forward(xs, aggregated, None)
            loss = self.loss_fn(v, y)
        z, steps = solve_z(v, self.lam[rows], y, self.rho, tol=self.tol)
        self.newton_steps += steps
        lam = self.lam[rows] + self.rho * (v - z)
        self.lam[rows] = lam
        if aggregated:  # VIMADMM-J: one message for every party; each adds its own logits to get its residual
            gap = z - v
            messages = [Message(DUAL_KIND, self.name, s, step, {"dual": lam, "residual": gap}) for s in senders]
            return loss, [self.tagger.tag(m, "train", ids, train=True) for m in messages]
        assert isinstance(self.head, PartyHeads) and self.optimizer is not None

        def outputs() -> tuple[list[torch.Tensor], torch.Tensor]:  # h^k W_k per party, and their sum with the bias
            with torch.no_grad():
                parts = self.head.party_logits(xs)
                return parts, torch.stack(parts).sum(dim=0) + self.head.bias

        if self.residual == "round-start":  # the others' outputs with the heads W^t that v (and z) came from
            parts, full = outputs()
        self.optimizer.zero_grad(set_to_none=True)  # eq. 8: one SGD step of every head at the new lambda and z
        admm_objective(self.head(xs), lam, z, self.rho).backward()
        self.optimizer.step()
        if self.residual == "new-heads":
            parts, full = outputs()
        messages = []
        with torch.no_grad():
            for k, s in enumerate(senders):
                residual = z - (full - parts[k])  # eq. 9: z - sum_{i != k} h^i W_i (and the bias)
                dual = Message(DUAL_KIND, self.name, s, step, {"dual": lam, "residual": residual})
                messages.append(self.tagger.tag(dual, "train", ids, train=True))
                # the same quantity every round (compression's error feedback keeps one memory per link for it)
                messages.append(Message(HEAD_KIND, self.name, s, step, {"weight": self.head.weights[k].detach()},
                                        meta={"persistent": True}))
        return loss, messages

    def state_dict(self) -> dict:
        state = {"head": self.head.state_dict(), "lam": self.lam.clone()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        self.lam = state["lam"].to(device=self.device, dtype=self.dtype).clone()
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
