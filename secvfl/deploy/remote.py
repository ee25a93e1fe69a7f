"""Parties in other processes: the coordinator's handles of them, and the loop that serves their requests.

The coordinator (in the label party's process) reaches a feature party only through a handle (secvfl.handles).
:class:`RemoteHandle` is the handle of a party in another process: each request becomes a ``party-call`` message
(secvfl.deploy.calls) to that process, whose :class:`PartyServer` makes the same request of its own in-process
handle. The party's messages to other parties then travel through that process's network, exactly as in one
process; what the party computes stays there. A request that returns nothing is sent without waiting (requests to
one party run in order, and parties compute side by side); one that returns a value waits for it.

Checkpoints stay with their owner: ``state_dict`` asks the party to write its state (model, optimiser, generators,
its network's counters and layer states) to its own run directory and returns only the file's SHA-256, which the
coordinator's checkpoint records; ``load_state_dict`` asks the party to load the file with that digest.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import os
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from secvfl.deploy.calls import CALL_KIND, RESULT_KIND, call_message, read_call, read_result, result_message
from secvfl.errors import ConfigError, MessageError, SecvflError
from secvfl.handles import LocalHandle, PartyHandle
from secvfl.io import torch_bytes, torch_load, write_bytes_atomic
from secvfl.messages import decode, encode
from secvfl.transport.base import CommStats
from secvfl.transport.grpc_link import ERROR_KIND, GrpcTransport, PartyLost

__all__ = ["PartyLink", "RemoteHandle", "PartyServer", "FederatedStats", "swap_remote_handles", "STOP", "HELLO",
           "BARRIER", "CPU", "LEAVE_AT_ENV"]

STOP, HELLO, START_EPOCH, STATS, SAVE, LOAD, BARRIER, CPU = "__stop__", "__hello__", "__start_epoch__", \
    "__stats__", "__save__", "__load__", "__barrier__", "__cpu__"
BARRIER_KIND = "party-barrier"  # control: nothing a party sent to another before it is still on the way
_KEEP_STATES = 3  # state files a party keeps (the coordinator keeps its two latest checkpoints)
_PEER_LOST = "__party_lost__"  # an answer: the request failed because another party (named) is gone
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
        answer = decode(self.transport.take(self.coordinator, kind=RESULT_KIND, sender=party, timeout=timeout))
        if answer.step != self._next_id:
            raise MessageError(f"{party} answered request {answer.step} while {self._next_id} was awaited")
        value = read_result(answer)
        if isinstance(value, dict) and _PEER_LOST in value:
            raise PartyLost(str(value[_PEER_LOST]), f"{value.get('reason', '')} (reported by {party})")
        return value

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
    """The handle of party ``name`` in another process: the requests of ``handle_type``, each one a message."""

    def __init__(self, name: str, handle_type: type[PartyHandle], link: PartyLink) -> None:
        self.name = name
        self._type = handle_type
        self._link = link
        self._void = {m for m in handle_type.requests() if _returns_nothing(handle_type, m)}

    def requests(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._type.requests()

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        if attr.startswith("_") or attr not in self._type.requests():
            raise AttributeError(f"{self.name} is in another process; {attr!r} is not one of its requests "
                                 f"({', '.join(self._type.requests())})")

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._link.call(self.name, attr, args, kwargs, reply=attr not in self._void)

        return call

    def state_dict(self) -> dict:
        return self._link.call(self.name, SAVE)

    def load_state_dict(self, state: dict) -> None:
        self._link.call(self.name, LOAD, (state,))


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


class FederatedStats(CommStats):
    """The coordinator's counters: what it sent itself (saved in its checkpoint, like any process's), and for
    reports the sum over every party, each of which counts what it sent (fetched when a total is read)."""

    def __init__(self, fetch: Callable[[], list[dict]]) -> None:
        super().__init__()
        self._fetch = fetch

    def _merged(self) -> CommStats:
        total = CommStats()
        for state in [self.state_dict(), *self._fetch()]:
            for field_name in self.__dataclass_fields__:
                mine = getattr(total, field_name)
                for k, v in state.get(field_name, {}).items():
                    mine[k] += v
        return total

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
            call = decode(self.transport.take(self.name, kind=CALL_KIND, sender=self.coordinator, timeout=wait))
            method, args, kwargs, reply = read_call(call)
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
            self.log(f"{self.name}: {what} failed: {exc}")
            return {_PEER_LOST: exc.party, "reason": str(exc)}
        except Exception as exc:
            text = exc.args[0] if isinstance(exc, SecvflError) and exc.args else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, SecvflError):  # a defect, not a refusal: its traceback is in this party's log
                self.log("".join(traceback.format_exception(exc)).rstrip())
            try:
                self.transport.put_control(self.name, self.coordinator, ERROR_KIND,
                                           f"{what} failed in {self.name}: {text}".encode())
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
            peers = [str(p) for p in args[0]]
            for peer in [*peers, self.coordinator]:
                self.transport.put_control(self.name, peer, BARRIER_KIND, b"")
            for peer in peers:
                self.transport.drain_until(self.name, peer, BARRIER_KIND)
            return None
        if self.handle is None:
            raise ConfigError(f"{self.name} got {method!r} before the coordinator's hello")
        if method not in type(self.handle).requests():
            raise MessageError(f"{method!r} is not a request of {self.name} ({', '.join(self.handle.requests())})")
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
