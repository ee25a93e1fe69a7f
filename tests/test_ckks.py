"""CKKS aggregation: decryption error bounds, who holds which key, who receives what, refusal of bad input."""

from __future__ import annotations

import itertools
import math
import tempfile
import warnings

import numpy as np
import pytest
import tenseal as ts
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.ckks import (
    CIPHERTEXT_KIND,
    HE_STANDARD_MAX_BITS,
    PRESETS,
    SUM_KIND,
    CKKSAggregation,
    CKKSParameterWarning,
    CKKSParams,
    pack,
)
from protocols.ckks_cipher import CKKSCipher
from secvfl.errors import ConfigError, ProtocolError, UnsupportedError
from secvfl.messages import Message, decode, encode
from secvfl.transport.inprocess import InProcessTransport
from secvfl.transport.layers import AlgorithmTraits, Role
from secvfl.transport.network import Network

AGG = "agg"
LABEL = "label"


def roles(k: int) -> dict[str, Role]:
    return {LABEL: Role.LABEL, AGG: Role.AGGREGATOR, **{f"p{i}": Role.FEATURE for i in range(k)}}


def embeddings(xs: list[torch.Tensor], step: int, kind: str = "embedding") -> list[Message]:
    return [Message(kind, f"p{i}", LABEL, step, {kind: x}) for i, x in enumerate(xs)]


_steps = itertools.count(1000)


@pytest.fixture(scope="module")
def networks():
    """One network (and so one key pair and one context hand-out) per party count, shared by every example."""
    cache: dict[int, tuple[Network, CKKSAggregation]] = {}

    def get(k: int) -> tuple[Network, CKKSAggregation]:
        if k not in cache:
            agg = CKKSAggregation()
            cache[k] = (Network(roles(k), aggregation=agg), agg)
        return cache[k]

    return get


# -- parameters ---------------------------------------------------------------------------------------------------


def test_default_parameters_are_the_issue_defaults_and_128_bit_secure():
    p = CKKSParams()
    assert (p.poly_modulus_degree, p.coeff_mod_bit_sizes, p.scale_bits) == (8192, (60, 40, 40, 60), 40)
    assert p.slots == 4096 and p.total_bits == 200 <= HE_STANDARD_MAX_BITS[8192] == 218
    d = p.describe()
    assert d["max_coeff_modulus_bits_128"] == 218 and d["slots_per_ciphertext"] == 4096
    assert 1e-8 < p.error_bound_per_party < 1e-6
    # Aggregation only adds: ciphertexts go out under the first (60-bit) prime alone, which still holds sums up to
    # 2^18 at scale 2^40; each carries two floats per complex slot.
    assert p.wire_primes == 1 and p.wire_bits == 60 and p.max_abs_sum == pytest.approx(2.0**18)
    assert p.floats_per_ciphertext == 8192 and d["wire_primes"] == [60]
    # Low-scale parameters keep more primes on the wire, so that sums still fit.
    with pytest.warns(CKKSParameterWarning, match="raise the scale"):  # 20-bit scale: imprecise, but valid
        assert CKKSParams.parse("8192:30,30,30,60:20").wire_primes == 2


def test_security_table_matches_seal():
    from tenseal import sealapi

    for n, bits in HE_STANDARD_MAX_BITS.items():
        assert sealapi.CoeffModulus.MaxBitCount(n, sealapi.SEC_LEVEL_TYPE.TC128) == bits


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("8192:60,60,60,60:40", "218-bit maximum for 128-bit security"),
        ("4096:60,40,40:40", "N=8192"),  # the hint names the degree that would fit
        ("3000:60,40:40", "not supported"),
        ("8192:61,40,60:40", "2..60 bits"),
        ("8192:60:40", "at least one data prime and the special prime"),
        ("8192:30,60:25", "integer part"),
        ("8192:60,40,60:0", "scale bits"),
        ("32768:20,20,20,20,20,20,20,20:10", "cannot find distinct primes"),
        ("8192;60,40", "cannot read --ckks-params"),
        ("fast", "cannot read --ckks-params"),
    ],
)
def test_invalid_parameters_are_refused_with_the_reason(spec, needle):
    with pytest.raises(ConfigError) as info:
        CKKSParams.parse(spec)
    assert needle in str(info.value)


def test_parse_presets_and_specs():
    assert CKKSParams.parse(None) == CKKSParams() == PRESETS["default"] == CKKSParams.parse("8192:60,40,40,60:40")
    compact = CKKSParams.parse("compact")
    assert compact.coeff_mod_bit_sizes == (60, 60) and compact.spec() == "8192:60,60:40"
    assert CKKSParams.parse(compact.spec()) == compact
    assert CKKSParams.parse(" 16384 : 60, 40, 40, 60 : 40 ").slots == 8192


