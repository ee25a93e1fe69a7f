"""Fuzzing the strict decoder with mutated real messages of every kind (issue 14, section 1).

The corpus is captured at the transport while short real runs train with every protocol layer (see
``secvfl.bench.decode``). The property, for any mutation: ``decode`` raises ``MessageError``, or returns a message
whose header is exactly what the standard library's JSON reader finds in the bytes (types included: ``true`` is not
``1``, ``2.0`` is not ``2``), whose payload is the bytes that follow, and which re-encodes to the very same bytes --
nothing refused with another exception, nothing silently coerced. Decode time per case is measured by
``secvfl bench decode`` (BENCHMARKS.md), not asserted here.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secvfl.bench.decode import RandomDraw, capture_corpus, check_decode, mutate
from secvfl.messages import KINDS, WIRE_DTYPES, Message

_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


@pytest.fixture(scope="session")
def corpus() -> dict[str, list[bytes]]:
    return capture_corpus()


class HypothesisDraw:
    """The mutations' choices, drawn through hypothesis (so failures shrink and replay)."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options):
        return self.data.draw(st.sampled_from(options))


def _typed(value):
    """A JSON value with its types spelled out, so that equality is exact (``True != 1``, ``2.0 != 2``)."""
    if isinstance(value, dict):
        return ("object", [(k, _typed(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return ("array", [_typed(v) for v in value])
    return (type(value).__name__, value)


def _reference_header(message: Message) -> dict:
    return {
        "kind": message.kind, "sender": message.sender, "receiver": message.receiver, "step": message.step,
        "meta": dict(message.meta),
        "tensors": [[n, _DTYPE_NAMES[t.dtype], list(t.shape)] for n, t in message.tensors.items()],
        "blobs": [[n, len(b)] for n, b in message.blobs.items()],
    }


def assert_strict(original: bytes, mutated: bytes) -> None:
    outcome, message, exc, _ = check_decode(mutated)
    assert outcome in ("accepted", "refused"), f"{outcome}: {type(exc).__name__}: {exc}"
    if mutated == original:
        assert outcome == "accepted"
    if outcome == "refused":
        return
    # Independent reading of the same bytes: the standard library's JSON parser on the header.
    hlen = int.from_bytes(mutated[5:9], "little")
    reference = json.loads(mutated[9 : 9 + hlen])
    assert _typed(reference) == _typed(_reference_header(message))
    payload = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
                       for t in message.tensors.values())
    assert payload + b"".join(message.blobs.values()) == mutated[9 + hlen :]


def test_corpus_has_every_registered_kind(corpus):
    # A kind some layer registers but no captured run produces would go unfuzzed: add a producer to the corpus.
    assert {key.split("[")[0] for key in corpus} == KINDS
    assert {"embedding[sealed]", "gradient[compressed]"} <= set(corpus)


def test_unmutated_messages_decode_to_themselves(corpus):
    for originals in corpus.values():
        for data in originals:
            assert_strict(data, data)


def _fuzz(corpus, data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(corpus)), label="kind")
    original = data.draw(st.sampled_from(corpus[key]), label="original")
    mutated, _ = mutate(original, HypothesisDraw(data))
    assert_strict(original, mutated)


_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=400, **_SETTINGS)
@given(data=st.data())
def test_mutated_messages_decode_exactly_or_raise_message_error(corpus, data):
    _fuzz(corpus, data)


@pytest.mark.slow
@settings(max_examples=10_000, **_SETTINGS)
@given(data=st.data())
def test_ten_thousand_mutated_messages_decode_exactly_or_raise_message_error(corpus, data):
    _fuzz(corpus, data)


@pytest.mark.slow
def test_ten_thousand_seeded_mutations_of_every_kind(corpus):
    # The acceptance run: >= 10^4 mutations per kind, the same cases `secvfl bench decode --seed 0` times.
    draw = RandomDraw(0)
    for key, originals in corpus.items():
        bad = []
        for i in range(10_000):
            mutated, names = mutate(originals[i % len(originals)], draw)
            outcome, _, exc, _ = check_decode(mutated)
            if outcome not in ("accepted", "refused"):
                bad.append((names, outcome, f"{type(exc).__name__}: {exc}"[:200]))
        assert not bad, f"{key}: {len(bad)} of 10000 cases, e.g. {bad[:3]}"


def test_bench_decode_reports_every_kind_and_its_time_distribution(corpus, monkeypatch):
    import argparse

    import secvfl.bench.decode as bench

    monkeypatch.setattr(bench, "capture_corpus", lambda per_kind: corpus)  # the session's capture, not a new one
    out = bench.DecodeBench().run(argparse.Namespace(cases=30, per_kind=6, seed=1, repeats=1, threads=1))
    assert set(out["kinds"]) == set(corpus)
    total = out["total"]
    assert total["cases"] == 30 * len(corpus) == total["accepted"] + total["refused"]
    assert total["crash"] == total["coerced"] == 0 and out["failures"] == []
    for row in (total, *out["kinds"].values()):
        assert 0 < row["median_us"] <= row["p99_us"] <= row["max_us"]
    assert out["typical_embedding"]["bytes"] > out["typical_embedding"]["payload_bytes"] == 256 * 64 * 4


def test_bench_decode_refuses_zero_cases():
    import argparse

    from secvfl.bench.decode import DecodeBench
    from secvfl.errors import ConfigError

    with pytest.raises(ConfigError, match="--cases and --per-kind must be at least 1"):
        DecodeBench().run(argparse.Namespace(cases=0, per_kind=6, seed=0, repeats=1, threads=1))
