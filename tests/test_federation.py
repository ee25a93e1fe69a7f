"""The federation file (secvfl/federation.py) and ``secvfl certs`` (secvfl/certs.py).

Certificates are checked with raw ``cryptography`` calls (signature by the CA key, extensions, key files), with
cryptography's own WebPKI verifier and with real TLS handshakes through Python's ``ssl`` (OpenSSL, in memory: no
sockets), never only with the helper under test.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import ssl
import stat
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store
from hypothesis import given, settings
from hypothesis import strategies as st

from secvfl.certs import issue_certificates, write_certificates
from secvfl.cli.main import main
from secvfl.errors import ConfigError, ProtocolError
from secvfl.federation import Address, Federation, load_federation, parse_address, verify_peer_certificate
from secvfl.io import write_bytes_atomic

GOOD = """\
[federation]
name = "credit-demo"
label_party = "bank"

[parties.bank]
address = "127.0.0.1:50051"
data = { file = "bank.csv", label = "default", id = "customer_id" }

[parties.shop]
address = "[::1]:50052"
cert = "keys/shop-cert.pem"
key = "/abs/shop.key"
data = { file = "data/shop.csv.gz", columns = ["spend", "visits"], id = "customer_id" }

[parties.telco-2]
address = "Telco.Example.ORG:443"
data = { file = "telco.csv", columns = ["calls"], id = "customer_id" }
"""


def _write(tmp: Path, text: str, name: str = "federation.toml") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def test_a_good_file_parses_with_paths_relative_to_it(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # hosts other than loopback are fine and say nothing
        fed = load_federation(_write(tmp_path, GOOD))
    assert fed.name == "credit-demo" and fed.source == tmp_path / "federation.toml"
    assert fed.label_party == "bank" and fed.names == ("bank", "shop", "telco-2")
    assert fed.ca == tmp_path / "certs/ca.pem" and fed.ca_key == tmp_path / "certs/ca.key"
    bank, shop, telco = fed.parties
    assert bank.holds_labels and not shop.holds_labels and not telco.holds_labels
    assert [p.name for p in fed.feature_parties] == ["shop", "telco-2"]
    assert bank.address == Address("127.0.0.1", 50051) and str(bank.address) == "127.0.0.1:50051"
    assert shop.address == Address("::1", 50052) and str(shop.address) == "[::1]:50052"
    assert telco.address == Address("telco.example.org", 443) and telco.address.ip is None
    assert bank.cert == tmp_path / "certs/bank.pem" and bank.key == tmp_path / "certs/bank.key"
    assert shop.cert == tmp_path / "keys/shop-cert.pem" and shop.key == Path("/abs/shop.key")
    assert bank.data.file == tmp_path / "bank.csv" and bank.data.label == "default" and bank.data.columns == ()
    assert shop.data.file == tmp_path / "data/shop.csv.gz" and shop.data.columns == ("spend", "visits")
    assert shop.data.id == "customer_id" and shop.data.label is None
    assert fed.party("shop") is shop
    with pytest.raises(ConfigError, match="no party 'shpo'.*did you mean 'shop'"):
        fed.party("shpo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fed.name = "other"  # type: ignore[misc]


# (id, text replaced in GOOD -> replacement, fragment of the one-line error). Each is one mistake in a good file.
BAD = [
    ("missing-name", ('name = "credit-demo"\n', ""), "[federation]: missing key 'name'"),
    ("typo-federation-key", ("label_party =", "label_pary ="), "unknown key 'label_pary'; did you mean 'label_party'?"),
    ("typo-party-key", ('address = "127.0.0.1:50051"', 'adress = "127.0.0.1:50051"'),
     "[parties.bank]: unknown key 'adress'; did you mean 'address'?"),
    ("typo-data-key", ('columns = ["calls"]', 'colums = ["calls"]'),
     "[parties.telco-2] data: unknown key 'colums'; did you mean 'columns'?"),
    ("typo-table", ("[parties.bank]", "[party.bank]"), "top level: unknown key 'party'; did you mean 'parties'?"),
    ("missing-address", ('address = "Telco.Example.ORG:443"\n', ""), "[parties.telco-2]: missing key 'address'"),
    ("duplicate-address", ('"[::1]:50052"', '"127.0.0.1:50051"'),
     "127.0.0.1:50051 is already the address of party 'bank'"),
    ("duplicate-address-spelled-otherwise", ('"127.0.0.1:50051"', '"[0:0::1]:50052"'),
     "::1]:50052 is already the address of party 'bank'"),
    ("label-party-not-declared", ('label_party = "bank"', 'label_party = "bnak"'),
     "'bnak' is not a declared party (declared: bank, shop, telco-2); did you mean 'bank'?"),
    ("label-party-unlike-any", ('label_party = "bank"', 'label_party = "insurer"'),
     "'insurer' is not a declared party (declared: bank, shop, telco-2); add a [parties.insurer] table"),
    ("label-party-without-label", ('label = "default", ', ""), "this is the [federation] label_party, so it needs its "
     "label column"),
    ("feature-party-with-label", ('columns = ["calls"]', 'columns = ["calls"], label = "y"'),
     "[parties.telco-2] data.label: only the label party holds labels"),
    ("label-party-with-columns", ('label = "default"', 'label = "default", columns = ["a"]'),
     "the label party holds only the labels"),
    ("port-too-large", ("50051", "70000"), "port '70000' must be a number from 1 to 65535"),
    ("port-zero", ("50051", "0"), "port '0' must be a number from 1 to 65535"),
    ("port-not-a-number", (":50051", ":grpc"), "port 'grpc' must be a number from 1 to 65535"),
    ("no-port", ('"127.0.0.1:50051"', '"127.0.0.1"'), "expected host:port"),
    ("ipv6-without-brackets", ('"[::1]:50052"', '"::1:50052"'), "an IPv6 address needs brackets: [::1]:50052"),
    ("bad-ipv6", ('"[::1]:50052"', '"[::g]:50052"'), "[::g] is not an IPv6 address"),
    ("unspecified-address", ('"127.0.0.1:50051"', '"0.0.0.0:50051"'), "0.0.0.0 means 'every interface'"),
    ("bad-host", ('"Telco.Example.ORG:443"', '"telco_db!:443"'), "host 'telco_db!' is neither an IP address nor a "
     "DNS name"),
    ("bad-ipv4", ('"127.0.0.1:50051"', '"127.0.0.300:50051"'), "host '127.0.0.300' is not a valid IPv4 address"),
    ("address-not-a-string", ('"127.0.0.1:50051"', "50051"), "[parties.bank] address: must be a non-empty string, "
     "got an integer"),
    ("party-name-invalid", ("[parties.telco-2]", "[parties.Telco_2]"), "'Telco_2' is not a valid party name: it "
     "becomes the certificate's DNS name, so use lowercase letters, digits and hyphens, starting with a letter "
     "(e.g. 'telco-2')"),
    ("party-name-digit-first", ("[parties.telco-2]", '[parties."2telco"]'), "(e.g. 'p-2telco')"),
    ("party-name-reserved", ("[parties.telco-2]", "[parties.ca]"), "'ca' is reserved"),
    ("parties-value-not-a-table", ("[parties.telco-2]\n", '[parties]\ntelco = "x"\n[parties.telco-2]\n'),
     "[parties.telco]: must be a table, got a string"),
    ("columns-empty", ('columns = ["calls"]', "columns = []"), "data.columns: must be a non-empty array"),
    ("columns-repeated", ('columns = ["calls"]', 'columns = ["calls", "calls"]'), "'calls' is listed twice"),
    ("id-among-columns", ('columns = ["calls"]', 'columns = ["calls", "customer_id"]'),
     "'customer_id' is the id column"),
    ("label-is-id", ('label = "default"', 'label = "customer_id"'), "'customer_id' is also the id column"),
    ("missing-id", ('columns = ["calls"], id = "customer_id"', 'columns = ["calls"]'),
     "[parties.telco-2] data: missing key 'id'"),
    ("same-cert-twice", ('cert = "keys/shop-cert.pem"', 'cert = "certs/bank.pem"'),
     "certs/bank.pem is already [parties.bank] cert"),
    ("key-is-ca-key", ('key = "/abs/shop.key"', 'key = "certs/ca.key"'), "certs/ca.key is already the CA key"),
    ("ca-names-a-key", ('label_party = "bank"', 'label_party = "bank"\nca = "certs/ca.key"'),
     "names a key file; name the CA certificate"),
    ("federation-name-invalid", ('name = "credit-demo"', 'name = "credit/demo"'), "'credit/demo': use up to 60"),
    ("toml-syntax", ('name = "credit-demo"', "name = credit-demo"), "not valid TOML: Invalid value (at line 2, "
     "column 8)"),
]


@pytest.mark.parametrize(("replace", "fragment"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_each_mistake_gets_one_line_naming_the_file(tmp_path: Path, replace: tuple[str, str], fragment: str) -> None:
    old, new = replace
    assert old in GOOD  # the mutation applies (else the case would test the good file)
    path = _write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        load_federation(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert fragment in message, message


def test_a_federation_needs_a_feature_party(tmp_path: Path) -> None:
    only_bank = GOOD.split("[parties.shop]")[0]
    with pytest.raises(ConfigError, match=r"\[parties\]: a federation needs the label party and at least one feature"):
        load_federation(_write(tmp_path, only_bank))


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_federation(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_federation(tmp_path)
    path = tmp_path / "latin1.toml"
    path.write_bytes(GOOD.replace("credit-demo", "cr\xe9dit").encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_federation(path)


def test_a_duplicate_key_is_the_toml_error_with_its_line(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD.replace('address = "127.0.0.1:50051"',
                                         'address = "127.0.0.1:50051"\naddress = "127.0.0.1:50055"'))
    with pytest.raises(ConfigError, match=r"not valid TOML: .*line 7"):
        load_federation(path)


@settings(max_examples=200, deadline=None)
@given(ip=st.ip_addresses(), port=st.integers(min_value=-5, max_value=70_000))
def test_parse_address_agrees_with_ipaddress(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> None:
    text = f"[{ip.exploded}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    if ip.is_unspecified or not 1 <= port <= 65535:
        with pytest.raises(ValueError):
            parse_address(text)
        return
    address = parse_address(text)
    assert ipaddress.ip_address(address.host) == ip and address.port == port
    assert parse_address(str(address)) == address  # the printed form reads back, IPv6 brackets included


# ------------------------------------------------------------------------------------------------- certificates

FED = """\
[federation]
name = "credit-demo"
label_party = "bank"

