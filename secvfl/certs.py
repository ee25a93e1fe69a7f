"""A federation's certificates (``secvfl certs``): a CA, and per party one certificate for mutual TLS signed by it.

Every key is ECDSA on P-256: every TLS 1.2/1.3 stack accepts it (gRPC's BoringSSL and Python's OpenSSL among
them, where Ed25519 certificates are not universally accepted), it gives 128-bit security with small keys and
signatures (short handshakes, instant key generation, unlike RSA-3072), and it is the curve secvfl's PSI already
uses. What the certificates protect and what they do not: :mod:`secvfl.federation`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from secvfl.errors import ConfigError
from secvfl.federation import PARTY_EKUS, Federation, PartySpec
from secvfl.io import write_bytes_atomic

__all__ = ["PemFile", "issue_certificates", "write_certificates", "MAX_DAYS"]

MAX_DAYS = 3650
# Certificates start a little in the past so that a peer whose clock is slightly behind accepts them at once.
_CLOCK_SKEW = timedelta(minutes=5)


@dataclass(frozen=True)
class PemFile:
    """One file to write; ``private`` files (keys) get mode 0600, certificates 0644."""

    path: Path
    data: bytes
    private: bool
    what: str

    @property
    def mode(self) -> int:
        return 0o600 if self.private else 0o644


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    # Unencrypted: a party process reads its key unattended at start; the file mode is its protection.
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _make_ca(federation: Federation, key: ec.EllipticCurvePrivateKey, start: datetime,
             end: datetime) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{federation.name} CA"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "secvfl federation")])
    public = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(public)
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        # path_length 0: the CA signs party certificates only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )


def _make_party_cert(party: PartySpec, key: ec.EllipticCurvePrivateKey, ca: x509.Certificate,
                     ca_key: ec.EllipticCurvePrivateKey, start: datetime, end: datetime) -> x509.Certificate:
    names: list[x509.GeneralName] = [x509.DNSName(party.name)]  # what a peer checks: the federation's name for it
    ip = party.address.ip
    if ip is not None:  # also valid for its address, so a plain TLS client dialling host:port accepts it too
        names.append(x509.IPAddress(ipaddress.ip_address(party.address.host)))
    elif party.address.host != party.name:
        names.append(x509.DNSName(party.address.host))
    public = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, party.name)]))
        .issuer_name(ca.subject).public_key(public)
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(PARTY_EKUS)), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def issue_certificates(federation: Federation, *, days: int = 365, out: Path | None = None,
                       now: datetime | None = None) -> list[PemFile]:
    """A fresh CA and one certificate and key per party, valid for ``days`` from ``now`` (default: the current
    time), as the files to write: to the paths the federation file names, or with ``out`` to ``out/ca.pem``,
    ``out/ca.key``, ``out/<party>.pem`` and ``out/<party>.key``. Nothing is written here."""
    if not 1 <= days <= MAX_DAYS:
        raise ConfigError(f"--days must be from 1 to {MAX_DAYS} (a certificate's validity in days), got {days}")
    start = (now or datetime.now(UTC)) - _CLOCK_SKEW
    end = start + _CLOCK_SKEW + timedelta(days=days)
    ca_key = _new_key()
    ca = _make_ca(federation, ca_key, start, end)

    def where(declared: Path, name: str) -> Path:
        return declared if out is None else Path(out) / name

    files = [
        PemFile(where(federation.ca, "ca.pem"), ca.public_bytes(serialization.Encoding.PEM), False,
                "CA certificate (give it to every party)"),
        PemFile(where(federation.ca_key, "ca.key"), _key_pem(ca_key), True,
                "CA private key (needed only to issue certificates: move it offline)"),
    ]
    for party in federation.parties:
        key = _new_key()
        cert = _make_party_cert(party, key, ca, ca_key, start, end)
        files += [
            PemFile(where(party.cert, f"{party.name}.pem"), cert.public_bytes(serialization.Encoding.PEM), False,
                    f"certificate of party {party.name!r}"),
            PemFile(where(party.key, f"{party.name}.key"), _key_pem(key), True,
                    f"private key of party {party.name!r} (give it to that party only)"),
        ]
    return files


def write_certificates(files: list[PemFile], *, force: bool = False) -> None:
    """Write every file atomically with its mode; refuses (before writing any) to replace an existing one unless
    ``force``, so a CA and its party certificates are never mixed with another CA's."""
    for f in files:
        if f.path.is_dir():
            raise ConfigError(f"{f.path} is a directory; it cannot hold the {f.what.split(' (')[0]}")
        if f.path.exists() and not force:
            raise ConfigError(f"{f.path} already exists; pass --force to replace it and every other certificate "
                              "and key of this federation (peers must then get the new ones)")
    for f in files:
        try:
            write_bytes_atomic(f.path, f.data, mode=f.mode)
        except OSError as exc:
            raise ConfigError(f"cannot write {f.path}: {exc.strerror or exc}; choose a writable --out") from None
