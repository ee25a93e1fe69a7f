"""Parties in other processes: the coordinator's handles of them, and the loop that serves their requests.

The coordinator (in the label party's process) reaches a feature party only through a handle (secvfl.handles).
:class:`RemoteHandle` is the handle of a party in another process: each request becomes a ``party-call`` message
(secvfl.deploy.calls) to that process, whose :class:`PartyServer` makes the same request of its own in-process
handle. The party's messages to other parties then travel through that process's network, exactly as in one
process; what the party computes stays there. A request that returns nothing is sent without waiting (requests to
one party run in order, and parties compute side by side); one that returns a value waits for it.

What a party answers is not trusted further than it can be checked: an answer must be well formed (the call codec
raises only MessageError), for the request awaited, and of the type the request declares (a ``-> float`` request
answers a number, arrays hold finite values); a party may report only its own failures: an answer saying that
another party is gone is believed only if the coordinator's own link to that party says so too, otherwise it is a
protocol violation by the party that said it; byte counts are what each sender counted, checked link by link
against what each receiver counted (:class:`FederatedStats`). Violations raise
:class:`~secvfl.transport.base.PeerViolation` naming the party.

Checkpoints stay with their owner: ``state_dict`` asks the party to write its state (model, optimiser, generators,
its network's counters and layer states) to its own run directory and returns only the file's SHA-256, which the
coordinator's checkpoint records; ``load_state_dict`` asks the party to load the file with that digest.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import os
import time
import traceback
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from secvfl.deploy.calls import CALL_KIND, RESULT_KIND, call_message, read_call, read_result, result_message
from secvfl.errors import ConfigError, MessageError, SecvflError
from secvfl.handles import LocalHandle, PartyHandle
from secvfl.io import torch_bytes, torch_load, write_bytes_atomic
from secvfl.messages import decode, encode
from secvfl.transport.base import CommStats, PeerViolation, peer_text
from secvfl.transport.grpc_link import ERROR_KIND, GrpcTransport, PartyLost, transport_kind

__all__ = ["PartyLink", "RemoteHandle", "PartyServer", "FederatedStats", "swap_remote_handles", "STOP", "HELLO",
           "BARRIER", "CPU", "LEAVE_AT_ENV"]

STOP, HELLO, START_EPOCH, STATS, SAVE, LOAD, BARRIER, CPU = "__stop__", "__hello__", "__start_epoch__", \
    "__stats__", "__save__", "__load__", "__barrier__", "__cpu__"
BARRIER_KIND = transport_kind("party-barrier")  # control: nothing a party sent to another before it is still on the way
_KEEP_STATES = 3  # state files a party keeps (the coordinator keeps its two latest checkpoints)
_PEER_LOST = "__party_lost__"  # an answer: the request failed because another party (named) is gone, a claim
# the coordinator believes only when its own link to that party says so
# Test hook (tests/test_deploy.py): "party2:test" makes party2's process stop dead (as if killed) at its first
# request that names the test split, to test that inference goes on without a party that left.
LEAVE_AT_ENV = "SECVFL_LEAVE_AT"


class PartyLink:
    """The coordinator's requests to parties in other processes, over its transport."""

    def __init__(self, transport: GrpcTransport, coordinator: str) -> None:
        self.transport = transport
        self.coordinator = coordinator
        self._next_id = 0

    def call(self, party: str, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *,
             reply: bool = True, timeout: float | None = None) -> Any:
        self._next_id += 1
        message = call_message(self.coordinator, party, self._next_id, method, tuple(args), dict(kwargs or {}),
                               reply=reply)
        self.transport.put_control(self.coordinator, party, CALL_KIND, encode(message))
        if not reply:
            return None
        data = self.transport.take(self.coordinator, kind=RESULT_KIND, sender=party, timeout=timeout)
        try:
            answer = decode(data)
            if (answer.kind, answer.sender, answer.receiver) != (RESULT_KIND, party, self.coordinator):
                raise MessageError(f"an answer labelled {answer.kind} from {answer.sender} to {answer.receiver}")
            if answer.step != self._next_id:
                raise MessageError(f"it answered request {answer.step} while {self._next_id} ({method}) was awaited")
            value = read_result(answer)
        except MessageError as exc:
            raise PeerViolation(party, f"its answer to {method}: {exc}") from None
        if isinstance(value, dict) and _PEER_LOST in value:
            raise self._lost_peer(party, method, value)
        return value

    def _lost_peer(self, party: str, method: str, value: dict) -> PartyLost | PeerViolation:
        """What an answer "the request failed: party X is gone" means: X's loss if this process sees X gone too
        (within the peer timeout), otherwise a false claim by ``party`` (a party may report only its own
        failures)."""
        lost, reason = value.get(_PEER_LOST), value.get("reason", "")
        if set(value) != {_PEER_LOST, "reason"} or not isinstance(lost, str) or not isinstance(reason, str):
            return PeerViolation(party, f"its answer to {method} is a malformed failure report")
        if lost == party:
            return PartyLost(party, f"{peer_text(reason)} (its own report)")
        if lost not in self.transport.peers:
            return PeerViolation(party, f"its answer to {method} reports an unknown party {peer_text(lost, 64)!r} gone")
        deadline = time.monotonic() + self.transport.peer_timeout + 2 * self.transport.heartbeat
        while True:
            seen = self.transport.lost(lost)
            if seen is not None:
                return PartyLost(lost, f"{seen} (also reported by {party})")
            if time.monotonic() > deadline:
                return PeerViolation(party, f"its answer to {method} says that party {lost} is gone, but "
                                     f"{self.coordinator} still hears from {lost} after the peer timeout "
                                     f"({self.transport.peer_timeout:g} s); a party may report only its own failures")
            time.sleep(min(0.1, self.transport.heartbeat))

    def barrier(self, parties: Sequence[str], *, timeout: float | None = None) -> None:
        """After a party left mid-request: every party in ``parties`` drops what the others (and the coordinator)
        sent it before the barrier, so that no message of the abandoned requests is taken for a later one."""
        for party in parties:
            self.call(party, BARRIER, ([p for p in parties if p != party],), reply=False)
        for party in parties:
            self.transport.drain_until(self.coordinator, party, BARRIER_KIND, timeout=timeout)