[parties.bank]
address = "127.0.0.1:50051"
data = { file = "bank.csv", label = "default", id = "customer_id" }

[parties.shop]
address = "127.0.0.1:50052"
data = { file = "shop.csv", columns = ["spend"], id = "customer_id" }

[parties.telco]
address = "telco.example.org:50051"
data = { file = "telco.csv", columns = ["calls"], id = "customer_id" }
"""


@pytest.fixture(scope="module")
def issued(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    """A federation whose certificates `secvfl certs` wrote to the default paths (certs/ beside the file)."""
    folder = tmp_path_factory.mktemp("fed")
    path = _write(folder, FED)
    assert main(["certs", "--federation", str(path), "--days", "30"]) == 0
    return load_federation(path)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def test_certs_are_signed_by_the_ca_with_names_usages_and_private_keys(issued: Federation) -> None:
    ca = _cert(issued.ca)
    ca_key = _key(issued.ca_key)
    assert isinstance(ca_key.curve, ec.SECP256R1)
    assert ca.public_key().public_numbers() == ca_key.public_key().public_numbers()
    ca.public_key().verify(ca.signature, ca.tbs_certificate_bytes, ec.ECDSA(ca.signature_hash_algorithm))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    for path in [issued.ca, *(p.cert for p in issued.parties)]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    for path in [issued.ca_key, *(p.key for p in issued.parties)]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    serials = set()
    for party in issued.parties:
        cert, key = _cert(party.cert), _key(party.key)
        # The CA's signature over this certificate, checked with the CA's public key directly (raises if wrong).
        ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
        assert cert.issuer == ca.subject
        assert isinstance(key.curve, ec.SECP256R1)
        assert cert.public_key().public_numbers() == key.public_key().public_numbers()
        assert [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == [party.name]
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert party.name in san.get_values_for_type(x509.DNSName)
        if party.address.ip is not None:
            assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(party.address.host)]
        else:
            assert party.address.host in san.get_values_for_type(x509.DNSName)
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert timedelta(days=30) <= lifetime <= timedelta(days=30, minutes=10)
        assert abs(cert.not_valid_after_utc - (datetime.now(UTC) + timedelta(days=30))) < timedelta(hours=1)
        serials.add(cert.serial_number)
        # cryptography's WebPKI verifier (the strict profile) accepts it as the named server and as a client.
        store = Store([ca])
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName(party.name)).verify(cert, [])
        PolicyBuilder().store(store).build_client_verifier().verify(cert, [])
    assert len(serials) == len(issued.parties)


def test_existing_files_are_kept_unless_force(issued: Federation, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p: p.read_bytes() for p in [issued.ca, issued.ca_key, *(q.key for q in issued.parties)]}
    assert main(["certs", "--federation", str(issued.source)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"{issued.ca} already exists; pass --force" in err
    assert {p: p.read_bytes() for p in before} == before  # nothing was touched, not even the files after the first


def test_force_replaces_and_tightens_a_loosened_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, FED)
    assert main(["certs", "--federation", str(path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'out' / 'shop.key'} (mode 0600)" in out
    assert "note: " in out and "names other paths for 8 of these files" in out
    old_key = (tmp_path / "out/shop.key").read_bytes()
    os.chmod(tmp_path / "out/shop.key", 0o644)
    old_umask = os.umask(0)  # a permissive umask must not loosen the keys
    try:
        assert main(["certs", "--federation", str(path), "--out", str(tmp_path / "out"), "--force"]) == 0
    finally:
        os.umask(old_umask)
    assert (tmp_path / "out/shop.key").read_bytes() != old_key
    assert stat.S_IMODE(os.stat(tmp_path / "out/shop.key").st_mode) == 0o600
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporary file left behind


def test_write_bytes_atomic_applies_the_mode(tmp_path: Path) -> None:
    write_bytes_atomic(tmp_path / "a", b"x", mode=0o640)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o640 and (tmp_path / "a").read_bytes() == b"x"


def test_write_certificates_checks_every_file_before_writing_any(issued: Federation, tmp_path: Path) -> None:
    files = issue_certificates(issued, out=tmp_path)
    files[-1].path.write_bytes(b"someone else's key")  # only the last one exists
    with pytest.raises(ConfigError, match="telco.key already exists"):
        write_certificates(files)
    assert [p.name for p in tmp_path.iterdir()] == ["telco.key"]


def test_verify_peer_certificate_accepts_the_named_party(issued: Federation) -> None:
    for party in issued.parties:
        pem = party.cert.read_bytes()
        verify_peer_certificate(issued, party.name, pem)
        verify_peer_certificate(issued, party.name, _cert(party.cert).public_bytes(serialization.Encoding.DER))


def test_verify_peer_certificate_refuses_another_partys_name(issued: Federation) -> None:
    with pytest.raises(ProtocolError, match="peer 'bank': certificate belongs to party 'shop', not 'bank'"):
        verify_peer_certificate(issued, "bank", issued.party("shop").cert.read_bytes())
    with pytest.raises(ConfigError, match="no party 'bnak'"):
        verify_peer_certificate(issued, "bnak", issued.party("bank").cert.read_bytes())


def test_verify_peer_certificate_refuses_expired_and_future_certs(issued: Federation, tmp_path: Path) -> None:
    long_ago = datetime.now(UTC) - timedelta(days=400)
    files = issue_certificates(issued, days=30, out=tmp_path, now=long_ago)
    write_certificates(files)
    old = dataclasses.replace(issued, ca=tmp_path / "ca.pem")
    verify_peer_certificate(old, "shop", (tmp_path / "shop.pem").read_bytes(), now=long_ago + timedelta(days=1))
    with pytest.raises(ProtocolError, match=r"peer 'shop': the federation's CA certificate expired on \d{4}-"):
        verify_peer_certificate(old, "shop", (tmp_path / "shop.pem").read_bytes())
    # A party certificate that expired under a CA that is still valid.
    ca, ca_key = _cert(issued.ca), _key(issued.ca_key)
    expired = _party_cert(ca, ca_key, "shop", not_after=datetime.now(UTC) - timedelta(days=1))
    with pytest.raises(ProtocolError, match=r"peer 'shop': certificate expired on"):
        verify_peer_certificate(issued, "shop", expired)
    with pytest.raises(ProtocolError, match="certificate is not valid before"):
        verify_peer_certificate(issued, "shop", issued.party("shop").cert.read_bytes(),
                                now=datetime.now(UTC) - timedelta(days=1))


def test_verify_peer_certificate_refuses_another_ca(issued: Federation, tmp_path: Path) -> None:
    write_certificates(issue_certificates(issued, out=tmp_path))  # same federation, same names, a fresh CA
    with pytest.raises(ProtocolError, match="peer 'shop': certificate not issued by the federation's CA"):
        verify_peer_certificate(issued, "shop", (tmp_path / "shop.pem").read_bytes())


def _party_cert(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, cn: str, *, dns: str | None = None,
                usages: tuple[x509.ObjectIdentifier, ...] = (ExtendedKeyUsageOID.SERVER_AUTH,
                                                             ExtendedKeyUsageOID.CLIENT_AUTH),
                not_after: datetime | None = None, is_ca: bool = False) -> bytes:
    """A certificate signed by the federation's CA, built here with raw cryptography calls."""
    now = datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
               .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - timedelta(days=3)).not_valid_after(not_after or now + timedelta(days=3))
               .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns or cn)]), critical=False)
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_verify_peer_certificate_refuses_bad_usage_names_and_bytes(issued: Federation) -> None:
    ca, ca_key = _cert(issued.ca), _key(issued.ca_key)
    verify_peer_certificate(issued, "shop", _party_cert(ca, ca_key, "shop"))  # the reference case passes
    server_only = _party_cert(ca, ca_key, "shop", usages=(ExtendedKeyUsageOID.SERVER_AUTH,))
    with pytest.raises(ProtocolError, match="does not allow clientAuth"):
        verify_peer_certificate(issued, "shop", server_only)
    with pytest.raises(ProtocolError, match="does not allow serverAuth and clientAuth"):
        verify_peer_certificate(issued, "shop", _party_cert(ca, ca_key, "shop", usages=()))
    with pytest.raises(ProtocolError, match=r"is for CN \['shop'\] and DNS names \['shop.evil'\], not 'shop'"):
        verify_peer_certificate(issued, "shop", _party_cert(ca, ca_key, "shop", dns="shop.evil"))
    with pytest.raises(ProtocolError, match=r"is for CN \['outsider'\]"):
        verify_peer_certificate(issued, "shop", _party_cert(ca, ca_key, "outsider"))
    with pytest.raises(ProtocolError, match="presented a CA certificate"):
        verify_peer_certificate(issued, "shop", _party_cert(ca, ca_key, "shop", is_ca=True))
    with pytest.raises(ProtocolError, match="not an X.509 certificate"):
        verify_peer_certificate(issued, "shop", b"-----BEGIN CERTIFICATE-----\nnonsense\n-----END CERTIFICATE-----\n")


