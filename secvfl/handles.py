"""Party handles: the only way a coordinator reaches a party.

An algorithm coordinates its parties through one handle per party; it never holds a party object. A handle offers a
small, explicit set of requests (the methods marked :func:`request`). A request carries public facts only -- step
numbers, split names, batch row ids (every party derives them from the shared seed), party names, step sizes and
flags of the algorithm -- and returns only what may leave the party toward the coordinator: nothing, public scalars
(a batch loss), results of the party the coordinator runs itself (the label party's probabilities), predictions the
experimenter collects to score them, or the party's own state for its checkpoint. Whatever crosses a party
boundary goes through the network: the handle sends the messages its party produces and hands its party the
messages the network delivered to it (a party never holds the network, see :mod:`secvfl.parties`).

:class:`LocalHandle` is the in-process implementation: a request is a direct call on the party object plus the
network calls for its messages, so nothing is serialised beyond the messages themselves. A party in another process
needs another implementation of the same requests (each one a request message to that process); the algorithms do
not change. ``tests/test_party_handle.py`` trains every algorithm through handles that pass requests on and nothing
else, and checks that results and byte counts are those of the local handles.

The handles of :class:`~secvfl.parties.FeatureParty` and :class:`~secvfl.parties.LabelParty` (the split algorithms)
are here; each algorithm family keeps the handles of its own parties next to them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from secvfl.errors import UnsupportedError
from secvfl.messages import Message
from secvfl.metrics import classification_metrics
from secvfl.parties import FeatureParty, LabelParty
from secvfl.transport.network import Network

__all__ = ["request", "PartyHandle", "LocalHandle", "local_party", "FeatureHandle", "LabelHandle"]

F = TypeVar("F", bound=Callable[..., Any])
_REQUEST = "__party_request__"


@functools.cache
def _requests_of(cls: type) -> tuple[str, ...]:  # asked at every request a party process serves
    return tuple(sorted({n for k in cls.__mro__ for n, v in vars(k).items() if getattr(v, _REQUEST, False)}))


_FACTS = ("step", "split", "ids", "rows")  # the request arguments that say which round the messages belong to
_NOWHERE = 1 << 62  # (the position of a keyword-only or absent argument: past any call's positional ones)


def facts_reader(method: Callable[..., Any]) -> Callable[[tuple, dict], tuple[Any, Any, Any]] | None:
    """A function of a request's (args, kwargs) that returns the values of its ``step``, ``split`` and rows
    (``rows``, else ``ids``) arguments, None for one it lacks (:meth:`ReceiveGuard.enter` takes them); None for a
    request with none of them. Where they are in the arguments is read from the signature once, not at every call."""
    params = list(inspect.signature(method).parameters.values())[1:]  # (self)
    where = {p.name: (i if p.kind is p.POSITIONAL_OR_KEYWORD else _NOWHERE) for i, p in enumerate(params)
             if p.name in _FACTS}
    if not where:
        return None
    rows = "rows" if "rows" in where else "ids"
    # (a name it lacks is looked up as None, which no keyword argument is)
    (si, sn), (pi, pn), (ri, rn) = ((where.get(name, _NOWHERE), name if name in where else None)
                                    for name in ("step", "split", rows))

    def read(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
        n = len(args)
        return (args[si] if si < n else kwargs.get(sn), args[pi] if pi < n else kwargs.get(pn),
                args[ri] if ri < n else kwargs.get(rn))

    return read


def request(method: F) -> F:
    """Mark ``method`` as a request a coordinator may make of a party (the handle's API).

    Serving one that names a round (its ``step``, ``split`` or rows) first tells the receive guard of the party's
    network which round the messages it takes belong to (:mod:`secvfl.transport.guard`). ``facts``: the function
    that reads them from a call's arguments (the remote handles record the same facts: deploy.remote), None for a
    request that names none (served as it is)."""
    read = facts_reader(method)
    if read is None:
        setattr(method, _REQUEST, True)
        method.facts = None  # type: ignore[attr-defined]
        return method

    @functools.wraps(method)
    def serve(self: Any, *args: Any, **kwargs: Any) -> Any:
        net = getattr(self, "_net", None)
        if net is not None:
            net.guard.enter(*read(args, kwargs))
        return method(self, *args, **kwargs)

    setattr(serve, _REQUEST, True)
    serve.facts = read  # type: ignore[attr-defined]
    return serve  # type: ignore[return-value]


class PartyHandle:
    """What a coordinator may ask of one party: the :func:`request` methods of the concrete handle class."""

    name: str

    @classmethod
    def requests(cls) -> tuple[str, ...]:
        """The names of this handle's requests."""
        return _requests_of(cls)

    @request
    def state_dict(self) -> dict:
        """The party's state for its checkpoint (model, optimiser, generators): each party saves its own."""
        raise NotImplementedError

    @request
    def load_state_dict(self, state: dict) -> None:
        """Restore the party from the state its checkpoint holds."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class LocalHandle(PartyHandle):
    """A party in this process: requests are direct calls; its messages go through ``net``."""

    def __init__(self, party: Any, net: Network) -> None:
        self.name = party.name
        self._party = party
        self._net = net

    def state_dict(self) -> dict:
        return self._party.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._party.load_state_dict(state)

    def _send(self, messages: Sequence[Message]) -> None:
        if messages:
            self._net.send(*messages)

    def _receive(self, kind: str, sender: str) -> Message:
        return self._net.receive(self.name, kind=kind, sender=sender)


def local_party(handle: PartyHandle) -> Any:
    """The party object behind an in-process handle.

    For what happens in the party's own process: protocol hooks installed on it, an attack on its recorded view, tests
    and benchmarks that inspect its model. Training and evaluation never use it: they make requests.
    """
    if not isinstance(handle, LocalHandle):
        raise UnsupportedError(f"party {handle.name} is not in this process; only its requests "
                               f"({', '.join(handle.requests())}) reach it")
    return handle._party


class FeatureHandle(LocalHandle):
    """A :class:`~secvfl.parties.FeatureParty`: sends its bottom model's output, applies the gradient it gets back."""

    _party: FeatureParty

    @request
    def forward(self, step: int, split: str, ids: np.ndarray, *, to: str, train: bool, aggregated: bool = False
                ) -> None:
        """The party's output on rows ``ids`` of ``split``, sent to ``to``; with ``aggregated``, submitted as its
        input to the network's aggregation for ``to`` instead."""
        message = self._party.forward(step, split, ids, to, train=train)
        if aggregated:
            self._net.submit(message)
        else:
            self._net.send(message)

    @request
    def backward(self, *, sender: str) -> None:
        """Take the gradient ``sender`` sent for the last training output from the network, and apply it."""
        self._party.backward(self._receive("gradient", sender))


class LabelHandle(LocalHandle):
    """A :class:`~secvfl.parties.LabelParty`. The coordinator runs in its process: its probabilities and losses are
    the coordinator's own results, and it scores predictions with its labels."""

    _party: LabelParty

    def __init__(self, party: LabelParty, net: Network) -> None:
        super().__init__(party, net)
        self._inputs: list[Message] = []
        self._aggregated = False

    @request
    def receive(self, senders: Sequence[str], *, aggregated: bool) -> list[str]:
        """Take this step's inputs from the network: one message per sender, or (``aggregated``) the aggregate of
        what they submitted. Returns the senders whose outputs arrived: a secure aggregation that retried a round
        without a dropped party names it in the aggregate's ``meta["dropped"]``."""
        kind = self._party.input_kind
        if aggregated:
            total = self._net.aggregate_submitted(self.name, kind, senders=senders)
            dropped = set(total.meta.get("dropped", ()))
            self._inputs, present = [total], [s for s in senders if s not in dropped]
        else:
            self._inputs, present = [self._receive(kind, s) for s in senders], list(senders)
        self._aggregated = aggregated
        return present

    def _take(self) -> list[Message]:
        inputs, self._inputs = self._inputs, []
        return inputs

    @request
    def train_step(self, step: int, ids: np.ndarray, senders: Sequence[str], *,
                   input_scale: torch.Tensor | None = None) -> float:
        """One step of the head on the received inputs; sends each of ``senders`` its gradient. Returns the loss.
        ``input_scale``: per-row factors from the public alignment pattern (a mean over the observed parties)."""
        loss, grads = self._party.train_step(step, ids, self._take(), senders, aggregated=self._aggregated,
                                             input_scale=input_scale)
        self._send(grads)
        return float(loss)  # after the send: on a GPU the step has run by now, so reading it does not wait

    @request
    def predict(self, *, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Class probabilities for the rows of the received inputs."""
        return self._party.predict(self._take(), aggregated=self._aggregated, input_scale=input_scale)

    @request
    def score(self, split: str, proba: np.ndarray) -> dict[str, float]:
        """Metrics of the probabilities ``proba`` against the party's labels of ``split``."""
        return classification_metrics(self._party.labels(split).cpu().numpy(), proba)
