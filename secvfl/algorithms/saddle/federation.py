"""The parties of a linear saddle-point VFL problem, the federation that holds them, and its setup round.

Feature party ``k`` holds the block ``A_k`` (N x d_k) of the training matrix and weights ``x_k`` (d_k x C); the label
party holds the labels, the loss, ``z`` (N x C) and the dual variable ``lambda`` (N x C). Everything between them
crosses the federation's :class:`~secvfl.transport.network.Network` as messages of kind ``logits`` (forward: ``A_k
x_k``), ``gradient`` (backward: ``lambda``, ``grad l`` or a residual) and ``control`` (the power iteration of
:func:`power_lambda_max`), so protocol layers apply and the network counts every byte (and the payload bytes the
experiments report as floats transmitted).

The methods reach a feature party only through its :class:`LinearFeatureHandle` (:mod:`secvfl.handles`): requests
name the party's points (``x``, the half-step iterate ``xh``, ...) and the public step sizes, and the party computes
its block's steps itself. The label party's variables are the other half of the optimiser, and the coordinator, which
runs in the label party's process, holds it directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from secvfl.algorithms.saddle.losses import Loss, make_loss
from secvfl.errors import ConfigError, DataError
from secvfl.handles import LocalHandle, local_party, request
from secvfl.messages import Message
from secvfl.transport.base import CommStats
from secvfl.transport.layers import Aggregation, AlgorithmTraits, Layer, Role
from secvfl.transport.network import Network

__all__ = [
    "LABEL",
    "FORWARD_KIND",
    "BACKWARD_KIND",
    "CONTROL_KIND",
    "SADDLE_TRAITS",
    "LinearFeatureParty",
    "LinearFeatureHandle",
    "LinearLabelParty",
    "LinearFederation",
    "build_federation",
    "power_lambda_max",
    "received_array",
]

LABEL = "label"
FORWARD_KIND = "logits"  # A_k x_k: a party's local linear output, summed at the label party
BACKWARD_KIND = "gradient"  # lambda (EG) or grad l(z) (GD / Nesterov), or the ADMM residual
CONTROL_KIND = "control"  # setup traffic (power iteration); never compressed
# full batch: each link carries the same quantity every round (what error feedback needs; AlgorithmTraits)
SADDLE_TRAITS = AlgorithmTraits("eg", "sum", forward_kinds=(FORWARD_KIND,), backward_kinds=(BACKWARD_KIND,),
                                persistent_messages=True)

Array = np.ndarray
Matrix = np.ndarray | sp.csr_matrix


def _as_matrix(X: Any, dense_above: float = 0.3) -> Matrix:
    """CSR when sparse enough (LIBSVM data), else a dense float64 array."""
    if sp.issparse(X):
        X = sp.csr_matrix(X, dtype=np.float64)
        return X if X.nnz <= dense_above * X.shape[0] * X.shape[1] else X.toarray()
    X = np.asarray(X, dtype=np.float64)
    if X.size and np.count_nonzero(X) <= dense_above * X.size:
        return sp.csr_matrix(X)
    return np.ascontiguousarray(X)


def _mm(A: Matrix, x: Array) -> Array:
    return np.asarray(A @ x)


def _rmm(A: Matrix, v: Array) -> Array:
    return np.asarray(A.T @ v)


def received_array(t: torch.Tensor) -> Array:
    """A received tensor as the float64 array every party computes with, whatever the wire dtype was."""
    return t.to(torch.float64).numpy()


class LinearFeatureParty:
    """Holds its own block ``A_k`` (train and test rows) and weights ``x_k``; never sees labels or other blocks."""

    def __init__(self, name: str, blocks: dict[str, Matrix], n_outputs: int, mu: float) -> None:
        self.name = name
        self._A = {s: _as_matrix(b) for s, b in blocks.items()}
        self.d = int(self._A["train"].shape[1])
        self.n_outputs = n_outputs
        self.mu = float(mu)
        self.x = np.zeros((self.d, n_outputs))
        self.vars: dict[str, Array] = {}  # algorithm state kept by this party across iterations (averages, momentum)
        self.scratch: dict[str, Array] = {}  # points of the current iteration only (half-step iterate, ...)

    def __repr__(self) -> str:
        return f"LinearFeatureParty({self.name!r}, d={self.d})"

    def rows(self, split: str = "train") -> int:
        return int(self._A[split].shape[0])

    def output(self, x: Array | None = None, split: str = "train", rows: Array | None = None) -> Array:
        A = self._A[split] if rows is None else self._A[split][rows]
        return _mm(A, self.x if x is None else x)

    def adjoint(self, v: Array, rows: Array | None = None) -> Array:
        A = self._A["train"] if rows is None else self._A["train"][rows]
        return _rmm(A, v)

    def gram_apply(self, v: Array) -> Array:
        """``A_k A_k^T v`` (power iteration in the row space; reveals no more than that product)."""
        return _mm(self._A["train"], _rmm(self._A["train"], v))

    def reg_value(self, x: Array | None = None) -> float:
        x = self.x if x is None else x
        return 0.5 * self.mu * float(np.sum(x * x))

    def reg_grad(self, x: Array) -> Array:
        return self.mu * x

    def operator(self, x: Array, lam: Array, rows: Array | None = None, scale: float = 1.0) -> Array:
        """This party's block of F: ``grad r_k(x_k) + A_k^T lambda`` (``scale * A_kB^T lambda_B`` on a batch)."""
        return self.reg_grad(x) + scale * self.adjoint(lam, rows=rows)

    def local_gram_max(self) -> float:
        """``lambda_max(A_k^T A_k)`` (local, no communication)."""
        A = self._A["train"]
        G = (A.T @ A).toarray() if sp.issparse(A) else A.T @ A
        return float(np.linalg.eigvalsh(G)[-1]) if G.size else 0.0

    def solve_regularised(self, rho: float, rhs: Array) -> Array:
        """``(mu I + rho A_k^T A_k)^{-1} rhs`` with a cached Cholesky factor (ADMM's x-update)."""
        key = f"chol:{rho!r}"
        if key not in self.vars:
            A = self._A["train"]
            G = (A.T @ A).toarray() if sp.issparse(A) else A.T @ A
            self.vars[key] = np.linalg.cholesky(self.mu * np.eye(self.d) + rho * G)
        L = self.vars[key]
        return np.linalg.solve(L.T, np.linalg.solve(L, rhs))

    def point(self, name: str) -> Array:
        """``x``, a kept variable or a point of the current iteration, by name."""
        if name == "x":
            return self.x
        return self.vars[name] if name in self.vars else self.scratch[name]

    def set_point(self, name: str, value: Array) -> None:
        if name == "x":
            self.x = value
        elif name in self.vars:
            self.vars[name] = value
        else:
            self.scratch[name] = value

    def state_dict(self) -> dict:
        return {"x": torch.from_numpy(self.x.copy()),
                "vars": {k: torch.from_numpy(np.array(v)) for k, v in self.vars.items() if not k.startswith("chol:")}}

    def load_state_dict(self, state: dict) -> None:
        self.x = state["x"].numpy().copy()
        self.vars = {k: v.numpy().copy() for k, v in state["vars"].items()}


