"""``secvfl certs``: a CA and one mutual-TLS certificate per party of a federation file.

Example::

    secvfl certs --federation federation.toml                  # to the paths the federation file names
    secvfl certs --federation federation.toml --out certs/ --days 90

With ``--out DIR`` the files are ``DIR/ca.pem``, ``DIR/ca.key``, ``DIR/<party>.pem`` and ``DIR/<party>.key``; a note
names every one the federation file expects elsewhere. Keys are written with mode 0600; existing files are
replaced only with ``--force``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from secvfl.certs import MAX_DAYS, issue_certificates, write_certificates
from secvfl.cli.helptext import show_defaults
from secvfl.cli.paths import check_output_file
from secvfl.errors import ConfigError
from secvfl.federation import load_federation

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "certs",
        help="create a federation's CA and one mutual-TLS certificate per party",
        description="Create a CA (ECDSA P-256) and, for every party of the federation file, a certificate signed "
        "by it for mutual TLS: the party name as CN and DNS name, its address as a further name, usable as TLS "
        "server and client. Private keys are written with mode 0600. Whoever holds the CA key can impersonate "
        "any party: move ca.key offline after this.",
    )
    p.add_argument("--federation", type=Path, required=True, metavar="FILE", help="the federation file (TOML)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write ca.pem, ca.key, <party>.pem, <party>.key into this folder (default: the paths the "
                        "federation file names)")
    p.add_argument("--days", type=int, default=365, help=f"validity of the certificates in days (1 to {MAX_DAYS})")
    p.add_argument("--force", action="store_true", help="replace existing certificate and key files")
    p.add_argument("--clients", nargs="+", default=None, metavar="NAME",
                   help="instead: certificates for client applications of `secvfl serve`, signed by a client CA of "
                        "their own (clients/ca.pem beside the federation's CA, made if missing; with --out: "
                        "DIR/clients/)")
    show_defaults(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.days <= MAX_DAYS:  # before the federation file, like every flag check
        raise ConfigError(f"--days must be from 1 to {MAX_DAYS} (a certificate's validity in days), got {args.days}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a file; name a folder for the certificates")
    federation = load_federation(args.federation)
    if args.clients is not None:
        return _clients(args, federation)
    files = issue_certificates(federation, days=args.days, out=args.out)
    for f in files:
        check_output_file(f.path, "--out" if args.out is not None else "certificate file")
    write_certificates(files, force=args.force)
    for f in files:
        print(f"wrote {f.path} (mode {f.mode:04o}): {f.what}")
    if args.out is not None:
        declared = [federation.ca, federation.ca_key, *(p for party in federation.parties
                                                        for p in (party.cert, party.key))]
        elsewhere = [(f.path, expected) for f, expected in zip(files, declared, strict=True)
                     if f.path.resolve() != expected.resolve()]
        if elsewhere:
            written, expected = elsewhere[0]
            print(f"note: {federation.source} names other paths for {len(elsewhere)} of these files (e.g. {expected} "
                  f"for {written}); move them there or edit its ca/cert/key entries")
    print(f"{len(federation.parties)} party certificates for federation {federation.name!r}, valid {args.days} "
          "days; each party needs ca.pem, its own .pem and its own .key (and nothing else)")
    return 0


def _clients(args: argparse.Namespace, federation) -> int:  # noqa: ANN001
    from secvfl.serve.clientcerts import (
        default_client_dir,
        issue_client_certificates,
        write_client_certificates,
    )

    folder = Path(args.out) / "clients" if args.out is not None else default_client_dir(federation.ca)
    files = issue_client_certificates(folder, list(args.clients), days=args.days, federation=federation.name)
    for f in files:
        check_output_file(f.path, "--out" if args.out is not None else "certificate file")
    write_client_certificates(files, force=args.force)
    for f in files:
        print(f"wrote {f.path} (mode {f.mode:04o}): {f.what}")
    print(f"{len(args.clients)} client certificate(s); the label party's `secvfl serve` accepts them with "
          f"--client-ca {folder / 'ca.pem'} (its default)")
    return 0
