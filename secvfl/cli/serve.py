"""`secvfl serve` (one party's serving process) and `secvfl demo-federation` (a federation of files on this host).

    secvfl serve --federation federation.toml --name shop --run runs/demo/shop             # each feature party
    secvfl serve --federation federation.toml --name bank --run runs/demo/bank \\
        --http 127.0.0.1:8443                                                              # the label party
    curl --cacert certs/ca.pem --cert certs/clients/app.pem --key certs/clients/app.key \\
        https://127.0.0.1:8443/v2/models/<federation>/infer \\
        -d '{"inputs": [{"name": "entity_id", "datatype": "BYTES", "shape": [1], "data": ["c00042"]}]}'

Each party serves the run it trained (``--run``: the directory `secvfl party --out` or `secvfl launch --out RUN`
(RUN/<party>) wrote for it) from its own table (``--table``, default its training file). The label party's process
answers client applications over HTTPS (the Open Inference Protocol's REST shape; client certificates from
``secvfl certs --clients``) and coordinates the feature parties over the federation's mutual-TLS links.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from secvfl.cli.helptext import show_defaults
from secvfl.errors import ConfigError

__all__ = ["register"]


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--http takes HOST:PORT (e.g. 127.0.0.1:8443), got {text!r}")
    return host, int(port)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a trained federation: one party's serving process",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--federation", type=Path, required=True, help="the federation file (TOML)")
    p.add_argument("--name", required=True, help="this party's name in the federation file")
    p.add_argument("--run", type=Path, required=True, metavar="DIR",
                   help="this party's directory of the trained run (secvfl party --out, or RUN/<party> of launch)")
    p.add_argument("--table", type=Path, default=None, metavar="FILE",
                   help="feature party: the table to score (CSV or Parquet), with the training file's id and columns "
                        "(default: the party's file in the federation file); prepared as the training rows were: a "
                        "category training never saw counts as a missing cell, and under --nan-policy error an id "
                        "whose row has a missing cell gets an error instead of a score")
    h = p.add_argument_group("the label party's endpoint")
    h.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="where the label party answers clients over HTTPS (required for the label party)")
    h.add_argument("--client-ca", type=Path, default=None, metavar="FILE",
                   help="CA of the client certificates (default: clients/ca.pem beside the federation's CA; "
                        "`secvfl certs --clients NAME` makes it)")
    h.add_argument("--http-cert", type=Path, default=None, help="server certificate (default: the party's own)")
    h.add_argument("--http-key", type=Path, default=None, help="its key (default: the party's own)")
    h.add_argument("--model-name", default=None, help="the model's name in URLs (default: the federation's name)")
    h.add_argument("--max-ids", type=int, default=1024, help="most entity ids in one request (more: 413)")
    h.add_argument("--max-batch-ids", type=int, default=4096, help="most ids scored in one batch")
    h.add_argument("--batch-wait-ms", type=float, default=2.0,
                   help="longest wait for more requests to fill a batch once one is waiting")
    h.add_argument("--max-queue", type=int, default=256, help="most requests waiting to be scored (more: 429)")
    h.add_argument("--deadline-ms", type=float, default=1000.0,
                   help="how long the label party waits for the parties' answers to a request (a client may ask for "
                        "less with parameters.deadline_ms); LASER-VFL leaves out a party that does not answer in time")
    h.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (more: 413)")
    d = p.add_argument_group("links between the parties")
    d.add_argument("--party-timeout", type=float, default=300.0, metavar="S",
                   help="longest wait for a party to connect and load its model (default 300 s)")
    d.add_argument("--peer-timeout", type=float, default=15.0, metavar="S",
                   help="a peer silent this long (no message, no heartbeat) is declared gone (default 15 s)")
    d.add_argument("--heartbeat", type=float, default=1.0, metavar="S", help="heartbeat interval on each link")
    show_defaults(p)
    p.set_defaults(func=run_serve)

    q = subparsers.add_parser("demo-federation",
                              help="write a federation on this host whose parties read their own files (for trying "
                                   "secvfl launch and secvfl serve)",
                              description="Write DIR/federation.toml (a label party and feature parties on free "
                                          "loopback ports), each party's own CSV file made from a dataset "
                                          "scikit-learn bundles (each feature party lacks a few ids), the parties' "
                                          "certificates and a client certificate (DIR/certs/clients/).")
    q.add_argument("--out", type=Path, required=True, metavar="DIR", help="a new folder")
    q.add_argument("--dataset", default="breast_cancer", choices=["breast_cancer", "digits", "wine"])
    q.add_argument("--parties", type=int, default=2, help="feature parties")
    q.add_argument("--aggregator", action="store_true", help="add a CKKS aggregator party (for --he ckks)")
    q.add_argument("--client", default="app", help="name of the client application's certificate")
    show_defaults(q)
    q.set_defaults(func=run_demo)


def _limits(args: argparse.Namespace):  # noqa: ANN202
    from secvfl.serve.coordinator import ServeLimits

    limits = ServeLimits(max_ids_per_request=args.max_ids, max_batch_ids=args.max_batch_ids,
                         batch_wait_ms=args.batch_wait_ms, max_queued_requests=args.max_queue,
                         deadline_ms=args.deadline_ms, max_body_bytes=args.max_body_bytes)
    limits.check()
    if not 1024 <= args.max_body_bytes <= 1 << 30:
        raise ConfigError(f"--max-body-bytes must be from 1024 to {1 << 30}, got {args.max_body_bytes}")
    return limits


def _stop_on_sigterm() -> None:
    def stop(signum: int, _frame) -> None:  # noqa: ANN001 - a signal handler
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def run_serve(args: argparse.Namespace) -> int:
    from secvfl.deploy.party import Timeouts, stderr_log
    from secvfl.federation import load_federation

    federation = load_federation(args.federation)
    federation.party(args.name)  # an unknown name: one line, with the declared ones
    timeouts = Timeouts(wait=args.party_timeout, peer=args.peer_timeout, heartbeat=args.heartbeat)
    if not args.run.is_dir():
        raise ConfigError(f"--run {args.run} is not a directory; pass this party's directory of the trained run")
    log = stderr_log("")
    if args.name != federation.label_party:
        given = [flag for flag, value in (("--http", args.http), ("--client-ca", args.client_ca),
                                          ("--model-name", args.model_name)) if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: only the label party ({federation.label_party}) answers clients")
        from secvfl.serve.party import serve_feature_party

        _stop_on_sigterm()
        try:
            serve_feature_party(federation, args.name, run_dir=args.run, table=args.table, timeouts=timeouts, log=log)
        except KeyboardInterrupt:
            log(f"{args.name}: stopped")
        return 0
    if args.table is not None:
        raise ConfigError("--table: the label party scores no table of its own (the feature parties read theirs)")
    if args.http is None:
        raise ConfigError("the label party answers clients: give --http HOST:PORT (e.g. 127.0.0.1:8443)")
    host, port = _address(args.http)
    limits = _limits(args)
    return _serve_label(federation, args, host, port, limits, timeouts, log)


def _serve_label(federation, args, host, port, limits, timeouts, log) -> int:  # noqa: ANN001
    from secvfl.serve.audit import AuditLog
    from secvfl.serve.batching import Batcher
    from secvfl.serve.clientcerts import default_client_dir
    from secvfl.serve.coordinator import Coordinator
    from secvfl.serve.http import make_app, make_server

    spec = federation.party(args.name)
    client_ca = args.client_ca or default_client_dir(federation.ca) / "ca.pem"
    if not Path(client_ca).is_file():
        raise ConfigError(f"no client CA at {client_ca}: make one with `secvfl certs --federation "
                          f"{args.federation} --clients app` (or pass --client-ca FILE)")
    cert, key = args.http_cert or spec.cert, args.http_key or spec.key
    for what, path in (("--http-cert", cert), ("--http-key", key)):
        if not Path(path).is_file():
            raise ConfigError(f"{what} {path} does not exist; make the certificates with `secvfl certs`")
    coordinator = Coordinator(federation, args.run, timeouts=timeouts, limits=limits, log=log)
    audit = AuditLog(args.run, args.name)
    batcher = Batcher(coordinator.score, max_batch_ids=limits.max_batch_ids, batch_wait_ms=limits.batch_wait_ms,
                      max_queued_requests=limits.max_queued_requests, log=log)
    failure: list[str] = []
    model_name = args.model_name or federation.name
    server = make_server(lambda client_of: make_app(coordinator, batcher, model_name=model_name, limits=limits,
                                                    audit=audit, client_of=client_of,
                                                    startup_error=lambda: failure[0] if failure else ""),
                         host=host, port=port, cert=Path(cert), key=Path(key), client_ca=Path(client_ca),
                         limits=limits)

    def connect() -> None:
        try:
            coordinator.connect()
            log(f"{args.name}: model {model_name!r} at https://{args.http}/v2/models/{model_name}/infer")
        except Exception as exc:  # noqa: BLE001 - reported, and the server stops with it
            failure.append(str(exc) if str(exc) else type(exc).__name__)
            log(f"{args.name}: serving cannot start: {failure[0]}")
            server.should_exit = True

    starter = threading.Thread(target=connect, name="secvfl-serve-connect", daemon=True)
    starter.start()
    try:
        server.run()
    finally:
        batcher.close()
        starter.join(timeout=5)
        coordinator.close()
        audit.close()
    if failure:
        raise ConfigError(f"serving did not start: {failure[0]}")
    if not server.started:
        raise ConfigError(f"cannot listen on {args.http} (in use?); free the port or choose another --http")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from secvfl.serve.demo import write_demo_federation

    path = write_demo_federation(args.out, dataset=args.dataset, parties=args.parties, aggregator=args.aggregator,
                                 clients=(args.client,))
    print(f"wrote {path}, each party's CSV file beside it, certs/ (parties) and certs/clients/ ({args.client})")
    return 0
