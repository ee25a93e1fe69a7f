"""Message compression: sparsification, stochastic quantisation and error feedback, as a protocol layer.

Specs (``--compress SPEC``, ``--compress-forward SPEC``, ``--compress-backward SPEC``) are ``+``-joined operators,
applied to every floating-point tensor of a message, flattened:

==================  ====================================================================================  =========
operator            wire form (per tensor of ``n`` elements)                                               unbiased
==================  ====================================================================================  =========
``topk:RATIO``      the ``k = ceil(RATIO * n)`` largest magnitudes: indices + values; on a batch of        no
                    samples (a non-persistent tensor of 2+ dimensions) the ``ceil(RATIO * width)`` largest
                    of *each row*, so every sample keeps a representation and no row's wire form depends
                    on the other rows of its batch (predictions do not depend on batch composition)
``randk:RATIO``     ``k`` uniformly random entries: a 64-bit seed + values, rescaled by ``n / k``          yes
``quant:BITS``      stochastic uniform quantisation on ``[min, max]`` with ``2^BITS - 1`` steps:           yes
                    ``BITS`` bits per value, bit-packed into uint8, + the range (2 floats)
``fp16`` / ``bf16`` values cast to half precision (deterministic rounding)                                 no
``fp32``            values cast to float32 (useful after a float64 algorithm)                              no
``ef``              error feedback. For persistent messages (the same quantity every round: full-batch
                    outputs, duals): EF21 (Richtarik et al., 2021), the sender sends ``C(x - g)``, sender and
                    receiver both update ``g += C(x - g)``, the receiver uses ``g``. For per-row *gradients*
                    (backward messages with rows), which the receiver adds into its parameters: the sender
                    sends ``C(x + e)`` and keeps ``e <- x + e - C(x + e)`` for the row's next message (Seide et al.
                    2014; Stich et al. 2018), so no gradient mass is lost; an EF21 estimate of a row's gradient
                    would mix in the row's stale gradient from its previous batch. Per-batch forward outputs
                    keep no memory (see below)
``vr``              DIANA-style shifted compression (variance reduction, Mishchenko et al., 2019): the receiver
                    uses the unbiased ``h + C(x - h)``, both update ``h += alpha C(x - h)``, ``alpha = 1/(1+omega)``  yes
==================  ====================================================================================  =========

At most one sparsifier (``topk``/``randk``, first) and one value codec (``quant``/``fp16``/``bf16``/``fp32``) may
be combined, e.g. ``topk:0.1+quant:8+ef``. ``ef`` and ``vr`` exclude each other; ``vr`` needs an unbiased spec.

Wire formats, all counted by the transport as they are encoded (nothing dense travels):

* a top-k support travels as indices in the smallest integer type that holds ``n`` (uint8 for n <= 256; 16 bits
  for n <= 65536, carried in an int16 tensor as ``index - 32768`` because the wire has no uint16; else int32) or as
  an ``n``-bit mask, whichever is smaller (the mask wins once ``k/n`` exceeds 1/16 with 16-bit indices);
* ``randk`` does not transmit indices: the sender draws a fresh 64-bit seed per tensor and message, sends it (8
  bytes), and both sides derive the same ``k`` indices from it (numpy PCG64, sampling without replacement). The
  selection is independent of the data, which is what makes it unbiased and also why it composes with noise
  added earlier. Under ``ef`` the values are not rescaled by ``n / k`` (EF21 needs a contractive operator);
* values keep the tensor's dtype unless a codec changes it; quantised codes are packed ``BITS`` per value, little
  endian within each byte, ``ceil(m * BITS / 8)`` bytes for ``m`` values, plus the range ``[lo, hi]``;
* the message ``meta["cmp"]`` carries, per compressed tensor, its shape, dtype, the link's sequence number (with
  memory) and the row width (row-wise top-k) -- a few dozen header bytes, counted too. The spec itself does not
  travel: both ends are configured with the same ``--compress`` flags.

Error feedback keeps state per (party, peer, message kind, tensor name), at the sender and (as a mirror) at the
receiver, so ``inbound`` can rebuild the estimate; the sequence number detects a lost or reordered message (which
would desynchronise the two copies) and raises :class:`ProtocolError`. A tensor whose size changes restarts its
state at zero on both sides. The state is meaningful only when successive messages on a link carry *the same
quantity*: a message says so with ``meta["persistent"] = true`` (a full-batch output, the dual variable of a
saddle-point method), or names its rows with ``meta["rows"]`` (per-batch embeddings), and the state is then kept per
row. Rows are described by explicit ids (packed like indices and counted), a contiguous range, or a slice of the
public shared-seed batch order (nothing but three integers travels; see :class:`CompressionLayer`). A feedback
message with neither is refused, because mixing one batch's memory into another batch's rows silently corrupts them.

Algorithms whose every link carries the same full-batch quantity each round (``AlgorithmTraits.persistent_messages``:
the saddle family's eg, gd, nesterov, admm) are refused a sparsifier without ``ef``/``vr`` (:meth:`CompressionLayer.check`):
without memory a rand-k copy's error (``n/k - 1`` times the vector's squared size) enters every iterate and they
diverge (a9a, ``randk:0.1``: NaN at epoch 7), and a top-k copy drops the same entries every round (a9a: accuracy below
the majority class). Codecs alone (``quant``, ``fp16``...) lose only precision and are accepted.

Which messages keep memory under ``ef``/``vr``: persistent messages (EF21 / shift) and per-row backward gradients
(residual / shift per row). Per-batch *forward* outputs are compressed without memory: at prediction time there is
no memory for new rows, so the receiver must learn from the compressed form it will see then (see
:meth:`CompressionLayer._mode`). The gradient that goes back for a top-k-compressed training batch is taken
through the selection (zero outside the support the receiver saw; :meth:`CompressionLayer._mask_gradients`):
compressed split learning then trains exactly the model "bottom, then per-row top-k", and a top-k of the same
ratio on the gradient is lossless. Evaluation/prediction outputs (``meta["eval"] = true``), with ``--compress-eval
auto`` (default), are compressed like the link's training messages when those used no memory (train/predict
consistency) and sent dense otherwise (a linear model's test outputs, say); ``dense`` and ``compress`` force either.
They are counted like everything else.

Placement and composition (stack position 10, see :mod:`secvfl.plugins`):

* **Differential privacy: noise first, then compression.** The DP mechanisms add noise at the party, before the
  message enters the stack, so compression (including the data-dependent top-k choice and the error-feedback memory,
  which only ever sees noised releases) is post-processing and keeps the DP guarantee unchanged. Compressing first
  and noising the kept values would leak through the top-k indices and through the memory, and would need a new
  sensitivity analysis.
* **Secure aggregation (CKKS ``--he``, masking ``--secagg``)** adds the parties' forward outputs as encrypted or
  masked dense vectors: parties' sparse supports differ (top-k), and packed codes or seeds cannot be added by the
  aggregator, so forward compression is refused under them (the layer says what it makes of the outputs,
  :meth:`CompressionLayer.encoded_outputs`; such an aggregation declares ``accepts_encoded = False``, and
  ``check_stack`` refuses the pair). Backward messages (the label party's plaintext gradients or dual variables) can
  still be compressed.
* **Secure channel** (position 90) seals the compressed bytes; it composes.

Threat model: compression adds no protection. Top-k indices reveal where a tensor is large; the error-feedback
memory at the receiver is an estimate of what the sender sent, no more than the receiver already learns.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from secvfl.errors import ConfigError, ProtocolError, UnsupportedError
from secvfl.messages import WIRE_DTYPES, Message
from secvfl.options import Options, option
from secvfl.parties import ProtocolHooks
from secvfl.plugins import ProtocolPlugin, ProtocolSetup
from secvfl.transport.layers import AlgorithmTraits, Layer

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
    "COMPRESSION_POSITION",
    "specs_from_options",
    "tag_rows",
    "CompressionOptions",
    "CompressionPlugin",
]

SPARSIFIERS = ("topk", "randk")
CODECS = ("quant", "fp16", "bf16", "fp32")
FEEDBACK = ("ef", "vr")
VALID_OPS = ("topk:RATIO", "randk:RATIO", "quant:BITS", "fp16", "bf16", "fp32", "ef", "vr")
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MAX_BITS = 16


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
    """Sorted indices of ``k`` out of ``n`` drawn uniformly without replacement from ``seed`` (shared randomness).

    numpy's PCG64 stream from the seed (Floyd-style sampling, O(k)); both ends derive the same indices.
    """
    if k >= n:
        return torch.arange(n)
    return torch.from_numpy(_randk_cached(int(n), int(k), int(seed)).copy())


@functools.lru_cache(maxsize=256)
def _randk_cached(n: int, k: int, seed: int) -> np.ndarray:
    # A pure function of public values (the seed is on the wire); the cache only saves recomputation when sender
    # and receiver run in one process. The array is read-only so no caller can change a cached result.
    idx = np.sort(np.random.default_rng(seed).choice(n, k, replace=False, shuffle=False)).astype(np.int64)
    idx.setflags(write=False)
    return idx


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


def _support_bytes(n: int, k: int, row_width: int = 0) -> tuple[str, int]:
    """How a top-k support travels: ``"i"`` (k indices) or ``"m"`` (an n-bit mask), whichever is smaller.

    Row-wise (``row_width`` > 0) indices count within a row, so they fit a narrower type.
    """
    space = row_width or n
    idx = k * torch.empty((), dtype=index_dtype(space)).element_size()
    mask = -(-n // 8)
    return ("m", mask) if mask < idx else ("i", idx)


def _kept_total(spec: CompressionSpec, n: int, row_width: int) -> int:
    if spec.sparsifier == "topk" and row_width:
        return (n // row_width) * spec.kept(row_width)
    return spec.kept(n)


def compress_values(
    x: torch.Tensor, spec: CompressionSpec, generator: torch.Generator, *, row_width: int = 0
) -> dict[str, torch.Tensor]:
    """Wire parts of the flat tensor ``x`` under ``spec`` (feedback is applied by the caller, not here).

    Keys: ``i`` indices or ``m`` bitmask (top-k: whichever is smaller), ``s`` seed (rand-k), ``v`` values,
    ``q`` packed codes, ``r`` quantisation range. Rand-k values are sent *unscaled*; :func:`decompress_values`
    returns the ``n / k`` factor separately, so the same wire form serves plain, EF21 and shifted use.
    ``row_width`` > 0: top-k keeps the ``k`` largest magnitudes of *each row* of that width (a batch of samples:
    every sample keeps a representation, and one row's wire form does not depend on the other rows in its batch).
    """
    n = x.numel()
    parts: dict[str, torch.Tensor] = {}
    if spec.sparsifier == "topk":
        if row_width and n % row_width:
            raise ProtocolError(f"a tensor of {n} values is not made of rows of width {row_width}")
        k = _kept_total(spec, n, row_width)
        if row_width:
            kr = spec.kept(row_width)
            local = torch.sort(torch.topk(x.view(-1, row_width).abs(), kr, dim=1).indices, dim=1).values
            idx = (local + torch.arange(0, n, row_width)[:, None]).reshape(-1)
        else:
            idx = topk_indices(x, k)
        if _support_bytes(n, k, row_width)[0] == "m":
            mask = torch.zeros(n, dtype=torch.int64)
            mask[idx] = 1
            parts["m"] = pack_bits(mask, 1)
        else:
            parts["i"] = pack_indices(local.reshape(-1) if row_width else idx, row_width or n)
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
    parts: Mapping[str, torch.Tensor], spec: CompressionSpec, n: int, dtype: torch.dtype, *, row_width: int = 0
) -> tuple[torch.Tensor, float]:
    """Dense flat tensor rebuilt from wire parts (zeros where nothing was sent), and the unbiasing scale ``n / k``."""
    if spec.sparsifier == "topk" and row_width and (row_width < 0 or n % row_width):
        raise ProtocolError(f"a tensor of {n} values is not made of rows of width {row_width}")
    k = _kept_total(spec, n, row_width)
    try:
        if spec.sparsifier == "topk":
            if "m" in parts:
                idx: torch.Tensor | None = torch.nonzero(unpack_bits(parts["m"], 1, n)).reshape(-1)
            elif row_width:
                local = unpack_indices(parts["i"], row_width)
                if local.numel() != k:
                    raise ProtocolError(f"row-wise top-k carries {local.numel()} indices, expected {k}")
                idx = (local.view(-1, spec.kept(row_width)) + torch.arange(0, n, row_width)[:, None]).reshape(-1)
            else:
                idx = unpack_indices(parts["i"], n)
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


def packed_size(spec: CompressionSpec, n: int, dtype: torch.dtype, *, row_width: int = 0) -> int:
    """Payload bytes of one tensor of ``n`` elements under ``spec`` (what :func:`compress_values` produces)."""
    k = _kept_total(spec, n, row_width)
    size = 0
    if spec.sparsifier == "topk":
        size += _support_bytes(n, k, row_width)[1]
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
_SEP = "@"  # wire tensor names: "<tensor>@<part>"; "@rows" holds explicit row ids
_META = "cmp"
RowSchedule = Callable[[int], np.ndarray]


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())


class CompressionLayer(Layer):
    """Compresses forward and/or backward messages on the way out and restores dense tensors on the way in.

    ``forward``/``backward``: specs (strings or :class:`CompressionSpec`) for the algorithm's forward kinds (party
    outputs: embeddings, logits, ``A_k x_k``) and backward kinds (gradients, dual variables). The kinds come from the
    algorithm's traits at :meth:`check`, or explicitly. ``seed`` makes the senders' randomness (rand-k seeds, stochastic rounding) reproducible; each party draws from its own generator.

    Rows of per-batch messages (for error feedback), in ``meta["rows"]``, one of:

    * ``[split, id, id, ...]``: explicit ids; they travel packed (uint8/16/32 bits each) and are counted;
    * ``{"s": split, "range": [start, stop]}``: contiguous rows (evaluation batches);
    * ``{"s": split, "sched": [epoch, offset, count]}``: a slice of a public batch order that every party derives
      from the shared seed (as the split-learning trainers do), resolved through :attr:`schedules`.
    """

    name: ClassVar[str] = "compress"

    def __init__(
        self,
        forward: str | CompressionSpec | None = None,
        backward: str | CompressionSpec | None = None,
        *,
        forward_kinds: Iterable[str] | None = None,
        backward_kinds: Iterable[str] | None = None,
        seed: int = 0,
        evaluation: str = "auto",
    ) -> None:
        if evaluation not in ("auto", "dense", "compress"):
            raise ConfigError(f"evaluation traffic must be 'auto', 'dense' or 'compress', got {evaluation!r}")
        self.evaluation = evaluation
        self.forward = parse_spec(forward)
        self.backward = parse_spec(backward)
        self.forward_kinds = tuple(forward_kinds) if forward_kinds is not None else None
        self.backward_kinds = tuple(backward_kinds) if backward_kinds is not None else None
        self.seed = int(seed)
        # split -> epoch -> public row order (the shared-seed batch schedule every party can compute)
        self.schedules: dict[str, RowSchedule] = {}
        self._schedule_cache: dict[tuple[str, int], np.ndarray] = {}
        self._rng: dict[str, torch.Generator] = {}
        self._memory: dict[str, dict[str, torch.Tensor]] = {}  # party -> state key -> g (EF21) or h (shift)
        self._seq: dict[str, dict[str, int]] = {}  # party -> link key -> messages so far
        self._train_modes: dict[str, str] = {}  # "party|kind" -> mode of its last training message
        self._support: dict[str, torch.Tensor] = {}  # "receiver|sender" -> support of the last top-k training batch
        self.counts: dict[str, dict[str, int]] = {
            d: {"messages": 0, "dense_bytes": 0, "wire_bytes": 0} for d in ("forward", "backward", "evaluation")
        }

    # -- validity ---------------------------------------------------------------------------------------------
    def across_processes(self) -> str | None:
        return None  # per-party generators and residuals: each process runs its own party's (tests/test_deploy.py)

    def check(self, traits: AlgorithmTraits) -> list[str]:
        if self.forward_kinds is None:
            self.forward_kinds = tuple(traits.forward_kinds)
        if self.backward_kinds is None:
            self.backward_kinds = tuple(traits.backward_kinds)
        problems = []
        if self.forward is None and self.backward is None:
            problems.append("no direction to compress: give a forward and/or backward spec")
        if traits.persistent_messages:
            memoryless = {d: spec for d, spec in (("forward", self.forward), ("backward", self.backward))
                          if spec is not None and spec.sparsifier is not None and spec.feedback is None}
            for spec in dict.fromkeys(memoryless.values()):
                directions = " and ".join(d for d, s in memoryless.items() if s == spec)
                problems.append(self._memoryless_sparsifier(traits, directions, spec))
        elif traits.needs_error_feedback:
            memoryless = [str(s) for s in dict.fromkeys((self.forward, self.backward))
                          if s is not None and s.sparsifier is not None and s.feedback is None]
            problems += [f"{spec} has no error feedback, which {traits.name} needs: {traits.needs_error_feedback}"
                         for spec in memoryless]
        if traits.exact_outputs and self.forward is not None and self.forward.sparsifier is not None:
            problems.append(f"forward compression ({self.forward}): {traits.exact_outputs}")
        return problems

    @staticmethod
    def _memoryless_sparsifier(traits: AlgorithmTraits, directions: str, spec: CompressionSpec) -> str:
        """Why a sparsifier without error feedback cannot serve an iterative full-batch method (the saddle family)."""
        if spec.sparsifier == "randk":
            why = (f"the error of an unbiased rand-k copy is {1 / spec.ratio - 1:g} times the vector's squared size "
                   "and enters every iterate, so the iterates blow up")
            fix = f"add +ef (EF21, as `secvfl reproduce saddle` runs it: {spec}+ef) or +vr (shifted compression)"
        else:
            why = "a top-k copy drops the same small entries round after round, so the method converges to the wrong point"
            fix = f"add +ef (EF21: {spec}+ef)"
        return (f"{spec} on the {directions} messages has no error feedback, but {traits.name} sends the same "
                f"full-batch quantity every round and {why}; {fix}")

    def encoded_outputs(self, traits: AlgorithmTraits) -> tuple[str, str] | None:
        if self.forward is None:
            return None
        return (f"forward compression ({self.forward})",
                "it sends sparse supports that differ between parties (top-k), shared-seed selections or bit-packed "
                "codes, which the aggregator cannot add; compress the backward direction only (--compress-backward)")

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

    # -- rows -------------------------------------------------------------------------------------------------
    def _scheduled(self, split: str, epoch: int) -> np.ndarray:
        key = (split, epoch)
        if key not in self._schedule_cache:
            if split not in self.schedules:
                raise ProtocolError(f"rows refer to a batch schedule of split {split!r}, which this layer does not know")
            if len(self._schedule_cache) > 8:
                self._schedule_cache.clear()
            self._schedule_cache[key] = np.asarray(self.schedules[split](epoch), dtype=np.int64)
        return self._schedule_cache[key]

    def _resolve_rows(self, desc: Any, tensors: Mapping[str, torch.Tensor]) -> tuple[str, list[int]]:
        """``(split, ids)`` from a wire row descriptor (see the class docstring)."""
        try:
            split = str(desc["s"])
            if "range" in desc:
                a, b = (int(v) for v in desc["range"])
                return split, list(range(a, b))
            if "sched" in desc:
                epoch, off, count = (int(v) for v in desc["sched"])
                order = self._scheduled(split, epoch)
                if not 0 <= off <= off + count <= len(order):
                    raise ProtocolError(f"scheduled rows {off}..{off + count} outside the epoch's {len(order)} rows")
                return split, order[off : off + count].tolist()
            space = int(desc["ids"])
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad row descriptor {desc!r}: {exc}") from None
        if f"{_SEP}rows" not in tensors:
            raise ProtocolError("the row descriptor names explicit ids but the message carries none")
        return split, unpack_indices(tensors[f"{_SEP}rows"], space).tolist()

    @staticmethod
    def _wire_rows(rows: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
        """Sender side: the descriptor for the wire (and the packed ids when they must travel)."""
        if isinstance(rows, dict):
            return dict(rows), None
        if not isinstance(rows, (list, tuple)) or not rows or not isinstance(rows[0], str):
            raise ProtocolError("meta['rows'] must be [split, id, ...] or a {'s', 'range'|'sched'} descriptor")
        ids = [int(i) for i in rows[1:]]
        if any(i < 0 for i in ids):
            raise ProtocolError("meta['rows'] has a negative row id")
        if ids and ids == list(range(ids[0], ids[0] + len(ids))):
            return {"s": rows[0], "range": [ids[0], ids[0] + len(ids)]}, None
        space = _row_space(ids)
        return {"s": rows[0], "ids": space}, pack_indices(torch.as_tensor(ids, dtype=torch.int64), space)

    # -- outbound ---------------------------------------------------------------------------------------------
    def outbound(self, messages: list[Message], party: str) -> list[Message]:
        return [self._compress(self._mask_gradients(m, party), party) for m in messages]

    def _mask_gradients(self, m: Message, party: str) -> Message:
        """The gradient of a top-k-compressed output, taken through the top-k selection.

        A feature party's output ``h`` reached this party as ``topk(h)``; the loss depends on ``h`` only through the
        kept entries, so ``dL/dh = mask * dL/dtopk(h)``. Sending the unmasked gradient would push entries that never
        reached the loss (a straight-through estimate). The mask is this party's own knowledge (the support it
        received); a gradient row block of another shape (no matching training batch) is left as is.
        """
        if m.kind not in (self.backward_kinds if self.backward_kinds is not None else ("gradient",)):
            return m
        support = self._support.pop(f"{party}|{m.receiver}", None)
        if support is None:
            return m
        floats = [n for n, t in m.tensors.items() if t.is_floating_point()]
        if len(floats) != 1 or tuple(m.tensors[floats[0]].shape) != tuple(support.shape):
            return m
        g = m.tensors[floats[0]]
        return m.replace(tensors={**m.tensors, floats[0]: g * support.to(device=g.device, dtype=g.dtype)})

    def _compress(self, m: Message, party: str) -> Message:
        found = self._direction(m.kind)
        if found is None or _META in m.meta:
            return m
        direction, spec = found
        if m.meta.get("eval"):
            trained = self._train_modes.get(f"{party}|{m.kind}")
            if self.evaluation == "dense" or (self.evaluation == "auto" and trained != "plain"):
                self.counts["evaluation"]["messages"] += 1
                return m  # prediction traffic sent as is (counted): see the module docstring
            mode = "plain" if self.evaluation == "auto" else self._mode(spec, direction, m, party)
        else:
            mode = self._mode(spec, direction, m, party)
            self._train_modes[f"{party}|{m.kind}"] = mode
        tensors: dict[str, torch.Tensor] = {}
        meta = dict(m.meta)
        rows: tuple[str, list[int]] | None = None
        if mode == "memory" and "rows" in m.meta:
            desc, packed = self._wire_rows(m.meta["rows"])
            local = {f"{_SEP}rows": packed} if packed is not None else {}
            rows = self._resolve_rows(desc, local)
            if self._accumulates(spec, direction, rows):
                meta.pop("rows")  # only the sender keeps (per-row) state: the ids need not travel
            else:
                tensors.update(local)
                meta["rows"] = desc
        info: dict[str, Any] = {}
        gen = self._generator(party)
        for name, t in m.tensors.items():
            if not t.is_floating_point() or t.numel() == 0 or _SEP in name:
                tensors[name] = t
                continue
            if not bool(torch.isfinite(t).all()):
                raise ProtocolError(f"{m.kind} tensor {name!r} from {party} has non-finite values; refusing to compress")
            x = t.detach().cpu().reshape(-1)
            seq = -1
            # a batch of samples (not a persistent quantity): top-k acts row by row
            width = t.numel() // t.shape[0] if t.dim() >= 2 and not m.meta.get("persistent", False) else 0
            width = width if width >= 2 else 0  # rows of one value: top-k over the whole tensor
            if mode == "memory" and self._accumulates(spec, direction, rows):
                # per-row gradients the receiver adds into its parameters: carry the residual into the row's next
                # message (error feedback of Seide et al. 2014 / Stich et al. 2018); only the sender keeps state
                key = f"{m.receiver}|{m.kind}|{name}"
                seq = -2  # tells the receiver: use the values as they are (unscaled), keep nothing
                residual = self._state(party, key, x, rows)
                parts = compress_values(x + residual, spec, gen, row_width=width)
                raw, _ = decompress_values(parts, spec, x.numel(), x.dtype, row_width=width)
                self._write(party, key, rows, x + residual - raw)
            elif mode == "memory":
                key = f"{m.receiver}|{m.kind}|{name}"
                seq = self._next_seq(party, key)
                memory = self._state(party, key, x, rows)
                parts = compress_values(x - memory, spec, gen, row_width=width)
                raw, scale = decompress_values(parts, spec, x.numel(), x.dtype, row_width=width)
                self._update(party, key, raw, scale, spec, rows, memory)
            else:
                parts = compress_values(x, spec, gen, row_width=width)
            for p, v in parts.items():
                tensors[f"{len(info)}{_SEP}{p}"] = v  # wire parts named by the tensor's position in meta["cmp"]
            info[name] = [list(t.shape), _dtype_name(t.dtype), seq, width]
            c = self.counts[direction]
            c["messages"] += 1
            c["dense_bytes"] += t.numel() * t.element_size()
            c["wire_bytes"] += sum(v.numel() * v.element_size() for v in parts.values())
        if not info:
            return m
        meta[_META] = info
        return m.replace(tensors=tensors, meta=meta)

    # -- inbound ----------------------------------------------------------------------------------------------
    def inbound(self, message: Message, party: str) -> Message:
        info = message.meta.get(_META)
        if info is None:
            return message
        tensors = {k: v for k, v in message.tensors.items() if _SEP not in k}
        rows: tuple[str, list[int]] | None = None
        found = self._direction(message.kind)
        if found is None:
            raise ProtocolError(f"received a compressed {message.kind} message, but this layer compresses no "
                                f"{message.kind} messages; sender and receiver must use the same --compress specs")
        spec = found[1]
        for j, (name, entry) in enumerate(info.items()):
            try:
                shape, dtype_name, seq, width = entry
                width, seq = int(width), int(seq)
                shape = [int(s) for s in shape]
                dtype = WIRE_DTYPES[dtype_name]
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(f"bad compression header for tensor {name!r}: {exc}") from None
            n = math.prod(shape)
            prefix = f"{j}{_SEP}"
            parts = {k[len(prefix) :]: v for k, v in message.tensors.items() if k.startswith(prefix)}
            raw, scale = decompress_values(parts, spec, n, dtype, row_width=width)
            if seq == -2:  # the sender carried its residual (per-row gradients): values as they are
                tensors[name] = raw.reshape(shape)
                continue
            if spec.feedback and seq >= 0:  # seq -1: sent without memory (see CompressionLayer._mode)
                key = f"{message.sender}|{message.kind}|{name}"
                expected = self._next_seq(party, key)
                if int(seq) != expected:
                    raise ProtocolError(
                        f"compressed {message.kind} from {message.sender}: sequence {seq} but {party} expected "
                        f"{expected}; a message was lost or reordered, so the error-feedback states diverged"
                    )
                if rows is None and "rows" in message.meta:
                    rows = self._resolve_rows(message.meta["rows"], message.tensors)
                memory = self._state(party, key, raw, rows)
                out = self._update(party, key, raw, scale, spec, rows, memory)
            else:
                out = raw * scale if scale != 1.0 else raw
                forward = found[0] == "forward"
                if forward and spec.sparsifier == "topk" and width and not message.meta.get("eval"):
                    # the support of a training batch's top-k outputs: the next gradient back to this sender
                    # is taken through the top-k selection (zero outside the support), see _mask_gradients
                    self._support[f"{party}|{message.sender}"] = (raw != 0).reshape(shape)
            tensors[name] = out.reshape(shape)
        meta = {k: v for k, v in message.meta.items() if k != _META}
        return message.replace(tensors=tensors, meta=meta, wire_size=message.wire_size)

    # -- feedback state ---------------------------------------------------------------------------------------
    def _next_seq(self, party: str, key: str) -> int:
        seqs = self._seq.setdefault(party, {})
        seqs[key] = seqs.get(key, -1) + 1
        return seqs[key]

    def _state(self, party: str, key: str, x: torch.Tensor, rows: tuple[str, list[int]] | None) -> torch.Tensor:
        """The memory (flat, like ``x``) this message is compressed against, created or restarted as needed."""
        mem = self._memory.setdefault(party, {})
        if rows is None:
            g = mem.get(key)
            if g is None or g.numel() != x.numel() or g.dtype != x.dtype:
                g = torch.zeros(x.numel(), dtype=x.dtype)
                mem[key] = g
            return g
        split, ids = rows
        if not ids or x.numel() % len(ids):
            raise ProtocolError(f"a message of {x.numel()} values cannot hold {len(ids)} rows")
        width = x.numel() // len(ids)
        rkey = f"{key}|rows:{split}"
        table = mem.get(rkey)
        need = max(ids) + 1
        if table is None or table.shape[1] != width or table.dtype != x.dtype:
            table = torch.zeros((need, width), dtype=x.dtype)
        elif table.shape[0] < need:
            table = torch.cat([table, torch.zeros((need - table.shape[0], width), dtype=x.dtype)])
        mem[rkey] = table
        return table[torch.as_tensor(ids)].reshape(-1)

    def _mode(self, spec: CompressionSpec, direction: str, m: Message, party: str) -> str:
        """``"plain"`` (the operator alone) or ``"memory"`` (error feedback / shift) for this message.

        Memory needs to know that successive messages on a link describe the same thing: ``persistent`` messages
        (EF21 / shift on the whole tensor) and per-row backward gradients (residual carried per row, or per-row
        shift). Per-batch *forward* outputs are compressed without memory even under ``ef``/``vr``: at prediction
        time there is no memory for new rows, so the receiver has to learn from the compressed form it will see
        then; training on EF21 estimates (close to dense) and predicting from plain compressed outputs (or dense
        ones) is a train/predict mismatch that cost accuracy in our runs (credit, splitnn).
        """
        if spec.feedback is None:
            return "plain"
        if m.meta.get("persistent", False):
            return "memory"
        if direction == "forward":
            return "plain"
        if "rows" in m.meta:
            return "memory"
        raise ProtocolError(
            f"{spec} on a {m.kind} message from {party}: error feedback on backward messages needs either the "
            "message's rows (meta['rows'], for per-batch gradients) or meta['persistent'] = true (the message carries "
            "the same quantity every step); without them one batch's memory would corrupt another's rows"
        )

    @staticmethod
    def _accumulates(spec: CompressionSpec, direction: str, rows: tuple[str, list[int]] | None) -> bool:
        """Whether ``ef`` means residual accumulation (per-row backward gradients) rather than EF21 (values)."""
        return spec.feedback == "ef" and direction == "backward" and rows is not None

    def _write(self, party: str, key: str, rows: tuple[str, list[int]] | None, new: torch.Tensor) -> None:
        mem = self._memory[party]
        if rows is None:
            mem[key] = new
        else:
            table = mem[f"{key}|rows:{rows[0]}"]
            table[torch.as_tensor(rows[1])] = new.reshape(len(rows[1]), -1)

    def _update(
        self,
        party: str,
        key: str,
        raw: torch.Tensor,
        scale: float,
        spec: CompressionSpec,
        rows: tuple[str, list[int]] | None,
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
        self._write(party, key, rows, new)
        return estimate.clone()

    # -- facts and state --------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layer": self.name,
            "forward": str(self.forward) if self.forward else None,
            "backward": str(self.backward) if self.backward else None,
            "placement": "after DP noise (post-processing), before encryption/secure channel",
            "evaluation": self.evaluation,
        }
        for d, c in self.counts.items():
            if c["messages"] and d != "evaluation":
                out[f"{d}_payload"] = {**c, "ratio": c["dense_bytes"] / max(1, c["wire_bytes"])}
        out["evaluation_messages_dense"] = self.counts["evaluation"]["messages"]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "rng": {p: g.get_state() for p, g in self._rng.items()},
            "memory": {p: dict(m) for p, m in self._memory.items()},
            "seq": {p: dict(s) for p, s in self._seq.items()},
            "counts": {d: dict(c) for d, c in self.counts.items()},
            "train_modes": dict(self._train_modes),
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
        self._train_modes = dict(state.get("train_modes", {}))


def _dtype_name(dtype: torch.dtype) -> str:
    for k, v in WIRE_DTYPES.items():
        if v == dtype:
            return k
    raise ProtocolError(f"dtype {dtype} has no wire format")


def _row_space(ids: list[int]) -> int:
    """Index space for explicit row ids (a power of two, at least 256)."""
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


class _RowTagger:
    """The compression layer's :class:`~secvfl.parties.MessageTagger`: marks evaluation outputs (``meta["eval"]``)
    and, when installed on the label party, names the rows of its gradients (``meta["rows"]``) so per-row error
    feedback can key its memory. Training batches are described as a slice of the public shared-seed batch order
    (``schedule``: a :class:`~secvfl.algorithms.base.BatchSchedule`, which every party can compute), so no ids
    travel; anything else as explicit, counted ids.

    A tagger runs as its party: it holds the public schedule and nothing else (never the algorithm, which holds every
    party, nor the layer, which holds every party's error-feedback memory)."""

    def __init__(self, schedule: Any | None, *, rows: bool, kinds: tuple[str, ...] = ("gradient",)) -> None:
        self.schedule, self.rows, self.kinds = schedule, rows, kinds  # kinds: the backward messages it names rows of
        self._position: tuple[int, dict[int, int], np.ndarray] | None = None  # epoch, row -> offset, order

    def tag(self, message: Message, split: str, ids: Any, *, train: bool) -> Message:
        if not train:  # forward outputs keep no memory (CompressionLayer._mode), so only evaluation needs marking
            return message.replace(meta={**message.meta, "eval": True})
        if not self.rows or message.kind not in self.kinds:
            return message
        return message.replace(meta={**message.meta, "rows": self.describe(split, ids)})

    def describe(self, split: str, ids: Any) -> Any:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        epoch = self.schedule.epoch if self.schedule is not None else None
        if split == "train" and epoch is not None and len(ids):
            if self._position is None or self._position[0] != epoch:
                order = np.asarray(self.schedule.order(epoch), dtype=np.int64)
                self._position = (epoch, {int(r): i for i, r in enumerate(order)}, order)
            _, pos, order = self._position
            off = pos.get(int(ids[0]))
            if off is not None and np.array_equal(order[off : off + len(ids)], ids):
                return {"s": "train", "sched": [epoch, off, len(ids)]}
        return [split, *ids.tolist()]


def tag_rows(hooks: ProtocolHooks, layer: CompressionLayer, *, backward_rows: bool = True) -> bool:
    """Install the compression layer's tagger on a split-style algorithm's parties (their public ``tagger`` hook):
    evaluation outputs get marked and, with ``backward_rows``, the label party's gradient messages name their rows.
    Training batches are named by position in the shared-seed batch order when the algorithm publishes its
    ``schedule`` (a :class:`~secvfl.algorithms.base.BatchSchedule`); the label party's tagger gets that schedule,
    never the algorithm. Returns False when the algorithm offers no such parties (``hooks``)."""
    if not hooks.feature_parties or hooks.label is None:
        return False
    schedule = hooks.schedule
    if schedule is not None:
        layer.schedules["train"] = schedule.order
    for fp in hooks.feature_parties:
        fp.tagger = _RowTagger(None, rows=False)  # a feature party's outputs name no rows: it only marks evaluation
    hooks.label.tagger = _RowTagger(schedule, rows=backward_rows, kinds=layer.backward_kinds or ("gradient",))
    return True


@dataclass(frozen=True)
class CompressionOptions(Options):
    compress: str | None = option(
        None, "compress forward and backward messages (topk:RATIO, randk:RATIO, quant:BITS, fp16, bf16, fp32, joined "
              "with '+', then optionally +ef or +vr), e.g. topk:0.1+ef or randk:0.1+quant:8", metavar="SPEC")
    compress_forward: str | None = option(
        None, "compression of forward messages (embeddings, outputs); overrides --compress", metavar="SPEC")
    compress_backward: str | None = option(
        None, "compression of backward messages (gradients, duals); overrides --compress", metavar="SPEC")
    compress_eval: Literal["auto", "dense", "compress"] | None = option(
        None, "evaluation/prediction outputs: auto (default: compressed like training when training used no memory, "
              "else dense), dense, or compress (always, with memory)")
    # library form {"compress": "topk", "compress_ratio": r}: the ratio of a bare sparsifier
    compress_ratio: float | None = option(None, "the ratio of a bare --compress topk/randk", cli=False)


class CompressionPlugin(ProtocolPlugin):
    """``--compress SPEC`` (both directions), ``--compress-forward SPEC``, ``--compress-backward SPEC``."""

    name = "compression"
    options_type = CompressionOptions

    def configure(self, cfg: Any, traits: AlgorithmTraits, ctx: Any) -> ProtocolSetup | None:
        o = cfg.options_for(CompressionOptions)
        both = o.compress
        if o.compress_ratio is not None and both in SPARSIFIERS:
            both = f"{both}:{o.compress_ratio}"
        fwd, bwd = specs_from_options(both, o.compress_forward, o.compress_backward)
        if fwd is None and bwd is None:
            if o.compress_eval is not None:
                raise ConfigError("--compress-eval only applies together with --compress/--compress-forward")
            return None
        if not traits.forward_kinds and not traits.backward_kinds:
            raise UnsupportedError(f"--compress: algorithm {traits.name!r} exchanges no embeddings or gradients")
        layer = CompressionLayer(fwd, bwd, seed=cfg.seed, evaluation=o.compress_eval or "auto")
        problems = layer.check(traits)
        if problems:
            raise UnsupportedError(f"--compress is not valid for algorithm {traits.name!r}: " + "; ".join(problems))
        feedback = any(s is not None and s.feedback for s in (fwd, bwd))

        def attach(algo: Any) -> None:
            if traits.persistent_messages:
                return  # the algorithm marks its own messages (persistent, rows, eval)
            rows = bwd is not None and bwd.feedback is not None
            if not tag_rows(algo.protocol_hooks(), layer, backward_rows=rows) and feedback:
                raise UnsupportedError(
                    f"--compress ...+ef/+vr: algorithm {traits.name!r} sends per-batch messages without naming "
                    "their rows, so error feedback cannot keep a per-row memory; drop +ef/+vr"
                )

        return ProtocolSetup(
            layers=[(COMPRESSION_POSITION, layer)], attach=[attach],
            summary=lambda: {"compression": layer.describe()},
        )