def test_low_precision_parameters_warn():
    with pytest.warns(CKKSParameterWarning, match="raise the scale"):
        CKKSParams.parse("8192:60,60:20")
    with pytest.warns(CKKSParameterWarning, match="headroom"):
        CKKSParams.parse("8192:50,60:40")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CKKSParams.parse("compact")
        CKKSParams.parse("default")


# -- validity for algorithms and topologies --------------------------------------------------------------------------


def test_check_accepts_sums_and_means_and_refuses_concatenation():
    agg = CKKSAggregation()
    for how in ("sum", "mean", "subset-mean"):
        assert agg.check(AlgorithmTraits("x", aggregation=how)) == []
    (problem,) = agg.check(AlgorithmTraits("splitnn", aggregation="concat"))
    assert "CKKS needs sum or mean aggregation" in problem and "'splitnn' concatenates" in problem and "vafl" in problem
    assert agg.check(AlgorithmTraits("local", aggregation="none"))
    with pytest.raises(UnsupportedError, match="concatenates embeddings"):
        Network(roles(2), aggregation=CKKSAggregation(), traits=AlgorithmTraits("splitnn", aggregation="concat"))


def test_topology_needs_an_aggregator_and_two_feature_parties():
    no_aggregator = {LABEL: Role.LABEL, "p0": Role.FEATURE, "p1": Role.FEATURE}
    with pytest.raises(UnsupportedError, match="needs an aggregator party"):
        Network(no_aggregator, aggregation=CKKSAggregation())
    with pytest.raises(UnsupportedError, match="at least 2 feature parties"):
        Network(roles(1), aggregation=CKKSAggregation())


