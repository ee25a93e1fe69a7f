"""Saddle-point VFL for linear and generalised linear models: ExtraGradient on the Lagrangian.

Beznosikov et al., "Exploring New Frontiers in Vertical Federated Learning: the Role of Saddle Point
Reformulation". Feature party ``k`` holds the block ``A_k`` (N x d_k) of the training matrix and weights ``x_k``
(d_k x C); the label party holds the labels, ``z`` (N x C) and the dual variable ``lambda`` (N x C).

* minimisation form: ``min_x f(x) = l(sum_k A_k x_k) + sum_k r_k(x_k)``, ``l(z) = mean_n loss(z_n, y_n)``,
  ``r_k = (mu/2) ||x_k||^2``;
* saddle form: ``min_{x,z} max_lambda  l(z) + r(x) + <lambda, sum_k A_k x_k - z>``, with the monotone operator
  ``F(x, z, lambda) = (grad r_k(x_k) + A_k^T lambda  for each k,  grad l(z) - lambda,  -(sum_k A_k x_k - z))``.

ExtraGradient (:class:`ExtraGradient`): ``w+ = w - G F(w)``, ``w <- w - G F(w+)``, with ``G`` the step sizes of the
``x``, ``z`` and ``lambda`` blocks. Each iteration is two communication rounds, each one "feature parties send
``A_k x_k`` (through the aggregation: plain, or CKKS/masking for the sum), the label party sends ``lambda`` to every
(participating) feature party". Everything crosses a :class:`~secvfl.transport.Network` as messages of kind
``logits`` (forward) and ``gradient`` (backward), so compression, DP and secure aggregation layers apply and every
byte is counted.

Step sizes (``step=``):

* ``"theory"``: one step for all blocks, ``gamma = 1/2 min{1, 1/sqrt(lambda_max(A^T A)), 1/L_r, 1/L_l}``
  (``lambda_max`` by a power iteration that runs over the network, :func:`power_lambda_max`; no party shares
  ``A_k``). With the *mean* loss, ``L_l = O(1/N)`` and the coupling is ``O(sqrt(N))``, so this step is safe but
  very slow: the ``z``/``lambda`` blocks live on scales ``1`` and ``1/N``.
* ``"scaled"`` (default): block steps ``gamma_x = c_x / (L_r + L_l lambda_max)``, ``gamma_z = c_z / L_l``,
  ``gamma_lambda = c_lambda L_l``. A positive block-diagonal step is the same ExtraGradient on the same saddle
  problem in rescaled variables (``z / sqrt(gamma_z)``, ``lambda / sqrt(gamma_lambda)``), chosen so the ``z``-
  ``lambda`` pair is well conditioned; the convergence theory is unchanged.
* ``"tuned"``: a short pilot run per multiplier of the ``"scaled"`` steps; the best one is kept (see
  :func:`tune_multiplier`; the pilots' traffic is reported separately).

Extensions: compression of both directions comes from the protocol stack (:class:`protocols.compression.
CompressionLayer`, e.g. ``randk:0.1+ef`` or ``randk:0.1+vr``; messages carry ``meta["persistent"]`` because each
link carries the same quantity every round, which error feedback needs); partial participation (``participation=p``:
each feature party takes part in an iteration with probability ``p``; the label party reuses the last ``A_k x_k`` of
the others, which only it can do when it receives them individually, i.e. with the plain aggregation); stochastic
mini-batch EG (``batch_size=``: batch-sized messages, ``z`` and ``lambda`` updated on the batch, an unbiased
``(N/b) A_kB^T lambda_B`` for the ``x`` blocks).

Monitoring (objective, suboptimality, accuracy) is the experimenter's instrument, not part of the protocol: the
:class:`Monitor` reads party state directly and its traffic is not counted, as a deployment would evaluate once.

Threat model: as plain VFL with the same messages. The label party sees every ``A_k x_k`` (or only their sum under
CKKS/masking); feature parties see ``lambda``, which at the optimum is ``grad l(z*)`` -- a function of the labels,
like a gradient in split learning. Power iteration exposes ``A_k A_k^T v`` for random ``v`` once at setup.
"""

from __future__ import annotations

import math
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import scipy.sparse as sp
import torch

from protocols.base import AlgorithmTraits, Layer, Role
from secvfl.errors import ConfigError, DataError, UnsupportedError
from secvfl.messages import Message
from secvfl.registry import Registry
from secvfl.transport.inprocess import InProcessTransport
from secvfl.transport.network import Network