class LinearFeatureHandle(LocalHandle):
    """A :class:`LinearFeatureParty`: requests name the party's points (``x``, a kept variable such as ``x_avg``, or a
    point of the current iteration such as the half-step ``xh``) and the public step sizes; the party takes the
    label party's messages from the network and computes its block's steps itself. Values travel as ``wire_dtype``."""

    _party: LinearFeatureParty

    def __init__(self, party: LinearFeatureParty, net: Network, wire_dtype: torch.dtype) -> None:
        super().__init__(party, net)
        self._wire_dtype = wire_dtype

    def _value(self, v: Array) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(v)).to(self._wire_dtype)

    def _submit(self, step: int, value: Array, meta: dict[str, Any], aggregated: bool) -> None:
        message = Message(FORWARD_KIND, self.name, LABEL, step, {"value": self._value(value)}, meta=meta)
        if aggregated:
            self._net.submit(message)
        else:
            self._net.send(message)

    def _dual(self) -> Array:
        return received_array(self._receive(BACKWARD_KIND, LABEL).tensor("value"))

    @request
    def keep(self, name: str, initial: str) -> None:
        """Keep the variable ``name`` across iterations (checkpointed) from now on, starting as ``initial``: "x" (a
        copy of x), "zeros" (x's shape) or "zero-output" (the shape of ``A_k x``). A kept one (a resumed run) stays."""
        p = self._party
        if name not in p.vars:
            starts = {"x": p.x.copy, "zeros": lambda: np.zeros_like(p.x),
                      "zero-output": lambda: np.zeros((p.rows("train"), p.n_outputs))}
            p.vars[name] = starts[initial]()

    @request
    def send_output(self, step: int, meta: dict[str, Any], *, point: str = "x", split: str = "train",
                    rows: Array | None = None, aggregated: bool = True) -> None:
        """``A_k`` times the point ``point`` (on rows ``rows`` of ``split``), for the label party: its input to the
        aggregation (``aggregated``) or a message of its own."""
        p = self._party
        self._submit(step, p.output(p.point(point), split=split, rows=rows), meta, aggregated)

    @request
    def operator_step(self, dst: str, *, start: str, at: str, gamma: float, rows: Array | None = None,
                      scale: float = 1.0) -> None:
        """Take the dual the label party sent and set ``dst = start - gamma * F_k(at)``, F_k this block of the
        operator (``scale``: the batch estimate's factor on rows ``rows``)."""
        p = self._party
        lam = self._dual()
        p.set_point(dst, p.point(start) - gamma * p.operator(p.point(at), lam, rows=rows, scale=scale))

    @request
    def extrapolate(self, dst: str, beta: float) -> None:
        """``dst = x + beta (x - x_prev)`` (Nesterov's momentum point)."""
        p = self._party
        p.set_point(dst, p.x + beta * (p.x - p.vars["x_prev"]))

    @request
    def assign(self, dst: str, src: str, *, previous: str | None = None) -> None:
        """``dst = src``; with ``previous``, the old ``dst`` is kept there first."""
        p = self._party
        if previous is not None:
            p.set_point(previous, p.point(dst))
        p.set_point(dst, p.point(src))

    @request
    def average(self, into: str, point: str, weight: float) -> None:
        """The running average ``into += weight (point - into)``."""
        p = self._party
        p.vars[into] += weight * (p.point(point) - p.vars[into])

    @request
    def admm_step(self, step: int, meta: dict[str, Any], *, rho: float) -> None:
        """ADMM's x-update from the label party's ``v``: ``argmin (mu/2)||x||^2 + (rho/2)||A x - (A x^t - v)||^2``,
        then ``A_k x`` to the aggregation."""
        p = self._party
        target = p.vars["Ax"] - self._dual()
        # (mu I + rho A^T A) x = rho A^T (A x^t - v)
        p.x = p.solve_regularised(rho, rho * p.adjoint(target))
        p.vars["Ax"] = p.output()
        self._submit(step, p.vars["Ax"], meta, True)

    @request
    def gram_reply(self, step: int) -> None:
        """The power iteration: ``A_k A_k^T v`` back to the label party for the vector ``v`` it sent."""
        got = received_array(self._receive(CONTROL_KIND, LABEL).tensor("vector"))
        self._send([Message(CONTROL_KIND, self.name, LABEL, step, {"vector": self._value(self._party.gram_apply(got))})])


