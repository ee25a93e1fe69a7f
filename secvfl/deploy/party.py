"""One party's process: a feature party serving requests, or the label party running the training as coordinator.

The label party proposes the run: its ``secvfl party`` command carries the training settings, and its hello to
every feature party carries them (plus whether the run resumes). Each party then builds the run from those settings
and keeps only its own party: its model, its optimiser, its block of columns; the other parties' objects built on
the way are dropped before the first request. Where the data comes from: with a ``data`` table for every party in
the federation file, each party reads only its own file and the rows are aligned by private set intersection
before the hello (secvfl.deploy.data); without data tables (a demonstration on one host), every process takes its
block of the run's dataset (``--dataset``) with the run's seed, as the in-process simulation partitions it.

What crosses processes: the algorithm's messages (the same bytes as in one process, counted the same way), and the
coordinator's requests with their answers (public facts: step numbers, row ids, party names, losses; counted
apart, in ``control`` of summary.json).

Protocol layers run where they act, in each party's own process, on its own messages (each process builds the run
for its own party, ``build_run(cfg, local=...)``, so a layer sets up that party's keys only); so far only the layers
that say they can (``Layer.across_processes``: compression, label DP, the secure channel) and the aggregations that
implement their halves (``Aggregation.across_processes``: plain, masking, CKKS with an aggregator party) are allowed.
A run asking for another is refused before any party trains, with the reason.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from secvfl.algorithms.base import LABEL_PARTY, feature_party_names
from secvfl.config import TrainConfig
from secvfl.deploy.data import (
    ALIGN,
    PLAN,
    AlignRows,
    check_config,
    counting_apart,
    plan_rows,
    prepare_own_block,
    read_own_file,
    receive_plan,
    record_alignment,
    run_table,
    save_preprocessing,
    save_run_layout,
    send_plan,
    uses_data_files,
    with_federation_dataset,
)
from secvfl.deploy.limits import run_limits, startup_limits, table_limits
from secvfl.deploy.remote import (
    CPU,
    HELLO,
    LOAD,
    SAVE,
    START_EPOCH,
    STATS,
    STOP,
    FederatedStats,
    PartyLink,
    PartyServer,
    RemoteHandle,
    load_party_state,
    save_party_state,
    swap_remote_handles,
)
from secvfl.errors import ConfigError, ProtocolError, SecvflError, UnsupportedError
from secvfl.federation import Federation, verify_peer_certificate
from secvfl.transport.base import PeerViolation
from secvfl.transport.grpc_link import GrpcTransport, PartyLost, PeerAddress, ReceiveLimits, TlsFiles
from secvfl.transport.layers import Role
from secvfl.transport.network import Network

__all__ = ["run_names", "Timeouts", "make_transport", "serve_party", "coordinate", "AGGREGATOR", "DEPLOYMENT_FILE",
           "mark_deployed", "deployed_resume_command"]

AGGREGATOR = "aggregator"  # the run name of the CKKS aggregator (protocols.ckks.CKKSAggregation's default)


MAX_WAIT = 1e6  # seconds: the longest --party-timeout, --peer-timeout or --heartbeat
MIN_HEARTBEAT = 0.01  # seconds


class Timeouts:
    """How long a party waits: for a message or a connection (``wait``), for the coordinator's next request
    (``idle``), and for a silent peer (``peer``, with ``heartbeat`` the interval of the heartbeats)."""

    def __init__(self, wait: float = 300.0, peer: float = 15.0, heartbeat: float = 1.0, idle: float = 3600.0) -> None:
        for name, value, low in (("--party-timeout", wait, 0.0), ("--peer-timeout", peer, 0.0),
                                 ("--heartbeat", heartbeat, MIN_HEARTBEAT)):
            if not (value > 0 and math.isfinite(value)):  # inf: no deadline can be set (timestamps overflow)
                raise ConfigError(f"{name} must be a positive number of seconds, got {value:g}")
            if value > MAX_WAIT:
                raise ConfigError(f"{name} {value:g}: at most {MAX_WAIT:g} s (about 11 days); a party that waits "
                                  "longer for a peer has lost it")
            if value < low:
                raise ConfigError(f"{name} {value:g}: at least {low:g} s (a party sends a heartbeat on every open link "
                                  "at this interval; shorter ones flood the links)")
        if heartbeat >= peer:
            raise ConfigError(f"--heartbeat {heartbeat:g} must be shorter than --peer-timeout {peer:g} (a peer is "
                              "declared gone after missing several heartbeats)")
        self.wait, self.peer, self.heartbeat, self.idle = wait, peer, heartbeat, max(idle, wait)


def run_names(federation: Federation) -> dict[str, str]:
    """Federation party name -> the party's name in the run: the label party is ``label``, the feature parties
    ``party0``, ``party1``, ... in the federation file's order (the order of their column blocks)."""
    features = feature_party_names(len(federation.feature_parties))
    names = {p.name: run for p, run in zip(federation.feature_parties, features, strict=True)}
    names[federation.label_party] = LABEL_PARTY
    if federation.aggregator is not None:
        names[federation.aggregator] = AGGREGATOR
    return names


