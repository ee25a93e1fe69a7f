"""`secvfl serve` at the label party: the coordinator that scores entity ids with the feature parties.

The label party's process loads the run's settings, its own part of the model (the head of a split algorithm; a
LASER-VFL coordinator holds no model) and, from its final checkpoint, which state file each feature party must load.
It says hello to every party (each builds the run and loads its state), starts a serving epoch (handshakes of the
secure channel, fresh masking keys) and then scores batches of ids (:meth:`Coordinator.score`, called by one worker
thread: secvfl.serve.batching):

* split algorithms (``splitnn``, ``vafl``, ``fdml``): every feature party's output for the ids, in parallel; the
  head combines them as in training (concatenation, or the sum / mean the run's aggregation delivers: plain, CKKS or
  masked, so the label party sees only the sum under ``--he ckks`` / ``--secagg mask``). An id needs every party:
  one that does not hold it, or does not answer within the deadline, gives that id an error that names it.
* ``laser``: every live party's representation of the ids (round 1); each id's observed set is the parties that
  answered in time and hold it; each party of a set predicts the set's ids with its own predictor from the set's
  representations, exchanged between the parties (round 2); the answer is the mean of the predictors' class
  probabilities, and names the parties whose features were used. A party that does not answer round 1 in time is
  left out of that request; one that is gone is left out of every later request; a set whose round 2 fails because
  a member left is retried once without it.

Every answer and output a party sends is checked (sender, request, shape = ids x agreed width, dtype, finite);
answers to requests abandoned at their deadline arrive later and are dropped (their outputs taken off the network in
order, so the secure channel's sequence and the secure sums' rounds stay in step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from secvfl.checkpoint import read_party_states
from secvfl.deploy.data import load_run_layout, uses_data_files
from secvfl.deploy.limits import serve_limits
from secvfl.deploy.party import AGGREGATOR, Timeouts, check_across_processes, make_transport, run_names
from secvfl.errors import ConfigError, MessageError, ProtocolError, SecvflError
from secvfl.federation import Federation
from secvfl.messages import decode, encode
from secvfl.models import output_dim
from secvfl.serve.model import build_served_run, check_servable, is_laser, own_party
from secvfl.serve.wire import (
    SERVE_ANSWER,
    SERVE_CALL,
    SERVE_OUTPUT,
    Answer,
    Call,
    Group,
    call_message,
    check_output,
    read_answer,
)
from secvfl.transport.grpc_link import PartyLost

__all__ = ["Coordinator", "Scored", "ServeLimits"]


_MAX_PENDING_ROUNDS = 32  # abandoned secure-sum rounds kept for their late answers


def _reason(exc: PartyLost) -> str:
    """Why a party is gone, without the training advice (--resume) the transport's message ends with."""
    return str(exc).split("; restart it and continue", 1)[0]


@dataclass(frozen=True)
class ServeLimits:
    """Every bound of the serving endpoint (flags of `secvfl serve`)."""

    max_ids_per_request: int = 1024
    max_batch_ids: int = 4096
    batch_wait_ms: float = 2.0
    max_queued_requests: int = 256
    deadline_ms: float = 1000.0
    max_body_bytes: int = 1 << 20

    def check(self) -> None:
        for flag, value in (("--max-ids", self.max_ids_per_request), ("--max-batch-ids", self.max_batch_ids),
                            ("--max-queue", self.max_queued_requests)):
            if not 1 <= value <= 1_000_000:
                raise ConfigError(f"{flag} must be from 1 to 1000000, got {value}")
        if self.max_batch_ids < self.max_ids_per_request:
            raise ConfigError(f"--max-batch-ids {self.max_batch_ids} is below --max-ids {self.max_ids_per_request}: "
                              "a batch must hold at least one full request")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ConfigError(f"--batch-wait-ms must be from 0 to 1000, got {self.batch_wait_ms:g}")
        if not 1 <= self.deadline_ms <= 600_000:
            raise ConfigError(f"--deadline-ms must be from 1 to 600000, got {self.deadline_ms:g}")