class LinearLabelParty:
    """Holds the labels, the loss and the variables ``z`` and ``lambda`` (both N x C)."""

    def __init__(self, name: str, labels: dict[str, Array], loss: Loss, n_classes: int) -> None:
        self.name = name
        self.loss = loss
        self.n_classes = n_classes
        self._y = {s: np.asarray(v, dtype=np.int64) for s, v in labels.items()}
        self._t = {s: loss.targets(v, n_classes) for s, v in self._y.items()}
        self.n = len(self._y["train"])
        self.C = loss.outputs(n_classes)
        self.z = np.zeros((self.n, self.C))
        self.lam = np.zeros((self.n, self.C))
        self.vars: dict[str, Array] = {}

    def __repr__(self) -> str:
        return f"LinearLabelParty({self.name!r}, n={self.n})"

    @property
    def smoothness(self) -> float:
        """``L_l`` of the mean loss in z."""
        return self.loss.curvature() / self.n

    def loss_value(self, z: Array, split: str = "train", rows: Array | None = None) -> float:
        return self.loss.value(z, self._t[split] if rows is None else self._t[split][rows])

    def labels(self, split: str) -> Array:
        return self._y[split]

    def loss_grad(self, z: Array, rows: Array | None = None) -> Array:
        t = self._t["train"] if rows is None else self._t["train"][rows]
        return self.loss.grad(z, t) * (z.shape[0] / self.n)  # rows of the full mean, also on a batch

    def operator(self, z: Array, lam: Array, S: Array, rows: Array | None = None) -> tuple[Array, Array]:
        """The label party's blocks of F: ``(grad l(z) - lambda, -(S - z))`` with ``S = sum_k A_k x_k``."""
        return self.loss_grad(z, rows=rows) - lam, z - S

    def accuracy(self, z: Array, split: str) -> float:
        return float(np.mean(self.loss.predict(z) == self._y[split]))

    def prox(self, c: Array, tau: float) -> Array:
        return self.loss.prox(c, self._t["train"], tau)

    def state_dict(self) -> dict:
        return {"z": torch.from_numpy(self.z.copy()), "lam": torch.from_numpy(self.lam.copy()),
                "vars": {k: torch.from_numpy(np.array(v)) for k, v in self.vars.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.z = state["z"].numpy().copy()
        self.lam = state["lam"].numpy().copy()
        self.vars = {k: v.numpy().copy() for k, v in state["vars"].items()}


@dataclass
class LinearFederation:
    """The parties of one linear VFL problem and the network between them: the feature parties' handles and the
    label party, whose variables are the coordinator's half of the optimiser (see the module docstring)."""

    net: Network
    feature_handles: list[LinearFeatureHandle]
    label: LinearLabelParty
    mu: float
    wire_dtype: torch.dtype = torch.float64  # what a value costs on the wire; parties compute in float64 either way

    @property
    def n(self) -> int:
        return self.label.n

    @property
    def features(self) -> list[LinearFeatureParty]:
        """The feature party objects, in process only: for the experimenter's :class:`~secvfl.algorithms.saddle.
        monitor.Monitor` and tests, never for the methods' iterations."""
        return [local_party(h) for h in self.feature_handles]

    def wire(self, v: Array) -> torch.Tensor:
        """``v`` as a message carries it (in :attr:`wire_dtype`)."""
        return torch.from_numpy(np.ascontiguousarray(v)).to(self.wire_dtype)

    @property
    def stats(self) -> CommStats:
        """The network's counters: bytes, messages, and the payload bytes "floats transmitted" are measured from."""
        return self.net.stats

    @property
    def individual_messages(self) -> bool:
        """Whether the label party receives each ``A_k x_k`` (plain aggregation) or only their sum."""
        return self.net.aggregation.reveals_individual_outputs

    def reset(self) -> None:
        for p in self.features:
            p.x = np.zeros_like(p.x)
            p.vars = {k: v for k, v in p.vars.items() if k.startswith("chol:")}
        self.label.z = np.zeros_like(self.label.z)
        self.label.lam = np.zeros_like(self.label.lam)
        self.label.vars = {}


def build_federation(
    X_train: Any,
    y_train: Array,
    X_test: Any,
    y_test: Array,
    *,
    n_parties: int = 5,
    loss: str | Loss = "logistic",
    mu: float = 1e-3,
    n_classes: int | None = None,
    layers: Sequence[Layer] = (),
    aggregation: Aggregation | None = None,
    traits: AlgorithmTraits = SADDLE_TRAITS,
    blocks: Sequence[Array] | None = None,
    val: tuple[Any, Array] | None = None,
    net: Network | None = None,
    intercept: bool = False,
    wire_dtype: torch.dtype = torch.float64,
) -> LinearFederation:
    """Split the columns into ``n_parties`` contiguous blocks (or the given ``blocks``), hand each to a party, and
    wire them up; ``secvfl train`` and ``secvfl reproduce saddle`` both build their parties here.

    ``val``: a further evaluated split (features, labels). ``net``: the network to use (the run's, with its protocol
    stack); by default a new in-process one with ``layers`` and ``aggregation``.
    ``intercept``: the first feature party also holds a column of ones, so the model has an intercept. Centred
    (standardised) features need one: without it ``sum_k A_k x_k`` has mean zero over the training rows and the model
    cannot even learn the class prior (a9a standardised: optimum below the majority class). The column costs no
    message and reveals nothing. The LIBSVM data of the reproduction carry it implicitly (one-hot groups sum to 1).
    """
    if mu < 0 or not math.isfinite(mu):
        raise ConfigError(f"mu must be a non-negative number, got {mu}")
    if net is not None and (layers or aggregation is not None):
        raise ConfigError("build_federation takes either a network or the layers and aggregation to build one")
    loss_obj = make_loss(loss) if isinstance(loss, str) else loss
    splits = {"train": (X_train, y_train), "test": (X_test, y_test), **({"val": val} if val is not None else {})}
    labels = {s: np.asarray(y, dtype=np.int64) for s, (_, y) in splits.items()}
    C = int(n_classes if n_classes is not None else max(int(y.max(initial=0)) for y in labels.values()) + 1)
    C = max(C, 2)
    n_out = loss_obj.outputs(C)
    d = X_train.shape[1]
    for s, (X, _) in splits.items():
        if X.shape[1] != d:
            raise DataError(f"train has {d} columns but {s} has {X.shape[1]}")
        if X.shape[0] != len(labels[s]):
            raise DataError("features and labels have different numbers of rows")
    if blocks is None:
        if not 1 <= n_parties <= d:
            raise ConfigError(f"cannot split {d} columns among {n_parties} parties")
        blocks = np.array_split(np.arange(d), n_parties)
    matrices = {s: sp.csr_matrix(X) if sp.issparse(X) else np.asarray(X, dtype=np.float64) for s, (X, _) in splits.items()}

    def block(k: int, cols: Array, X: Matrix) -> Matrix:
        A = X[:, cols]
        if not (intercept and k == 0):
            return A
        ones = np.ones((A.shape[0], 1))
        return sp.hstack([A, sp.csr_matrix(ones)], format="csr") if sp.issparse(A) else np.hstack([A, ones])

    features = [
        LinearFeatureParty(f"party{k}", {s: block(k, cols, X) for s, X in matrices.items()}, n_out, mu)
        for k, cols in enumerate(blocks)
    ]
    label = LinearLabelParty(LABEL, labels, loss_obj, C)
    if net is None:
        roles = {p.name: Role.FEATURE for p in features}
        roles[LABEL] = Role.LABEL
        if aggregation is not None:
            roles.update(aggregation.extra_roles())
        net = Network(roles, layers=layers, aggregation=aggregation, traits=traits)
    handles = [LinearFeatureHandle(p, net, wire_dtype) for p in features]
    return LinearFederation(net, handles, label, float(mu), wire_dtype)


def power_lambda_max(fed: LinearFederation, *, iters: int = 100, tol: float = 1e-6, seed: int = 0) -> float:
    """``lambda_max(A^T A) = lambda_max(sum_k A_k A_k^T)`` by power iteration driven by the label party.

    The label party holds a random vector ``v`` (length N), sends it to every feature party (``control``
    messages), each returns ``A_k A_k^T v``; the label party adds them up. No block ``A_k`` leaves its party.
    Stops when the Rayleigh quotient changes by less than ``tol`` (relative); the estimate is a lower bound, so it
    is inflated by ``tol`` plus 1% for safety.
    """
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(fed.n)
    v /= np.linalg.norm(v)
    est = 0.0
    net = fed.net
    for it in range(iters):
        net.send(*[Message(CONTROL_KIND, LABEL, h.name, it, {"vector": fed.wire(v)}) for h in fed.feature_handles])
        for h in fed.feature_handles:
            h.gram_reply(it)
        w = sum(received_array(net.receive(LABEL, kind=CONTROL_KIND, sender=h.name).tensor("vector"))
                for h in fed.feature_handles)
        new = float(v @ w)
        norm = float(np.linalg.norm(w))
        if norm == 0.0:
            return 0.0
        v = w / norm
        if it > 0 and abs(new - est) <= tol * abs(new):
            est = new
            break
        est = new
    return est * (1.0 + tol + 0.01)