def make_transport(federation: Federation, name: str, timeouts: Timeouts, log: Callable[[str], None],
                   limits: ReceiveLimits | None = None) -> GrpcTransport:
    runs = run_names(federation)
    spec = federation.party(name)
    addresses = {p.name: PeerAddress(runs[p.name], p.name, str(p.address)) for p in federation.parties}
    peers = {a.name: a for n, a in addresses.items() if n != name}
    return GrpcTransport(addresses[name], peers, TlsFiles(federation.ca, spec.cert, spec.key),
                         verify=lambda cert_name, pem: verify_peer_certificate(federation, cert_name, pem),
                         timeout=timeouts.wait, heartbeat=timeouts.heartbeat, peer_timeout=timeouts.peer, log=log,
                         limits=limits or startup_limits(federation, None))


def check_across_processes(run: Any, federation: Federation) -> None:
    """Refuse, before training, what this deployment cannot run with parties in separate processes."""
    problems = []
    aggregators = run.net.topology.parties(Role.AGGREGATOR)
    if aggregators and aggregators != [AGGREGATOR]:
        problems.append(f"an aggregator named {aggregators} (the federation's aggregator runs as {AGGREGATOR!r})")
    if aggregators and AGGREGATOR not in run_names(federation).values():
        problems.append(f"the {run.net.aggregation.name} aggregation without an aggregator party (add aggregator = "
                        "\"<party>\" to [federation] and a [parties.<party>] table with its address)")
    if not run.net.aggregation.across_processes:
        problems.append(f"the {run.net.aggregation.name} aggregation (its rounds run every party in one process "
                        "so far)")
    for layer in run.net.layers:
        why = layer.across_processes()
        if why is not None:
            problems.append(f"the {layer.name} layer ({why})")
    if problems:
        raise UnsupportedError("parties in separate processes cannot run " + "; ".join(problems) +
                               "; run it in one process (`secvfl train`), or drop those protocols")


def _own_file(federation: Federation, name: str, align_ids: AlignRows | None):  # noqa: ANN202
    """This party's own file when the parties read their own files (None otherwise), read before it listens."""
    if not uses_data_files(federation):
        return None
    if align_ids is None:
        raise ConfigError(f"{federation.source}: the parties read their own files, which needs a private set "
                          "intersection to align their rows; start the party with `secvfl party`")
    spec = federation.party(name).data
    return None if spec is None else read_own_file(spec, name)  # the aggregator holds no file


def _check_layout(federation: Federation, sender: str, widths: Any, sizes: Any, n_classes: Any) -> None:
    """The run table's layout a peer announced (column widths per feature party, rows per split, classes), checked
    against the federation's limits before anything is allocated for it."""
    limits = table_limits(federation)
    k = len(federation.feature_parties)

    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(widths, list) or len(widths) != k or not all(whole(w) and 1 <= w <= limits.columns
                                                                    for w in widths):
        raise PeerViolation(sender, f"it announced the column widths {str(widths)[:80]}; expected {k} whole numbers "
                            f"from 1 to {limits.columns} ([limits] party_columns)")
    if not isinstance(sizes, list) or len(sizes) != 3 or not all(whole(n) and n >= 0 for n in sizes):
        raise PeerViolation(sender, f"it announced the split sizes {str(sizes)[:80]}; expected 3 whole numbers")
    if not whole(n_classes) or not 2 <= n_classes <= 1 << 16:
        raise PeerViolation(sender, f"it announced {str(n_classes)[:20]} classes")
    table = sum(widths) * sum(sizes) * 4
    if table > limits.table_bytes:
        raise PeerViolation(sender, f"its announced layout needs a run table of {table / (1 << 20):.0f} MiB, over the "
                            f"{limits.table_bytes / (1 << 20):.0f} MiB limit ([limits] table_mib)")


