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
HEAD_HALVINGS = 20  # the most times VIMADMM's head step is halved in one round (ADMMLabelParty._head_step)

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
    """The parties' local SGD-with-momentum steps, safeguarded by adaptive restart (O'Donoghue and Candes, 2015) and
    step rejection: when the local objective rises from one step to the next, the momentum is reset; when it blows up
    (rises by more than its own size), the step that caused it is undone -- every parameter goes back to where it was
    before that step -- and the step size is halved for the rest of the round (restored after it). On a round whose
    objective only falls it is plain SGD with momentum, the paper's local solver. Undoing the step matters: the step
    size a party can take is set by the curvature of its objective (rho ||W_k||^2 times that of its bottom model,
    rho ||h^k||^2 for its own head), which the data set, not the defaults, decides; a blown-up step kept would leave
    the party's outputs in a region where the next rounds diverge (VIMADMM-J on digits at 10x the default step size:
    non-finite outputs after 65 rounds). ``optimizers``: every optimiser that steps in the round (the bottom model's;
    VIMADMM-J's own head's too, whose step comes first)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        self.lrs = [[g["lr"] for g in o.param_groups] for o in optimizers]
        self.params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        self.previous = math.inf
        self.saved: list[torch.Tensor] | None = None  # the parameters where ``previous`` was measured
        self.restarts = 0
        self.rejected = 0

    def step(self, value: float) -> None:
        """``value``: the objective at the current parameters (the bottom model's gradients computed there); steps
        the bottom model's optimiser, or, when ``value`` blew up, puts every parameter back where the last accepted
        ``value`` was measured (undoing the steps since: the bottom model's, and VIMADMM-J's head step before it)."""
        if not math.isfinite(value) or value > self.previous:
            self.restarts += 1
            for o in self.optimizers:
                for group in o.param_groups:
                    for p in group["params"]:
                        buffer = o.state.get(p, {}).get("momentum_buffer")
                        if buffer is not None:
                            buffer.zero_()
            blow_up = not math.isfinite(value) or value - self.previous > abs(self.previous)
            if blow_up and self.saved is not None:  # undo it
                self.rejected += 1
                with torch.no_grad():
                    for p, before in zip(self.params, self.saved, strict=True):
                        p.copy_(before)
                for o in self.optimizers:
                    for group in o.param_groups:
                        group["lr"] *= 0.5
                return  # back at the point whose objective was self.previous
        self.previous = value
        self.saved = [p.detach().clone() for p in self.params]
        self.optimizers[0].step()

    def step_other(self, optimizer: torch.optim.Optimizer) -> None:
        """Step one of the other optimisers of the round (VIMADMM-J's own head, before the bottom model's step)."""
        optimizer.step()

    def restore(self) -> None:
        for o, lrs in zip(self.optimizers, self.lrs, strict=True):
            for group, lr in zip(o.param_groups, lrs, strict=True):
                group["lr"] = lr


class _DeviceLocalSteps:
    """:class:`_LocalSteps` decided on the parties' device: the objective is never read on the host, so on a GPU the
    tau steps queue without a wait between them (:mod:`secvfl.device`).

    The momentum reset multiplies the buffers by 0 or 1; undoing a blown-up step copies the saved parameters back
    where a 0/1 mask says so; the halved step size is carried as a factor on the gradients instead of the learning
    rate (the weight decay is added to the gradient first, as torch's SGD does, and taken out of the optimisers for
    the round), and a rejected step is a step with factor 0 on buffers just reset. The factor is a power of two and
    the reset zeroes the buffers whenever it changes, so the parameters move exactly as with :class:`_LocalSteps`
    (one reads the other's steps bit for bit on the CPU: ``tests/test_device.py``)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        self.decays = [[g["weight_decay"] for g in o.param_groups] for o in optimizers]
        for o in optimizers:
            for group in o.param_groups:
                group["weight_decay"] = 0.0
        self.params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        self.previous: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.saved: list[torch.Tensor] | None = None
        self._restarts: torch.Tensor | None = None
        self._rejected: torch.Tensor | None = None

    @property
    def restarts(self) -> int:
        return 0 if self._restarts is None else int(self._restarts)  # (read on the host: a wait, outside the steps)

    @property
    def rejected(self) -> int:
        return 0 if self._rejected is None else int(self._rejected)

    def _scale_gradients(self, index: int, factor: torch.Tensor) -> None:
        o = self.optimizers[index]
        for group, decay in zip(o.param_groups, self.decays[index], strict=True):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if decay:
                    p.grad.add_(p.detach(), alpha=decay)
                p.grad.mul_(factor)

    def step(self, value: torch.Tensor) -> None:
        value = value.detach()
        if self.previous is None:
            self.previous = torch.full_like(value, math.inf)
            self.scale = torch.ones_like(value)
            self._restarts = torch.zeros((), dtype=torch.int64, device=value.device)
            self._rejected = torch.zeros((), dtype=torch.int64, device=value.device)
        finite = torch.isfinite(value)
        rising = ~finite | (value > self.previous)
        blow_up = rising & (~finite | (value - self.previous > self.previous.abs()))
        if self.saved is None:
            blow_up = torch.zeros_like(blow_up)  # nothing to go back to yet: the host path keeps the step too
        self._restarts += rising
        self._rejected += blow_up
        keep = (~rising).to(value.dtype)
        for o in self.optimizers:
            for group in o.param_groups:
                for p in group["params"]:
                    buffer = o.state.get(p, {}).get("momentum_buffer")
                    if buffer is not None:
                        buffer.mul_(keep)
        with torch.no_grad():
            if self.saved is not None:
                for p, before in zip(self.params, self.saved, strict=True):
                    p.copy_(torch.where(blow_up, before, p))
        self.scale = torch.where(blow_up, self.scale * 0.5, self.scale)
        self.previous = torch.where(blow_up, self.previous, value)
        self.saved = [p.detach().clone() for p in self.params]
        self._scale_gradients(0, self.scale * (~blow_up).to(value.dtype))
        self.optimizers[0].step()

    def step_other(self, optimizer: torch.optim.Optimizer) -> None:
        """Step one of the other optimisers of the round at the round's current factor (VIMADMM-J's own head)."""
        index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
        if self.scale is not None:
            self._scale_gradients(index, self.scale)
        elif any(self.decays[index]):
            self._scale_gradients(index, torch.ones((), dtype=self.params[0].dtype, device=self.params[0].device))
        optimizer.step()

    def restore(self) -> None:
        for o, decays in zip(self.optimizers, self.decays, strict=True):
            for group, decay in zip(o.param_groups, decays, strict=True):
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

        optimizers = (self.optimizer, *([self.head_optimizer] if self.joint else []))
        steps = _DeviceLocalSteps(*optimizers) if self.steps_on_device else _LocalSteps(*optimizers)
        try:
            for _ in range(self.local_steps):
                if self.joint:
                    assert self.head_optimizer is not None
                    bottom, own_head = self.model[BOTTOM], self.model[HEAD]
                    with torch.no_grad():
                        h = bottom(x)
                    self.head_optimizer.zero_grad(set_to_none=True)  # eq. 19: W_k with the bottom model fixed
                    objective(held_rows(own_head(h))).backward()
                    steps.step_other(self.head_optimizer)
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
        self.head_backtracks_exhausted = 0  # rounds whose head step found no descent (see _head_step)

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
        self._head_step(xs, lam, z)  # eq. 8: one SGD step of every head at the new lambda and z
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

    def _head_step(self, xs: list[torch.Tensor], lam: torch.Tensor, z: torch.Tensor) -> None:
        """Eq. 8, one SGD step of every head ``W_k`` and the bias on ``lam^T o + rho/2 ||z - o||^2`` (plus the weight
        decay's ``beta/2 ||W||^2``), backtracked: a step that raises that objective is undone and taken again at half
        the step size (at most :data:`HEAD_HALVINGS` times; the step size is back for the next round). The objective
        is quadratic in the heads with curvature up to ``rho lambda_max(H^T H) / B``, ``H`` every party's embeddings
        side by side: it grows with the number of parties and the size of their embeddings, which the data decide, so
        no fixed step size is safe everywhere (VIMADMM at --vim-lr 0.3 on digits diverged in its first epoch). A step
        that descends, as every step did at the defaults, is taken as it is."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        decay = [g["weight_decay"] for g in self.optimizer.param_groups for _ in g["params"]]

        def decay_term() -> torch.Tensor:  # the optimiser adds its gradient (weight decay): it is not backpropagated
            with torch.no_grad():
                return sum((0.5 * w * (q ** 2).sum() for w, q in zip(decay, params, strict=True) if w),
                           torch.zeros((), dtype=self.dtype, device=self.device))

        before = [q.detach().clone() for q in params]
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.optimizer.zero_grad(set_to_none=True)
        loss = admm_objective(self.head(xs), lam, z, self.rho)
        loss.backward()
        start = loss.detach() + decay_term()
        try:
            for _ in range(HEAD_HALVINGS + 1):
                self.optimizer.step()
                with torch.no_grad():
                    # compared on the device: one read per round on the common path (a GPU waits once)
                    if bool(admm_objective(self.head(xs), lam, z, self.rho) + decay_term() <= start):
                        return
                    for q, b in zip(params, before, strict=True):
                        q.copy_(b)
                for g in self.optimizer.param_groups:
                    g["lr"] *= 0.5
            self.head_backtracks_exhausted += 1  # no descent even at 2^-20 of the step: the heads keep their values
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                g["lr"] = lr

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