def _returns_nothing(cls: type, method: str) -> bool:
    return inspect.signature(getattr(cls, method)).return_annotation in ("None", None)


class RemoteHandle(PartyHandle):
    """The handle of party ``name`` in another process: the requests of ``handle_type``, each one a message.

    ``net``: the coordinator's network, whose receive guard learns each request's round (its step and rows) as the
    party's own process does when it serves it. An answer must be of the type the request declares."""

    def __init__(self, name: str, handle_type: type[PartyHandle], link: PartyLink, net: Any = None) -> None:
        self.name = name
        self._type = handle_type
        self._link = link
        self._net = net
        self._void = {m for m in handle_type.requests() if _returns_nothing(handle_type, m)}

    def requests(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._type.requests()

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        if attr.startswith("_") or attr not in self._type.requests():
            raise AttributeError(f"{self.name} is in another process; {attr!r} is not one of its requests "
                                 f"({', '.join(self._type.requests())})")
        facts = getattr(getattr(self._type, attr), "facts", None)
        expected = _answer_type(self._type, attr)

        reply = attr not in self._void
        guard = None if self._net is None or facts is None else self._net.guard

        def call(*args: Any, **kwargs: Any) -> Any:
            if guard is not None:
                guard.enter(*facts(args, kwargs))
            value = self._link.call(self.name, attr, args, kwargs, reply=reply)
            if reply:
                problem = _type_problem(value, expected)
                if problem is not None:
                    raise PeerViolation(self.name, f"its answer to {attr} is {problem}")
            return value

        self.__dict__[attr] = call  # made once per request name: later lookups find it without __getattr__
        return call

    def state_dict(self) -> dict:
        record = self._link.call(self.name, SAVE)
        if (not isinstance(record, dict) or record.get("party") != self.name
                or not _is_digest(record.get("state_sha256"))):
            raise PeerViolation(self.name, "its answer to a checkpoint request is not its state file's digest")
        return record

    def load_state_dict(self, state: dict) -> None:
        self._link.call(self.name, LOAD, (state,))


def _is_digest(text: Any) -> bool:
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


@functools.cache
def _answer_type(handle_type: type, method: str) -> Any:
    """The return annotation of a request (None: unknown, nothing checked)."""
    fn = inspect.unwrap(getattr(handle_type, method))
    try:
        return typing.get_type_hints(fn).get("return")
    except Exception:  # noqa: BLE001 - an annotation naming what only type checkers import: nothing to check
        return None


def _type_problem(value: Any, hint: Any, depth: int = 0) -> str | None:
    """Why ``value`` is not of the annotated type ``hint`` (None: it is, or the annotation says too little);
    arrays and tensors must hold finite numbers."""
    if hint is None or hint is Any or depth > 8:
        return None
    if hint is type(None):
        return None if value is None else f"a {type(value).__name__}, not nothing"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, a, depth + 1) for a in args]
        return None if any(p is None for p in problems) else problems[0]
    if hint in (float, int):
        ok = isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
        return None if ok else f"a {type(value).__name__}, not a number"
    if hint in (bool, str):
        return None if isinstance(value, hint) else f"a {type(value).__name__}, not a {hint.__name__}"
    if hint is np.ndarray or hint is torch.Tensor:
        if not isinstance(value, hint):
            return f"a {type(value).__name__}, not an array"
        kind = value.dtype.kind if isinstance(value, np.ndarray) else ("f" if value.is_floating_point() else "i")
        if kind == "f" and value.size and not bool(np.isfinite(np.asarray(value)).all()):
            return "an array with non-finite values (NaN or infinity)"
        return None
    if origin in (list, Sequence, tuple) and args:
        if not isinstance(value, (list, tuple)):
            return f"a {type(value).__name__}, not a sequence"
        items = args[:1] if origin is not tuple or (len(args) == 2 and args[1] is Ellipsis) else args
        if origin is tuple and items is args and len(value) != len(args):
            return f"a sequence of {len(value)}, not {len(args)}"
        for i, item in enumerate(value):
            problem = _type_problem(item, items[min(i, len(items) - 1)], depth + 1)
            if problem is not None:
                return problem
        return None
    if origin in (dict, Mapping) and len(args) == 2:
        if not isinstance(value, dict):
            return f"a {type(value).__name__}, not a mapping"
        for k, v in value.items():
            problem = _type_problem(k, args[0], depth + 1) or _type_problem(v, args[1], depth + 1)
            if problem is not None:
                return problem
        return None
    if hint in (list, tuple, dict):
        return None if isinstance(value, hint) else f"a {type(value).__name__}, not a {hint.__name__}"
    return None