def _check_federation(federation: Federation, cfg: TrainConfig) -> None:
    k = len(federation.feature_parties)
    if cfg.parties != k:
        raise ConfigError(f"--parties {cfg.parties}, but federation {federation.name!r} has {k} feature "
                          f"part{'ies' if k != 1 else 'y'}; set --parties {k}")


# -- a feature party ---------------------------------------------------------------------------------------------
def serve_party(federation: Federation, name: str, *, state_dir: Path, data_dir: str | None,
                timeouts: Timeouts, log: Callable[[str], None], align_ids: AlignRows | None = None) -> None:
    """Run party ``name`` (a feature party, or the aggregator) until the coordinator says stop (or fails, or goes
    silent). ``align_ids``: this party's side of the private set intersection, when the parties read their own
    files (protocols.psi.align_rows_with_peers, given by the command)."""
    from secvfl.checkpoint import _global_rng_state, _set_global_rng_state
    from secvfl.runner import build_run

    own = _own_file(federation, name, align_ids)
    runs = run_names(federation)
    me = runs[name]
    coordinator = runs[federation.label_party]
    transport = make_transport(federation, name, timeouts, log,
                               startup_limits(federation, None if own is None else own.ids))
    server = PartyServer(me, transport, coordinator, idle_timeout=timeouts.idle, log=log)
    held: dict[str, Any] = {}

    def on_call(method: str, args: list, kwargs: dict) -> Any:
        if method == ALIGN:  # the label party's private set intersection with this party, as messages
            if own is None or align_ids is None:
                raise ProtocolError(f"{name} reads no data file of its own, so it has no ids to align")
            with counting_apart(transport) as psi_stats:
                net = Network({coordinator: Role.LABEL, me: Role.FEATURE}, transport=transport)
                held["learned"] = align_ids(net, me, [coordinator], own.ids)[coordinator]
            held["psi_sent"] = {"bytes": psi_stats.bytes_total, "messages": psi_stats.messages_total}
            log(f"{name}: {len(held['learned'])} of its {len(own.ids)} ids are also held by {federation.label_party}")
            return None
        if method == PLAN:  # the rows of each split (sent as messages): prepare this party's own columns for them
            if "learned" not in held:
                raise ProtocolError(f"{name} got the label party's rows before aligning its ids")
            cfg = TrainConfig.from_dict(args[0])
            net = Network({coordinator: Role.LABEL, me: Role.FEATURE}, transport=transport)
            ids = receive_plan(net, me, coordinator, limit=len(held["learned"]))
            held["sizes"] = [len(split) for split in ids]
            held["columns"], names, notes, preprocessing = prepare_own_block(own, ids, held["learned"], cfg)
            for note in notes:
                log(f"{name}: data: {note}")
            save_preprocessing(state_dir, preprocessing)  # `secvfl serve` prepares the tables it scores with it
            return {"width": len(names), "psi_sent": held["psi_sent"]}
        if method == HELLO:
            cfg = TrainConfig.from_dict(args[0])
            if data_dir is not None:
                cfg = replace(cfg, data_dir=data_dir)
            _check_federation(federation, cfg)
            prepared = None
            if len(args) > 1 and args[1] is not None:  # the parties read their own files: the announced layout
                if own is not None and "columns" not in held:
                    raise ProtocolError(f"{name} got the hello before the rows of the run were planned")
                layout = args[1]
                if not isinstance(layout, dict) or set(layout) != {"widths", "sizes", "n_classes"}:
                    raise PeerViolation(coordinator, "its hello's table layout is malformed")
                _check_layout(federation, coordinator, layout["widths"], layout["sizes"], layout["n_classes"])
                if own is not None and layout["sizes"] != held["sizes"]:
                    raise PeerViolation(coordinator, f"its hello announces the split sizes {layout['sizes']}, but "
                                        f"its row plan had {held['sizes']}")
                block = [p.name for p in federation.feature_parties].index(name) if own is not None else None
                prepared = run_table(cfg.dataset, layout["widths"], layout["sizes"], layout["n_classes"],
                                     block=block, columns=held.get("columns"))
            elif own is not None:
                raise ProtocolError(f"{name} reads its own file, but the label party proposed a run on "
                                    f"{cfg.dataset!r}; every party of the federation must read its own file")
            run = build_run(cfg, prepared, local=me)
            check_across_processes(run, federation)
            run.net.transport = transport
            transport.set_limits(run_limits(federation, run))
            server.handle = run.algorithm.handles().get(me)  # the aggregator has none: it acts on messages
            server.hello_done = True
            server.mark_run_start()
            held.update(cfg=cfg, net=run.net)  # the rest of the run (other parties' objects) is dropped here
            log(f"{name} ({me}) ready: {cfg.algo} on {cfg.dataset}, {cfg.epochs} epochs")
            return {"ready": me}
        if method == START_EPOCH:
            epoch = int(args[0])
            torch.manual_seed(held["cfg"].seed * 100_003 + epoch)  # as the in-process runner seeds each epoch
            held["net"].start_epoch(epoch)
            return None
        if method == STATS:  # what it sent and what it received (the coordinator checks one against the other)
            net = held["net"]
            return {"sent": net.stats.state_dict(),
                    "received": net.received.state_dict() if net.received_complete else None}
        if method == SAVE:
            state = server.handle.state_dict() if server.handle is not None else {}
            return save_party_state(state_dir, me, {"party": state, "network": held["net"].state_dict(),
                                                    "rng": _global_rng_state()})
        if method == LOAD:
            state = load_party_state(state_dir, me, args[0])
            if server.handle is not None:
                server.handle.load_state_dict(state["party"])
            held["net"].load_state_dict(state["network"])
            _set_global_rng_state(state["rng"])
            log(f"{name} restored its state {args[0]['state_sha256'][:12]}")
            return None
        return NotImplemented

    def relay(sender: str, kind: str) -> None:  # the aggregator: ciphertexts and its context
        net = held.get("net")
        if net is None:
            raise ConfigError(f"{name} got a {kind} message from {sender} before the coordinator's hello")
        net.aggregation.relay(net, net.receive(me, kind=kind, sender=sender))

    server.on_call = on_call
    log(f"{name} listening on {transport.local.address} as {me}; waiting for {federation.label_party}")
    try:
        server.serve(on_message=relay if me == AGGREGATOR else None)
        log(f"{name}: the run is over; stopping")
    finally:
        transport.close()