__all__ = [
    "LOSSES",
    "Loss",
    "make_loss",
    "CountingTransport",
    "LinearFeatureParty",
    "LinearLabelParty",
    "LinearFederation",
    "build_federation",
    "power_lambda_max",
    "Monitor",
    "Trace",
    "LinearAlgorithm",
    "ExtraGradient",
    "StepSizes",
    "tune_multiplier",
    "SADDLE_TRAITS",
    "LABEL",
]

LABEL = "label"
FORWARD_KIND = "logits"  # A_k x_k: a party's local linear output, summed at the label party
BACKWARD_KIND = "gradient"  # lambda (EG) or grad l(z) (GD / Nesterov), or the ADMM residual
CONTROL_KIND = "control"  # setup traffic (power iteration); never compressed
SADDLE_TRAITS = AlgorithmTraits("eg", "sum", forward_kinds=(FORWARD_KIND,), backward_kinds=(BACKWARD_KIND,))

Array = np.ndarray
Matrix = np.ndarray | sp.csr_matrix


# ---------------------------------------------------------------------------------------------------------------
# Losses on z (N x C), averaged over rows
# ---------------------------------------------------------------------------------------------------------------
class Loss(ABC):
    name: ClassVar[str]

    @abstractmethod
    def outputs(self, n_classes: int) -> int:
        """Columns C of z for a task with ``n_classes`` classes."""

    @abstractmethod
    def targets(self, y: Array, n_classes: int) -> Array:
        """What the label party keeps from the int labels (0..C-1)."""

    @abstractmethod
    def value(self, z: Array, t: Array) -> float:
        """Mean loss over rows."""

    @abstractmethod
    def grad(self, z: Array, t: Array) -> Array:
        """Gradient of the mean loss with respect to z (so rows are scaled by 1/N)."""

    @abstractmethod
    def curvature(self) -> float:
        """Bound on the per-row Hessian norm of ``loss`` (``L_l = curvature / N`` for the mean)."""

    @abstractmethod
    def predict(self, z: Array) -> Array:
        """Class predictions (int) from z."""

    @abstractmethod
    def proba(self, z: Array) -> Array:
        """Class scores in [0, 1] per row, (N, classes), for metrics such as AUC."""

    @abstractmethod
    def hess_diag(self, z: Array, t: Array) -> Array:
        """Per-row Hessian of ``loss`` (not divided by N): (N, C) for diagonal losses, (N, C, C) for softmax."""

    def prox(self, c: Array, t: Array, tau: float, iters: int = 50) -> Array:
        """``argmin_w  loss(w_n, t_n) + (1/(2 tau)) ||w_n - c_n||^2`` for every row (Newton, safeguarded)."""
        w = c.copy()
        for _ in range(iters):
            g = self._row_grad(w, t) + (w - c) / tau
            h = self.hess_diag(w, t)
            if h.ndim == 3:
                eye = np.eye(h.shape[1])[None] / tau
                step = np.linalg.solve(h + eye, g[..., None])[..., 0]
            else:
                step = g / (h + 1.0 / tau)
            w -= step
            if float(np.max(np.abs(step), initial=0.0)) < 1e-13 * (1.0 + float(np.max(np.abs(w), initial=0.0))):
                break
        return w

    def _row_grad(self, z: Array, t: Array) -> Array:
        return self.grad(z, t) * z.shape[0]


def _sigmoid(z: Array) -> Array:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


LOSSES: Registry[type[Loss]] = Registry("loss")


@LOSSES.register("logistic")
class LogisticLoss(Loss):
    """Binary cross-entropy on one logit; labels 0/1."""

    name = "logistic"

    def outputs(self, n_classes: int) -> int:
        if n_classes != 2:
            raise ConfigError(f"logistic loss is for 2 classes, the data has {n_classes}; use softmax")
        return 1

    def targets(self, y: Array, n_classes: int) -> Array:
        return y.astype(np.float64).reshape(-1, 1)

    def value(self, z: Array, t: Array) -> float:
        return float(np.mean(np.logaddexp(0.0, z) - t * z))

    def grad(self, z: Array, t: Array) -> Array:
        return (_sigmoid(z) - t) / z.shape[0]

    def curvature(self) -> float:
        return 0.25

    def predict(self, z: Array) -> Array:
        return (z[:, 0] > 0).astype(np.int64)

    def proba(self, z: Array) -> Array:
        p = _sigmoid(z[:, 0])
        return np.stack([1.0 - p, p], axis=1)

    def hess_diag(self, z: Array, t: Array) -> Array:
        s = _sigmoid(z)
        return s * (1.0 - s)


