"""Privacy accounting: events, composition, epsilon for a delta, and noise calibration.

The API follows the ``dp_accounting`` style: describe *what was released* as events, compose them in an accountant,
ask for ``get_epsilon(delta)``. The arithmetic is Opacus's: the RDP accountant calls
``opacus.accountants.analysis.rdp.compute_rdp`` / ``get_privacy_spent`` and the PRV accountant builds an
``opacus.accountants.PRVAccountant``, so a number reported here is the number Opacus reports for the same mechanism.

Events
    :class:`GaussianEvent`        one Gaussian mechanism (noise std / L2 sensitivity = ``noise_multiplier``) applied
                                  ``count`` times *without* subsampling amplification (Opacus ``sample_rate=1``). This
                                  is what secvfl's label- and feature-DP release: the feature parties choose, and so
                                  know, which samples are in each batch, so there is no secret sampling to amplify.
    :class:`SampledGaussianEvent` the Poisson-subsampled Gaussian of DP-SGD, for completeness; valid only where the
                                  batch membership is secret and Poisson-sampled.
    :class:`PureDPEvent`          an epsilon-DP mechanism (randomized response).
    :func:`compose`               a composition of events (adaptive composition is covered by every accountant).

Accountants (``make_accountant(name)``)
    ``rdp``  Renyi DP with Opacus's analysis and conversion (Balle et al. 2020); the default.
    ``prv``  Opacus's PRV accountant (Gopi et al. 2021): numerical, tighter, reports its upper bound.
    ``gdp``  exact for compositions of unsubsampled Gaussians: ``T`` releases at multiplier ``s`` are ``mu``-GDP with
             ``mu = sqrt(T) / s`` (Dong, Roth & Su 2019, Cor. 3.3), and the (epsilon, delta) curve of ``mu``-GDP is
             the analytic Gaussian curve (Balle & Wang 2018). Refuses anything else.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm

from secvfl.errors import ConfigError, UnsupportedError

__all__ = [
    "DEFAULT_ORDERS",
    "GaussianEvent",
    "SampledGaussianEvent",
    "PureDPEvent",
    "ComposedEvent",
    "compose",
    "Accountant",
    "RdpAccountant",
    "PrvAccountant",
    "GdpAccountant",
    "ACCOUNTANTS",
    "make_accountant",
    "epsilon_of",
    "calibrate_noise_multiplier",
    "gaussian_epsilon",
    "gaussian_delta",
]

# Opacus's default RDP orders, extended upwards so that small epsilons (which need high orders) are not
# over-reported. Opacus's own RDPAccountant gives the identical number when handed these orders.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [80, 96, 128, 160, 192, 256, 384, 512, 1024]
)


# ----------------------------------------------------------------------------------------------------------------
# Events
# ----------------------------------------------------------------------------------------------------------------
def _check_count(count: int) -> None:
    if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 0:
        raise ConfigError(f"an event's count must be a non-negative integer, got {count!r}")


@dataclass(frozen=True)
class GaussianEvent:
    """``count`` adaptive Gaussian releases, noise std = ``noise_multiplier`` x L2 sensitivity, no subsampling."""

    noise_multiplier: float
    count: int = 1

    def __post_init__(self) -> None:
        _check_count(self.count)
        if not self.noise_multiplier > 0:
            raise ConfigError(f"noise multiplier must be > 0, got {self.noise_multiplier}")


@dataclass(frozen=True)
class SampledGaussianEvent:
    """``count`` steps of the Poisson-subsampled Gaussian mechanism (DP-SGD with secret Poisson batches)."""

    noise_multiplier: float
    sample_rate: float
    count: int = 1

    def __post_init__(self) -> None:
        _check_count(self.count)
        if not self.noise_multiplier > 0:
            raise ConfigError(f"noise multiplier must be > 0, got {self.noise_multiplier}")
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"sample rate must be in (0, 1], got {self.sample_rate}")


@dataclass(frozen=True)
class PureDPEvent:
    """``count`` releases of an ``epsilon``-DP mechanism (delta = 0), e.g. randomized response."""

    epsilon: float
    count: int = 1

    def __post_init__(self) -> None:
        _check_count(self.count)
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ConfigError(f"a pure-DP event needs a finite epsilon > 0, got {self.epsilon}")


@dataclass(frozen=True)
class ComposedEvent:
    """The (adaptive) composition of several events."""

    events: tuple[Event, ...]


Event = GaussianEvent | SampledGaussianEvent | PureDPEvent | ComposedEvent


def compose(*events: Event) -> ComposedEvent:
    """Compose events (nested compositions are flattened)."""
    return ComposedEvent(tuple(_flatten(events)))


def _flatten(events: Iterable[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if isinstance(e, ComposedEvent):
            out.extend(_flatten(e.events))
        elif isinstance(e, (GaussianEvent, SampledGaussianEvent, PureDPEvent)):
            out.append(e)
        else:
            raise _unknown(e, "compose")
    return out


def _unknown(event: object, where: str) -> UnsupportedError:
    """Fail closed: a release no accountant knows how to price must be refused, never counted as costing nothing."""
    return UnsupportedError(f"{where}: cannot account for a {type(event).__name__}, which is not a known privacy "
                            "event; describe the release as a GaussianEvent, SampledGaussianEvent or PureDPEvent")


def _check_delta(delta: float) -> None:
    if not 0 <= delta < 1:
        raise ConfigError(f"delta must be in [0, 1), got {delta}")


# ----------------------------------------------------------------------------------------------------------------
# Accountants
# ----------------------------------------------------------------------------------------------------------------
class Accountant(ABC):
    """Accumulates events; :meth:`get_epsilon` answers for the composition of everything added so far."""

    name: ClassVar[str] = "accountant"
    description: ClassVar[str] = ""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def compose(self, event: Event, count: int = 1) -> Accountant:
        """Add ``event`` (``count`` times); returns ``self`` so calls chain."""
        _check_count(count)
        self.events.extend(_flatten([event]) * count)
        return self

    @abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """Smallest epsilon this accountant can certify at ``delta`` for everything composed so far."""

    def describe(self) -> dict[str, Any]:
        return {"accountant": self.name, "description": self.description}


class RdpAccountant(Accountant):
    """Renyi-DP accounting with Opacus's analysis functions (sample rate 1 for unsubsampled releases)."""

    name = "rdp"
    description = "Renyi DP (Opacus rdp analysis; RDP-to-(epsilon, delta) conversion of Balle et al. 2020)"

    def __init__(self, orders: Sequence[float] = DEFAULT_ORDERS) -> None:
        super().__init__()
        self.orders = np.asarray(orders, dtype=np.float64)
        if self.orders.ndim != 1 or not np.all(self.orders > 1):
            raise ConfigError("RDP orders must be a list of numbers > 1")

    def rdp(self) -> np.ndarray:
        """RDP of the composition at every order."""
        from opacus.accountants.analysis.rdp import compute_rdp

        total = np.zeros_like(self.orders)
        orders = list(self.orders)
        for e, times in Counter(self.events).items():  # identical events: one evaluation, RDP scales linearly
            steps = e.count * times
            if isinstance(e, GaussianEvent):
                total += compute_rdp(q=1.0, noise_multiplier=e.noise_multiplier, steps=steps, orders=orders)
            elif isinstance(e, SampledGaussianEvent):
                total += compute_rdp(q=e.sample_rate, noise_multiplier=e.noise_multiplier, steps=steps, orders=orders)
            elif isinstance(e, PureDPEvent):
                # epsilon-DP implies (alpha, epsilon)-RDP (Mironov 2017, Prop. 3) and (epsilon^2 / 2)-zCDP, i.e.
                # (alpha, alpha epsilon^2 / 2)-RDP (Bun & Steinke 2016, Prop. 1.4); both hold, so take the smaller.
                total += steps * np.minimum(e.epsilon, self.orders * e.epsilon**2 / 2)
            else:
                raise _unknown(e, f"{self.name} accountant")
        return total

    def get_epsilon_and_order(self, delta: float) -> tuple[float, float]:
        _check_delta(delta)
        if not self.events:
            return 0.0, float("nan")
        if delta == 0:
            if all(isinstance(e, PureDPEvent) for e in self.events):
                return float(sum(e.epsilon * e.count for e in self.events)), float("inf")
            return float("inf"), float("nan")
        from opacus.accountants.analysis.rdp import get_privacy_spent

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus warns when the optimum is an extreme order; we extend them
            eps, order = get_privacy_spent(orders=list(self.orders), rdp=self.rdp(), delta=delta)
        eps = float(eps)
        # Pure-DP only: basic composition can beat the RDP conversion; both are valid bounds.
        if all(isinstance(e, PureDPEvent) for e in self.events):
            eps = min(eps, float(sum(e.epsilon * e.count for e in self.events)))
        return eps, float(order)

    def get_epsilon(self, delta: float) -> float:
        return self.get_epsilon_and_order(delta)[0]