# -- the label party: the coordinator ----------------------------------------------------------------------------
def coordinate(federation: Federation, cfg: TrainConfig, *, out: Path | None, resume: Path | None,
               timeouts: Timeouts, log: Callable[[str], None], progress: bool = False,
               align_ids: AlignRows | None = None, from_epoch: int | None = None,
               resume_as: str | None = None, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train with the feature parties of ``federation`` in their own processes; returns the summary.
    ``align_ids``: the label party's side of the private set intersection, when the parties read their own files
    (protocols.psi.align_rows_with_peers, given by the command). ``resume_as``: the command that continues this run
    (every hint names it): ``secvfl launch --resume BASE`` when launched, else this party's ``secvfl party ...
    --resume DIR`` (default)."""
    run_dir = resume if resume is not None else out
    if resume_as is None and run_dir is not None:
        resume_as = (f"secvfl party --federation {federation.source} --name {federation.label_party} "
                     f"--resume {run_dir}")
    from secvfl.runner import build_run, run_training

    own = _own_file(federation, federation.label_party, align_ids)
    if resume is None:  # a resumed run's settings are its own (checked once read, in build)
        _check_federation(federation, cfg)
        if own is not None:
            check_config(cfg)
            cfg = with_federation_dataset(cfg, federation)
    runs = run_names(federation)
    me = runs[federation.label_party]
    transport = make_transport(federation, federation.label_party, timeouts, log,
                               startup_limits(federation, None if own is None else own.ids))
    link = PartyLink(transport, me)
    remote = [runs[p.name] for p in federation.feature_parties]
    helpers = [AGGREGATOR] if federation.aggregator is not None else []  # parties without a handle
    started: list[str] = []
    alignment: dict[str, Any] = {}
    departed: dict[str, str] = {}  # feature parties that left during the test evaluation, and why
    cpu_since = time.process_time()  # reset once the run is built (see build)

    def align(cfg: TrainConfig) -> tuple[Any, dict[str, Any]]:
        """Private set intersection with every feature party, the rows of each split, each party's width."""
        check_config(cfg)
        t0 = time.perf_counter()
        for party in remote:
            link.call(party, ALIGN, reply=False)
            started.append(party)
        with counting_apart(transport) as psi_stats:
            net = Network({me: Role.LABEL, **{p: Role.FEATURE for p in remote}}, transport=transport)
            shared = align_ids(net, me, remote, own.ids)
        plan = plan_rows(own, shared, cfg)
        record_alignment(resume if resume is not None else out, plan, resumed=resume is not None)
        with counting_apart(transport) as plan_stats:
            for party in remote:
                send_plan(net, me, party, plan)
        answers = [link.call(p, PLAN, (cfg.to_dict(),), timeout=timeouts.wait) for p in remote]
        for party, answer in zip(remote, answers, strict=True):
            if not isinstance(answer, dict) or not isinstance(answer.get("width"), int):
                raise PeerViolation(party, "its answer to the row plan does not give its width")
        widths = [a["width"] for a in answers]
        sizes = [len(ids) for ids in plan.ids]
        # before any table is allocated for them: a width over the limits is the announcing party's
        widest = max(range(len(remote)), key=lambda i: widths[i] if isinstance(widths[i], int) else 1 << 62)
        bad = next((i for i, w in enumerate(widths) if not 1 <= w <= table_limits(federation).columns), widest)
        _check_layout(federation, remote[bad], widths, sizes, len(plan.classes))
        if (resume or out) is not None:  # what `secvfl serve` needs to answer with class names
            save_run_layout(Path(resume or out), classes=plan.classes, widths=widths)
        received = net.received.stats()  # every PSI message crossed the label party's links: its own counts, sent
        alignment.update(protocol=getattr(align_ids, "protocol", "private set intersection"), **plan.counts,
                         widths=widths, rows_sha256=plan.digest(),  # and received
                         psi_bytes=psi_stats.bytes_total + received.bytes_total,
                         psi_messages=psi_stats.messages_total + received.messages_total,
                         plan_bytes=plan_stats.bytes_total, plan_messages=plan_stats.messages_total,
                         seconds=round(time.perf_counter() - t0, 3))
        log(f"{federation.label_party}: aligned {plan.counts['held_by_all']} rows held by every party "
            f"(train/val/test {'/'.join(map(str, sizes))}); columns per party {widths}")
        layout = {"widths": widths, "sizes": sizes, "n_classes": len(plan.classes)}
        return run_table(cfg.dataset, widths, sizes, len(plan.classes), labels=plan.y, classes=plan.classes), layout

    def build(cfg: TrainConfig) -> Any:
        nonlocal cpu_since
        _check_federation(federation, cfg)
        prepared, layout = align(cfg) if own is not None else (None, None)
        run = build_run(cfg, prepared, local=me)
        check_across_processes(run, federation)
        t0 = time.perf_counter()
        hello = (cfg.to_dict(),) if layout is None else (cfg.to_dict(), layout)
        for party in remote + helpers:  # each builds the same run from the same settings, keeping only its own
            link.call(party, HELLO, hello, timeout=timeouts.wait)
            if party not in started:
                started.append(party)
        log(f"{federation.label_party}: {len(remote + helpers)} parties ready in {time.perf_counter() - t0:.1f} s")
        swapped = swap_remote_handles(run.algorithm, me,
                                      lambda h: RemoteHandle(h.name, type(h), link, run.net))
        if sorted(swapped) != sorted(remote):
            raise SecvflError(f"{cfg.algo}: its handles are {swapped}, the federation's feature parties {remote}")
        transport.waited_seconds = 0.0  # from here on: the run's own waits, not the parties' start-up
        cpu_since = time.process_time()
        transport.stats = FederatedStats(
            lambda: {p: link.call(p, STATS) for p in remote + helpers if p not in departed},
            lambda: run.net.received.stats() if run.net.received_complete else None,
            me if me in run.net.topology.roles else None, departed)
        transport.set_limits(run_limits(federation, run))
        if hasattr(run.algorithm, "depart"):  # any observed set of parties predicts (LASER-VFL and its baselines)
            _test_without_departed(run.algorithm, link, remote, departed, log, timeouts.wait)
        run.net.transport = transport
        run.net.epoch_listeners.append(
            lambda epoch: [link.call(p, START_EPOCH, (epoch,), reply=False) for p in remote + helpers])
        for party in helpers:  # checkpointed by the party itself, like the others (their handles do it for them)
            run.net.remote_states[party] = (lambda p=party: link.call(p, SAVE),
                                            lambda record, p=party: link.call(p, LOAD, (record,)))
        return run

    def extra() -> dict[str, Any]:
        return {**({"alignment": dict(alignment)} if alignment else {}),
                # a party that left during the test evaluation: scored without its block; its message counts after
                # it left (and since its last answer) are not in "comm"
                **({"departed": dict(departed)} if departed else {}),
                "control": transport.control_stats.to_dict(),
                "deployment": {"transport": "grpc+mtls", "federation": federation.name,
                               "parties": {p.name: str(p.address) for p in federation.parties},
                               # the two measurements below cover this launch of the processes only: after a
                               # --resume, not the time before the kill (wall_seconds covers the whole run)
                               "measured_since": "start" if resume is None else "resume",
                               # the coordinator's time blocked on messages and answers (the rest is its own work)
                               "coordinator_wait_seconds": round(transport.waited_seconds, 3),
                               # each process's CPU time (all its threads) from the run's build to the end of
                               # training and evaluation: their sum against the wall time says whether the
                               # federation waited for cores or for messages
                               "cpu_seconds": {me: round(time.process_time() - cpu_since, 3),
                                               **{p: _cpu_seconds(p, link.call(p, CPU)) for p in started
                                                  if p not in departed}},
                               "frame_bytes_sent_and_received": transport.wire_stats.bytes_total}}

    try:
        # once the run has started (its config.toml written), its directory records that it is a deployed run
        mark = (lambda _run: mark_deployed(out, federation, resume_as)) if resume is None and out is not None else None
        return run_training(cfg, out, resume=resume, from_epoch=from_epoch, changes=changes, progress=progress,
                            log=log, build=build, summary_extra=extra, resume_as=resume_as, on_build=mark)
    finally:
        for party in started:
            try:
                link.call(party, STOP, timeout=min(10.0, timeouts.wait))
            except (PartyLost, SecvflError):
                pass  # it is gone already; nothing of it is waited for
        transport.close()


DEPLOYMENT_FILE = "deployment.toml"  # in the label party's run directory: how that run continues


def mark_deployed(run_dir: Path, federation: Federation, resume_as: str | None) -> None:
    """Record in the label party's run directory that its parties run in separate processes, and the command that
    continues the run (``secvfl train --resume`` cannot: the feature parties' states are theirs)."""
    import tomli_w

    from secvfl.io import write_text_atomic

    record = {"federation": str(Path(federation.source).resolve()), "label_party": federation.label_party,
              **({"resume": resume_as} if resume_as else {})}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(run_dir) / DEPLOYMENT_FILE, tomli_w.dumps(record))