@LOSSES.register("squared")
class SquaredLoss(Loss):
    """``(z - t)^2 / 2`` with targets +-1 (binary) or one-hot (multi-class)."""

    name = "squared"

    def outputs(self, n_classes: int) -> int:
        return 1 if n_classes == 2 else n_classes

    def targets(self, y: Array, n_classes: int) -> Array:
        if n_classes == 2:
            return (2.0 * y - 1.0).reshape(-1, 1)
        return np.eye(n_classes)[y]

    def value(self, z: Array, t: Array) -> float:
        return float(0.5 * np.mean(np.sum((z - t) ** 2, axis=1)))

    def grad(self, z: Array, t: Array) -> Array:
        return (z - t) / z.shape[0]

    def curvature(self) -> float:
        return 1.0

    def predict(self, z: Array) -> Array:
        return (z[:, 0] > 0).astype(np.int64) if z.shape[1] == 1 else np.argmax(z, axis=1)

    def proba(self, z: Array) -> Array:
        if z.shape[1] == 1:
            p = np.clip((z[:, 0] + 1.0) / 2.0, 0.0, 1.0)
            return np.stack([1.0 - p, p], axis=1)
        return SoftmaxLoss._softmax(z)

    def hess_diag(self, z: Array, t: Array) -> Array:
        return np.ones_like(z)

    def prox(self, c: Array, t: Array, tau: float, iters: int = 50) -> Array:
        return (c + tau * t) / (1.0 + tau)


@LOSSES.register("softmax")
class SoftmaxLoss(Loss):
    """Softmax cross-entropy on C logits; labels 0..C-1."""

    name = "softmax"

    def outputs(self, n_classes: int) -> int:
        return n_classes

    def targets(self, y: Array, n_classes: int) -> Array:
        return np.eye(n_classes)[y]

    @staticmethod
    def _softmax(z: Array) -> Array:
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def value(self, z: Array, t: Array) -> float:
        m = z.max(axis=1, keepdims=True)
        lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
        return float(np.mean(lse - np.sum(t * z, axis=1)))

    def grad(self, z: Array, t: Array) -> Array:
        return (self._softmax(z) - t) / z.shape[0]

    def curvature(self) -> float:
        return 0.5  # ||diag(p) - p p^T|| <= 1/2

    def predict(self, z: Array) -> Array:
        return np.argmax(z, axis=1)

    def proba(self, z: Array) -> Array:
        return self._softmax(z)

    def hess_diag(self, z: Array, t: Array) -> Array:
        p = self._softmax(z)
        return p[:, :, None] * np.eye(z.shape[1])[None] - p[:, :, None] * p[:, None, :]


def make_loss(name: str) -> Loss:
    return LOSSES.get(name)()


# ---------------------------------------------------------------------------------------------------------------
# Transport that also counts payload (what "floats transmitted" is measured from)
# ---------------------------------------------------------------------------------------------------------------
_PREFIX = struct.Struct("<4sBI")


class CountingTransport(InProcessTransport):
    """In-process transport that also records payload bytes (message size minus prefix and JSON header).

    ``floats`` is payload bytes / 8: float64 equivalents, exactly the number of values for uncompressed float64
    messages, and the honest equivalent (indices, seeds, packed codes included) for compressed ones.
    """

    def __init__(self) -> None:
        super().__init__()
        self.payload_by_kind: dict[str, int] = {}

    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        super().put(sender, receiver, kind, data)
        _, _, hlen = _PREFIX.unpack_from(data)
        self.payload_by_kind[kind] = self.payload_by_kind.get(kind, 0) + len(data) - _PREFIX.size - hlen

    def payload(self, kinds: Sequence[str] | None = None) -> int:
        return sum(v for k, v in self.payload_by_kind.items() if kinds is None or k in kinds)


# ---------------------------------------------------------------------------------------------------------------
# Parties
# ---------------------------------------------------------------------------------------------------------------
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