class PrvAccountant(Accountant):
    """Opacus's PRV accountant (numerical composition of privacy loss random variables); reports its upper bound."""

    name = "prv"
    description = "privacy loss random variables (Opacus PRVAccountant, Gopi et al. 2021; upper bound)"

    def __init__(self, eps_error: float = 0.01) -> None:
        super().__init__()
        self.eps_error = eps_error

    def get_epsilon(self, delta: float) -> float:
        _check_delta(delta)
        if not self.events:
            return 0.0
        if delta == 0:
            return float("inf")
        from opacus.accountants import PRVAccountant

        acc = PRVAccountant()
        for e, times in Counter(self.events).items():
            if isinstance(e, GaussianEvent):
                acc.history.append((e.noise_multiplier, 1.0, e.count * times))
            elif isinstance(e, SampledGaussianEvent):
                acc.history.append((e.noise_multiplier, e.sample_rate, e.count * times))
            else:
                raise UnsupportedError(f"the PRV accountant handles Gaussian events only, not a {type(e).__name__}; "
                                       "use --dp-accountant rdp")
        acc.history = [h for h in acc.history if h[2] > 0]
        if not acc.history:
            return 0.0
        with warnings.catch_warnings(), np.errstate(divide="ignore"):
            warnings.simplefilter("ignore")  # log(1 - q) at q = 1 is -inf by design
            return float(acc.get_epsilon(delta, eps_error=self.eps_error))