def deployed_resume_command(run_dir: Path) -> str | None:
    """The command that continues a deployed label party's run in ``run_dir`` (None: not a deployed run)."""
    import tomllib

    path = Path(run_dir) / DEPLOYMENT_FILE
    if not path.is_file():
        return None
    try:
        record = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        record = {}
    return str(record.get("resume") or f"secvfl party --federation {record.get('federation', 'FILE')} --name "
               f"{record.get('label_party', 'LABEL_PARTY')} --resume {run_dir}")


def _cpu_seconds(party: str, answer: Any) -> float:
    seconds = answer.get("cpu_seconds") if isinstance(answer, dict) and len(answer) == 1 else None
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 1e9:
        raise PeerViolation(party, "its answer to the CPU-time request is not a number of seconds")
    return float(seconds)


def _test_without_departed(algorithm: Any, link: PartyLink, parties: list[str], departed: dict[str, str],
                            log: Callable[[str], None], timeout: float) -> None:
    """The test evaluation of ``algorithm`` goes on without a feature party that leaves during it: its block is
    then missing in every test row (every observed set of the others still predicts). During training and
    validation a lost party stops the run (resume it with --resume once the party is back)."""
    evaluate = algorithm.evaluate

    def evaluate_without_departed(split: str) -> dict[str, float]:
        while True:
            try:
                return evaluate(split)
            except PartyLost as lost:
                if split != "test" or lost.party not in parties or lost.party in departed \
                        or not algorithm.depart(lost.party):
                    raise
                departed[lost.party] = str(lost)
                log(f"{lost.party} left during the test evaluation ({lost}); predicting without its block")
                link.barrier([p for p in parties if p not in departed], timeout=timeout)

    algorithm.evaluate = evaluate_without_departed


def stderr_log(prefix: str) -> Callable[[str], None]:
    def log(text: str) -> None:
        print(f"[{prefix}] {text}" if prefix else text, file=sys.stderr, flush=True)

    return log