def _received(t: torch.Tensor) -> Array:
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
        self.vars: dict[str, Array] = {}  # algorithm state kept by this party (half-step iterates, momentum, ...)

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

    def state_dict(self) -> dict:
        return {"x": torch.from_numpy(self.x.copy()),
                "vars": {k: torch.from_numpy(np.array(v)) for k, v in self.vars.items() if not k.startswith("chol:")}}

    def load_state_dict(self, state: dict) -> None:
        self.x = state["x"].numpy().copy()
        self.vars = {k: v.numpy().copy() for k, v in state["vars"].items()}


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
    """The parties of one linear VFL problem and the network between them."""

    net: Network
    features: list[LinearFeatureParty]
    label: LinearLabelParty
    mu: float
    wire_dtype: torch.dtype = torch.float64  # what a value costs on the wire; parties compute in float64 either way

    @property
    def n(self) -> int:
        return self.label.n

    def wire(self, v: Array) -> torch.Tensor:
        """``v`` as a message carries it (in :attr:`wire_dtype`)."""
        return torch.from_numpy(np.ascontiguousarray(v)).to(self.wire_dtype)

    @property
    def transport(self) -> CountingTransport:
        t = self.net.transport
        if not isinstance(t, CountingTransport):
            raise UnsupportedError("saddle-point runs need a CountingTransport to report floats transmitted")
        return t

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
    aggregation: Any = None,
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
    stack); by default a new one over a :class:`CountingTransport` with ``layers`` and ``aggregation``.
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
        if aggregation is not None and hasattr(aggregation, "extra_roles"):
            roles.update(aggregation.extra_roles())
        net = Network(roles, transport=CountingTransport(), layers=layers, aggregation=aggregation, traits=traits)
    return LinearFederation(net, features, label, float(mu), wire_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Setup: lambda_max(A^T A) by power iteration over the network
# ---------------------------------------------------------------------------------------------------------------
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
        net.send(*[Message(CONTROL_KIND, LABEL, p.name, it, {"vector": fed.wire(v)}) for p in fed.features])
        for p in fed.features:
            got = _received(net.receive(p.name, kind=CONTROL_KIND, sender=LABEL).tensor("vector"))
            net.send(Message(CONTROL_KIND, p.name, LABEL, it, {"vector": fed.wire(p.gram_apply(got))}))
        w = sum(_received(net.receive(LABEL, kind=CONTROL_KIND, sender=p.name).tensor("vector")) for p in fed.features)
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


# ---------------------------------------------------------------------------------------------------------------
# Monitoring (outside the protocol) and traces
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Monitor:
    """The experimenter's view: objective and accuracy from the parties' current (or averaged) weights.

    It reads party state directly; nothing it computes is sent over the network or counted.
    """

    fed: LinearFederation
    f_star: float | None = None

    def objective(self, xs: Sequence[Array]) -> tuple[float, Array]:
        z = sum(p.output(x) for p, x in zip(self.fed.features, xs, strict=True))
        f = self.fed.label.loss_value(z) + sum(p.reg_value(x) for p, x in zip(self.fed.features, xs, strict=True))
        return float(f), z

    def test_accuracy(self, xs: Sequence[Array]) -> float:
        z = sum(p.output(x, split="test") for p, x in zip(self.fed.features, xs, strict=True))
        return self.fed.label.accuracy(z, "test")

    def point(self, xs: Sequence[Array], prefix: str = "") -> dict[str, float]:
        f, z = self.objective(xs)
        out = {f"{prefix}objective": f, f"{prefix}train_accuracy": self.fed.label.accuracy(z, "train"),
               f"{prefix}test_accuracy": self.test_accuracy(xs)}
        if self.f_star is not None:
            out[f"{prefix}subopt"] = (f - self.f_star) / abs(self.f_star) if self.f_star else f
        return out


@dataclass
class Trace:
    """One run's curve: a row per evaluation (iteration, floats and bytes so far, objective, accuracies)."""

    method: str
    rows: list[dict[str, float]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def first(self, key: str, below: float) -> dict[str, float] | None:
        """The first row where ``key`` <= ``below`` (e.g. the floats needed to reach a suboptimality)."""
        for r in self.rows:
            v = r.get(key)
            if v is not None and math.isfinite(v) and v <= below:
                return r
        return None

    def last(self) -> dict[str, float]:
        return self.rows[-1] if self.rows else {}

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "info": self.info, "rows": self.rows}


# ---------------------------------------------------------------------------------------------------------------
# Algorithms
# ---------------------------------------------------------------------------------------------------------------
class LinearAlgorithm(ABC):
    """A federated first-order method on a :class:`LinearFederation`; subclasses implement :meth:`iterate`.

    Helpers move ``A_k x_k`` forward (aggregated, or individually where the label party needs each) and a dense
    vector backward, always through the network.
    """

    method: ClassVar[str] = "linear"
    persistent_messages: ClassVar[bool] = True  # each link carries the same quantity every round (error feedback)

    def __init__(self, fed: LinearFederation, *, seed: int = 0) -> None:
        self.fed = fed
        self.seed = seed
        self.t = 0  # iterations done
        self.round = 0  # communication rounds (message step numbers)
        self.last_sum: tuple[Array, Array | None] | None = None

    # -- communication ----------------------------------------------------------------------------------------
    def send_forward(
        self, outputs: dict[str, Array], *, rows: Array | None = None, reuse_absent: bool = False
    ) -> Array:
        """Feature parties in ``outputs`` send their ``A_k x_k``; returns what the label party gets: the sum."""
        net = self.fed.net
        meta: dict[str, Any] = {"persistent": True} if rows is None else {"rows": ["train", *map(int, rows)]}
        msgs = [Message(FORWARD_KIND, name, LABEL, self.round, {"value": self.fed.wire(v)}, meta=meta)
                for name, v in outputs.items()]
        if reuse_absent and not self.fed.individual_messages:
            raise UnsupportedError(
                "partial participation reuses each absent party's last A_k x_k, which the label party only "
                f"has with the plain aggregation, not {self.fed.net.aggregation.name}"
            )
        if reuse_absent:  # the label party keeps each party's latest A_k x_k, so it needs them one by one
            for m in msgs:
                net.send(m)
            for name in outputs:
                # the label party keeps each party's last A_k x_k (reused while that party is absent)
                got = _received(net.receive(LABEL, kind=FORWARD_KIND, sender=name).tensor("value"))
                self.fed.label.vars[f"last:{name}"] = got
            names = [p.name for p in self.fed.features] if reuse_absent else list(outputs)
            last = {n: self.fed.label.vars.get(f"last:{n}") for n in names}
            missing = [n for n, v in last.items() if v is None]
            if missing:
                raise UnsupportedError(f"no earlier message from {missing} to reuse")
            total = sum(last[n] for n in names)
        else:
            total = _received(net.aggregate(msgs, LABEL, "sum").tensor("value"))
        self.last_sum = (total, rows)  # the label party's latest sum (its training loss comes from it)
        return total

    def send_backward(self, value: Array, receivers: Sequence[str], *, rows: Array | None = None) -> dict[str, Array]:
        """The label party sends ``value`` to each receiver (one message each); returns what each receives."""
        net = self.fed.net
        meta: dict[str, Any] = {"persistent": True} if rows is None else {"rows": ["train", *map(int, rows)]}
        t = self.fed.wire(value)
        net.send(*[Message(BACKWARD_KIND, LABEL, r, self.round, {"value": t}, meta=meta) for r in receivers])
        return {r: _received(net.receive(r, kind=BACKWARD_KIND, sender=LABEL).tensor("value")) for r in receivers}

    # -- loop -------------------------------------------------------------------------------------------------
    @abstractmethod
    def iterate(self) -> None:
        """One iteration (its communication rounds included)."""

    def current(self) -> list[Array]:
        return [p.x for p in self.fed.features]

    def averaged(self) -> list[Array] | None:
        return None

    def run(
        self,
        monitor: Monitor,
        *,
        max_iters: int = 1000,
        target: float | None = None,
        eval_every: int = 10,
        max_floats: float | None = None,
        stop_on_target: bool = True,
        time_limit: float | None = None,
    ) -> Trace:
        trace = Trace(self.method, info=self.describe())
        tr = self.fed.transport
        base_payload, base_bytes = tr.payload(), tr.stats.bytes_total
        base_msgs = tr.stats.messages_total
        wall = 0.0
        f0 = None

        def record() -> dict[str, float]:
            row: dict[str, float] = {"iter": self.t, "floats": (tr.payload() - base_payload) / 8.0,
                                     "bytes": tr.stats.bytes_total - base_bytes,
                                     "messages": tr.stats.messages_total - base_msgs, "wall_s": wall}
            row.update(monitor.point(self.current()))
            avg = self.averaged()
            if avg is not None:
                row.update(monitor.point(avg, prefix="avg_"))
            trace.rows.append(row)
            return row

        row = record()
        f0 = row["objective"]
        status = "max_iters"
        while self.t < max_iters:
            start = time.perf_counter()
            self.iterate()
            wall += time.perf_counter() - start
            if self.t % eval_every == 0 or self.t == max_iters:
                row = record()
                f = row["objective"]
                if not math.isfinite(f) or f > 1e6 * max(1.0, abs(f0)):
                    status = "diverged"
                    break
                if stop_on_target and target is not None and row.get("subopt", math.inf) <= target:
                    status = "target"
                    break
                if max_floats is not None and row["floats"] >= max_floats:
                    status = "max_floats"
                    break
                if time_limit is not None and wall >= time_limit:
                    status = "time_limit"
                    break
        if trace.rows[-1]["iter"] != self.t:
            record()
        trace.info["status"] = status
        trace.info["wall_s"] = wall
        trace.info["bytes_by_kind"] = dict(tr.stats.bytes_by_kind)
        return trace

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "protocols": self.fed.net.describe()}


