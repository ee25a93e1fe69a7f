"""`secvfl party` (one party's long-lived process) and `secvfl launch` (every party of a federation on this host).

    secvfl certs --federation federation.toml                       # once: a CA and a certificate per party
    secvfl party --federation federation.toml --name shop --out runs/shop        # on each feature party's host
    secvfl party --federation federation.toml --name bank --out runs/bank --algo splitnn --epochs 5   # label party
    secvfl launch --federation federation.toml --out runs/demo --algo splitnn    # or: all of them here, on loopback

The label party's command carries the training settings (the `secvfl train` flags) and proposes them to the feature
parties; a feature party's command takes only where it is and where it keeps its state. An interrupted run
continues with `--resume DIR` on every party (each its own directory).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from secvfl.cli.train import _given, add_train_arguments, config_from_args
from secvfl.errors import ConfigError

__all__ = ["register"]

_PARTY_ONLY = {"federation", "name", "out", "resume", "data_dir", "party_timeout", "peer_timeout", "heartbeat",
               "no_progress"}


def _add_deploy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--federation", type=Path, required=True, help="the federation file (TOML)")
    p.add_argument("--party-timeout", type=float, default=300.0, metavar="S",
                   help="longest wait for a message or a connection before the party stops (default 300 s)")
    p.add_argument("--peer-timeout", type=float, default=15.0, metavar="S",
                   help="a peer silent this long (no message, no heartbeat) is declared gone (default 15 s)")
    p.add_argument("--heartbeat", type=float, default=1.0, metavar="S",
                   help="interval of the heartbeats every party sends on each open link (default 1 s)")
    p.add_argument("--no-progress", action="store_true", help="a line per epoch instead of a progress bar")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("party", help="run one party of a federation (a long-lived process)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="this party's name in the federation file")
    p.add_argument("--out", type=Path, help="this party's run directory (label party: the run's results; feature "
                   "party: its state files)")
    p.add_argument("--resume", type=Path, metavar="DIR", help="continue from the checkpoint in DIR (every party)")
    _add_deploy_arguments(p)
    add_train_arguments(p)
    p.set_defaults(func=run_party, _parser=p)

    q = subparsers.add_parser("launch", help="start every party of a federation as a local process (loopback)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("--out", type=Path, help="run directory: one sub-directory per party (default runs/<federation>-"
                   "<time>)")
    q.add_argument("--resume", type=Path, metavar="DIR", help="continue every party from the launch run in DIR")
    _add_deploy_arguments(q)
    add_train_arguments(q)
    q.set_defaults(func=run_launch, _parser=q)


def _one_run_dir(args: argparse.Namespace) -> None:
    if args.out is not None and args.resume is not None:
        raise ConfigError("--out and --resume exclude each other: a resumed run continues in its own directory")


def _timeouts(args: argparse.Namespace):  # noqa: ANN202
    from secvfl.deploy.party import Timeouts

    return Timeouts(wait=args.party_timeout, peer=args.peer_timeout, heartbeat=args.heartbeat)


def run_party(args: argparse.Namespace) -> int:
    from functools import partial

    from protocols.psi import PROTOCOL, align_rows_with_peers
    from secvfl.deploy.party import coordinate, serve_party, stderr_log
    from secvfl.federation import load_federation

    federation = load_federation(args.federation)
    federation.party(args.name)  # an unknown name: one line, with the declared ones
    align_ids = partial(align_rows_with_peers, progress=stderr_log(""))  # progress of the alignment on stderr
    align_ids.protocol = PROTOCOL
    timeouts = _timeouts(args)
    argv = args._argv
    given = _given(args._parser, argv[argv.index("party") + 1:])
    _one_run_dir(args)
    if args.name != federation.label_party:
        extra = sorted(given - _PARTY_ONLY)
        if extra:
            flags = {a.dest: a.option_strings[0] for a in args._parser._actions if a.option_strings}
            raise ConfigError(f"{', '.join(flags.get(d, d) for d in extra)}: the label party "
                              f"({federation.label_party}) sets the training; a feature party takes only --federation,"
                              " --name, --out or --resume, --data-dir and the timeouts")
        state_dir = args.resume or args.out
        if state_dir is None:
            raise ConfigError(f"party {args.name} needs --out DIR (where it keeps its state) or --resume DIR")
        serve_party(federation, args.name, state_dir=Path(state_dir),
                    data_dir=args.data_dir if "data_dir" in given else None, timeouts=timeouts,
                    log=stderr_log(""), align_ids=align_ids)
        return 0
    cfg = config_from_args(argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _PARTY_ONLY - {
        "data_dir", "out", "resume", "no_progress"}}))
    out = None if args.resume is not None else args.out
    if out is None and args.resume is None:
        from secvfl.rundir import default_run_dir

        out = default_run_dir(cfg)
    coordinate(federation, cfg, out=out, resume=args.resume, timeouts=timeouts, log=stderr_log(""),
               progress=not args.no_progress, align_ids=align_ids)
    return 0


def _pump(stream, prefix: str) -> None:  # noqa: ANN001
    for line in iter(stream.readline, ""):
        sys.stderr.write(f"[{prefix}] {line}")
        sys.stderr.flush()


def run_launch(args: argparse.Namespace) -> int:
    from secvfl.federation import load_federation

    federation = load_federation(args.federation)
    for p in federation.parties:
        if p.address.ip is None or not p.address.ip.is_loopback:
            raise ConfigError(f"secvfl launch starts every party on this host, but {p.name} is at {p.address}; "
                              "use 127.0.0.1 addresses (or start each party with `secvfl party` on its host)")
    _timeouts(args)
    argv = args._argv
    rest = argv[argv.index("launch") + 1:]
    _one_run_dir(args)
    base = args.resume or args.out or Path("runs") / f"{federation.name.replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
    train_flags = _strip(rest, {"--out", "--resume"}, {"--no-progress"})
    party_flags = _keep(rest, {"--federation", "--party-timeout", "--peer-timeout", "--heartbeat", "--data-dir"})
    procs: list[tuple[str, subprocess.Popen]] = []
    where = "--resume" if args.resume is not None else "--out"

    def stop(signum: int, _frame) -> None:  # noqa: ANN001 - a signal handler
        raise KeyboardInterrupt  # so that the finally below stops every party it started

    signal.signal(signal.SIGTERM, stop)
    try:
        for p in federation.parties:
            flags = train_flags if p.name == federation.label_party else party_flags
            cmd = [sys.executable, "-m", "secvfl.cli.main", "party", "--name", p.name, where, str(Path(base) / p.name),
                   "--no-progress", *flags]
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    start_new_session=True)
            threading.Thread(target=_pump, args=(proc.stdout, p.name), daemon=True).start()
            procs.append((p.name, proc))
        label = dict(procs)[federation.label_party]
        code = _wait_all(procs, label, args.party_timeout)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    if code == 0:
        print(f"secvfl launch: every party finished; results in {Path(base) / federation.label_party}",
              file=sys.stderr)
    return code


def _wait_all(procs: list[tuple[str, subprocess.Popen]], label: subprocess.Popen, timeout: float) -> int:
    """Wait for the label party; then give the others ``timeout`` to stop. The first failure decides the code."""
    failed: tuple[str, int] | None = None
    while label.poll() is None:
        for name, proc in procs:
            code = proc.poll()
            if code not in (None, 0) and failed is None:
                failed = (name, code)
        time.sleep(0.2)
    if label.returncode != 0:  # the run is over: the others are told nothing more, so stop them soon
        timeout = min(timeout, 10.0)
    deadline = time.monotonic() + timeout
    for name, proc in procs:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        code = proc.poll()
        if code not in (None, 0) and failed is None:
            failed = (name, code)
    if failed is not None and label.returncode == 0:  # the run finished without it (it left during the test)
        print(f"secvfl launch: party {failed[0]} exited with code {failed[1]}; the label party finished the run "
              "without it (summary.json: departed)", file=sys.stderr)
    elif failed is not None:
        print(f"secvfl launch: party {failed[0]} exited with code {failed[1]}", file=sys.stderr)
        return failed[1] if failed[1] > 0 else 1
    return 0


def _strip(argv: list[str], with_value: set[str], alone: set[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        flag = a.split("=", 1)[0]
        if flag in with_value:
            skip = "=" not in a
            continue
        if flag in alone:
            continue
        out.append(a)
    return out


def _keep(argv: list[str], flags: set[str]) -> list[str]:
    out, take = [], False
    for a in argv:
        if take:
            out.append(a)
            take = False
            continue
        flag = a.split("=", 1)[0]
        if flag in flags:
            out.append(a)
            take = "=" not in a
    return out
