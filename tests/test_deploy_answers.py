"""A party's answers and words are believed only as far as they can be checked (CPU, loopback).

Rows of the attack table about what crosses besides the algorithm's messages: a party claiming that another party
is gone, forged byte counters, a row plan with absurd widths, error texts with terminal escapes, and the TLS checks
a client now applies to its server as a server does to its clients (a server certificate without a subject
alternative name or without extended key usages; a TLS key readable by others). References are the facts the
coordinator holds itself (its own link, its own counters), and the certificate checks of
:func:`secvfl.federation.verify_peer_certificate`, already tested against raw ``cryptography`` and ``ssl``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from test_deploy import _federation, _transport

from secvfl.deploy.calls import result_message
from secvfl.deploy.remote import FederatedStats, PartyLink
from secvfl.errors import ConfigError, ProtocolError
from secvfl.federation import load_federation
from secvfl.messages import encode
from secvfl.transport.base import CommStats, PeerViolation, peer_text
from secvfl.transport.grpc_link import ERROR_KIND, PartyLost


class _Answers:
    """The coordinator's transport, answering each request with the next of ``answers``; ``gone``: the parties its
    own links say are gone."""

    def __init__(self, answers: list, gone: dict[str, str] | None = None) -> None:
        self.answers = deque(answers)
        self.gone = gone or {}
        self.peers = {"party0": None, "party1": None, "party2": None}
        self.peer_timeout, self.heartbeat = 0.3, 0.05
        self._id = 0

    def put_control(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        self._id += 1

    def take(self, receiver: str, *, kind: str, sender: str, timeout: float | None = None) -> bytes:
        return encode(result_message(sender, receiver, self._id, self.answers.popleft()))

    def lost(self, party: str) -> str | None:
        return self.gone.get(party)


def test_a_party_saying_that_another_is_gone_is_believed_only_if_the_coordinator_sees_it_too() -> None:
    claim = {"__party_lost__": "party0", "reason": "party party0 is gone: its stream ended"}
    link = PartyLink(_Answers([claim]), "label")
    t0 = time.monotonic()
    with pytest.raises(PeerViolation, match="^party party1 broke the protocol: its answer to predict says that party "
                                            "party0 is gone, but label still hears from party0") as err:
        link.call("party1", "predict")
    assert err.value.party == "party1" and time.monotonic() - t0 < 0.3 + 0.1 + 2  # within the peer timeout
    seen = PartyLink(_Answers([claim], gone={"party0": "its stream ended (process stopped?)"}), "label")
    with pytest.raises(PartyLost, match="^party party0 is gone: its stream ended .*also reported by party1") as lost:
        seen.call("party1", "predict")
    assert lost.value.party == "party0"
    for forged in ({"__party_lost__": "nobody", "reason": ""}, {"__party_lost__": 3, "reason": ""},
                   {"__party_lost__": "party0"}):
        with pytest.raises(PeerViolation, match="^party party1 broke the protocol"):
            PartyLink(_Answers([forged]), "label").call("party1", "predict")


def _ledger(party: str, links: dict[str, int], kind: str = "embedding") -> dict:
    stats = CommStats()
    for link, nbytes in links.items():
        sender, _, receiver = link.partition("->")
        stats.count(sender, receiver, kind, nbytes)
        stats.count_payload(kind, nbytes // 2)
    return stats.state_dict()


def test_byte_counters_are_the_senders_checked_against_the_receivers() -> None:
    own_sent = {"label->party0": 500, "label->party1": 500}
    own_received = {"party0->label": 700, "party1->label": 700}

    def federation_stats(reports: dict) -> FederatedStats:
        stats = FederatedStats(lambda: reports, lambda: _as_stats(own_received, "label"), "label")
        for link, nbytes in own_sent.items():
            stats.count("label", link.split("->")[1], "embedding", nbytes)
            stats.count_payload("embedding", nbytes // 2)
        return stats

    honest = {p: {"sent": _ledger(p, {f"{p}->label": 700}), "received": _ledger(p, {f"label->{p}": 500})}
              for p in ("party0", "party1")}
    assert federation_stats(honest).bytes_total == 2400
    forged = {**honest, "party1": {"sent": _ledger("party1", {"party1->label": 10**18}),
                                   "received": honest["party1"]["received"]}}
    with pytest.raises(PeerViolation, match=r"^party party1 broke the protocol: its byte counters are false \(party1 "
                                            r"says it sent 1000000000000000000 bytes to label, label says it received 700"):
        federation_stats(forged).to_dict()
    lying_receiver = {**honest, "party0": {"sent": honest["party0"]["sent"],
                                           "received": _ledger("party0", {"label->party0": 9})}}
    with pytest.raises(PeerViolation, match="^party party0 broke the protocol: its byte counters are false"):
        assert federation_stats(lying_receiver).bytes_total is None
    for bad in ({"sent": "x", "received": {}}, {"sent": _ledger("party1", {"party0->label": 700}), "received": {}},
                {"sent": {"bytes_sent": {"party1": -5}}, "received": {}}, ["sent"]):
        with pytest.raises(PeerViolation, match="^party party1 broke the protocol"):
            assert federation_stats({**honest, "party1": bad}).bytes_total is None
    between = {"party0": {"sent": _ledger("party0", {"party0->party1": 30}), "received": {}},
               "party1": {"sent": {}, "received": _ledger("party1", {"party0->party1": 20})}}
    with pytest.raises(PeerViolation, match="^party party0 or party1 broke the protocol: their byte counters disagree"):
        assert FederatedStats(lambda: between, CommStats, None).bytes_total is None
    unchecked = {**forged, "party0": {**honest["party0"], "received": None}}  # resumed from an older checkpoint
    assert federation_stats(unchecked).bytes_total == 1000 + 700 + 10**18  # (the check needs every receiver)


def _as_stats(links: dict[str, int], party: str) -> CommStats:
    stats = CommStats()
    stats.load_state_dict(_ledger(party, links))
    return stats


def test_a_row_plan_with_absurd_widths_is_refused_before_any_table_is_allocated(tmp_path: Path) -> None:
    from secvfl.deploy.party import _check_layout

    fed = load_federation(_federation(tmp_path, 2))
    _check_layout(fed, "party1", [3, 5], [80, 10, 20], 2)  # a plausible layout passes
    with pytest.raises(PeerViolation, match=r"^party party1 broke the protocol: it announced the column widths "
                                            r"\[3, 2000000\]; expected 2 whole numbers from 1 to 16384"):
        _check_layout(fed, "party1", [3, 2_000_000], [80, 10, 20], 2)
    with pytest.raises(PeerViolation, match="needs a run table of .* MiB, over the 2048 MiB limit"):
        _check_layout(fed, "party1", [16000, 16000], [20000, 1000, 1000], 2)
    for widths, sizes, classes in (([3, True], [1, 1, 1], 2), ([3, 5], [1, -1, 1], 2), ([3, 5], [1, 1, 1], 10**9),
                                   ("3,5", [1, 1, 1], 2)):
        with pytest.raises(PeerViolation, match="^party party1 broke the protocol: it announced"):
            _check_layout(fed, "party1", widths, sizes, classes)


def test_peer_text_is_escaped_and_bounded() -> None:
    assert peer_text("a\x1b[2J\nFAKE: party0 finished\r\u2028x") == "a\\x1b[2J\\nFAKE: party0 finished\\r\\u2028x"
    assert peer_text(b"\xff ok") == "\ufffd ok"
    assert peer_text("y" * 1000, 10) == "yyyyyyyyyy... (990 more characters)"


def test_a_party_s_error_text_reaches_the_others_escaped_on_one_line(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    label, party0 = _transport(fed, "label"), _transport(fed, "party0")
    try:
        party0.put_control("party0", "label", ERROR_KIND, b"it failed\n[label] \x1b[2Jtraining finished: accuracy 1.0")
        party0.flush()
        with pytest.raises(PartyLost) as err:
            label.take("label", sender="party0", timeout=10)
        text = str(err.value)
        assert "\n" not in text and "\x1b" not in text
        assert "it failed\\n[label] \\x1b[2Jtraining finished" in text
    finally:
        party0.close(0.5)
        label.close(0.5)


# -- TLS, both directions alike -----------------------------------------------------------------------------------
def _reissue(fed_path: Path, party: str, *, san: bool, usages: tuple) -> None:
    """Replace ``party``'s certificate by one the federation's CA signs, without a SAN or extended key usages."""
    fed = load_federation(fed_path)
    ca = x509.load_pem_x509_certificate(fed.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(fed.ca_key.read_bytes(), None)
    spec = fed.party(party)
    key = serialization.load_pem_private_key(spec.key.read_bytes(), None)
    now = datetime.now(UTC)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, party)]))
               .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - timedelta(days=1)).not_valid_after(now + timedelta(days=3))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(party)]), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    spec.cert.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    assert isinstance(key, ec.EllipticCurvePrivateKey)


@pytest.mark.parametrize(("san", "usages", "problem"), [
    (False, (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
     "is for CN \\['label'\\] and DNS names \\[\\], not 'label'"),
    (True, (), "does not allow serverAuth and clientAuth"),
], ids=["cn-without-san", "without-eku"])
def test_a_client_checks_its_server_s_certificate_as_a_server_checks_its_clients(
        tmp_path: Path, san: bool, usages: tuple, problem: str) -> None:
    fed = _federation(tmp_path)
    _reissue(fed, "label", san=san, usages=usages)
    label, party0 = _transport(fed, "label"), _transport(fed, "party0")
    try:
        with pytest.raises(ProtocolError, match=f"the party at 127.0.0.1:\\d+ is refused: peer 'label': certificate "
                                                f"{problem}"):
            party0.put("party0", "label", "embedding", b"x")
        assert label.pending() == 0
    finally:
        party0.close(0.5)
        label.close(0.5)


def test_a_tls_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    fed = _federation(tmp_path)
    key = load_federation(fed).party("party0").key
    os.chmod(key, 0o644)
    with pytest.raises(ConfigError, match=f"the party key {key} is accessible by group or others \\(mode 0644\\); "
                                          f"run `chmod 600 {key}`"):
        _transport(fed, "party0")
    os.chmod(key, 0o600)
    _transport(fed, "party0").close(0.5)