def gaussian_delta(epsilon: float, mu: float) -> float:
    """delta(epsilon) of ``mu``-GDP (the exact curve of one Gaussian with sensitivity/std = ``mu``)."""
    if mu <= 0:
        return 0.0
    return float(norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon with ``delta(epsilon) <= delta`` for ``mu``-GDP (analytic Gaussian mechanism)."""
    _check_delta(delta)
    if mu <= 0:
        return 0.0
    if delta == 0:
        return float("inf")
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(hi, mu) > delta:
        hi *= 2
        if hi > 1e6:
            return float("inf")
    return float(brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


class GdpAccountant(Accountant):
    """Exact accounting for adaptive compositions of unsubsampled Gaussian mechanisms (Gaussian DP)."""

    name = "gdp"
    description = "Gaussian DP, exact for unsubsampled Gaussian compositions (Dong, Roth & Su 2019; Balle & Wang 2018)"

    def mu(self) -> float:
        total = 0.0
        for e in self.events:
            if not isinstance(e, GaussianEvent):
                raise UnsupportedError(
                    f"the gdp accountant is exact only for unsubsampled Gaussian releases, not {type(e).__name__}; "
                    "use --dp-accountant rdp"
                )
            total += e.count / e.noise_multiplier**2
        return math.sqrt(total)

    def get_epsilon(self, delta: float) -> float:
        return gaussian_epsilon(self.mu(), delta)


ACCOUNTANTS: dict[str, type[Accountant]] = {"rdp": RdpAccountant, "prv": PrvAccountant, "gdp": GdpAccountant}


def make_accountant(name: str) -> Accountant:
    try:
        return ACCOUNTANTS[name]()
    except KeyError:
        raise ConfigError(f"unknown DP accountant {name!r}; valid names: {', '.join(sorted(ACCOUNTANTS))}") from None


def epsilon_of(event: Event, delta: float, accountant: str = "rdp") -> float:
    """Epsilon of one (composed) event under the named accountant."""
    return make_accountant(accountant).compose(event).get_epsilon(delta)


# ----------------------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------------------
def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    event_for: Callable[[float], Event] | int,
    *,
    accountant: str = "rdp",
    rel_tol: float = 1e-4,
    max_multiplier: float = 1e4,
) -> float:
    """Smallest noise multiplier (to relative precision ``rel_tol``) whose epsilon at ``delta`` is <= the target.

    ``event_for`` maps a multiplier to the event it produces (e.g. ``lambda s: GaussianEvent(s, epochs)``); an integer
    ``T`` is shorthand for ``T`` unsubsampled Gaussian releases. The answer ``s`` always satisfies
    ``epsilon(s) <= target_epsilon``; bisection brackets the true threshold in ``[s * (1 - rel_tol), s]``.
    """
    if isinstance(event_for, (int, np.integer)):
        releases = int(event_for)
        if releases < 1:
            raise ConfigError(f"need at least one release to calibrate noise, got {releases}")
        event_for = lambda s: GaussianEvent(s, releases)  # noqa: E731
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ConfigError(f"target epsilon must be a finite number > 0, got {target_epsilon}")
    if not 0 < delta < 1:
        raise ConfigError(f"calibrating Gaussian noise needs 0 < delta < 1, got {delta}")

    def eps(s: float) -> float:
        return epsilon_of(event_for(s), delta, accountant)

    hi = 1.0
    while eps(hi) > target_epsilon:
        hi *= 2
        if hi > max_multiplier:
            raise ConfigError(
                f"epsilon {target_epsilon} at delta {delta} would need a noise multiplier above {max_multiplier:g}; "
                "raise epsilon or delta, or train for fewer epochs"
            )
    lo = hi / 2
    while lo > 1e-3 and eps(lo) <= target_epsilon:
        hi, lo = lo, lo / 2
    if lo <= 1e-3:
        raise ConfigError(f"epsilon {target_epsilon} is so large that almost no noise is needed; use a smaller epsilon")
    # Invariant: eps(lo) > target >= eps(hi).
    while (hi - lo) > rel_tol * hi:
        mid = (lo + hi) / 2
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi
