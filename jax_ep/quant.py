"""Wire formats: token rows quantized for the wire, with their scales (docs/contract.md, "Wire
formats").

`quantize(x, format)` returns a `Quantized` pytree (`data`, `scales`, `global_scale` or None,
static `format`); `dequantize(q)` returns floats. The rules are float32 arithmetic in which a
quotient is a product with a float32 reciprocal rounded once (as in `jax_ep.fp8`), and the
scales that are powers of two are built from their exponent bits, so every backend and the
NumPy reference give the same bytes:

- "e4m3": `jax_ep.fp8.quantize` (blocks of 128 channels, a float32 scale each).
- "e4m3_ue8m0": blocks of 128; `s = max(amax, 1e-4) * float32(1/448)`, `scale = 2^ceil(log2 s)`
  (the smallest power of two >= s), stored as its biased exponent `e` (uint8, the value
  2^(e - 127)); data `e4m3(x * (1/scale))`. `packed=True` packs 4 exponents per int32 (block
  j in byte j % 4 of word j // 4, little-endian; a last word short of 4 blocks is 0 there).
- "mxfp8" (OCP Microscaling v1.0, e4m3 elements): blocks of 32; `scale = 2^(floor(log2 amax)
  - 8)`, the exponent clamped to [-127, 127] (a block of zeros gets 2^-127); data
  `e4m3(clamp(x * (1/scale), -448, 448))`; scales uint8 biased exponents.
- "nvfp4": per row `g = amax_row * float32(1/2688)` (2688 = 448 * 6); blocks of 16 with
  `s_b = e4m3(min(amax_b * float32(1 / float32(6 g)), 448))`; elements
  `e2m1(clamp(x * float32(1 / float32(float32(s_b) * g)), -6, 6))`, two per uint8 (the even
  channel in the low nibble); `scales` float8_e4m3fn [..., H/16], `global_scale` float32 [...].

Edge values, the same on every path (docs/contract.md): inputs below 2^-126 in magnitude
count as 0; a block (nvfp4: a row) holding a NaN or an infinity dequantizes to NaN (UE8M0 and
MX scales 0xFF, E8M0's NaN, and elements 0x7F); nvfp4 rows and blocks too small for float32's
normal range are quantized as zeros.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _checks, fp8
from jax_ep.structs import _pytree, static

FORMATS = ("e4m3", "e4m3_ue8m0", "mxfp8", "nvfp4")
BLOCKS = {"e4m3": 128, "e4m3_ue8m0": 128, "mxfp8": 32, "nvfp4": 16}
SMALLEST_NORMAL = 2.0**-126
E4M3_MAX, E2M1_MAX = 448.0, 6.0
NAN_EXPONENT = 0xFF  # E8M0's NaN


@_pytree
class Quantized:
    """Rows in a wire format.

    Attributes:
      data: the elements: float8_e4m3fn [..., H] ("e4m3", "e4m3_ue8m0", "mxfp8"), or uint8
        [..., H/2] ("nvfp4", two e2m1 elements a byte).
      scales: one per block: float32 [..., H/128] ("e4m3"), uint8 biased exponents
        [..., H/128] or, packed, int32 [..., ceil(H/512)] ("e4m3_ue8m0"), uint8 [..., H/32]
        ("mxfp8"), float8_e4m3fn [..., H/16] ("nvfp4").
      global_scale: float32 [...] per row ("nvfp4"), else None.
      format: one of FORMATS.
      packed: "e4m3_ue8m0" scales packed four to an int32.
    """

    data: jax.Array
    scales: jax.Array
    global_scale: jax.Array | None = None
    format: str = static("e4m3")
    packed: bool = static(False)


def _expected_fields(format: str, lead: tuple[int, ...], hidden: int, packed: bool = False
                     ) -> dict[str, tuple[Any, tuple[int, ...]] | None]:
    """{field: (dtype, shape) or None} of a Quantized of `format` holding rows [*lead, H]."""
    blocks = hidden // BLOCKS[format]
    return {
        "e4m3": {"data": (fp8.FP8_DTYPE, (*lead, hidden)), "scales": (jnp.float32, (*lead, blocks)),
                 "global_scale": None},
        "e4m3_ue8m0": {"data": (fp8.FP8_DTYPE, (*lead, hidden)),
                       "scales": (jnp.int32, (*lead, -(-blocks // 4))) if packed
                       else (jnp.uint8, (*lead, blocks)), "global_scale": None},
        "mxfp8": {"data": (fp8.FP8_DTYPE, (*lead, hidden)), "scales": (jnp.uint8, (*lead, blocks)),
                  "global_scale": None},
        "nvfp4": {"data": (jnp.uint8, (*lead, hidden // 2)),
                  "scales": (fp8.FP8_DTYPE, (*lead, blocks)), "global_scale": (jnp.float32, lead)},
    }[format]


def check_format(op: str, name: str, format: str, hidden: int, what: str) -> None:
    """Raises, naming the argument, unless `format` is one of FORMATS and `hidden` (the
    hidden size of `what`) a multiple of its block."""
    _checks.check_choice(op, name, format, FORMATS)
    block = BLOCKS[format]
    if hidden % block:
        raise ValueError(f"{op}: {name} {format!r} quantizes blocks of {block} channels: "
                         f"{what} ({hidden}) must be a multiple of {block}.")


def check(op: str, name: str, q: Any) -> None:
    """Raises, naming the field and what it must be, unless `q` is a Quantized as `quantize`
    makes them: a known format, and data, scales and global_scale of that format's dtypes and
    shapes for the rows its data holds (H a multiple of the format's block)."""
    if not isinstance(q, Quantized):
        raise TypeError(f"{op}: {name} must be a jax_ep.quant.Quantized; got "
                        f"{type(q).__name__}.")
    if q.format not in FORMATS:
        raise ValueError(f"{op}: {name}.format must be one of {', '.join(FORMATS)}; got "
                         f"{q.format!r}. Make it with jax_ep.quant.quantize(x, format).")
    if q.packed and q.format != "e4m3_ue8m0":
        raise ValueError(f"{op}: {name}.packed goes with format 'e4m3_ue8m0'; got format "
                         f"{q.format!r} packed.")
    fix = f"Make it with jax_ep.quant.quantize(x, {q.format!r}), which gives these fields."
    data = q.data
    if not hasattr(data, "shape") or not hasattr(data, "dtype") or len(data.shape) < 1:
        raise TypeError(f"{op}: {name}.data must be an array [..., H]; got "
                        f"{_checks.describe(data)}. {fix}")
    hidden = data.shape[-1] * (2 if q.format == "nvfp4" else 1)
    block = BLOCKS[q.format]
    if hidden % block:
        raise ValueError(f"{op}: {name}.data holds rows of {hidden} channels; format "
                         f"{q.format!r} needs a multiple of {block}. {fix}")
    expected = _expected_fields(q.format, tuple(data.shape[:-1]), hidden, q.packed)
    for field, want in expected.items():
        got = getattr(q, field)
        if want is None:
            if got is not None:
                raise ValueError(f"{op}: {name}.{field} must be None for format "
                                 f"{q.format!r}; got {_checks.describe(got)}. {fix}")
            continue
        dtype, shape = want
        _checks.check_array(op, f"{name}.{field}", got, ndim=len(shape), dtypes=(dtype,),
                            shape=shape, fix=fix,
                            expect=f"{jnp.dtype(dtype).name} {list(shape)} for format "
                                   f"{q.format!r}{' packed' if q.packed else ''} rows of "
                                   f"{hidden} channels")


def quantize(x: jax.Array, format: str, *, packed: bool = False) -> Quantized:
    """Quantizes `x` [..., H] (any float dtype, H a multiple of the format's block) to
    `format` (FORMATS; the rules in the module's docstring)."""
    op = "jax_ep.quant.quantize"
    _checks.check_choice(op, "format", format, FORMATS)
    _checks.check_array(op, "x", x, expect="a float array [..., H]")
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op}: x must be a float array [..., H]; got {_checks.describe(x)}.")
    block = BLOCKS[format]
    if x.shape[-1] % block:
        raise ValueError(f"{op}: format {format!r} quantizes blocks of {block} channels: the "
                         f"hidden size ({x.shape[-1]}) must be a multiple of {block}. Pad the "
                         f"hidden dimension.")
    if packed and format != "e4m3_ue8m0":
        raise ValueError(f"{op}: packed=True packs UE8M0 exponents: it goes with format "
                         f"'e4m3_ue8m0'; got format {format!r}.")
    if format == "e4m3":
        data, scales = fp8.quantize(x)
        return Quantized(data, scales, None, format)
    x = x.astype(jnp.float32)
    x = jnp.where(jnp.abs(x) < SMALLEST_NORMAL, jnp.float32(0), x)
    if format == "nvfp4":
        return _nvfp4(x)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = _amax(blocks)
    if format == "e4m3_ue8m0":
        s = jnp.maximum(amax, jnp.float32(fp8.AMAX_FLOOR)) * jnp.float32(fp8.INV_FP8_MAX)
        biased = _exponent(s) + (_mantissa(s) != 0)  # 2^ceil(log2 s): s is normal here
        limit = None
    else:
        floor_log2 = _exponent(amax) - 127  # amax is 0 or normal
        biased = jnp.where(amax > 0, jnp.clip(floor_log2 - 8, -127, 127) + 127, 0)
        limit = E4M3_MAX
    finite = jnp.isfinite(amax)
    biased = jnp.where(finite, biased, NAN_EXPONENT).astype(jnp.uint8)
    # 1/scale = 2^(127 - e): a normal float32 for every e a finite block gets.
    inverse = _power_of_two(254 - biased.astype(jnp.int32))
    scaled = blocks * inverse[..., None]
    if limit is not None:
        scaled = jnp.clip(scaled, -limit, limit)
    # A non-finite block's elements are e4m3's NaN 0x7F (whatever sign a NaN product has).
    scaled = jnp.where(finite[..., None], scaled, jnp.float32(jnp.nan))
    data = scaled.astype(fp8.FP8_DTYPE).reshape(x.shape)
    scales = _pack(biased) if packed else biased
    return Quantized(data, scales, None, format, packed)


def dequantize(q: Quantized, dtype: Any = jnp.float32) -> jax.Array:
    """`q` back to floats [..., H] in `dtype`: each element times its block's scale (and, for
    nvfp4, the row's global scale), in float32."""
    check("jax_ep.quant.dequantize", "q", q)
    block = BLOCKS[q.format]
    if q.format == "e4m3":
        return fp8.dequantize(q.data, q.scales, dtype)
    values = _unpack_e2m1(q.data) if q.format == "nvfp4" else q.data.astype(jnp.float32)
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // block, block)
    if q.format == "nvfp4":
        scale = fp8.canonical(q.scales.astype(jnp.float32) * q.global_scale[..., None])
        blocks = fp8.canonical(blocks * scale[..., None])
    else:
        biased = _unpack(q.scales, blocks.shape[-2]) if q.packed else q.scales
        blocks = _times_power_of_two(blocks, biased.astype(jnp.int32))
    return blocks.reshape(values.shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Pieces


def _amax(blocks: jax.Array) -> jax.Array:
    """max |x| over the last axis, NaN when the block holds a NaN (whatever the reduction does
    with NaN)."""
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    return jnp.where(jnp.isnan(blocks).any(axis=-1), jnp.float32(jnp.nan), amax)


def _bits(v: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(v, jnp.int32)


def _exponent(v: jax.Array) -> jax.Array:
    """The biased exponent field of float32 `v` (floor(log2 v) + 127 for a normal v > 0)."""
    return (_bits(v) >> 23) & 0xFF


def _mantissa(v: jax.Array) -> jax.Array:
    return _bits(v) & 0x7FFFFF


def _power_of_two(biased: jax.Array) -> jax.Array:
    """2^(biased - 127) in float32 for biased 1..254, NaN for 0xFF; 2^-126 for 0 (2^-127 is a
    subnormal: _times_power_of_two applies it)."""
    normal = jax.lax.bitcast_convert_type(jnp.maximum(biased, 1) << 23, jnp.float32)
    return jnp.where(biased == NAN_EXPONENT, jnp.float32(jnp.nan), normal)


def _times_power_of_two(blocks: jax.Array, biased: jax.Array) -> jax.Array:
    """blocks [..., n, block] times their scales 2^(biased - 127), exact wherever the product
    is a normal float32 (each product made canonical, fp8.canonical): 2^-127 (biased 0) is a
    subnormal, which XLA:CPU flushes to 0, so it is applied as 2^-126 and then 0.5."""
    out = fp8.canonical(blocks * _power_of_two(biased)[..., None])
    return jnp.where((biased == 0)[..., None], fp8.canonical(out * jnp.float32(0.5)), out)


def _pack(biased: jax.Array) -> jax.Array:
    """uint8 [..., n] -> int32 [..., ceil(n / 4)]: byte j in byte j % 4 of word j // 4."""
    n = biased.shape[-1]
    padded = jnp.pad(biased, [(0, 0)] * (biased.ndim - 1) + [(0, -n % 4)])
    quads = padded.reshape(*biased.shape[:-1], padded.shape[-1] // 4, 4).astype(jnp.uint32)
    words = quads[..., 0] | quads[..., 1] << 8 | quads[..., 2] << 16 | quads[..., 3] << 24
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def _unpack(words: jax.Array, n: int) -> jax.Array:
    """The inverse of _pack: uint8 [..., n]."""
    u = jax.lax.bitcast_convert_type(words, jnp.uint32)
    quads = jnp.stack([(u >> (8 * j)) & 0xFF for j in range(4)], axis=-1)
    return quads.reshape(*words.shape[:-1], words.shape[-1] * 4)[..., :n].astype(jnp.uint8)


def _nvfp4(x: jax.Array) -> Quantized:
    rows = _amax(x)
    g = rows * jnp.float32(1 / 2688)
    zero_row = (rows == 0) | (g < SMALLEST_NORMAL)
    finite_row = jnp.isfinite(rows)
    g = jnp.where(zero_row | ~finite_row, jnp.float32(1), g)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCKS["nvfp4"], BLOCKS["nvfp4"])
    r = jnp.float32(1) / (jnp.float32(6) * g)
    s = jnp.minimum(_amax(blocks) * r[..., None], jnp.float32(E4M3_MAX))
    s_b = s.astype(fp8.FP8_DTYPE)
    q = s_b.astype(jnp.float32) * g[..., None]
    empty = (s_b.astype(jnp.float32) == 0) | (q < SMALLEST_NORMAL) | zero_row[..., None]
    inverse = jnp.where(empty, jnp.float32(0), jnp.float32(1) / jnp.where(empty, 1, q))
    e = jnp.clip(blocks * inverse[..., None], -E2M1_MAX, E2M1_MAX)
    e = jnp.where(finite_row[..., None, None], e, jnp.float32(0))
    codes = jax.lax.bitcast_convert_type(e.astype(jnp.float4_e2m1fn), jnp.uint4)
    codes = codes.astype(jnp.uint8).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    data = codes[..., 0] | codes[..., 1] << 4
    nan = jnp.float32(jnp.nan)
    scales = jnp.where(finite_row[..., None], s_b.astype(jnp.float32), nan)
    return Quantized(data, scales.astype(fp8.FP8_DTYPE),
                     jnp.where(finite_row, g, nan), "nvfp4")


def _unpack_e2m1(data: jax.Array) -> jax.Array:
    """uint8 [..., H/2] -> float32 [..., H]: the low nibble first."""
    codes = jnp.stack([data & 0xF, data >> 4], axis=-1)
    codes = codes.reshape(*data.shape[:-1], data.shape[-1] * 2)
    magnitude = jnp.asarray(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32))[codes & 7]
    return jnp.where(codes & 8, -magnitude, magnitude)


# ---------------------------------------------------------------------------------------------
# On the wire: dispatch moves a Quantized as its data rows and one float32 array of the rest


def wire_bytes(format: str, hidden: int) -> tuple[int, int]:
    """Bytes of one row of H channels as dispatch moves it: (its data, its other bytes in
    float32 words, to_rows)."""
    block = BLOCKS[format]
    if format == "e4m3":
        return hidden, hidden // block * 4
    data = hidden // 2 if format == "nvfp4" else hidden
    rest = hidden // block + (4 if format == "nvfp4" else 0)
    return data, -(-rest // 4) * 4


def to_rows(q: Quantized) -> tuple[jax.Array, jax.Array]:
    """(data [T, ...], float32 [T, W]) that dispatch moves as it moves the FP8 pair: the data
    rows, and every other byte of a row (its block scales, then its global scale) in float32
    words, bit for bit (dispatch copies them, never computes with them)."""
    if q.format == "e4m3":
        return q.data, q.scales
    parts = [q.scales] + ([q.global_scale[..., None]] if q.global_scale is not None else [])
    row = jnp.concatenate([_as_bytes(p) for p in parts], axis=-1)
    row = jnp.pad(row, [(0, 0)] * (row.ndim - 1) + [(0, -row.shape[-1] % 4)])
    words = row.reshape(*row.shape[:-1], row.shape[-1] // 4, 4)
    return q.data, jax.lax.bitcast_convert_type(words, jnp.float32)


def from_rows(data: jax.Array, words: jax.Array, like: Quantized) -> Quantized:
    """The inverse of `to_rows` for rows of `like`'s format and sizes (any number of rows)."""
    if like.format == "e4m3":
        return Quantized(data, words, None, like.format)
    row = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*words.shape[:-1],
                                                                words.shape[-1] * 4)
    n = like.scales.shape[-1] * like.scales.dtype.itemsize
    scales = _from_bytes(row[..., :n], like.scales.dtype)
    global_scale = None
    if like.global_scale is not None:
        global_scale = _from_bytes(row[..., n:n + 4], jnp.float32)[..., 0]
    return Quantized(data, scales, global_scale, like.format, like.packed)


def _as_bytes(a: jax.Array) -> jax.Array:
    """[..., n] of any dtype -> uint8 [..., n * itemsize] (little-endian bytes)."""
    b = jax.lax.bitcast_convert_type(a, jnp.uint8)
    return b.reshape(*a.shape[:-1], a.shape[-1] * a.dtype.itemsize)


def _from_bytes(b: jax.Array, dtype: Any) -> jax.Array:
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], b.shape[-1] // size, size),
                                        dtype)
