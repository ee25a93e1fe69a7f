"""Certificates of the client applications that query a served federation (``secvfl certs --clients NAME ...``).

Clients get their own CA, apart from the federation's: a party certificate cannot query the endpoint, and a client
certificate cannot join the federation. The label party's ``secvfl serve`` accepts exactly the certificates this CA
signed (``--client-ca``, default ``<folder of the federation's CA>/clients/ca.pem``). Keys are ECDSA P-256 like the
federation's (secvfl.certs); client certificates carry only the clientAuth extended key usage, and the CA signs
client certificates only (path length 0).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from secvfl.certs import MAX_DAYS, PemFile, write_certificates
from secvfl.errors import ConfigError

__all__ = ["issue_client_certificates", "default_client_dir"]

_CLOCK_SKEW = timedelta(minutes=5)


def default_client_dir(federation_ca: Path) -> Path:
    return Path(federation_ca).parent / "clients"


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    cert, key = folder / "ca.pem", folder / "ca.key"
    if not cert.exists() and not key.exists():
        return None
    try:
        ca = x509.load_pem_x509_certificate(cert.read_bytes())
        ca_key = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read the client CA in {folder} (ca.pem and ca.key): {exc}; remove both to start a "
                          "new client CA (every client then needs a new certificate)") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{folder / 'ca.key'} is not an ECDSA key")
    return ca, ca_key


def issue_client_certificates(folder: Path, names: list[str], *, days: int = 365, federation: str = "secvfl",
                              now: datetime | None = None) -> list[PemFile]:
    """Client certificates for ``names`` in ``folder`` (``<name>.pem``, ``<name>.key``), signed by the client CA
    there, which is created (``ca.pem``, ``ca.key``) if the folder has none. Returns the files to write."""
    if not 1 <= days <= MAX_DAYS:
        raise ConfigError(f"--days must be from 1 to {MAX_DAYS} (a certificate's validity in days), got {days}")
    bad = [n for n in names if not n or not n.replace("-", "").replace("_", "").replace(".", "").isalnum()]
    if bad or not names:
        raise ConfigError(f"--clients takes names of letters, digits, '-', '_' and '.', got {names}")
    folder = Path(folder)
    start = (now or datetime.now(UTC)) - _CLOCK_SKEW
    end = start + _CLOCK_SKEW + timedelta(days=days)
    files: list[PemFile] = []
    found = _load_ca(folder)
    if found is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{federation} serving clients CA"),
                             x509.NameAttribute(NameOID.ORGANIZATION_NAME, "secvfl serving")])
        ca = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(ca_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(start)
              .not_valid_after(start + _CLOCK_SKEW + timedelta(days=MAX_DAYS))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                           crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
        files += [PemFile(folder / "ca.pem", ca.public_bytes(serialization.Encoding.PEM), False,
                          "client CA certificate (give it to the label party: secvfl serve --client-ca)"),
                  PemFile(folder / "ca.key", _key_pem(ca_key), True,
                          "client CA private key (needed only to issue client certificates: keep it offline)")]
    else:
        ca, ca_key = found
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                             crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        files += [PemFile(folder / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), False,
                          f"certificate of client {name!r}"),
                  PemFile(folder / f"{name}.key", _key_pem(key), True, f"private key of client {name!r}")]
    return files


def write_client_certificates(files: list[PemFile], *, force: bool = False) -> None:
    write_certificates(files, force=force)