def swap_remote_handles(algorithm: Any, keep: str, make: Callable[[LocalHandle], PartyHandle]) -> list[str]:
    """Replace every in-process handle ``algorithm`` holds (directly, in lists or dicts, or in objects of the
    algorithm modules it holds) by ``make(handle)``, except the handle of party ``keep`` (the coordinator's own).
    Returns the names of the parties swapped."""
    swapped: dict[int, PartyHandle] = {}
    names: list[str] = []

    def swap(h: LocalHandle) -> PartyHandle:
        if id(h) not in swapped:
            swapped[id(h)] = make(h)
            names.append(h.name)
        return swapped[id(h)]

    def visit(obj: Any, seen: set[int], depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        for key, value in list(vars(obj).items()):
            if isinstance(value, LocalHandle) and value.name != keep:
                setattr(obj, key, swap(value))
            elif isinstance(value, list):
                value[:] = [swap(v) if isinstance(v, LocalHandle) and v.name != keep else v for v in value]
            elif isinstance(value, dict):
                for k, v in list(value.items()):
                    if isinstance(v, LocalHandle) and v.name != keep:
                        value[k] = swap(v)
            elif type(value).__module__.startswith("secvfl.algorithms") and hasattr(value, "__dict__"):
                visit(value, seen, depth + 1)

    visit(algorithm, set(), 0)
    return sorted(set(names))


_MAX_COUNT = 2**62  # no honest counter gets near it


def _read_ledger(party: str, state: Any, what: str) -> CommStats:
    """A party's counters (CommStats.state_dict) from its answer, checked for form: names to non-negative ints."""
    if not isinstance(state, dict):
        raise PeerViolation(party, f"its {what} counters are a {type(state).__name__}, not a mapping")
    ledger = CommStats()
    for field_name in ledger.__dataclass_fields__:
        entries = state.get(field_name, {})
        if not isinstance(entries, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _MAX_COUNT
                for k, v in entries.items()):
            raise PeerViolation(party, f"its {what} counters ({field_name}) are not names with non-negative counts")
        getattr(ledger, field_name).update(entries)
    return ledger


def _own_only(party: str, sent: CommStats, received: CommStats) -> None:
    """A party counts only what it sent and what it received itself, consistently across its counters."""
    problems = []
    if set(sent.bytes_sent) - {party} or set(sent.messages_sent) - {party}:
        problems.append("it counts sends of other parties")
    if any(not link.startswith(f"{party}->") for link in sent.bytes_by_link):
        problems.append("it counts links that do not start at it")
    if set(received.bytes_received) - {party} or any(not link.endswith(f"->{party}") for link in received.bytes_by_link):
        problems.append("it counts what other parties received")
    for what, ledger, own in (("sent", sent, sent.bytes_sent), ("received", received, received.bytes_received)):
        total = sum(own.values())
        if sum(ledger.bytes_by_kind.values()) != total or sum(ledger.bytes_by_link.values()) != total:
            problems.append(f"its {what} bytes by kind, by link and in total disagree")
    if sum(sent.messages_by_kind.values()) != sum(sent.messages_sent.values()):
        problems.append("its message counts by kind and in total disagree")
    if problems:
        raise PeerViolation(party, f"its byte counters are inconsistent ({'; '.join(problems)})")


class FederatedStats(CommStats):
    """The coordinator's counters: what it sent itself (saved in its checkpoint, like any process's), and for
    reports the sum over every party, each of which counts what it sent (fetched when a total is read).

    Every party also counts what it received; the totals are accepted only if, on every link, what the sender says
    it sent is what the receiver says it received (and likewise per message kind). The coordinator's own counts
    settle any disagreement on a link it is an end of: the other end's report is the false one; on a link between
    two other parties the error names both. ``fetch()``: party -> its answer to STATS (``{"sent": ..., "received":
    ...}``); ``received()``: what the coordinator's own process received; ``local``: the party it acts for (None: it
    hosts none); ``departed``: parties that left (the check is then skipped: what they sent was not all taken). A
    run resumed from a checkpoint written before receivers counted (``received`` None) is not checked either.
    """

    def __init__(self, fetch: Callable[[], dict[str, Any]], received: Callable[[], CommStats | None] | None = None,
                 local: str | None = None, departed: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self._fetch = fetch
        self._received = received or CommStats
        self._local = local
        self._departed = departed if departed is not None else {}

    def _merged(self) -> CommStats:
        total, received = CommStats(), CommStats()
        _add(total, self.state_dict())
        own = self._received()
        complete = own is not None
        if own is not None:
            _add(received, own.state_dict())
        for party, answer in self._fetch().items():
            if not isinstance(answer, dict) or set(answer) != {"sent", "received"}:
                raise PeerViolation(party, "its answer to a counters request is not its sent and received counters")
            sent = _read_ledger(party, answer["sent"], "sent")
            if answer["received"] is None:  # resumed from a checkpoint that did not count it
                got, complete = CommStats(), False
            else:
                got = _read_ledger(party, answer["received"], "received")
            _own_only(party, sent, got)
            _add(total, sent.state_dict())
            _add(received, got.state_dict())
        if complete and not self._departed:
            self._check(total, received)
        return total

    def _check(self, sent: CommStats, received: CommStats) -> None:
        for link in sorted(set(sent.bytes_by_link) | set(received.bytes_by_link)):
            said, counted = sent.bytes_by_link.get(link, 0), received.bytes_by_link.get(link, 0)
            if said == counted:
                continue
            source, _, target = link.partition("->")
            facts = f"{source} says it sent {said} bytes to {target}, {target} says it received {counted}"
            if target == self._local:
                raise PeerViolation(source, f"its byte counters are false ({facts})")
            if source == self._local:
                raise PeerViolation(target, f"its byte counters are false ({facts})")
            raise PeerViolation(f"{source} or {target}", f"their byte counters disagree ({facts})")
        for field_name in ("bytes_by_kind", "messages_by_kind", "payload_by_kind"):
            said, counted = getattr(sent, field_name), getattr(received, field_name)
            if {k: v for k, v in said.items() if v} != {k: v for k, v in counted.items() if v}:
                kinds = sorted(k for k in set(said) | set(counted) if said.get(k, 0) != counted.get(k, 0))
                raise PeerViolation("one of the parties", f"the senders' and the receivers' counts of {kinds[:4]} "
                                    f"messages disagree ({field_name})")

    @property
    def bytes_total(self) -> int:  # type: ignore[override]
        return self._merged().bytes_total

    @property
    def messages_total(self) -> int:  # type: ignore[override]
        return self._merged().messages_total

    def payload(self, kinds: Sequence[str] | None = None) -> int:
        return self._merged().payload(kinds)

    def to_dict(self) -> dict:
        return self._merged().to_dict()


def _add(total: CommStats, state: dict) -> None:
    for field_name in total.__dataclass_fields__:
        mine = getattr(total, field_name)
        for k, v in state.get(field_name, {}).items():
            mine[k] += v


class PartyServer:
    """Serves the coordinator's requests to one party in this process until it says stop.

    ``on_call(method, args, kwargs)`` answers the calls that are not party requests (hello, epochs, counters, state
    files); it returns ``NotImplemented`` for anything it does not know.
    """

    def __init__(self, name: str, transport: GrpcTransport, coordinator: str, *, idle_timeout: float,
                 log: Callable[[str], None]) -> None:
        self.name = name
        self.transport = transport
        self.coordinator = coordinator
        self.idle_timeout = idle_timeout
        self.log = log
        self.handle: LocalHandle | None = None
        self.hello_done = False
        # CPU time of this process (every thread: gRPC's included) since the run was built; see mark_run_start
        self.cpu_since = time.process_time()
        self.on_call: Callable[[str, list, dict], Any] = lambda *_: NotImplemented
        self._leave_at = os.environ.get(LEAVE_AT_ENV, "").partition(":")  # read once: it is looked at per request

    def mark_run_start(self) -> None:
        """From here on the process works for the run (after its imports, data and build): what ``CPU`` answers."""
        self.cpu_since = time.process_time()

    def serve(self, on_message: Callable[[str, str], None] | None = None) -> None:
        """Answer requests until the coordinator's stop. ``on_message(sender, kind)``, if given, is called for
        every other message that arrives (it takes it from the network): a party that acts on messages, not
        requests (a CKKS aggregator)."""
        while True:
            # until the coordinator's hello, wait only as long as for any message (it may never come)
            wait = self.idle_timeout if self.handle is not None or self.hello_done else self.transport.timeout
            if on_message is not None:
                sender, kind = self.transport.wait_any(self.name, timeout=wait)
                if kind != CALL_KIND or sender != self.coordinator:
                    self._guarded("message", lambda s=sender, k=kind: on_message(s, k))
                    continue
            data = self.transport.take(self.name, kind=CALL_KIND, sender=self.coordinator, timeout=wait)
            try:
                call = decode(data)
                if (call.kind, call.sender, call.receiver) != (CALL_KIND, self.coordinator, self.name):
                    raise MessageError(f"a request labelled {call.kind} from {call.sender} to {call.receiver}")
                method, args, kwargs, reply = read_call(call)
            except MessageError as exc:
                raise PeerViolation(self.coordinator, f"its request: {exc}") from None
            self._maybe_leave(args)
            result = self._guarded(method, lambda m=method, a=args, k=kwargs: self._dispatch(m, a, k))
            if reply or method == STOP:
                answer = result_message(self.name, self.coordinator, call.step, result)
                self.transport.put_control(self.name, self.coordinator, RESULT_KIND, encode(answer))
            if method == STOP:
                return

    def _maybe_leave(self, args: list) -> None:
        party, _, split = self._leave_at
        if party == self.name and split and any(isinstance(a, str) and a == split for a in args):
            self.log(f"{self.name}: leaving at its first {split} request (${LEAVE_AT_ENV})")
            os._exit(137)  # no goodbye, no flush: as a killed process

    def _guarded(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; if it fails, the coordinator is told why (so the whole run stops with the reason) first.
        Another party gone (not the coordinator) only fails this request: the answer names it, and this party
        keeps serving (the coordinator decides whether the run can go on without it)."""
        try:
            return fn()
        except PartyLost as exc:
            if exc.party == self.coordinator:
                raise
            self.log(f"{self.name}: {peer_text(what, 80)} failed: {exc}")
            return {_PEER_LOST: exc.party, "reason": str(exc)}
        except Exception as exc:
            text = exc.args[0] if isinstance(exc, SecvflError) and exc.args else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, SecvflError):  # a defect, not a refusal: its traceback is in this party's log
                self.log("".join(traceback.format_exception(exc)).rstrip())
            try:
                self.transport.put_control(self.name, self.coordinator, ERROR_KIND,
                                           f"{peer_text(what, 80)} failed in {self.name}: {text}".encode())
            except SecvflError:
                pass  # the coordinator is gone too; this party's own error says enough
            raise

    def _dispatch(self, method: str, args: list, kwargs: dict) -> Any:
        result = self.on_call(method, args, kwargs)
        if result is not NotImplemented:
            return result
        if method == STOP:
            return None
        if method == CPU:  # where a deployed run's time goes (secvfl bench transport): this process's share
            return {"cpu_seconds": round(time.process_time() - self.cpu_since, 3)}
        if method == BARRIER:  # every earlier request of the coordinator is done: drop what came before
            peers = args[0] if len(args) == 1 and isinstance(args[0], list) else None
            if peers is None or not all(isinstance(p, str) and p in self.transport.peers for p in peers):
                raise PeerViolation(self.coordinator, "its barrier request does not list parties of the federation")
            for peer in [*peers, self.coordinator]:
                self.transport.put_control(self.name, peer, BARRIER_KIND, b"")
            for peer in peers:
                self.transport.drain_until(self.name, peer, BARRIER_KIND)
            return None
        if self.handle is None:
            raise ConfigError(f"{self.name} got {peer_text(method, 80)!r} before the coordinator's hello")
        if method not in type(self.handle).requests():
            raise PeerViolation(self.coordinator, f"{peer_text(method, 80)!r} is not a request of {self.name} "
                                f"({', '.join(self.handle.requests())})")
        return getattr(self.handle, method)(*args, **kwargs)


def save_party_state(state_dir: Path, name: str, state: dict) -> dict[str, str]:
    """Write a party's state to its own directory; returns what the coordinator's checkpoint records."""
    data = torch_bytes(state)
    digest = hashlib.sha256(data).hexdigest()
    state_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(state_dir / f"state-{digest[:20]}.pt", data, mode=0o600)
    files = sorted(state_dir.glob("state-*.pt"), key=lambda p: p.stat().st_mtime)
    for old in files[:-_KEEP_STATES]:
        old.unlink(missing_ok=True)
    return {"party": name, "state_sha256": digest}


def load_party_state(state_dir: Path, name: str, record: dict) -> dict:
    """The state a coordinator's checkpoint names (by digest), from the party's own directory."""
    digest = str(record.get("state_sha256", ""))
    if record.get("party") != name or len(digest) != 64:
        raise ConfigError(f"the coordinator's checkpoint names no state of {name} ({record}); resume every party "
                          "from the same run")
    path = state_dir / f"state-{digest[:20]}.pt"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{name} has no state {digest[:20]} in {state_dir}: start it with the run directory it "
                          "wrote (--out) when the checkpoint was taken") from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise ConfigError(f"{path} is damaged (its SHA-256 differs from the checkpoint's); restore it from a backup")
    return torch_load(io.BytesIO(data))