# -- correctness -------------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(2, 5),
    batch=st.integers(1, 300),
    dim=st.integers(1, 70),
    op=st.sampled_from(["sum", "mean"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_decrypted_aggregate_matches_plaintext_within_the_stated_bound(networks, k, batch, dim, op, dtype, seed):
    net, agg = networks(k)
    rng = np.random.default_rng(seed)
    xs = [torch.from_numpy(rng.uniform(-100, 100, size=(batch, dim))).to(dtype) for _ in range(k)]
    out = net.aggregate(embeddings(xs, next(_steps)), LABEL, op).tensor("embedding")
    assert out.shape == (batch, dim) and out.dtype == dtype

    exact = torch.stack([x.double() for x in xs]).sum(0)
    bound = agg.params.error_bound(k)
    if op == "mean":
        exact, bound = exact / k, bound / k
    err = (out.double() - exact).abs()
    rounding = torch.finfo(dtype).eps * exact.abs()  # the final cast to the input dtype
    assert (err <= bound + rounding).all(), float((err - rounding).max())
    assert (err <= 1e-5 * exact.abs().clamp(min=1.0)).all()  # 1e-5 relative for values in [-100, 100]


def test_several_tensors_per_message_keep_names_shapes_and_dtypes(networks):
    net, agg = networks(3)
    gen = torch.Generator().manual_seed(1)
    msgs = [
        Message("logits", f"p{i}", LABEL, next(_steps),
                {"a": torch.randn(5, 3, generator=gen), "b": torch.randn(7, dtype=torch.float64, generator=gen),
                 "c": torch.randn(2, 2, 2, generator=gen).half()})
        for i in range(3)
    ]
    out = net.aggregate(msgs, LABEL, "sum")
    assert out.sender == "aggregate" and out.kind == "logits" and out.meta["parties"] == 3
    for name in ("a", "b", "c"):
        want = sum(m.tensor(name).double() for m in msgs)
        got = out.tensor(name)
        assert got.dtype == msgs[0].tensor(name).dtype and got.shape == want.shape
        tol = agg.params.error_bound(3) + torch.finfo(got.dtype).eps * want.abs()
        assert ((got.double() - want).abs() <= tol).all()


def test_packing_uses_as_few_ciphertexts_as_possible():
    size = CKKSParams().floats_per_ciphertext
    chunks = pack({"e": torch.zeros(256, 64), "f": torch.zeros(3)}, size)
    assert [len(c) for c in chunks] == [8192, 8192, 3]
    assert pack({}, size) == []


def test_two_floats_share_a_slot_and_any_count_round_trips(networks):
    net, agg = networks(2)
    net.aggregate(embeddings([torch.ones(2), torch.ones(2)], next(_steps)), LABEL, "sum")  # hands out contexts
    encryptor, decryptor = agg.cipher_of("p0"), agg.cipher_of(LABEL)
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 4095, 8191, 8192):
        values = rng.uniform(-100, 100, n)
        out = decryptor.decrypt(decryptor.load(encryptor.dump(encryptor.encrypt(values))), n)
        assert out.shape == (n,) and np.abs(out - values).max() <= agg.params.error_bound(1)
    # Slot i holds values 2i (real part) and 2i+1 (imaginary part).
    from tenseal import sealapi

    plain = sealapi.Plaintext()
    decryptor._decryptor.decrypt(encryptor.encrypt([1.0, 2.0, 3.0]), plain)
    slots = decryptor._encoder.decode_complex(plain)
    assert abs(slots[0] - (1 + 2j)) < 1e-6 and abs(slots[1] - 3) < 1e-6 and abs(slots[2]) < 1e-6
    with pytest.raises(ValueError, match="do not fit one ciphertext"):
        encryptor.encrypt(np.zeros(8193))


# -- roles, keys and who receives what ----------------------------------------------------------------------------


def test_keys_and_routing_follow_the_trust_model():
    k = 3
    agg = CKKSAggregation()
    net = Network(roles(k), aggregation=agg)
    views = {p: net.record(p) for p in [LABEL, AGG, "p0"]}
    xs = [torch.full((256, 64), float(i + 1)) for i in range(k)]
    out = net.aggregate(embeddings(xs, 0), LABEL, "sum")
    assert torch.allclose(out.tensor("embedding"), torch.full((256, 64), 6.0), atol=1e-4)

    # Key material: the secret key only with the label party; the aggregator cannot even encrypt.
    label_ctx, agg_ctx = agg.context_of(LABEL), agg.context_of(AGG)
    assert label_ctx.has_secret_key()
    assert not agg_ctx.has_secret_key() and not agg_ctx.has_public_key()
    for i in range(k):
        ctx = agg.context_of(f"p{i}")
        assert ctx.is_public() and ctx.has_public_key() and not ctx.has_secret_key()
        assert not ctx.has_galois_keys() and not ctx.has_relin_keys()

    # Routing: ciphertexts go to the aggregator; the label party gets only the sum, from the aggregator.
    links = net.stats.bytes_by_link
    assert not any(link.startswith("p") and link.endswith(f"->{LABEL}") for link in links)
    assert all(links[f"p{i}->{AGG}"] > 0 for i in range(k)) and links[f"{AGG}->{LABEL}"] > 0
    assert [(m.kind, m.sender) for m in views[LABEL].received] == [(SUM_KIND, AGG)]
    assert {m.kind for m in views[AGG].received} == {"ckks-context", CIPHERTEXT_KIND}
    assert all(not m.tensors for m in views[AGG].received)  # nothing in the clear
    assert net.transport.pending() == 0


def test_byte_accounting_shows_the_ciphertext_expansion():
    net = Network(roles(2), aggregation=CKKSAggregation())
    xs = [torch.randn(256, 64) for _ in range(2)]
    net.aggregate(embeddings(xs, 0), LABEL, "mean")
    stats = net.stats
    plaintext = 256 * 64 * 4
    per_party = stats.bytes_by_link[f"p0->{AGG}"]
    assert stats.messages_by_kind[CIPHERTEXT_KIND] == 2
    # 16384 floats at two per complex slot fill 2 ciphertexts of two polynomials of N = 8192 coefficients under the
    # one 60-bit wire prime (8-byte words), plus SEAL's and our headers: 4.0x the float32 bytes (TenSEAL's real,
    # first-level vectors would be 4 ciphertexts and ~20x).
    raw = 2 * 2 * 8192 * 8
    assert raw < per_party <= raw + 1024 and per_party <= 4.01 * plaintext
    assert stats.bytes_by_kind[CIPHERTEXT_KIND] == stats.bytes_by_link[f"p0->{AGG}"] + stats.bytes_by_link[f"p1->{AGG}"]
    assert stats.bytes_by_kind["ckks-context"] > 2 * 400_000  # the public key, once per feature party
    net.aggregate(embeddings(xs, 1), LABEL, "mean")
    assert stats.messages_by_kind["ckks-context"] == 3  # handed out once, not per step


def test_a_public_context_cannot_decrypt(networks):
    net, agg = networks(2)
    msgs = embeddings([torch.ones(4, 4), torch.ones(4, 4)], next(_steps))
    net.aggregate(msgs, LABEL, "sum")  # hands out the contexts
    ct = agg.encrypt_message(msgs[0], AGG, ["p0", "p1"])
    for party in ("p0", "p1", AGG):
        with pytest.raises(ProtocolError, match="holds no CKKS secret key"):
            agg.decrypt(party, ct)
    # Not just our guard: the key material a feature party holds has no secret key to decrypt with, and the
    # aggregator's has no public key to encrypt with either.
    with pytest.raises(ValueError, match="(?i)secret"):
        agg.context_of("p1").secret_key()
    with pytest.raises(PermissionError, match="no secret key"):
        agg.cipher_of("p1").decrypt(agg.cipher_of("p1").load(ct.blobs["c0"]), 16)
    with pytest.raises(PermissionError, match="no public key"):
        agg.cipher_of(AGG).encrypt([1.0])
    assert torch.allclose(agg.decrypt(LABEL, ct)["embedding"], torch.ones(4, 4), atol=1e-5)


def test_a_context_carrying_the_secret_key_is_refused():
    agg = CKKSAggregation()
    Network(roles(2), aggregation=agg)
    leaky = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 40, 60])
    msg = Message("ckks-context", LABEL, "p0", blobs={"context": leaky.serialize(save_secret_key=True)})
    with pytest.raises(ProtocolError, match="carrying a secret key"):
        agg._install("p0", msg, needs_public_key=True)
    weak = ts.context(ts.SCHEME_TYPE.CKKS, 4096, coeff_mod_bit_sizes=[40, 20, 40])
    msg = Message("ckks-context", LABEL, "p0", blobs={"context": weak.serialize()})
    with pytest.raises(ProtocolError, match="refuses the CKKS context"):
        agg._install("p0", msg, needs_public_key=True)


