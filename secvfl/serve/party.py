"""`secvfl serve` at a feature party (or the CKKS aggregator): answer the coordinator's scoring requests.

The party reads its own table (its training file, or ``--table FILE`` with the same id and columns; CSV or Parquet)
and prepares it with the preprocessing its training run fitted, by the code that prepared its training rows
(secvfl.deploy.data.read_prepared_table), and indexes its ids (secvfl.data.id_index) before it listens; then it waits for the coordinator's
hello, which names the run's settings and the party's state file (the one the label party's final checkpoint
records), loads its model from its own run directory and answers, one request at a time:

* ``embed`` (split algorithms): its bottom model's output for the requested ids, zeros where it does not hold an id,
  sent to the coordinator through the run's network (sealed under ``--secure-channel``; submitted to the secure sum
  under ``--he ckks`` / ``--secagg mask``), then an answer naming the ids it does not hold;
* ``represent`` then ``predict`` (LASER-VFL): its representation of the ids, kept; then, for each group of ids and
  the parties the coordinator found to hold them, its representation to the group's other parties, theirs back, and
  its predictor's class probabilities to the coordinator.

It never sends a raw feature, answers only the coordinator (calls from any other sender are refused by the
transport's routing and dropped here), bounds every wait by the time the request has left, refuses calls for more
ids than agreed, and writes every request to its append-only audit log (secvfl.serve.audit).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from secvfl.config import TrainConfig
from secvfl.deploy.data import PreparedTable, Preprocessing, load_preprocessing, read_prepared_table
from secvfl.deploy.limits import MAX_SERVE_IDS, serve_limits
from secvfl.deploy.party import AGGREGATOR, Timeouts, check_across_processes, make_transport, run_names
from secvfl.deploy.remote import load_party_state
from secvfl.errors import ConfigError, MessageError, ProtocolError, SecvflError
from secvfl.federation import Federation
from secvfl.messages import Message, decode, encode
from secvfl.parties import probabilities
from secvfl.serve.audit import AuditLog
from secvfl.serve.model import build_served_run, is_laser, own_party
from secvfl.serve.wire import (
    SERVE_ANSWER,
    SERVE_CALL,
    SERVE_OUTPUT,
    Answer,
    Call,
    answer_message,
    check_output,
    read_call,
)
from secvfl.transport.grpc_link import PartyLost

__all__ = ["serve_feature_party", "load_served_table"]

_FOREVER = 10.0 * 365 * 24 * 3600  # between requests a serving party waits as long as its coordinator lives
_KEEP_REPRESENTATIONS = 4  # LASER-VFL: representations kept for the predict round of the latest requests


def load_served_table(federation: Federation, name: str, run_dir: Path, table: Path | None,
                      log: Callable[[str], None]) -> tuple[Preprocessing, PreparedTable]:
    """Feature party ``name``'s fitted preprocessing (from its run directory) and its table prepared with it: its
    training file, or ``table`` (the same id and columns), with its ids indexed."""
    spec = federation.party(name).data
    if spec is None:
        raise ConfigError(f"{federation.source}: serving scores entities by id, so every party needs its own data "
                          f"table; [parties.{name}] has none")
    preprocessing = load_preprocessing(run_dir)
    if table is not None:
        spec = replace(spec, file=Path(table))
    t0 = time.perf_counter()
    prepared = read_prepared_table(spec, name, preprocessing)
    for note in prepared.notes:
        log(f"{name}: table {spec.file.name}: {note}")
    prepared.index  # noqa: B018 - built before the party listens, not by its first request
    log(f"{name}: {len(prepared.ids)} ids in {spec.file}, {int(prepared.usable.sum())} can be scored (read, prepared "
        f"and indexed in {time.perf_counter() - t0:.1f} s)")
    return preprocessing, prepared


class _FeatureServer:
    def __init__(self, federation: Federation, name: str, run_dir: Path, table: Path | None,
                 timeouts: Timeouts, log: Callable[[str], None]) -> None:
        self.federation, self.name, self.run_dir, self.log = federation, name, Path(run_dir), log
        runs = run_names(federation)
        self.me, self.coordinator = runs[name], runs[federation.label_party]
        self.names = {run: fed for fed, run in runs.items()}  # run name -> federation name
        self.is_aggregator = self.me == AGGREGATOR
        self.table: PreparedTable | None = None
        if not self.is_aggregator:
            self.preprocessing, self.table = load_served_table(federation, name, self.run_dir, table, log)
        self.audit = AuditLog(self.run_dir, name)
        self.transport = make_transport(federation, name, timeouts, log)
        self.timeouts = timeouts
        self.net: Any = None
        self.party: Any = None
        self.max_ids = 0
        self.reps: OrderedDict[int, tuple[torch.Tensor, np.ndarray, list[str]]] = OrderedDict()
        self.last_request = -1

    # -- the loop ------------------------------------------------------------------------------------------------
    def serve(self) -> None:
        self.log(f"{self.name} serving on {self.transport.local.address} as {self.me}; waiting for "
                 f"{self.federation.label_party}")
        wait = self.timeouts.wait  # until the hello: as long as for any message
        while True:
            if self.is_aggregator:
                sender, kind = self.transport.wait_any(self.me, timeout=wait)
                if kind != SERVE_CALL or sender != self.coordinator:
                    self._relay(sender, kind)
                    continue
            data = self.transport.take(self.me, kind=SERVE_CALL, sender=self.coordinator, timeout=wait)
            try:
                call = read_call(decode(data), self.coordinator, self.me)
            except MessageError as exc:  # the coordinator is at fault: say so, and keep serving
                self.log(f"{self.name}: refused a malformed call from {self.federation.label_party}: {exc}")
                continue
            if call.op == "stop":
                self._answer(Answer("stop", call.request))
                self.log(f"{self.name}: {self.federation.label_party} stopped serving")
                return
            answer, tensors = self._handle(call)
            self._answer(answer, tensors)
            if call.op == "hello" and not answer.error:
                wait = _FOREVER

    def _answer(self, answer: Answer, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.transport.put_control(self.me, self.coordinator, SERVE_ANSWER,
                                   encode(answer_message(self.me, self.coordinator, answer, tensors)))
        self.transport.flush()

    def _handle(self, call: Call) -> tuple[Answer, dict[str, torch.Tensor] | None]:
        try:
            if call.op == "hello":
                return self._hello(call), None
            if self.net is None:
                raise ProtocolError(f"{call.op} before the hello")
            if call.request <= self.last_request and call.op in ("embed", "represent"):
                raise ProtocolError(f"request {call.request} after request {self.last_request}: requests only go "
                                    "forward")
            if call.op == "start":
                self.net.start_epoch(call.epoch)  # handshakes of the secure channel, fresh masking keys
                return Answer("start", call.request), None
            if self.is_aggregator:
                raise ProtocolError(f"the aggregator scores nothing; it got {call.op!r}")
            if len(call.ids) > self.max_ids:
                raise ProtocolError(f"{len(call.ids)} ids in one request, over the {self.max_ids} agreed at hello")
            if call.op == "embed":
                return self._embed(call), None
            if call.op == "represent":
                return self._represent(call), None
            return self._predict(call)
        except PartyLost as exc:
            if exc.party == self.coordinator:
                raise
            self.log(f"{self.name}: {call.op} {call.request} failed: {exc}")
            return Answer(call.op, call.request, error=str(exc)), None
        except (SecvflError, RuntimeError) as exc:
            self.log(f"{self.name}: {call.op} {call.request} refused: {exc}")
            return Answer(call.op, call.request, error=f"{self.name}: {exc}"), None

    # -- hello: build the run, load this party's state -------------------------------------------------------------
    def _hello(self, call: Call) -> Answer:
        cfg = TrainConfig.from_dict(call.config)
        parties = [p.name for p in self.federation.feature_parties]
        if len(call.widths) != len(parties) or cfg.parties != len(parties):
            raise ConfigError(f"the run has {cfg.parties} feature parties with widths {call.widths}, the federation "
                              f"{len(parties)}")
        if not 1 <= call.max_ids <= MAX_SERVE_IDS:  # it sets what this party accepts from its peers
            raise ProtocolError(f"the hello asks for batches of {call.max_ids} ids; at most {MAX_SERVE_IDS}")
        run = build_served_run(cfg, call.widths, call.n_classes, None, self.me)
        check_across_processes(run, self.federation)
        run.net.transport = self.transport
        self.transport.set_limits(serve_limits(self.federation, cfg, call.n_classes, call.max_ids))
        facts: dict[str, Any] = {}
        if not self.is_aggregator:
            block = parties.index(self.name)
            if self.preprocessing.width != call.widths[block]:
                raise ConfigError(f"{self.name}'s fitted preprocessing gives {self.preprocessing.width} columns, the "
                                  f"run trained on {call.widths[block]}; serve with the run directory of the same run")
            state = load_party_state(self.run_dir, self.me, call.state)
            party = own_party(run, self.me)
            party.load_state_dict(state["party"])
            self.party = party
            for model in self._models():
                model.eval()
            facts = {"ids": len(self.table.ids), "usable": int(self.table.usable.sum())}
        self.net, self.max_ids, self.laser = run.net, call.max_ids, is_laser(cfg)
        self.aggregated = not self.laser and run.algorithm.traits.aggregation != "concat"
        self.log(f"{self.name} ({self.me}) ready to serve {cfg.algo} (state {call.state.get('state_sha256', '')[:12]})")
        return Answer("hello", call.request, facts=facts)

    def _models(self) -> list[torch.nn.Module]:
        return [self.party.f, self.party.g] if hasattr(self.party, "f") else [self.party.model]

    def _rows(self, call: Call) -> tuple[torch.Tensor, np.ndarray, Answer]:
        rows = self.table.rows(call.ids)
        present = rows >= 0
        rows = np.where(present, rows, 0)
        held = present & self.table.usable[rows]  # an id this party holds and can score
        x = torch.as_tensor(self.table.X[rows], dtype=self.party.dtype, device=self.party.device)
        self.audit.write(coordinator=self.federation.label_party, request=call.request, op=call.op,
                         ids=list(call.ids), held=int(held.sum()))
        self.last_request = call.request
        return x, held, Answer(call.op, call.request, missing=np.flatnonzero(~held).tolist(),
                               unusable=np.flatnonzero(present & ~held).tolist())

    # -- split algorithms ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _embed(self, call: Call) -> Answer:
        if not call.ids:  # the coordinator's warm-up of a secure sum: one row of zeros, no id
            x = torch.zeros((1, self.preprocessing.width), dtype=self.party.dtype, device=self.party.device)
            held, answer = np.zeros(1, dtype=bool), Answer("embed", call.request)
        else:
            x, held, answer = self._rows(call)
        out = self.party.model(x)
        out = out * torch.as_tensor(held, dtype=out.dtype, device=out.device)[:, None]  # zeros where not held
        kind = self.party.output_kind
        message = Message(SERVE_OUTPUT, self.me, self.coordinator, call.step, {kind: out.detach().cpu()},
                          meta={"request": call.request})
        if self.aggregated:
            self.net.submit(message)
        else:
            self.net.send(message)
        return answer

    # -- LASER-VFL -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _represent(self, call: Call) -> Answer:
        x, held, answer = self._rows(call)
        rep = self.party.f(x)
        self.reps[call.request] = (rep, held, list(call.ids))
        while len(self.reps) > _KEEP_REPRESENTATIONS:
            self.reps.popitem(last=False)
        return answer

    @torch.no_grad()
    def _predict(self, call: Call) -> tuple[Answer, dict[str, torch.Tensor]]:
        deadline = time.monotonic() + call.budget_ms / 1000.0
        kept = self.reps.get(call.request)
        if kept is None:
            raise ProtocolError(f"predict {call.request} without its represent round (or long after it)")
        rep, held, _ = kept
        me = self.party.index
        names = [f"party{k}" for k in range(len(self.federation.feature_parties))]
        for group in call.groups:
            if me not in group.members or not group.rows or max(group.rows) >= len(held) \
                    or not held[group.rows].all() or sorted(set(group.members)) != group.members \
                    or max(group.members) >= len(names):
                raise ProtocolError(f"group {group.index} of request {call.request} is not one this party can "
                                    "predict (it must hold every id of it, and be one of its members)")
        tensors: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        for group in call.groups:  # every peer of every group gets this party's representation first
            rows = torch.as_tensor(group.rows, device=rep.device)
            for k in group.members:
                if k == me:
                    continue
                try:
                    self.net.send(Message(SERVE_OUTPUT, self.me, names[k], call.step, {"embedding": rep[rows].cpu()},
                                          meta={"request": call.request, "group": group.index}))
                except PartyLost as exc:  # the peer left: this group fails, the others go on
                    failed[str(group.index)] = f"{names[k]}: {exc}"
        try:
            self.transport.flush()
        except PartyLost:
            pass  # a peer that left: its groups fail below, when its representation does not come
        for group in call.groups:
            if str(group.index) in failed:
                continue
            rows = torch.as_tensor(group.rows, device=rep.device)
            parts, lost = [], None
            for k in group.members:
                if k == me:
                    parts.append(rep[rows])
                    continue
                try:
                    got = self._peer_output(names[k], call.request, group.index, deadline)
                    t = check_output(got, sender=names[k], request=call.request, name="embedding",
                                     shape=(len(group.rows), rep.shape[1]), dtype=rep.dtype,
                                     extra_meta={"group": group.index})
                except (PartyLost, MessageError, TimeoutError) as exc:
                    lost = f"{names[k]}: {exc}"  # the coordinator reads the peer's name before the colon
                    break
                parts.append(t.to(device=rep.device))
            if lost is not None:
                failed[str(group.index)] = lost
                continue
            reps = torch.stack(parts)
            tensors[f"g{group.index}"] = probabilities(self.party.g(reps.mean(dim=0)), self.party.n_classes)
        self.audit.write(coordinator=self.federation.label_party, request=call.request, op="predict",
                         groups=[[g.members, len(g.rows)] for g in call.groups], failed=sorted(failed))
        return Answer("predict", call.request, failed=failed), tensors

    def _peer_output(self, peer: str, request: int, group: int, deadline: float) -> Message:
        """The next representation ``peer`` sent for (request, group); older ones (of requests abandoned at their
        deadline) are skipped. Waits until ``deadline`` at most."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{peer}: its representation did not arrive in time")
            message = self.net.receive(self.me, kind=SERVE_OUTPUT, sender=peer, timeout=left)
            got = (message.meta.get("request"), message.meta.get("group"))
            if type(got[0]) is not int or type(got[1]) is not int:
                raise MessageError(f"{peer}: a representation without its request and group")
            if got < (request, group):
                continue
            if got != (request, group):
                raise MessageError(f"{peer}: sent request {got[0]} group {got[1]} while {request}/{group} was due")
            return message

    # -- the CKKS aggregator ---------------------------------------------------------------------------------------
    def _relay(self, sender: str, kind: str) -> None:
        if self.net is None:
            raise ConfigError(f"{self.name} got a {kind} message from {sender} before the coordinator's hello")
        self.net.aggregation.relay(self.net, self.net.receive(self.me, kind=kind, sender=sender))

    def close(self) -> None:
        self.audit.close()
        self.transport.close()


def serve_feature_party(federation: Federation, name: str, *, run_dir: Path, table: Path | None,
                        timeouts: Timeouts, log: Callable[[str], None]) -> None:
    """Serve party ``name`` (a feature party, or the aggregator) until the coordinator stops (or goes)."""
    server = _FeatureServer(federation, name, run_dir, table, timeouts, log)
    try:
        server.serve()
    except PartyLost as exc:
        if exc.party != server.coordinator:
            raise
        log(f"{name}: {federation.label_party} is gone ({exc}); stopping")
    finally:
        server.close()
