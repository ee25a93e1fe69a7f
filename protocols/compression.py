"""Message compression: sparsification, stochastic quantisation and error feedback, as a protocol layer.

Specs (``--compress SPEC``, ``--compress-forward SPEC``, ``--compress-backward SPEC``) are ``+``-joined operators,
applied to every floating-point tensor of a message, flattened:

==================  ====================================================================================  =========
operator            wire form (per tensor of ``n`` elements)                                               unbiased
==================  ====================================================================================  =========
``topk:RATIO``      the ``k = ceil(RATIO * n)`` largest magnitudes: indices + values                      no
``randk:RATIO``     ``k`` uniformly random entries: a 64-bit seed + values, rescaled by ``n / k``          yes
``quant:BITS``      stochastic uniform quantisation on ``[min, max]`` with ``2^BITS - 1`` steps:           yes
                    ``BITS`` bits per value, bit-packed into uint8, + the range (2 floats)
``fp16`` / ``bf16`` values cast to half precision (deterministic rounding)                                 no
``fp32``            values cast to float32 (useful after a float64 algorithm)                              no
``ef``              EF21 error feedback (Richtarik et al., 2021): the sender sends ``C(x - g)``, and sender
                    and receiver both update ``g += C(x - g)``; the receiver uses ``g``
``vr``              DIANA-style shifted compression (variance reduction, Mishchenko et al., 2019): the receiver
                    uses the unbiased ``h + C(x - h)``, both update ``h += alpha C(x - h)``, ``alpha = 1/(1+omega)``  yes
==================  ====================================================================================  =========

At most one sparsifier (``topk``/``randk``, first) and one value codec (``quant``/``fp16``/``bf16``/``fp32``) may
be combined, e.g. ``topk:0.1+quant:8+ef``. ``ef`` and ``vr`` exclude each other; ``vr`` needs an unbiased spec.

Wire formats, all counted by the transport as they are encoded (nothing dense travels):

* indices use the smallest integer type that holds ``n``: uint8 (n <= 256), 16 bits (n <= 65536, carried in an int16
  tensor as ``index - 32768`` because the wire has no uint16), else int32;
* ``randk`` does not transmit indices: the sender draws a fresh 64-bit seed per tensor and message, sends it (8
  bytes), and both sides derive the same ``k`` indices from it with ``torch.randperm``. The selection is therefore
  independent of the data, which is what makes it unbiased and also why it composes with noise added earlier;
* values keep the tensor's dtype unless a codec changes it; quantised codes are packed ``BITS`` per value, little
  endian within each byte, ``ceil(m * BITS / 8)`` bytes for ``m`` values, plus the range ``[lo, hi]``;
* the message ``meta`` carries, per compressed tensor, the spec, shape and dtype needed to restore it (a few dozen
  header bytes, counted too).

Error feedback keeps state per (party, peer, message kind, tensor name), at the sender and (as a mirror) at the
receiver, so ``inbound`` can rebuild the estimate; a per-link sequence number in ``meta`` detects a lost or
reordered message (which would desynchronise the two copies) and raises :class:`ProtocolError`. A tensor whose size
changes restarts its state at zero on both sides. The state is meaningful only when successive messages on a link
carry *the same quantity* (a full-batch output, a parameter vector, the dual variable of a saddle-point method).
For per-batch messages (mini-batch embeddings of different rows), the sender must name the rows: ``meta["rows"] =
[split, ids...]`` (or a ``rows`` int64 tensor); the state is then kept per row, and ids travel packed like indices. A
per-batch message with ``ef``/``vr`` and no row ids is refused, because mixing one batch's memory into another
batch's rows silently corrupts them.

Placement and composition (stack position 10, see :mod:`protocols.plugins`):

* **Differential privacy: noise first, then compression.** The DP mechanisms add noise at the party, before the
  message enters the stack, so compression (including the data-dependent top-k choice and the error-feedback memory,
  which only ever sees noised releases) is post-processing and keeps the DP guarantee unchanged. Compressing first
  and noising the kept values would leak through the top-k indices and through the memory, and would need a new
  sensitivity analysis.
* **Secure aggregation (CKKS ``--he``, masking ``--secagg``)** adds the parties' forward outputs as encrypted or
  masked dense vectors: parties' sparse supports differ (top-k), and packed codes or seeds cannot be added by the
  aggregator, so forward compression is refused under them. Backward messages (the label party's plaintext
  gradients or dual variables) can still be compressed. Tell the layer the aggregation's name (``aggregation=``).
* **Secure channel** (position 90) seals the compressed bytes; it composes.

Threat model: compression adds no protection. Top-k indices reveal where a tensor is large; the error-feedback
memory at the receiver is an estimate of what the sender sent, no more than the receiver already learns.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from protocols.base import AlgorithmTraits, Layer
from secvfl.errors import ConfigError, ProtocolError
from secvfl.messages import WIRE_DTYPES, Message

__all__ = [
    "VALID_OPS",
    "CompressionSpec",
    "parse_spec",
    "topk_indices",
    "randk_indices",
    "index_dtype",
    "pack_indices",
    "unpack_indices",
    "pack_bits",
    "unpack_bits",
    "quantize",
    "dequantize",
    "compress_values",
    "decompress_values",
    "packed_size",
    "CompressionLayer",
    "SECURE_AGGREGATIONS",
    "COMPRESSION_POSITION",
    "specs_from_options",
    "secure_aggregation_name",
    "tag_rows",
]

SPARSIFIERS = ("topk", "randk")
CODECS = ("quant", "fp16", "bf16", "fp32")
FEEDBACK = ("ef", "vr")
VALID_OPS = ("topk:RATIO", "randk:RATIO", "quant:BITS", "fp16", "bf16", "fp32", "ef", "vr")
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MAX_BITS = 16
# Aggregations that add the parties' forward outputs homomorphically or under masks (protocols.ckks, protocols.secagg).
SECURE_AGGREGATIONS = ("ckks", "mask")


# ---------------------------------------------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompressionSpec:
    """A parsed compression spec. Build with :func:`parse_spec`."""

    sparsifier: str | None = None  # "topk" | "randk"
    ratio: float = 1.0
    codec: str | None = None  # "quant" | "fp16" | "bf16" | "fp32"
    bits: int = 0
    feedback: str | None = None  # "ef" | "vr"

    def __str__(self) -> str:
        parts = []
        if self.sparsifier:
            parts.append(f"{self.sparsifier}:{self.ratio:g}")
        if self.codec == "quant":
            parts.append(f"quant:{self.bits}")
        elif self.codec:
            parts.append(self.codec)
        if self.feedback:
            parts.append(self.feedback)
        return "+".join(parts)

    @property
    def unbiased(self) -> bool:
        """Whether the (rescaled) operator is an unbiased estimator of its input."""
        return self.sparsifier != "topk" and self.codec in (None, "quant")

    def kept(self, n: int) -> int:
        """Number of values a sparsifier keeps out of ``n``."""
        if self.sparsifier is None or n == 0:
            return n
        return min(n, max(1, math.ceil(self.ratio * n - 1e-9)))

    def omega(self, n: int) -> float:
        """Variance bound ``E||C(x) - x||^2 <= omega ||x||^2`` of the unbiased operator on ``n`` values."""
        if not self.unbiased:
            raise ConfigError(f"compression {self} is biased; it has no variance bound omega")
        k = self.kept(n)
        w_sparse = n / k - 1.0 if self.sparsifier == "randk" else 0.0
        w_quant = 0.0
        if self.codec == "quant":
            # per value Var <= step^2 / 4, step = (hi - lo) / s, (hi - lo)^2 <= 4 max|v|^2 <= 4 ||v||^2
            s = 2**self.bits - 1
            w_quant = k / s**2
        return (1.0 + w_sparse) * (1.0 + w_quant) - 1.0


def parse_spec(text: str | CompressionSpec | None) -> CompressionSpec | None:
    """Parse ``topk:0.1+quant:8+ef`` and friends; ``None``, ``""`` or ``"none"`` mean no compression."""
    if text is None or isinstance(text, CompressionSpec):
        return text
    text = str(text).strip()
    if text.lower() in ("", "none", "off"):
        return None
    valid = ", ".join(VALID_OPS)
    sparsifier, ratio, codec, bits, feedback = None, 1.0, None, 0, None
    for raw in text.split("+"):
        token = raw.strip().lower()
        name, _, arg = token.partition(":")
        if name in SPARSIFIERS:
            if sparsifier is not None:
                raise ConfigError(f"compression {text!r}: only one of topk/randk may be used")
            if codec is not None or feedback is not None:
                raise ConfigError(f"compression {text!r}: the sparsifier ({name}) must come first, e.g. topk:0.1+quant:8+ef")
            try:
                ratio = float(arg)
            except ValueError:
                raise ConfigError(f"compression {text!r}: {name} needs a ratio in (0, 1], e.g. {name}:0.1") from None
            if not (0.0 < ratio <= 1.0) or not math.isfinite(ratio):
                raise ConfigError(f"compression {text!r}: {name} ratio must be in (0, 1], got {arg}")
            sparsifier = name
        elif name in CODECS:
            if codec is not None:
                raise ConfigError(f"compression {text!r}: only one value codec (quant, fp16, bf16, fp32) may be used")
            if feedback is not None:
                raise ConfigError(f"compression {text!r}: put ef/vr last, e.g. quant:8+ef")
            if name == "quant":
                try:
                    bits = int(arg)
                except ValueError:
                    raise ConfigError(f"compression {text!r}: quant needs a bit width 1..{MAX_BITS}, e.g. quant:8") from None
                if not 1 <= bits <= MAX_BITS:
                    raise ConfigError(f"compression {text!r}: quant bits must be in 1..{MAX_BITS}, got {arg}")
            elif arg:
                raise ConfigError(f"compression {text!r}: {name} takes no argument")
            codec = name
        elif name in FEEDBACK:
            if arg:
                raise ConfigError(f"compression {text!r}: {name} takes no argument")
            if feedback is not None:
                raise ConfigError(f"compression {text!r}: use at most one of ef (EF21) and vr (DIANA shift)")
            feedback = name
        else:
            raise ConfigError(f"compression {text!r}: unknown operator {raw.strip()!r}; valid operators: {valid}")
    if sparsifier is None and codec is None:
        raise ConfigError(f"compression {text!r}: {feedback} needs an operator to feed back, e.g. topk:0.1+{feedback}")
    spec = CompressionSpec(sparsifier, ratio, codec, bits, feedback)
    if feedback == "vr" and not spec.unbiased:
        raise ConfigError(
            f"compression {text!r}: vr (shifted, variance-reduced compression) needs an unbiased operator "
            "(randk, quant); use ef for topk/fp16/bf16"
        )
    return spec


# ---------------------------------------------------------------------------------------------------------------
# Pure operators
# ---------------------------------------------------------------------------------------------------------------
def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the ``k`` largest magnitudes of the flat tensor ``x``."""
    if k >= x.numel():
        return torch.arange(x.numel())
    idx = torch.topk(x.abs(), k, sorted=False).indices
    return torch.sort(idx).values