# -- refusal of bad input ------------------------------------------------------------------------------------------


class TamperingTransport(InProcessTransport):
    """Replaces the ciphertexts one party sends to the aggregator (a corrupted link or a faulty party)."""

    def __init__(self, victim: str, mutate) -> None:
        super().__init__()
        self.victim, self.mutate = victim, mutate

    def put(self, sender: str, receiver: str, kind: str, data: bytes) -> None:
        if kind == CIPHERTEXT_KIND and sender == self.victim:
            msg = decode(data)
            data = encode(msg.replace(blobs={n: self.mutate(b) for n, b in msg.blobs.items()}))
        super().put(sender, receiver, kind, data)


def _tampered_round(mutate, shape=(4, 8)):
    net = Network(roles(2), transport=TamperingTransport("p1", mutate), aggregation=CKKSAggregation())
    net.aggregate(embeddings([torch.ones(*shape), torch.ones(*shape)], 0), LABEL, "sum")


def test_truncated_ciphertext_is_refused():
    with pytest.raises(ProtocolError, match=r"ciphertext 0 from p1 is not a valid CKKS ciphertext.*truncated"):
        _tampered_round(lambda b: b[: len(b) // 2])


def test_garbage_ciphertext_is_refused():
    with pytest.raises(ProtocolError, match="from p1 is not a valid CKKS ciphertext"):
        _tampered_round(lambda b: bytes(len(b)))


def test_ciphertext_under_other_parameters_is_refused():
    other = ts.context(ts.SCHEME_TYPE.CKKS, 4096, coeff_mod_bit_sizes=[40, 20, 40])
    other.global_scale = 2**20
    with pytest.raises(ProtocolError, match="from p1 is not a valid CKKS ciphertext"):
        _tampered_round(lambda b: ts.ckks_vector(other, [1.0] * 32).serialize())


def test_ciphertext_of_wrong_level_or_scale_is_refused(networks):
    net, agg = networks(2)
    net.aggregate(embeddings([torch.ones(2), torch.ones(2)], next(_steps)), LABEL, "sum")
    public = agg.context_of("p1")
    msgs = embeddings([torch.ones(4, 8), torch.ones(4, 8)], next(_steps))
    good = [agg.encrypt_message(m, AGG, ["p0", "p1"]) for m in msgs]
    assert agg.params.wire_primes == 1
    # Valid ciphertexts under the right key, but at the first level (three primes) or at another scale.
    for cipher, needle in [(CKKSCipher(public, 3, 2.0**40), "3 prime"), (CKKSCipher(public, 1, 2.0**30), r"2\^30")]:
        odd = good[1].replace(blobs={"c0": cipher.dump(cipher.encrypt([1.0] * 32))})
        with pytest.raises(ProtocolError, match=f"from p1 is not a fresh ciphertext at the agreed level.*{needle}"):
            agg.add_messages(AGG, [good[0], odd], LABEL)
    # TenSEAL's own vector format is not a SEAL ciphertext.
    vector = good[1].replace(blobs={"c0": ts.ckks_vector(public, [1.0] * 32).serialize()})
    with pytest.raises(ProtocolError, match="from p1 is not a valid CKKS ciphertext"):
        agg.add_messages(AGG, [good[0], vector], LABEL)
    missing = good[1].replace(blobs={})
    with pytest.raises(ProtocolError, match="sent 0 ciphertexts, expected 1"):
        agg.add_messages(AGG, [good[0], missing], LABEL)


def test_out_of_range_and_non_finite_values_are_refused_before_encryption():
    net = Network(roles(2), aggregation=CKKSAggregation("compact"))  # sums must stay below 2^18
    with pytest.raises(ProtocolError, match="above 1.311e\\+05, the most a sum over 2 parties"):
        net.aggregate(embeddings([torch.full((2, 2), 2e5), torch.ones(2, 2)], 0), LABEL, "sum")
    with pytest.raises(ProtocolError, match="NaN or infinite"):
        net.aggregate(embeddings([torch.tensor([1.0, math.nan]), torch.ones(2)], 1), LABEL, "sum")
    assert net.stats.messages_by_kind.get(CIPHERTEXT_KIND, 0) == 0  # nothing left a party


def test_bad_calls_are_refused(networks):
    net, _ = networks(3)
    step = next(_steps)
    with pytest.raises(UnsupportedError, match="only to the key holder"):
        net.aggregate(embeddings([torch.ones(2)] * 2, step), "p2", "sum")
    with pytest.raises(UnsupportedError, match="'sum' or 'mean'"):
        net.aggregate(embeddings([torch.ones(2)] * 2, step), LABEL, "max")
    with pytest.raises(ProtocolError, match="adds real numbers"):
        net.aggregate(embeddings([torch.ones(2, dtype=torch.int64)] * 2, step), LABEL, "sum")
    with pytest.raises(ProtocolError, match="do not match"):
        net.aggregate(embeddings([torch.ones(2), torch.ones(3)], step), LABEL, "sum")
    with pytest.raises(ProtocolError, match="two messages from one party"):
        net.aggregate([Message("embedding", "p0", LABEL, step, {"embedding": torch.ones(2)})] * 2, LABEL, "sum")
    with pytest.raises(ProtocolError, match="not feature parties"):
        net.aggregate([Message("embedding", p, LABEL, step, {"embedding": torch.ones(2)}) for p in ("p0", AGG)],
                      LABEL, "sum")


# -- disclosure control -----------------------------------------------------------------------------------------------


def test_a_sum_over_one_party_is_refused(networks):
    net, _ = networks(3)
    with pytest.raises(UnsupportedError, match="at least 2 parties"):
        net.aggregate(embeddings([torch.ones(2)], next(_steps)), LABEL, "sum")


def test_subset_sums_that_isolate_a_party_are_refused(networks):
    net, _ = networks(3)
    step = next(_steps)
    xs = [torch.randn(4, 2) for _ in range(3)]
    msgs = embeddings(xs, step)
    net.aggregate(msgs, LABEL, "mean")
    net.aggregate(msgs, LABEL, "mean")  # the same subset again reveals nothing new
    with pytest.raises(ProtocolError, match=r"solve for the output of p2"):
        net.aggregate(msgs[:2], LABEL, "mean")  # {p0,p1,p2} - {p0,p1} = p2
    # Overlapping pairs do not isolate anyone: (1,1,0) and (0,1,1) span no unit vector.
    step = next(_steps)
    msgs = embeddings(xs, step)
    net.aggregate(msgs[:2], LABEL, "sum")
    net.aggregate(msgs[1:], LABEL, "sum")
    with pytest.raises(ProtocolError, match="solve for the output of"):
        net.aggregate(msgs, LABEL, "sum")
    # A new step is new data: the same subsets are fine again.
    net.aggregate(embeddings(xs, next(_steps))[:2], LABEL, "sum")


# -- benchmark ------------------------------------------------------------------------------------------------------


# Fake section durations (wall ms, cpu ms) per party and step, chosen so that every ratio differs between the wall
# and CPU bases and from 1: a swapped basis, a wrong divisor or a section left out changes a reported number.
_FAKE_SECTION_MS = {
    "bare_encrypt": (2.0, 1.0), "bare_serialize": (0.5, 1.0), "bare_wire_encrypt": (1.0, 2.0),
    "pack": (0.25, 0.5), "encrypt": (0.75, 1.0), "serialize": (0.5, 0.25),
    "party_encrypt_message": (3.0, 2.0), "party_frame": (1.0, 1.0),
    "aggregator_read": (0.2, 0.1), "aggregator_deserialize": (0.3, 0.2), "aggregator_total": (0.4, 0.3),
    "label_decrypt": (0.6, 0.5), "step": (7.0, 5.0),
}


def test_crypto_bench_reports_costs_bytes_and_acceptance(monkeypatch):
    import argparse
    import resource

    from secvfl.bench import crypto
    from secvfl.bench.crypto import CryptoBench
    from secvfl.cli.registries import BENCHES, load_command_plugins

    clocked: dict[str, int] = {}

    def fake_clock(self, name, fn):  # runs every section for real, reports the fake duration
        out = fn()
        clocked[name] = clocked.get(name, 0) + 1
        self.add(name, *_FAKE_SECTION_MS[name])
        return out

    monkeypatch.setattr(crypto._Clock, "__call__", fake_clock)
    load_command_plugins()
    assert BENCHES.get("crypto") is CryptoBench
    parser = argparse.ArgumentParser()
    CryptoBench().add_arguments(parser)
    k, steps, batch, dim = 2, 2, 16, 8
    args = parser.parse_args(["--batch", str(batch), "--dim", str(dim), "--parties", str(k), "--steps", str(steps),
                              "--workers", "0"])
    out = CryptoBench().run(args)
    assert out["threads"] == 1
    assert 0 < out["peak_rss_mb"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + 0.1
    # Every section ran once per party (or once for the aggregator / label party) and step; 4 end-to-end runs.
    per_party = {"bare_encrypt", "bare_serialize", "bare_wire_encrypt", "pack", "encrypt", "serialize",
                 "party_encrypt_message", "party_frame"}
    assert clocked == {**{n: steps * k for n in per_party},
                       **{n: steps for n in _FAKE_SECTION_MS if n not in per_party and n != "step"},
                       "step": 4 * steps}
    comp = out["ckks_components"]
    assert comp["ciphertexts_per_party"] == 1
    ms = {basis: {n: v[i] for n, v in _FAKE_SECTION_MS.items()} for i, basis in enumerate(("wall", "cpu"))}
    for basis, t in ms.items():
        ours = t["party_encrypt_message"] + t["party_frame"]
        assert comp["party_cost_ratio"][basis] == pytest.approx({
            "vs_bare_encrypt": ours / t["bare_encrypt"],
            "vs_bare_encrypt_serialize": ours / (t["bare_encrypt"] + t["bare_serialize"]),
            "vs_bare_wire_encrypt": ours / t["bare_wire_encrypt"]}, abs=1e-3)
        assert comp["per_step"]["encrypt_ms"][basis] == pytest.approx(k * (t["pack"] + t["encrypt"]), abs=1e-3)
        assert comp["per_step"]["aggregate_ms"][basis] == pytest.approx(t["aggregator_read"] + t["aggregator_total"],
                                                                        abs=1e-3)
    assert out["acceptance"]["party_cost_ratio_cpu_vs_bare_encrypt"] == pytest.approx(3.0, abs=1e-3)
    assert out["acceptance"]["party_cost_ok"] is False  # 3.0 > the 1.3 limit
    runs = out["end_to_end"]
    assert set(runs) == {"ckks", "ckks_compact", "mask", "plain"}
    assert all(r["ms_per_step"] == pytest.approx({"wall_ms": 7.0, "cpu_ms": 5.0}) for r in runs.values())
    # Bytes are measured, not timed: exact for plaintext (the encoded embedding message), int64 words plus a small
    # header for masking, and for CKKS one ciphertext under its one 60-bit wire prime: two polynomials of 8192
    # 8-byte words plus headers (one ciphertext of 4096 slots carries these 128 floats).
    floats = batch * dim * 4
    plain_message = Message("embedding", "party0", crypto.LABEL, 1, {"embedding": torch.zeros(batch, dim)})
    assert runs["plain"]["bytes_per_party_per_step"] == len(encode(plain_message))
    assert 2 * floats < runs["mask"]["bytes_per_party_per_step"] < 2 * floats + 256
    for name in ("ckks", "ckks_compact"):
        assert 2 * 8192 * 8 < runs[name]["bytes_per_party_per_step"] < 2 * 8192 * 8 + 1024
    for r in runs.values():
        assert r["expansion_vs_float32"] == pytest.approx(r["bytes_per_party_per_step"] / floats, abs=1e-3)
    assert out["acceptance"]["ciphertext_expansion_vs_float32"] == runs["ckks"]["expansion_vs_float32"]  # a copy


# -- encryption in worker processes ---------------------------------------------------------------------------------


def test_worker_processes_encrypt_the_same_and_report_failures():
    agg = CKKSAggregation(workers=1)
    try:
        net = Network(roles(3), aggregation=agg)
        xs = [torch.rand(500, 20, dtype=torch.float64) * 200 - 100 for _ in range(3)]  # 2 ciphertexts per party
        out = net.aggregate(embeddings(xs, 0), LABEL, "mean").tensor("embedding")
        exact = torch.stack(xs).mean(0)
        assert ((out - exact).abs() <= agg.params.error_bound(3) / 3 + 1e-12).all()
        assert agg.describe()["encryption_workers"] == 1
        # 3 parties, 1 worker: the training process encrypts one party's share itself, the worker the other two.
        served = [agg._workers.serves(p) for p in agg.topology.feature_parties]
        assert sorted(served) == [False, True, True]
        with pytest.raises(ProtocolError, match="NaN"):  # checked in the party, before the worker is asked
            net.aggregate(embeddings([torch.tensor([math.nan])] * 3, 1), LABEL, "sum")
        agg._workers._procs[0].kill()
        agg._workers._procs[0].wait()
        with pytest.raises(ProtocolError, match="encryption worker 0"):
            net.aggregate(embeddings(xs, 2), LABEL, "sum")
    finally:
        agg.close()
    assert agg._workers is None


def test_ciphertext_bytes_survive_threads_and_forks(networks):
    """The SEAL bindings save and load through files: each thread and each forked process needs its own, and none
    may stay behind."""
    import glob
    import os
    import threading

    from protocols.ckks_cipher import _SCRATCH_DIR

    scratch = os.path.join(_SCRATCH_DIR or tempfile.gettempdir(), "secvfl-ct-*")
    before = set(glob.glob(scratch))

    net, agg = networks(2)
    net.aggregate(embeddings([torch.ones(2), torch.ones(2)], next(_steps)), LABEL, "sum")  # hands out contexts
    encryptor, decryptor = agg.cipher_of("p0"), agg.cipher_of(LABEL)
    values = {i: np.full(100, float(i)) for i in range(8)}
    blobs: dict[int, bytes] = {}

    def work(i: int) -> None:
        for _ in range(5):
            blobs[i] = encryptor.dump(encryptor.encrypt(values[i]))
            decryptor.load(blobs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, blob in blobs.items():
        assert np.allclose(decryptor.decrypt(decryptor.load(blob), 100), i, atol=1e-5)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child encrypts while the parent does too; neither may read the other's file
        os.close(read)
        ok = all(np.allclose(decryptor.decrypt(decryptor.load(encryptor.dump(encryptor.encrypt(values[1]))), 100), 1)
                 for _ in range(20))
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    for _ in range(20):
        assert np.allclose(decryptor.decrypt(decryptor.load(encryptor.dump(encryptor.encrypt(values[2]))), 100), 2)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(read)
    assert set(glob.glob(scratch)) <= before  # the child left through os._exit, and still nothing remains


class _ScheduledClocks:
    """Stands in for the epoch bench's wall clock and CPU counters: each training run (started by the bench's
    on_build hook, ended after run_training) takes the (wall s, cpu s) given for it, in round-robin order."""

    def __init__(self, schedule: list[tuple[float, float]]) -> None:
        self.schedule = iter(schedule)
        self.wall = self.cpu = 0.0
        self.run: tuple[float, float] | None = None
        self.wall_calls = self.cpu_calls = 0

    def perf_counter(self) -> float:
        self.wall_calls += 1
        if self.wall_calls % 2:  # a run starts
            self.run = next(self.schedule)
        else:
            self.wall += self.run[0]
        return self.wall

    def getrusage(self, who: int):  # noqa: ANN201
        import resource
        from types import SimpleNamespace

        if who == resource.RUSAGE_SELF:
            self.cpu_calls += 1
            if not self.cpu_calls % 2:
                self.cpu += self.run[1]
            return SimpleNamespace(ru_utime=self.cpu, ru_stime=0.0)
        return SimpleNamespace(ru_utime=0.0, ru_stime=0.0)  # the children's share stays 0 here


def test_epoch_bench_runs_every_variant_round_robin_and_compares_the_best(monkeypatch):
    import argparse
    import resource
    from types import SimpleNamespace

    from secvfl.bench import crypto
    from secvfl.bench.crypto import EPOCH_RATIO_LIMITS, PARALLEL_CKKS, mnist_epoch_hook

    order = ["plain", "ckks", "mask", "plain_threads", PARALLEL_CKKS]  # the bench's round-robin order
    wall = {"plain": [10.0, 12.0], "ckks": [45.0, 40.0], "mask": [13.0, 11.0], "plain_threads": [8.0, 9.0],
            PARALLEL_CKKS: [30.0, 33.0]}
    cpu = {"plain": [9.0, 10.0], "ckks": [40.0, 38.0], "mask": [12.0, 11.0], "plain_threads": [16.0, 18.0],
           PARALLEL_CKKS: [20.0, 22.0]}
    clocks = _ScheduledClocks([(wall[n][r], cpu[n][r]) for r in range(2) for n in order])
    monkeypatch.setattr(crypto, "time", SimpleNamespace(perf_counter=clocks.perf_counter))
    monkeypatch.setattr(resource, "getrusage", clocks.getrusage)
    args = argparse.Namespace(epoch_dataset="digits", data_dir=None, ckks_params="default", seed=0, threads=1,
                              workers=1, epoch_repeats=2)
    out = mnist_epoch_hook(args)
    monkeypatch.undo()
    assert out["repeats"] == 2 and clocks.wall_calls == 2 * 2 * len(order)  # every run was timed, start and end
    for name in order:
        assert out[name]["runs_wall_s"] == pytest.approx(wall[name]) and out[name]["wall_s"] == min(wall[name])
        assert out[name]["runs_cpu_s"] == pytest.approx(cpu[name]) and out[name]["cpu_s"] == min(cpu[name])
    assert out["ckks"]["ratio_vs_plain"] == pytest.approx({"wall": 4.0, "cpu": 4.22}, abs=1e-9)  # 40/10, 38/9
    assert out["mask"]["ratio_vs_plain"] == pytest.approx({"wall": 1.1, "cpu": 1.22}, abs=1e-9)  # 11/10, 11/9
    assert out[PARALLEL_CKKS]["wall_ratio_vs_best_plain"] == pytest.approx(3.75)  # 30 / plain on 2 threads (8)
    for name, limit in EPOCH_RATIO_LIMITS.items():
        assert out[name]["ratio_limit"] == limit
        assert out[name]["abs_metric_diff_vs_plain"]["accuracy"] <= 0.02  # same seed; CKKS noise, mask rounding
    # The metrics and bytes are the real runs': a trained digits model, ciphertexts 4x the floats.
    assert out["plain"]["test"]["accuracy"] > 0.5  # 10 classes
    assert out["ckks"]["bytes_total"] > 3 * out["plain"]["bytes_total"]


def test_parameters_whose_first_prime_is_too_small_send_two_primes():
    params = CKKSParams.parse("8192:50,40,40,60:35")  # 50 - 35 bits would carry sums only up to 2^13
    assert params.wire_primes == 2 and params.max_abs_sum == pytest.approx(2.0**53)
    agg = CKKSAggregation(params)
    net = Network(roles(2), aggregation=agg)
    xs = [torch.full((64, 64), 3000.0, dtype=torch.float64), torch.full((64, 64), 5000.0, dtype=torch.float64)]
    out = net.aggregate(embeddings(xs, 0), LABEL, "sum").tensor("embedding")
    assert ((out - 8000.0).abs() <= params.error_bound(2)).all()
    sent = agg.encrypt_message(embeddings(xs, 1)[0], AGG, ["p0", "p1"])
    assert len(sent.blobs) == 1 and agg.cipher_of(AGG).load(sent.blobs["c0"]).coeff_modulus_size() == 2


def test_small_preset_halves_the_bytes_of_a_default_vafl_step_and_stays_exact():
    """``--ckks-params small`` (N = 4096): 128-bit secure, and a vafl step at the default batch (64 x 16 floats per
    party) costs one ciphertext of two 4096-word polynomials under the 60-bit wire prime: bytes per party per step
    = 2 * 4096 * 8 + headers, half the default's 2 * 8192 * 8 + headers, for the same 1,024 floats."""
    small = CKKSParams.parse("small")
    assert small == CKKSParams.parse("4096:60,49:40")
    assert small.total_bits == HE_STANDARD_MAX_BITS[4096] == 109 and small.describe()["wire_primes"] == [60]
    assert small.max_abs_sum == PRESETS["default"].max_abs_sum and small.error_bound_per_party < 1e-6
    rng = np.random.default_rng(0)
    xs = [torch.from_numpy(rng.uniform(-100, 100, size=(64, 16))).float() for _ in range(3)]
    per_step = {}
    for spec in ("small", "default"):
        agg = CKKSAggregation(spec)
        net = Network(roles(3), aggregation=agg)
        out = net.aggregate(embeddings(xs, 0), LABEL, "mean").tensor("embedding")
        exact = torch.stack([x.double() for x in xs]).mean(0)
        tol = agg.params.error_bound(3) / 3 + torch.finfo(torch.float32).eps * exact.abs()
        assert ((out.double() - exact).abs() <= tol).all()
        per_step[spec] = net.stats.bytes_by_link[f"p0->{AGG}"]
        assert net.stats.messages_by_kind[CIPHERTEXT_KIND] == 3  # one ciphertext message per party
    assert 2 * 4096 * 8 < per_step["small"] <= 2 * 4096 * 8 + 1024
    assert 2 * 8192 * 8 < per_step["default"] <= 2 * 8192 * 8 + 1024
