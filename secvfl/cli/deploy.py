"""`secvfl party` (one party's long-lived process) and `secvfl launch` (every party of a federation on this host).

    secvfl certs --federation federation.toml                       # once: a CA and a certificate per party
    secvfl party --federation federation.toml --name shop --out runs/shop        # on each feature party's host
    secvfl party --federation federation.toml --name bank --out runs/bank --algo splitnn --epochs 5   # label party
    secvfl launch --federation federation.toml --out runs/demo --algo splitnn    # or: all of them here, on loopback

The label party's command carries the training settings (the `secvfl train` flags) and proposes them to the feature
parties; a feature party's command takes only where it is and where it keeps its state. An interrupted run
continues with `--resume DIR` on every party (each its own directory); a launched one with `secvfl launch --resume RUN`
(the launch directory records its federation file). `secvfl launch` stops every party as soon as one fails, and that
party's error is the first error line.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from secvfl.cli.train import _given, _resume_changes, add_train_arguments, config_from_args
from secvfl.errors import ConfigError

__all__ = ["register"]

_PARTY_ONLY = {"federation", "name", "out", "resume", "data_dir", "party_timeout", "peer_timeout", "heartbeat",
               "no_progress", "launch_dir"}


def _add_deploy_arguments(p: argparse.ArgumentParser, *, federation_help: str = "the federation file (TOML)",
                          federation_required: bool = True) -> None:
    p.add_argument("--federation", type=Path, required=federation_required, help=federation_help)
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
    p.add_argument("--from-epoch", type=int, default=None, metavar="N",
                   help="label party, with --resume: start from the checkpoint after epoch N (0: the run's beginning)")
    p.add_argument("--launch-dir", type=Path, default=None, help=argparse.SUPPRESS)  # set by `secvfl launch`
    _add_deploy_arguments(p)
    add_train_arguments(p)
    p.set_defaults(func=run_party, _parser=p)

    q = subparsers.add_parser("launch", help="start every party of a federation as a local process (loopback)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("--out", type=Path, help="run directory: one sub-directory per party (default runs/<federation>-"
                   "<time>)")
    q.add_argument("--resume", type=Path, metavar="DIR", help="continue every party from the launch run in DIR")
    q.add_argument("--from-epoch", type=int, default=None, metavar="N",
                   help="with --resume: start from the checkpoint after epoch N (0: the run's beginning)")
    _add_deploy_arguments(q, federation_required=False,
                          federation_help="the federation file (TOML); with --resume, the one the run was launched with")
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
    from secvfl.runlock import lock_run_dir

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
        state_dir = Path(state_dir)
        _check_state_dir(state_dir, resumed=args.resume is not None)
        with lock_run_dir(state_dir, flag="--resume" if args.resume is not None else "--out"):
            serve_party(federation, args.name, state_dir=state_dir,
                        data_dir=args.data_dir if "data_dir" in given else None, timeouts=timeouts,
                        log=stderr_log(""), align_ids=align_ids)
        return 0
    cfg = config_from_args(argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _PARTY_ONLY - {
        "data_dir", "out", "resume", "no_progress"}}))
    out = None if args.resume is not None else args.out
    if out is None and args.resume is None:
        from secvfl.rundir import default_run_dir

        out = default_run_dir(cfg)
    if args.from_epoch is not None and args.resume is None:
        raise ConfigError("--from-epoch applies only with --resume DIR")
    # a resumed run keeps its settings; --epochs (train longer), --threads, --data-dir may change, as for `train`
    changes = _resume_changes(args, "party", frozenset(_PARTY_ONLY)) if args.resume is not None else None
    resume_as = f"secvfl launch --resume {args.launch_dir}" if args.launch_dir is not None else None
    coordinate(federation, cfg, out=out, resume=args.resume, timeouts=timeouts, log=stderr_log(""),
               progress=not args.no_progress, align_ids=align_ids, from_epoch=args.from_epoch,
               resume_as=resume_as, changes=changes)
    return 0


def _check_state_dir(state_dir: Path, *, resumed: bool) -> None:
    """A feature party keeps only its own state files in its directory: refuse one that holds anything else."""
    from secvfl.runlock import LOCK_FILE

    if resumed:
        if not state_dir.is_dir():
            raise ConfigError(f"--resume {state_dir}: no such directory; give the directory this party kept its "
                              "state in (its --out)")
        return
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError(f"--out {state_dir} is an existing file; name a directory (it is created if needed)")
    if state_dir.is_dir():
        others = sorted(p.name for p in state_dir.iterdir()
                        if p.name != LOCK_FILE and not (p.name.startswith("state-") and p.suffix == ".pt"))
        if others:
            raise ConfigError(f"--out {state_dir} holds other files ({', '.join(others[:5])}); a party keeps its state "
                              "in a directory of its own: choose a new or empty one")


class _Child:
    """A party process of a launch: its output is shown as it comes, prefixed with its name, except its error lines,
    which are held until the launch knows whether they are the headline (the first party to fail) or consequences."""

    _print = threading.Lock()

    def __init__(self, name: str, proc: subprocess.Popen, exits: queue.Queue) -> None:
        self.name, self.proc = name, proc
        self.held: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        threading.Thread(target=lambda: exits.put((proc.wait(), self)), daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            text = f"[{self.name}] {line}"
            if line.startswith("secvfl: error:"):
                self.held.append(text)
            else:
                self.show(text)

    @classmethod
    def show(cls, text: str) -> None:
        with cls._print:
            sys.stderr.write(text if text.endswith("\n") else text + "\n")
            sys.stderr.flush()

    def show_held(self) -> None:
        self.reader.join(timeout=5)  # its last lines: the error it exited with
        for text in self.held:
            self.show(text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait_stopped(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


LAUNCH_FILE = "launch.toml"  # in a launch's directory: the federation it was launched with


def _launch_federation(args: argparse.Namespace) -> Path:
    """--federation, or for --resume the file the launch in that directory was started with."""
    if args.federation is not None:
        return args.federation
    if args.resume is None:
        raise ConfigError("secvfl launch needs --federation FILE (the federation to start)")
    import tomllib

    path = args.resume / LAUNCH_FILE
    try:
        return Path(tomllib.loads(path.read_text())["federation"])
    except FileNotFoundError:
        raise ConfigError(f"--resume {args.resume}: not a launch directory (no {LAUNCH_FILE}); give the directory "
                          "that `secvfl launch --out` wrote, or name the federation with --federation") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError):
        raise ConfigError(f"{path} is damaged; name the federation with --federation FILE") from None


def _check_launch_dir(base: Path, federation, resumed: bool) -> None:  # noqa: ANN001
    """A launch's directory holds one directory per party and the launch's own file, nothing else."""
    from secvfl.runlock import LOCK_FILE

    if resumed:
        if not base.is_dir():
            raise ConfigError(f"--resume {base}: no such directory; give the directory `secvfl launch --out` wrote")
        return
    if base.exists() and not base.is_dir():
        raise ConfigError(f"--out {base} is an existing file; name a directory (it is created if needed)")
    if base.is_dir():
        allowed = {LOCK_FILE, LAUNCH_FILE, *(p.name for p in federation.parties)}
        others = sorted(p.name for p in base.iterdir() if p.name not in allowed)
        if others:
            raise ConfigError(f"--out {base} holds other files ({', '.join(others[:5])}); a launch writes one directory "
                              "per party into a directory of its own: choose a new or empty one")


def run_launch(args: argparse.Namespace) -> int:
    from secvfl.federation import load_federation
    from secvfl.runlock import lock_run_dir

    _one_run_dir(args)
    federation_file = _launch_federation(args)
    federation = load_federation(federation_file)
    for p in federation.parties:
        if p.address.ip is None or not p.address.ip.is_loopback:
            raise ConfigError(f"secvfl launch starts every party on this host, but {p.name} is at {p.address}; "
                              "use 127.0.0.1 addresses (or start each party with `secvfl party` on its host)")
    _timeouts(args)
    if args.from_epoch is not None and args.resume is None:
        raise ConfigError("--from-epoch applies only with --resume DIR")
    argv = args._argv
    rest = argv[argv.index("launch") + 1:]
    base = args.resume or args.out or Path("runs") / f"{federation.name.replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
    base = Path(base)
    _check_launch_dir(base, federation, resumed=args.resume is not None)
    resume = f"secvfl launch --resume {base}"
    label_dir = base / federation.label_party
    with lock_run_dir(base, resume, flag="--resume" if args.resume is not None else "--out", started=label_dir):
        if args.resume is None:
            import tomli_w

            from secvfl.io import write_text_atomic

            write_text_atomic(base / LAUNCH_FILE, tomli_w.dumps({"federation": str(federation_file.resolve())}))
        train_flags = [*_strip(rest, {"--out", "--resume", "--federation"}, {"--no-progress"}),
                       "--federation", str(federation_file), "--launch-dir", str(base)]
        party_flags = [*_keep(rest, {"--party-timeout", "--peer-timeout", "--heartbeat", "--data-dir"}),
                       "--federation", str(federation_file)]
        where = "--resume" if args.resume is not None else "--out"
        children: list[_Child] = []
        exits: queue.Queue = queue.Queue()

        def stop(signum: int, _frame) -> None:  # noqa: ANN001 - a signal handler
            raise KeyboardInterrupt  # so that the finally below stops every party it started

        signal.signal(signal.SIGTERM, stop)
        try:
            for p in federation.parties:
                flags = train_flags if p.name == federation.label_party else party_flags
                cmd = [sys.executable, "-m", "secvfl.cli.main", "party", "--name", p.name, where, str(base / p.name),
                       "--no-progress", *flags]
                env = {**os.environ, "PYTHONUNBUFFERED": "1"}
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                        start_new_session=True)
                children.append(_Child(p.name, proc, exits))
            label = next(c for c in children if c.name == federation.label_party)
            code = _watch(children, label, exits, args.party_timeout)
        finally:
            for child in children:
                child.stop()
            for child in children:
                child.wait_stopped()
        if code == 0:
            print(f"secvfl launch: every party finished; results in {label_dir}", file=sys.stderr)
        elif (label_dir / "config.toml").is_file():
            print(f"secvfl launch: once the cause is fixed, `{resume}` continues the run from its last checkpoint",
                  file=sys.stderr)
        return code


def _killed(code: int) -> bool:
    """A process that ended by a signal (or as killed: 137), not by reporting an error of its own."""
    return code < 0 or code == 137


def _watch(children: list[_Child], label: _Child, exits: queue.Queue, timeout: float) -> int:
    """Follow the party processes until the run is over; returns the launch's exit code.

    The first party that exits with an error of its own (a bad file, a refused setting, a crash) ends the launch at
    once: the others are stopped and its error is the headline. A party that was killed is the label party's to
    judge: it stops the run naming it within --peer-timeout, or goes on without it (LASER-VFL's test evaluation).
    Once the label party has finished, the others get ``timeout`` to stop."""
    departed: list[tuple[str, int]] = []
    while True:
        try:
            code, child = exits.get(timeout=0.5)
        except queue.Empty:
            continue
        if child is label or (code != 0 and not _killed(code)):
            break
        if code != 0:
            departed.append((child.name, code))
    if child is not label or code != 0:  # the run failed: its first error is the headline, the rest consequences
        for other in children:
            if other is not child:
                other.stop()
        child.show_held()
        how = f"was killed (signal {-code})" if code < 0 else f"exited with code {code}"
        _Child.show(f"secvfl launch: party {child.name} {how}; every other party was stopped")
        return code if code > 0 else 1
    label.show_held()
    deadline = time.monotonic() + timeout
    for other in children:
        while other.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        other.show_held()
        if other.proc.poll() not in (None, 0) and (other.name, other.proc.returncode) not in departed:
            departed.append((other.name, other.proc.returncode))
    for name, code in departed:  # it left during the test evaluation: the label party finished without it
        _Child.show(f"secvfl launch: party {name} exited with code {code}; the label party finished the run without "
                    "it (summary.json: departed)")
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