def randk_indices(n: int, k: int, seed: int) -> torch.Tensor:
    """Sorted indices of ``k`` out of ``n`` drawn uniformly without replacement from ``seed`` (shared randomness)."""
    if k >= n:
        return torch.arange(n)
    g = torch.Generator().manual_seed(int(seed))
    return torch.sort(torch.randperm(n, generator=g)[:k]).values


def index_dtype(n: int) -> torch.dtype:
    """The wire dtype of indices into ``n`` elements."""
    if n <= 256:
        return torch.uint8
    if n <= 65536:
        return torch.int16  # as index - 32768: the wire has no uint16
    if n <= 2**31:
        return torch.int32
    raise ProtocolError(f"cannot index a tensor of {n} elements (more than 2^31)")


def pack_indices(idx: torch.Tensor, n: int) -> torch.Tensor:
    dt = index_dtype(n)
    if dt == torch.int16:
        return (idx.to(torch.int32) - 32768).to(torch.int16)
    return idx.to(dt)


def unpack_indices(packed: torch.Tensor, n: int) -> torch.Tensor:
    if packed.dtype != index_dtype(n):
        raise ProtocolError(f"index tensor has dtype {packed.dtype}, expected {index_dtype(n)} for {n} elements")
    idx = packed.to(torch.int64)
    if packed.dtype == torch.int16:
        idx = idx + 32768
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ProtocolError(f"compressed tensor has an index outside 0..{n - 1}")
    return idx


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integer codes (< 2^bits) into ``ceil(len * bits / 8)`` bytes, little endian."""
    c = codes.detach().cpu().numpy().astype(np.uint32, copy=False)
    if bits == 8:
        return torch.from_numpy(c.astype(np.uint8))
    planes = ((c[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return torch.from_numpy(np.packbits(planes.reshape(-1), bitorder="little"))


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` codes as int64."""
    need = -(-count * bits // 8)
    if packed.dtype != torch.uint8 or packed.numel() != need:
        raise ProtocolError(f"packed codes: expected {need} uint8 bytes for {count} x {bits} bits, got {packed.numel()}")
    p = packed.numpy()
    if bits == 8:
        return torch.from_numpy(p.astype(np.int64))
    planes = np.unpackbits(p, count=count * bits, bitorder="little").reshape(count, bits).astype(np.int64)
    return torch.from_numpy(planes @ (np.int64(1) << np.arange(bits, dtype=np.int64)))


def _range_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def quantize(v: torch.Tensor, bits: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastic uniform quantisation: (packed codes, [lo, hi]). Unbiased; error per value <= (hi - lo)/(2^bits-1)."""
    s = 2**bits - 1
    rd = _range_dtype(v.dtype)
    w = v.to(rd)
    if w.numel() == 0:
        return pack_bits(torch.zeros(0, dtype=torch.int64), bits), torch.zeros(2, dtype=rd)
    lo, hi = w.min(), w.max()
    width = hi - lo
    if width > 0:
        u = (w - lo) / width * s
        fl = torch.floor(u)
        codes = fl + (torch.rand(u.shape, generator=generator, dtype=rd) < (u - fl)).to(rd)
        codes = codes.clamp_(0, s).to(torch.int64)
    else:
        codes = torch.zeros(w.shape, dtype=torch.int64)
    return pack_bits(codes, bits), torch.stack([lo, hi])


def dequantize(packed: torch.Tensor, lohi: torch.Tensor, bits: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    s = 2**bits - 1
    codes = unpack_bits(packed, bits, count)
    if lohi.numel() != 2:
        raise ProtocolError("quantised tensor: the range must hold exactly [lo, hi]")
    lo, hi = lohi[0], lohi[1]
    return (lo + codes.to(lohi.dtype) * ((hi - lo) / s)).to(dtype)


def compress_values(
    x: torch.Tensor, spec: CompressionSpec, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Wire parts of the flat tensor ``x`` under ``spec`` (feedback is applied by the caller, not here).

    Keys: ``i`` indices (top-k), ``s`` seed (rand-k), ``v`` values, ``q`` packed codes, ``r`` quantisation range.
    Rand-k values are sent *unscaled*; :func:`decompress_values` and the layer apply ``n / k`` where unbiasedness
    needs it, so the same wire form serves plain, EF21 and shifted use.
    """
    n = x.numel()
    parts: dict[str, torch.Tensor] = {}
    if spec.sparsifier == "topk":
        idx = topk_indices(x, spec.kept(n))
        parts["i"] = pack_indices(idx, n)
        vals = x[idx]
    elif spec.sparsifier == "randk":
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        parts["s"] = torch.tensor([seed], dtype=torch.int64)
        vals = x[randk_indices(n, spec.kept(n), seed)]
    else:
        vals = x
    if spec.codec == "quant":
        parts["q"], parts["r"] = quantize(vals, spec.bits, generator)
    elif spec.codec in _CAST:
        parts["v"] = vals.to(_CAST[spec.codec])
    else:
        parts["v"] = vals.clone()
    return parts


def decompress_values(
    parts: Mapping[str, torch.Tensor], spec: CompressionSpec, n: int, dtype: torch.dtype
) -> tuple[torch.Tensor, float]:
    """Dense flat tensor rebuilt from wire parts (zeros where nothing was sent), and the unbiasing scale ``n / k``."""
    k = spec.kept(n)
    try:
        if spec.sparsifier == "topk":
            idx: torch.Tensor | None = unpack_indices(parts["i"], n)
        elif spec.sparsifier == "randk":
            idx = randk_indices(n, k, int(parts["s"].reshape(-1)[0]))
        else:
            idx = None
        m = k if idx is not None else n
        if spec.codec == "quant":
            vals = dequantize(parts["q"], parts["r"], spec.bits, m, dtype)
        else:
            vals = parts["v"].to(dtype)
    except KeyError as exc:
        raise ProtocolError(f"compressed tensor is missing its wire part {exc.args[0]!r} for spec {spec}") from None
    if vals.numel() != m or (idx is not None and idx.numel() != m):
        raise ProtocolError(f"compressed tensor carries {vals.numel()} values, expected {m} for spec {spec}")
    if idx is None:
        return vals.reshape(-1), 1.0
    dense = torch.zeros(n, dtype=dtype)
    dense[idx] = vals
    return dense, (n / k if spec.sparsifier == "randk" else 1.0)


def packed_size(spec: CompressionSpec, n: int, dtype: torch.dtype) -> int:
    """Payload bytes of one tensor of ``n`` elements under ``spec`` (what :func:`compress_values` produces)."""
    k = spec.kept(n)
    size = 0
    if spec.sparsifier == "topk":
        size += k * torch.empty((), dtype=index_dtype(n)).element_size()
    elif spec.sparsifier == "randk":
        size += 8
    if spec.codec == "quant":
        size += -(-k * spec.bits // 8) + 2 * torch.empty((), dtype=_range_dtype(dtype)).element_size()
    else:
        out = _CAST.get(spec.codec or "", dtype)
        size += k * torch.empty((), dtype=out).element_size()
    return size


# ---------------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------------
_SEP = "@"  # wire tensor names: "<tensor>@<part>"
_META = "compressed"


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())


class CompressionLayer(Layer):
    """Compresses forward and/or backward messages on the way out and restores dense tensors on the way in.

    ``forward``/``backward``: specs (strings or :class:`CompressionSpec`) for the algorithm's forward kinds (party
    outputs: embeddings, logits, ``A_k x_k``) and backward kinds (gradients, dual variables). The kinds come from the
    algorithm's traits at :meth:`check`, or explicitly. ``aggregation`` names the run's aggregation so the layer can
    refuse combinations that cannot work (forward compression under ``ckks`` or ``mask``). ``seed`` makes the
    senders' randomness (rand-k seeds, stochastic rounding) reproducible; each party draws from its own generator.
    """

    name: ClassVar[str] = "compress"

    def __init__(
        self,
        forward: str | CompressionSpec | None = None,
        backward: str | CompressionSpec | None = None,
        *,
        aggregation: str | None = "plain",
        forward_kinds: Iterable[str] | None = None,
        backward_kinds: Iterable[str] | None = None,
        seed: int = 0,
    ) -> None:
        self.forward = parse_spec(forward)
        self.backward = parse_spec(backward)
        self.aggregation = aggregation or "plain"
        self.forward_kinds = tuple(forward_kinds) if forward_kinds is not None else None
        self.backward_kinds = tuple(backward_kinds) if backward_kinds is not None else None
        self.seed = int(seed)
        self._rng: dict[str, torch.Generator] = {}
        self._memory: dict[str, dict[str, torch.Tensor]] = {}  # party -> state key -> g (EF21) or h (shift)
        self._seq: dict[str, dict[str, int]] = {}  # party -> link key -> messages so far
        self.counts: dict[str, dict[str, int]] = {
            d: {"messages": 0, "dense_bytes": 0, "wire_bytes": 0} for d in ("forward", "backward")
        }

    # -- validity ---------------------------------------------------------------------------------------------
    def check(self, traits: AlgorithmTraits) -> list[str]:
        if self.forward_kinds is None:
            self.forward_kinds = tuple(traits.forward_kinds)
        if self.backward_kinds is None:
            self.backward_kinds = tuple(traits.backward_kinds)
        problems = []
        if self.forward is not None and self.aggregation in SECURE_AGGREGATIONS and traits.aggregation != "none":
            what = "CKKS-encrypts" if self.aggregation == "ckks" else "masks"
            problems.append(
                f"forward compression ({self.forward}) cannot be combined with --{'he' if self.aggregation == 'ckks' else 'secagg'} "
                f"{self.aggregation}: that aggregation {what} each party's dense {'/'.join(traits.forward_kinds)} and adds "
                "them, and sparse supports that differ between parties (top-k), shared-seed selections or bit-packed "
                "codes cannot be added by the aggregator; compress the backward direction only (--compress-backward)"
            )
        if self.forward is None and self.backward is None:
            problems.append("no direction to compress: give a forward and/or backward spec")
        return problems

    def _direction(self, kind: str) -> tuple[str, CompressionSpec] | None:
        fk = self.forward_kinds if self.forward_kinds is not None else ("embedding",)
        bk = self.backward_kinds if self.backward_kinds is not None else ("gradient",)
        if self.forward is not None and kind in fk:
            return "forward", self.forward
        if self.backward is not None and kind in bk:
            return "backward", self.backward
        return None

    def _generator(self, party: str) -> torch.Generator:
        g = self._rng.get(party)
        if g is None:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + _stable_hash(party)) % 2**63)
            self._rng[party] = g
        return g

    # -- outbound ---------------------------------------------------------------------------------------------
    def outbound(self, messages: list[Message], party: str) -> list[Message]:
        return [self._compress(m, party) for m in messages]

    def _compress(self, m: Message, party: str) -> Message:
        found = self._direction(m.kind)
        if found is None or _META in m.meta:
            return m
        direction, spec = found
        rows = _row_ids(m) if spec.feedback else None
        if spec.feedback and rows is None and not m.meta.get("persistent", False):
            raise ProtocolError(
                f"{spec} on a {m.kind} message from {party}: error feedback needs either the message's rows "
                "(meta['rows'] = [split, ids...], for per-batch messages) or meta['persistent'] = true (the message "
                "carries the same quantity every step); without them one batch's memory would corrupt another's rows"
            )
        tensors: dict[str, torch.Tensor] = {}
        info: dict[str, Any] = {}
        gen = self._generator(party)
        for name, t in m.tensors.items():
            if not t.is_floating_point() or t.numel() == 0 or _SEP in name:
                tensors[name] = t
                continue
            if not bool(torch.isfinite(t).all()):
                raise ProtocolError(f"{m.kind} tensor {name!r} from {party} has non-finite values; refusing to compress")
            x = t.detach().cpu().reshape(-1)
            entry: dict[str, Any] = {"spec": str(spec), "shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
            if spec.feedback:
                key = f"{m.receiver}|{m.kind}|{name}"
                entry["seq"] = self._next_seq(party, key)
                memory = self._state(party, key, x, rows, t.shape)
                parts = compress_values(x - memory, spec, gen)
                raw, scale = decompress_values(parts, spec, x.numel(), x.dtype)
                self._update(party, key, raw, scale, spec, rows, t.shape, memory)
            else:
                parts = compress_values(x, spec, gen)
            for p, v in parts.items():
                tensors[f"{name}{_SEP}{p}"] = v
            if rows is not None:
                tensors[f"{name}{_SEP}rows"] = pack_indices(torch.as_tensor(rows[1]), _row_space(rows[1]))
                entry["rows"] = [rows[0], _row_space(rows[1])]
            info[name] = entry
            c = self.counts[direction]
            c["messages"] += 1
            c["dense_bytes"] += t.numel() * t.element_size()
            c["wire_bytes"] += sum(v.numel() * v.element_size() for v in parts.values())
        if not info:
            return m
        meta = {k: v for k, v in m.meta.items() if k != "rows"}
        meta[_META] = info
        return m.replace(tensors=tensors, meta=meta)

    # -- inbound ----------------------------------------------------------------------------------------------
    def inbound(self, message: Message, party: str) -> Message:
        info = message.meta.get(_META)
        if info is None:
            return message
        tensors = {k: v for k, v in message.tensors.items() if _SEP not in k}
        restored_rows: tuple[str, list[int]] | None = None
        for name, entry in info.items():
            try:
                spec = parse_spec(entry["spec"])
                shape = [int(s) for s in entry["shape"]]
                dtype = WIRE_DTYPES[entry["dtype"]]
            except (KeyError, TypeError, ValueError, ConfigError) as exc:
                raise ProtocolError(f"bad compression header for tensor {name!r}: {exc}") from None
            assert spec is not None
            n = math.prod(shape)
            parts = {
                k.rsplit(_SEP, 1)[1]: v for k, v in message.tensors.items() if k.rsplit(_SEP, 1)[0] == name and _SEP in k
            }
            raw, scale = decompress_values(parts, spec, n, dtype)
            if spec.feedback:
                key = f"{message.sender}|{message.kind}|{name}"
                seq = self._next_seq(party, key)
                if int(entry.get("seq", -1)) != seq:
                    raise ProtocolError(
                        f"compressed {message.kind} from {message.sender}: sequence {entry.get('seq')} but {party} "
                        f"expected {seq}; a message was lost or reordered, so the error-feedback states diverged"
                    )
                rows = None
                if "rows" in entry:
                    space = int(entry["rows"][1])
                    if "rows" not in parts:
                        raise ProtocolError(f"compressed tensor {name!r} names rows but carries no row ids")
                    rows = (str(entry["rows"][0]), unpack_indices(parts["rows"], space).tolist())
                    restored_rows = rows
                memory = self._state(party, key, raw, rows, shape)
                estimate = self._update(party, key, raw, scale, spec, rows, shape, memory)
                out = estimate
            else:
                out = raw * scale if scale != 1.0 else raw
            tensors[name] = out.reshape(shape)
        meta = {k: v for k, v in message.meta.items() if k != _META}
        if restored_rows is not None:
            meta["rows"] = [restored_rows[0], *restored_rows[1]]
        return message.replace(tensors=tensors, meta=meta, wire_size=message.wire_size)

    # -- feedback state ---------------------------------------------------------------------------------------
    def _next_seq(self, party: str, key: str) -> int:
        seqs = self._seq.setdefault(party, {})
        seqs[key] = seqs.get(key, -1) + 1
        return seqs[key]

    def _state(
        self, party: str, key: str, x: torch.Tensor, rows: tuple[str, list[int]] | None, shape: Any
    ) -> torch.Tensor:
        """The memory (flat, like ``x``) this message is compressed against, created or restarted as needed."""
        mem = self._memory.setdefault(party, {})
        if rows is None:
            g = mem.get(key)
            if g is None or g.numel() != x.numel() or g.dtype != x.dtype:
                g = torch.zeros(x.numel(), dtype=x.dtype)
                mem[key] = g
            return g
        split, ids = rows
        width = x.numel() // max(1, len(ids))
        rkey = f"{key}|rows:{split}"
        table = mem.get(rkey)
        need = max(ids) + 1 if ids else 0
        if table is None or table.shape[1] != width or table.dtype != x.dtype:
            table = torch.zeros((need, width), dtype=x.dtype)
        elif table.shape[0] < need:
            table = torch.cat([table, torch.zeros((need - table.shape[0], width), dtype=x.dtype)])
        mem[rkey] = table
        return table[torch.as_tensor(ids)].reshape(-1)

    def _update(
        self,
        party: str,
        key: str,
        raw: torch.Tensor,
        scale: float,
        spec: CompressionSpec,
        rows: tuple[str, list[int]] | None,
        shape: Any,
        memory: torch.Tensor,
    ) -> torch.Tensor:
        """Advance the memory by this message and return the receiver's estimate (identical at both ends)."""
        if spec.feedback == "ef":
            new = memory + raw  # EF21: g <- g + C(x - g); rand-k unscaled (contractive)
            estimate = new
        else:
            unbiased = raw * scale
            estimate = memory + unbiased  # shifted compression: h + C(x - h), unbiased
            new = memory + unbiased / (1.0 + spec.omega(raw.numel()))
        mem = self._memory[party]
        if rows is None:
            mem[key] = new
        else:
            table = mem[f"{key}|rows:{rows[0]}"]
            table[torch.as_tensor(rows[1])] = new.reshape(len(rows[1]), -1)
        return estimate.clone()

    # -- facts and state --------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layer": self.name,
            "forward": str(self.forward) if self.forward else None,
            "backward": str(self.backward) if self.backward else None,
            "placement": "after DP noise (post-processing), before encryption/secure channel",
        }
        for d, c in self.counts.items():
            if c["messages"]:
                out[f"{d}_payload"] = {**c, "ratio": c["dense_bytes"] / max(1, c["wire_bytes"])}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "rng": {p: g.get_state() for p, g in self._rng.items()},
            "memory": {p: dict(m) for p, m in self._memory.items()},
            "seq": {p: dict(s) for p, s in self._seq.items()},
            "counts": {d: dict(c) for d, c in self.counts.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ConfigError(f"resuming a compressed run with seed {self.seed}, but it was started with {state['seed']}")
        self._rng = {}
        for p, s in state.get("rng", {}).items():
            self._generator(p).set_state(s)
        self._memory = {p: {k: v.clone() for k, v in m.items()} for p, m in state.get("memory", {}).items()}
        self._seq = {p: {k: int(v) for k, v in s.items()} for p, s in state.get("seq", {}).items()}
        for d, c in state.get("counts", {}).items():
            self.counts[d] = {k: int(v) for k, v in c.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    for k, v in WIRE_DTYPES.items():
        if v == dtype:
            return k
    raise ProtocolError(f"dtype {dtype} has no wire format")


def _row_ids(m: Message) -> tuple[str, list[int]] | None:
    """``(split, ids)`` of a per-batch message, from ``meta['rows'] = [split, id, id, ...]`` if the sender gave it."""
    rows = m.meta.get("rows")
    if rows is None:
        return None
    if not isinstance(rows, (list, tuple)) or not rows or not isinstance(rows[0], str):
        raise ProtocolError("meta['rows'] must be [split, id, id, ...]")
    ids = [int(i) for i in rows[1:]]
    if any(i < 0 for i in ids):
        raise ProtocolError("meta['rows'] has a negative row id")
    return str(rows[0]), ids


def _row_space(ids: list[int]) -> int:
    """Index space for row ids (rounded up to a power of two, so it does not leak the largest id exactly)."""
    top = max(ids) + 1 if ids else 1
    return 1 << max(8, (top - 1).bit_length())


# ---------------------------------------------------------------------------------------------------------------
# Command line: --compress, --compress-forward, --compress-backward
# ---------------------------------------------------------------------------------------------------------------
COMPRESSION_POSITION = 10  # innermost: after DP noise (added at the party), before the secure channel (90)


def specs_from_options(
    both: str | None, forward: str | None, backward: str | None
) -> tuple[CompressionSpec | None, CompressionSpec | None]:
    """Resolve the three flags: ``--compress`` sets both directions, the per-direction flags override it."""
    f = parse_spec(forward) if forward is not None else parse_spec(both)
    b = parse_spec(backward) if backward is not None else parse_spec(both)
    return f, b


def secure_aggregation_name(options: Mapping[str, Any]) -> str:
    """The aggregation a run uses, from the --he / --secagg flags ("plain" when neither is on)."""
    if (options.get("he") or "none") != "none":
        return str(options["he"])
    if (options.get("secagg") or "none") != "none":
        return str(options["secagg"])
    return "plain"


def tag_rows(algo: Any) -> bool:
    """Make a split-style algorithm name the rows of its per-batch messages, so error feedback can key its memory.

    Wraps each feature party's ``forward(step, split, ids, ...)`` and the label party's ``train_step(step, ids, ...)``
    (the code runs as those parties, which know the ids already: batches come from a shared seed). The ids travel
    packed with the compressed tensor and are counted. Returns False when the algorithm has no such parties.
    """
    fps = getattr(algo, "feature_parties", None)
    lp = getattr(algo, "label_party", None)
    if not fps or lp is None or not all(callable(getattr(fp, "forward", None)) for fp in fps):
        return False
    if not callable(getattr(lp, "train_step", None)):
        return False

    def wrap_forward(fp: Any) -> None:
        original = fp.forward

        def forward(step: int, split: str, ids: Any, receiver: str, **kw: Any) -> Message:
            msg = original(step, split, ids, receiver, **kw)
            return msg.replace(meta={**msg.meta, "rows": [split, *(int(i) for i in np.asarray(ids).reshape(-1))]})

        fp.forward = forward

    for fp in fps:
        wrap_forward(fp)
    original_step = lp.train_step

    def train_step(step: int, ids: Any, *args: Any, **kw: Any) -> tuple[float, list[Message]]:
        loss, msgs = original_step(step, ids, *args, **kw)
        rows = ["train", *(int(i) for i in np.asarray(ids).reshape(-1))]
        return loss, [m.replace(meta={**m.meta, "rows": rows}) for m in msgs]

    lp.train_step = train_step
    return True


def _register_plugin() -> None:
    import argparse

    from protocols.plugins import PROTOCOLS, ProtocolPlugin, ProtocolSetup
    from secvfl.errors import UnsupportedError

    class CompressionPlugin(ProtocolPlugin):
        """``--compress SPEC`` (both directions), ``--compress-forward SPEC``, ``--compress-backward SPEC``."""

        name = "compression"

        def add_arguments(self, parser: argparse.ArgumentParser | Any) -> None:
            ops = "topk:RATIO, randk:RATIO, quant:BITS, fp16, bf16, fp32, joined with '+', then optionally +ef or +vr"
            parser.add_argument(
                "--compress", default=None, metavar="SPEC",
                help=f"compress forward and backward messages ({ops}), e.g. topk:0.1+ef or randk:0.1+quant:8",
            )
            parser.add_argument("--compress-forward", default=None, metavar="SPEC",
                                help="compression of forward messages (embeddings, outputs); overrides --compress")
            parser.add_argument("--compress-backward", default=None, metavar="SPEC",
                                help="compression of backward messages (gradients, duals); overrides --compress")

        def configure(self, cfg: Any, traits: AlgorithmTraits, ctx: Any) -> ProtocolSetup | None:
            both = cfg.option("compress")
            ratio = cfg.option("compress_ratio")  # options-only form {"compress": "topk", "compress_ratio": r}
            if ratio is not None and both in SPARSIFIERS:
                both = f"{both}:{ratio}"
            fwd, bwd = specs_from_options(both, cfg.option("compress_forward"), cfg.option("compress_backward"))
            if fwd is None and bwd is None:
                return None
            if not traits.forward_kinds and not traits.backward_kinds:
                raise UnsupportedError(f"--compress: algorithm {traits.name!r} exchanges no embeddings or gradients")
            layer = CompressionLayer(fwd, bwd, aggregation=secure_aggregation_name(cfg.options), seed=cfg.seed)
            problems = layer.check(traits)
            if problems:
                raise UnsupportedError(f"--compress is not valid for algorithm {traits.name!r}: " + "; ".join(problems))
            feedback = any(s is not None and s.feedback for s in (fwd, bwd))

            def attach(algo: Any) -> None:
                if not feedback or getattr(algo, "persistent_messages", False):
                    return
                if not tag_rows(algo):
                    raise UnsupportedError(
                        f"--compress ...+ef/+vr: algorithm {traits.name!r} sends per-batch messages without naming "
                        "their rows, so error feedback cannot keep a per-row memory; drop +ef/+vr"
                    )

            return ProtocolSetup(
                layers=[(COMPRESSION_POSITION, layer)], attach=[attach],
                summary=lambda: {"compression": layer.describe()},
            )

    if "compress" not in PROTOCOLS:
        PROTOCOLS.add("compress", CompressionPlugin())


_register_plugin()