@dataclass
class Scored:
    """The scores of a batch of distinct ids: probabilities (zeros where an id failed) and, per id, an error ("" if
    scored), the parties whose features were used and (LASER-VFL) those whose predictors answered."""

    probabilities: np.ndarray
    errors: list[str]
    contributors: list[list[str]]
    predictors: list[list[str]]
    unknown: set[int] = field(default_factory=set)  # ids that every party answered about and none holds

    @classmethod
    def failed(cls, n: int, n_classes: int, why: str) -> Scored:
        return cls(np.zeros((n, n_classes), dtype=np.float32), [why] * n, [[] for _ in range(n)],
                   [[] for _ in range(n)])


class Coordinator:
    def __init__(self, federation: Federation, run_dir: Path, *, timeouts: Timeouts, limits: ServeLimits,
                 log: Callable[[str], None]) -> None:
        from secvfl.runner import read_run_config

        self.federation, self.run_dir, self.timeouts, self.limits, self.log = federation, Path(run_dir), timeouts, \
            limits, log
        if not uses_data_files(federation):
            raise ConfigError(f"{federation.source}: serving scores entities by id, so every party needs its own data "
                              "table (a [parties.<name>] data = { file, id, ... } entry); this federation has none")
        self.cfg = read_run_config(self.run_dir)
        check_servable(self.cfg)
        self.classes, self.widths = load_run_layout(self.run_dir)
        self.epoch, states = read_party_states(self.run_dir)
        runs = run_names(federation)
        self.me = runs[federation.label_party]
        self.parties = [runs[p.name] for p in federation.feature_parties]
        self.helpers = [AGGREGATOR] if federation.aggregator is not None else []
        self.names = {run: fed for fed, run in runs.items()}  # run name -> federation name
        if self.cfg.parties != len(self.parties) or len(self.widths) != len(self.parties):
            raise ConfigError(f"{self.run_dir} trained {self.cfg.parties} feature parties, federation "
                              f"{federation.name!r} has {len(self.parties)}; serve with the federation file of the run")
        self.records = {}
        for p in self.parties:
            record = states.get(p)
            if not isinstance(record, dict) or record.get("party") != p or "state_sha256" not in record:
                raise ConfigError(f"the checkpoint in {self.run_dir} names no state file of {p}; serve the label "
                                  "party's directory of a run whose parties ran in their own processes")
            self.records[p] = {"party": p, "state_sha256": str(record["state_sha256"])}
        self.laser = is_laser(self.cfg)
        self.run = build_served_run(self.cfg, self.widths, len(self.classes), self.classes, self.me)
        check_across_processes(self.run, federation)
        self.label = None
        if not self.laser:
            self.label = own_party(self.run, self.me)
            self.label.load_state_dict(states[self.me])
            self.label.head.eval()
            self.aggregation = self.run.algorithm.traits.aggregation
            self.output_kind = self.run.algorithm.output_kind
            self.output_width = self.cfg.embedding_dim if self.output_kind == "embedding" else \
                output_dim(len(self.classes))
        else:
            self.aggregation = "broadcast"  # each party's representation goes to the other parties of its set
        self.transport = make_transport(federation, federation.label_party, timeouts, log)
        # what the parties may send it while serving: outputs and answers for batches of at most --max-batch-ids
        self.transport.set_limits(serve_limits(federation, self.cfg, len(self.classes), limits.max_batch_ids))
        self.run.net.transport = self.transport
        self.net = self.run.net
        self.request = 0
        self.gone: dict[str, str] = {}
        self.broken = ""  # a secure sum that cannot go on: why
        self.pending_rounds: list[tuple[int, set[str]]] = []  # aggregated rounds abandoned, waiting for answers
        self.ready = False

    @property
    def model_version(self) -> str:
        return f"epoch-{self.epoch}"

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.cfg.algo, "classes": list(self.classes), "epoch": self.epoch,
                "parties": [self.names[p] for p in self.parties],
                "protocols": [layer.name for layer in self.net.layers] + (
                    [self.net.aggregation.name] if self.net.aggregation.name != "plain" else [])}

    # -- start and stop --------------------------------------------------------------------------------------------
    def _call(self, party: str, call: Call) -> None:
        self.transport.put_control(self.me, party, SERVE_CALL, encode(call_message(self.me, party, call)))

    def _flush(self) -> None:
        """Send the calls held for every party; a party found gone on the way is marked (the others get theirs)."""
        try:
            self.transport.flush()
        except PartyLost as exc:
            self.gone.setdefault(exc.party, _reason(exc))
            self.log(f"{self.names.get(exc.party, exc.party)} is gone: {_reason(exc)}")

    def _next(self) -> int:
        self.request += 1
        return self.request

    def connect(self) -> None:
        """Hello to every party (each builds the run and loads its state), then a serving epoch; bounded by
        ``--party-timeout`` per party."""
        t0 = time.perf_counter()
        r = self._next()
        for p in self.parties + self.helpers:
            state = self.records.get(p, {})
            self._call(p, Call("hello", r, config=self.cfg.to_dict(), widths=list(self.widths),
                               n_classes=len(self.classes), state=state, max_ids=self.limits.max_batch_ids))
        for p in self.parties + self.helpers:
            answer = self._await(p, r, time.monotonic() + self.timeouts.wait, strict=True)[0]
            if answer.error:
                raise ConfigError(f"{self.names[p]} cannot serve: {answer.error}")
            if answer.facts:
                self.log(f"{self.names[p]}: ready, {answer.facts.get('usable')} of its {answer.facts.get('ids')} ids "
                         "can be scored")
        r = self._next()
        for p in self.parties + self.helpers:
            self._call(p, Call("start", r, epoch=self.epoch + 1))
        self.transport.flush()
        self.net.start_epoch(self.epoch + 1)  # every pair handshakes now (each process runs its side)
        for p in self.parties + self.helpers:
            answer = self._await(p, r, time.monotonic() + self.timeouts.wait, strict=True)[0]
            if answer.error:
                raise ProtocolError(f"{self.names[p]} could not start serving: {answer.error}")
        if not self.laser and self.aggregation != "concat":
            self._warm_up()
        self.ready = True
        self.log(f"{self.federation.label_party}: serving {self.cfg.algo} ({self.model_version}) with "
                 f"{len(self.parties)} feature parties; ready in {time.perf_counter() - t0:.1f} s")

    def _warm_up(self) -> None:
        """One round of the sum on a row of zeros (no id): the aggregation hands out its keys (the CKKS context, the
        masks' pair seeds) here, so that every later round is answered before its sum is collected."""
        r = self._next()
        for p in self.parties:
            self._call(p, Call("embed", r, step=r, ids=[]))
        self.transport.flush()
        self.net.aggregate_submitted(self.me, SERVE_OUTPUT, "sum", senders=self.parties)
        for p in self.parties:
            answer = self._await(p, r, time.monotonic() + self.timeouts.wait, strict=True)[0]
            if answer.error:
                raise ProtocolError(f"{self.names[p]} could not start the secure sum: {answer.error}")

    def close(self) -> None:
        r = self._next()
        for p in self.parties + self.helpers:
            if p not in self.gone:
                try:
                    self._call(p, Call("stop", r))
                except SecvflError:
                    pass
        try:
            self.transport.flush()
        except SecvflError:
            pass
        self.transport.close()

    # -- answers ---------------------------------------------------------------------------------------------------
    def _await(self, party: str, request: int, deadline: float, *, strict: bool = False) -> tuple[Answer, Any]:
        """``party``'s answer to ``request`` (with its message), or (an Answer with an error, None) when it does not
        come before ``deadline``, is malformed, or the party is gone. Answers to earlier requests are dropped on the
        way, with the outputs they announce."""
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise PartyLost(party, f"no answer within the deadline ({self.limits.deadline_ms:g} ms)")
                data = self.transport.take(self.me, kind=SERVE_ANSWER, sender=party, timeout=left)
                message = decode(data)
                answer = read_answer(message, party, self.me)
            except PartyLost as exc:
                if strict:
                    raise
                if time.monotonic() < deadline - 1e-3:  # not a timeout: the party is gone
                    self.gone.setdefault(party, _reason(exc))
                    self.log(f"{self.names[party]} is gone: {_reason(exc)}")
                    return Answer("embed", request, error=f"party {self.names[party]} is gone"), None
                return Answer("embed", request, error=f"party {self.names[party]} did not answer within the deadline "
                                                      f"({self.limits.deadline_ms:g} ms)"), None
            except MessageError as exc:
                if strict:
                    raise
                self.log(f"{self.names[party]} sent a malformed answer: {exc}")
                return Answer("embed", request, error=f"party {self.names[party]} sent a malformed answer"), None
            if answer.request < request:
                self._late(party, answer)
                continue
            if answer.request > request:
                raise ProtocolError(f"{self.names[party]} answered request {answer.request} before it was made")
            return answer, message

    def _late(self, party: str, answer: Answer) -> None:
        """An answer to a request abandoned at its deadline: take the output it announces off the network."""
        if answer.op != "embed" or answer.error:
            return
        if self.aggregation == "concat":
            self.net.receive(self.me, kind=SERVE_OUTPUT, sender=party)  # the output came before its answer
            return
        for r, missing in self.pending_rounds:
            if r == answer.request:
                missing.discard(party)

    def _catch_up(self) -> str:
        """Collect (and drop) the secure sums of abandoned rounds whose parties have all answered since, in order;
        returns why the current round cannot be collected yet ("" when it can)."""
        while self.pending_rounds:
            r, missing = self.pending_rounds[0]
            if missing:
                return f"waiting for {', '.join(self.names[p] for p in sorted(missing))} to finish an earlier request"
            self.net.aggregate_submitted(self.me, SERVE_OUTPUT, "sum", senders=self.parties)
            self.pending_rounds.pop(0)
        return ""

    # -- scoring ---------------------------------------------------------------------------------------------------
    def score(self, ids: Sequence[str], deadline_s: float) -> Scored:
        """Scores of distinct ``ids``; every wait for the parties ends ``deadline_s`` seconds from now."""
        if not self.ready:
            return Scored.failed(len(ids), len(self.classes), "the federation is not ready")
        deadline = time.monotonic() + deadline_s
        try:
            return self._score_laser(list(ids), deadline, deadline_s) if self.laser else \
                self._score_split(list(ids), deadline)
        except PartyLost as exc:  # a party lost while its output was being taken
            self.gone.setdefault(exc.party, _reason(exc))
            self.log(f"{self.names.get(exc.party, exc.party)} is gone: {_reason(exc)}")
            return Scored.failed(len(ids), len(self.classes), f"party {self.names.get(exc.party, exc.party)} is gone")

    def _held(self, answers: dict[str, Answer], n: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Per party that answered: which ids it holds and can score, and which it holds but cannot score."""
        held, unusable = {}, {}
        for p, a in answers.items():
            if any(i >= n for i in a.missing) or not set(a.unusable) <= set(a.missing):
                continue  # out of range, or inconsistent: treated as no answer
            mask = np.ones(n, dtype=bool)
            mask[a.missing] = False
            held[p] = mask
            unusable[p] = np.zeros(n, dtype=bool)
            unusable[p][a.unusable] = True
        return held, unusable

    def _cannot_score(self, parties: Sequence[str]) -> str:
        """Why ``parties`` hold an id but cannot score it (a party's row unusable under --nan-policy error)."""
        names = ", ".join(self.names[p] for p in parties)
        return (f"{names} hold{'s' * (len(parties) == 1)} it but cannot score it (its row has a missing cell, or a "
                f"category training never saw, and the model was trained with --nan-policy {self.cfg.nan_policy})")

    def _score_split(self, ids: list[str], deadline: float) -> Scored:
        n, C = len(ids), len(self.classes)
        if self.broken:
            return Scored.failed(n, C, self.broken)
        gone = [p for p in self.parties + self.helpers if p in self.gone]
        if gone:
            return Scored.failed(n, C, f"party {self.names[gone[0]]} is gone ({self.gone[gone[0]]}); {self.cfg.algo} "
                                       "needs every party: restart it, then every serving process")
        r = self._next()
        budget = max(0.0, (deadline - time.monotonic()) * 1000)
        for p in self.parties:
            try:
                self._call(p, Call("embed", r, step=r, ids=ids, budget_ms=budget))
            except PartyLost as exc:
                self.gone.setdefault(p, _reason(exc))
        self._flush()
        answers: dict[str, Answer] = {}
        errors: dict[str, str] = {}
        for p in self.parties:
            a, _ = self._await(p, r, deadline)
            (errors.__setitem__(p, a.error) if a.error else answers.__setitem__(p, a))
        aggregated = self.aggregation != "concat"
        if errors:
            if aggregated:
                if any(p not in self.gone and "deadline" not in why for p, why in errors.items()):
                    self.broken = ("the secure sum lost step with the parties (" + "; ".join(errors.values()) +
                                   "); restart every serving process")
                self.pending_rounds.append((r, {p for p in errors if p not in self.gone}))
                if len(self.pending_rounds) > _MAX_PENDING_ROUNDS:
                    self.broken = (f"{len(self.pending_rounds)} requests in a row missed their deadline at a party; the "
                                   "secure sum stops here: restart every serving process (or raise --deadline-ms)")
            else:
                for p in answers:  # their outputs of this abandoned request: off the network
                    self.net.receive(self.me, kind=SERVE_OUTPUT, sender=p)
            return Scored.failed(n, C, "; ".join(dict.fromkeys(errors.values())))
        held, unusable = self._held(answers, n)
        if len(held) != len(self.parties):
            return Scored.failed(n, C, "a party named ids outside the request")
        if aggregated:
            why = self._catch_up()
            if why:
                self.pending_rounds.append((r, set()))
                return Scored.failed(n, C, why)
            total = self.net.aggregate_submitted(self.me, SERVE_OUTPUT, "sum", senders=self.parties)
            if total.step != r:
                self.broken = f"the secure sum of request {total.step} arrived for request {r}; restart serving"
                return Scored.failed(n, C, self.broken)
            check_output(total.replace(meta={"request": r}), sender=total.sender, request=r, name=self.output_kind,
                         shape=(n, self.output_width), dtype=self.run.ctx.dtype)
            scale = None
            if self.aggregation == "mean":
                scale = torch.full((n, 1), 1.0 / len(self.parties), dtype=self.run.ctx.dtype, device=self.run.ctx.device)
            proba = self.label.predict([total], aggregated=True, input_scale=scale)
        else:
            inputs = [self.net.receive(self.me, kind=SERVE_OUTPUT, sender=p) for p in self.parties]
            for p, m in zip(self.parties, inputs, strict=True):
                check_output(m, sender=p, request=r, name=self.output_kind, shape=(n, self.output_width),
                             dtype=self.run.ctx.dtype)
            proba = self.label.predict(inputs, aggregated=False)
        proba = proba.detach().cpu().numpy().astype(np.float32)
        everyone = [self.names[p] for p in self.parties]
        errors_per_id, contributors = [], []
        for i in range(n):
            lacking = [self.names[p] for p in self.parties if not held[p][i] and not unusable[p][i]]
            unscorable = [p for p in self.parties if unusable[p][i]]
            if lacking or unscorable:
                why = ([f"not held by {', '.join(lacking)}"] if lacking else []) + (
                    [self._cannot_score(unscorable)] if unscorable else [])
                errors_per_id.append(f"{'; '.join(why)} ({self.cfg.algo} needs every party's features for an id)")
                contributors.append([])
                proba[i] = 0.0
            else:
                errors_per_id.append("")
                contributors.append(everyone)
        unknown = {i for i in range(n) if not any(held[p][i] or unusable[p][i] for p in self.parties)}
        return Scored(proba, errors_per_id, contributors, [[] for _ in range(n)], unknown)

    def _score_laser(self, ids: list[str], deadline: float, deadline_s: float) -> Scored:
        n, C = len(ids), len(self.classes)
        out = Scored.failed(n, C, "not scored")
        r = self._next()
        live = [p for p in self.parties if p not in self.gone]
        budget = max(0.0, (deadline - time.monotonic()) * 1000)
        for p in live:
            try:
                self._call(p, Call("represent", r, step=r, ids=ids, budget_ms=budget))
            except PartyLost as exc:
                self.gone.setdefault(p, _reason(exc))
        self._flush()
        answers, reasons = {}, {}
        for p in live:
            if p in self.gone:
                continue
            a, _ = self._await(p, r, deadline)
            (reasons.__setitem__(p, a.error) if a.error else answers.__setitem__(p, a))
        held, unusable = self._held(answers, n)
        index = {p: k for k, p in enumerate(self.parties)}
        sets: dict[tuple[int, ...], list[int]] = {}
        for i in range(n):
            members = tuple(index[p] for p in self.parties if p in held and held[p][i])
            if members:
                sets.setdefault(members, []).append(i)
                continue
            unscorable = [p for p in unusable if unusable[p][i]]
            why = list(dict.fromkeys(reasons.values())) + ([self._cannot_score(unscorable)] if unscorable else [])
            out.errors[i] = "no party that answered in time holds this id" + (f" ({'; '.join(why)})" if why else "")
        if len(held) == len(self.parties):
            out.unknown = {i for i in range(n) if not any(held[p][i] or unusable[p][i] for p in self.parties)}
        todo = [Group(g, list(m), rows) for g, (m, rows) in enumerate(sorted(sets.items()))]
        next_index = len(todo)
        for attempt in range(2):
            if not todo:
                break
            retry, next_index = self._predict_round(r, todo, out, deadline_s, next_index, last=attempt == 1)
            todo = retry
        return out

    def _predict_round(self, r: int, groups: list[Group], out: Scored, deadline_s: float, next_index: int,
                       *, last: bool) -> tuple[list[Group], int]:
        """Round 2 of LASER-VFL for ``groups``; fills ``out``; returns the groups to retry without a lost member."""
        deadline = time.monotonic() + deadline_s
        involved = sorted({self.parties[k] for g in groups for k in g.members})
        for p in involved:
            mine = [g for g in groups if self.parties.index(p) in g.members]
            try:
                self._call(p, Call("predict", r, step=r, groups=mine, budget_ms=deadline_s * 1000))
            except PartyLost as exc:
                self.gone.setdefault(p, _reason(exc))
        self._flush()
        results: dict[str, tuple[Answer, Any]] = {}
        for p in involved:
            if p not in self.gone:
                results[p] = self._await(p, r, deadline)
        retry: list[Group] = []
        C = len(self.classes)
        for g in groups:
            probs, predictors, lost = [], [], set()
            for k in g.members:
                p = self.parties[k]
                answer, message = results.get(p, (None, None))
                if answer is None or message is None or answer.error:
                    lost.add(k)
                    continue
                why = answer.failed.get(str(g.index))
                if why is not None:
                    lost.update(self.parties.index(q) for q in self.parties if why.startswith(f"{q}:"))
                    continue
                t = message.tensors.get(f"g{g.index}")
                if t is None or tuple(t.shape) != (len(g.rows), C) or not t.is_floating_point() \
                        or not bool(torch.isfinite(t).all()) or bool((t < 0).any()) \
                        or not bool(torch.allclose(t.sum(dim=1), torch.ones(len(g.rows), dtype=t.dtype), atol=1e-3)):
                    self.log(f"{self.names[p]} sent malformed probabilities for request {r}; left out")
                    continue
                probs.append(t.numpy())
                predictors.append(self.names[p])
            members = [self.names[self.parties[k]] for k in g.members]
            if probs:
                mean = np.mean(np.stack(probs), axis=0)
                for j, i in enumerate(g.rows):
                    out.probabilities[i] = mean[j]
                    out.errors[i], out.contributors[i], out.predictors[i] = "", members, predictors
                continue
            rest = [k for k in g.members if k not in lost]
            if not last and lost and rest:
                retry.append(Group(next_index, rest, g.rows))
                next_index += 1
                continue
            for i in g.rows:
                out.errors[i] = f"no predictor of {', '.join(members)} answered in time"
        return retry, next_index