def test_verify_peer_certificate_needs_the_ca_file(issued: Federation, tmp_path: Path) -> None:
    missing = dataclasses.replace(issued, ca=tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match="cannot read the federation's CA certificate .*run `secvfl certs`"):
        verify_peer_certificate(missing, "shop", issued.party("shop").cert.read_bytes())


# ------------------------------------------------------------------------------------ mutual TLS, in memory

def _context(side: int, cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(side)
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # the default from Python 3.13 on
    return ctx


def _mutual_tls(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_name: str) -> tuple[bytes, bytes, bytes]:
    """A TLS handshake between two in-memory endpoints, then one message from client to server: that message and
    the certificates each end received (DER)."""
    pipes = [ssl.MemoryBIO() for _ in range(4)]
    server = server_ctx.wrap_bio(pipes[0], pipes[1], server_side=True)
    client = client_ctx.wrap_bio(pipes[2], pipes[3], server_hostname=server_name)
    done = set()
    for _ in range(10):  # a TLS 1.3 handshake takes 2 round trips; bounded so a bug cannot spin
        for name, end in (("client", client), ("server", server)):
            if name not in done:
                try:
                    end.do_handshake()
                    done.add(name)
                except ssl.SSLWantReadError:
                    pass
        pipes[0].write(pipes[3].read())
        pipes[2].write(pipes[1].read())
        if len(done) == 2:
            break
    assert done == {"client", "server"}
    client.write(b"embedding")
    pipes[0].write(pipes[3].read())
    return server.read(100), server.getpeercert(binary_form=True), client.getpeercert(binary_form=True)


def test_mutual_tls_between_parties_and_refusals(issued: Federation, tmp_path: Path) -> None:
    bank, shop = issued.party("bank"), issued.party("shop")
    server = _context(ssl.PROTOCOL_TLS_SERVER, bank.cert, bank.key, issued.ca)
    client = _context(ssl.PROTOCOL_TLS_CLIENT, shop.cert, shop.key, issued.ca)
    received, client_cert, server_cert = _mutual_tls(server, client, "bank")
    assert received == b"embedding"
    verify_peer_certificate(issued, "shop", client_cert)  # what the transport will check after TLS's own checks
    verify_peer_certificate(issued, "bank", server_cert)
    with pytest.raises(ProtocolError, match="belongs to party 'shop'"):
        verify_peer_certificate(issued, "telco", client_cert)  # shop connecting where telco was expected
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        _mutual_tls(server, client, "telco")  # shop dials telco's name and gets bank's certificate
    write_certificates(issue_certificates(issued, out=tmp_path))  # another CA, the same party names
    outsider = _context(ssl.PROTOCOL_TLS_CLIENT, tmp_path / "shop.pem", tmp_path / "shop.key", issued.ca)
    with pytest.raises(ssl.SSLError):
        _mutual_tls(server, outsider, "bank")  # the server refuses a client certificate from another CA
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        _mutual_tls(_context(ssl.PROTOCOL_TLS_SERVER, tmp_path / "bank.pem", tmp_path / "bank.key", issued.ca),
                    client, "bank")  # and a client refuses a server certificate from another CA


def test_loopback_ports_are_free_distinct_and_outside_the_source_port_range() -> None:
    """(CPU, sockets on 127.0.0.1 only.) Ports for a loopback federation come from below the kernel's ephemeral
    range, which every outgoing connection takes its source port from: a client elsewhere on the host cannot take one
    between the choice and the party's bind. Each is free: a plain bind succeeds."""
    import socket

    from secvfl.deploy.loopback import _ephemeral_range, free_loopback_ports

    low, high = _ephemeral_range()
    for _ in range(20):
        ports = free_loopback_ports(6)
        assert len(set(ports)) == 6
        assert all(1024 <= p < low for p in ports), (ports, low)
        for port in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