@dataclass(frozen=True)
class StepSizes:
    """ExtraGradient step sizes of the x, z and lambda blocks."""

    x: float
    z: float
    lam: float

    @classmethod
    def theory(cls, lambda_max: float, L_r: float, L_l: float) -> StepSizes:
        inv = [1.0, 1.0 / math.sqrt(lambda_max) if lambda_max > 0 else math.inf]
        inv += [1.0 / L_r if L_r > 0 else math.inf, 1.0 / L_l if L_l > 0 else math.inf]
        g = 0.5 * min(inv)
        return cls(g, g, g)

    @classmethod
    def scaled(cls, lambda_max: float, L_r: float, L_l: float, multiplier: float = 1.0,
               c: tuple[float, float, float] = (1.0, 1.0, 0.5)) -> StepSizes:
        return cls(multiplier * c[0] / (L_r + L_l * lambda_max), multiplier * c[1] / L_l, multiplier * c[2] * L_l)

    def scale(self, m: float) -> StepSizes:
        return StepSizes(self.x * m, self.z * m, self.lam * m)


class ExtraGradient(LinearAlgorithm):
    """ExtraGradient on the Lagrangian (see the module docstring); ``--algo eg``.

    ``participation``: probability that a feature party takes part in an iteration (1: always).
    ``batch_size``: rows per iteration for stochastic mini-batch EG (None: full batch).
    """

    method = "eg"

    def __init__(
        self,
        fed: LinearFederation,
        steps: StepSizes,
        *,
        participation: float = 1.0,
        batch_size: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(fed, seed=seed)
        if not 0.0 < participation <= 1.0:
            raise ConfigError(f"participation probability must be in (0, 1], got {participation}")
        if batch_size is not None and not 1 <= batch_size <= fed.n:
            raise ConfigError(f"batch size must be in 1..{fed.n}, got {batch_size}")
        if participation < 1.0 and not fed.individual_messages:
            raise UnsupportedError(
                "partial participation reuses each absent party's last A_k x_k, which the label party only has with "
                f"the plain aggregation; {fed.net.aggregation.name} delivers only the sum"
            )
        if participation < 1.0 and batch_size is not None:
            raise UnsupportedError("partial participation and mini-batches are not combined here; choose one")
        self.steps = steps
        self.p = participation
        self.batch_size = batch_size
        self._avg_count = 0
        for p in fed.features:
            p.vars.setdefault("x_avg", np.zeros_like(p.x))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"steps": {"x": self.steps.x, "z": self.steps.z, "lambda": self.steps.lam},
                  "participation": self.p, "batch_size": self.batch_size})
        return d

    def averaged(self) -> list[Array] | None:
        return [p.vars["x_avg"] for p in self.fed.features] if self._avg_count else None

    def _draw(self) -> np.random.Generator:
        """This iteration's public randomness (who participates, which rows): a function of (seed, t) only."""
        return np.random.default_rng([self.seed, 11, self.t])

    def iterate(self) -> None:
        if self.batch_size is not None:
            self._iterate_batch()
        else:
            self._iterate_full()
        self.t += 1

    def _participants(self) -> list[LinearFeatureParty]:
        if self.p >= 1.0:
            return self.fed.features
        mask = self._draw().random(len(self.fed.features)) < self.p
        if not any(k.startswith("last:") for k in self.fed.label.vars):
            mask[:] = True  # everyone's first message (also after a resume) exists before anyone can reuse it
        return [p for p, m in zip(self.fed.features, mask, strict=True) if m]

    def _round(self, parts: list[LinearFeatureParty], xs: dict[str, Array], lam: Array) -> tuple[Array, dict[str, Array]]:
        """One communication round: outputs ``A_k xs[k]`` forward, ``lam`` backward."""
        S = self.send_forward({p.name: p.output(xs[p.name]) for p in parts}, reuse_absent=self.p < 1.0)
        lam_k = self.send_backward(lam, [p.name for p in parts])
        self.round += 1
        return S, lam_k

    def _iterate_full(self) -> None:
        g, lab = self.steps, self.fed.label
        parts = self._participants()
        # F at w^t
        S, lam_k = self._round(parts, {p.name: p.x for p in parts}, lab.lam)
        xh = {p.name: p.x - g.x * p.operator(p.x, lam_k[p.name]) for p in parts}
        Fz, Fl = lab.operator(lab.z, lab.lam, S)
        zh, lh = lab.z - g.z * Fz, lab.lam - g.lam * Fl
        # F at w^{t+1/2}
        Sh, lh_k = self._round(parts, xh, lh)
        for p in parts:
            p.x = p.x - g.x * p.operator(xh[p.name], lh_k[p.name])
        Fz, Fl = lab.operator(zh, lh, Sh)
        lab.z, lab.lam = lab.z - g.z * Fz, lab.lam - g.lam * Fl
        # running average of the half-step iterates (the ergodic EG iterate); absent parties average their x
        self._avg_count += 1
        w = 1.0 / self._avg_count
        for p in self.fed.features:
            point = xh.get(p.name, p.x)
            p.vars["x_avg"] += w * (point - p.vars["x_avg"])

    def _iterate_batch(self) -> None:
        g, lab, fed = self.steps, self.fed.label, self.fed
        b = self.batch_size
        assert b is not None
        rows = np.sort(self._draw().choice(fed.n, size=b, replace=False))
        scale = fed.n / b
        parts = fed.features
        names = [p.name for p in parts]
        z, lam = lab.z[rows], lab.lam[rows]
        S = self.send_forward({p.name: p.output(p.x, rows=rows) for p in parts}, rows=rows)
        lam_k = self.send_backward(lam, names, rows=rows)
        self.round += 1
        xh = {p.name: p.x - g.x * p.operator(p.x, lam_k[p.name], rows=rows, scale=scale) for p in parts}
        Fz, Fl = lab.operator(z, lam, S, rows=rows)
        zh, lh = z - g.z * Fz, lam - g.lam * Fl
        Sh = self.send_forward({p.name: p.output(xh[p.name], rows=rows) for p in parts}, rows=rows)
        lh_k = self.send_backward(lh, names, rows=rows)
        self.round += 1
        for p in parts:
            p.x = p.x - g.x * p.operator(xh[p.name], lh_k[p.name], rows=rows, scale=scale)
        Fz, Fl = lab.operator(zh, lh, Sh, rows=rows)
        lab.z[rows], lab.lam[rows] = z - g.z * Fz, lam - g.lam * Fl
        self._avg_count += 1
        w = 1.0 / self._avg_count
        for p in parts:
            p.vars["x_avg"] += w * (xh[p.name] - p.vars["x_avg"])


def tune_multiplier(
    make: Callable[[float], LinearAlgorithm],
    *,
    f_star: float | None = None,
    grid: Sequence[float] = (4.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.05),
    pilot_iters: int = 200,
) -> tuple[float, list[dict[str, float]]]:
    """Run ``make(m)`` for ``pilot_iters`` iterations per multiplier ``m``; return the best ``m`` and the pilots.

    The best multiplier has the lowest objective at the end of its pilot (diverged pilots lose). ``make`` must
    build each pilot on a fresh federation (new network, new layer state), so pilots do not share memory.
    """
    results = []
    for m in grid:
        algo = make(m)
        tr0 = algo.fed.transport.payload()
        trace = algo.run(Monitor(algo.fed, f_star), max_iters=pilot_iters, eval_every=pilot_iters, target=None)
        f = trace.last().get("objective", math.inf)
        if trace.info.get("status") == "diverged" or not math.isfinite(f):
            f = math.inf
        results.append({"multiplier": m, "objective": f, "floats": (algo.fed.transport.payload() - tr0) / 8.0})
    best = min(results, key=lambda r: (r["objective"], -r["multiplier"]))
    return float(best["multiplier"]), results
