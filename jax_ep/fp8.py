"""FP8 (e4m3) quantization with one float32 scale per token per 128 channels.

Per block of 128 channels, in float32: `scale = max(amax, 1e-4) * float32(1/448)`, then
`x_fp8 = float8_e4m3fn(x * (1 / scale))` (the reciprocal rounded to float32 once per block,
the cast rounding to nearest even); 448 is the largest e4m3 value, so the cast never
saturates. A NaN in a block makes its scale NaN and every value of the block NaN. Both are
products with a rounded reciprocal, not quotients, because compilers rewrite a division by a
constant or by a broadcast value into exactly such a product; writing the products out keeps
every backend bit-identical. The low-latency kernels' in-kernel cast uses the same rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import _checks

BLOCK = 128
FP8_MAX = 448.0
INV_FP8_MAX = 1.0 / FP8_MAX  # rounded to float32 where it is used
AMAX_FLOOR = 1e-4
FP8_DTYPE = jnp.float8_e4m3fn


def _blocks(x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def check_hidden(op: str, name: str, hidden: int, low_latency: bool = False) -> None:
    """H must be a multiple of 128: for FP8 (a scale per 128 channels), and for the
    low-latency ops, whose messages go in 128-channel blocks whether cast or not."""
    if hidden % BLOCK != 0:
        why = (f"for the low-latency ops (their messages go in blocks of {BLOCK} channels, "
               f"FP8 or not). Pad the hidden dimension" if low_latency else
               f"for FP8 (one scale per {BLOCK} channels). Pad the hidden dimension or "
               f"dispatch in bf16")
        raise ValueError(
            f"{op}: the hidden size of {name} ({hidden}) must be a multiple of {BLOCK} {why}.")


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantizes `x` [..., H] (any float dtype, H % 128 == 0).

    Returns:
      (x_fp8 float8_e4m3fn [..., H], scales float32 [..., H/128]).
    """
    op = "jax_ep.fp8.quantize"
    _checks.check_float(op, "x", x, ndim=x.ndim if hasattr(x, "ndim") else 1, expect="[..., H]")
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have at least one dimension; got a scalar.")
    check_hidden(op, "x", x.shape[-1])
    blocks = _blocks(x.astype(jnp.float32))
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), jnp.float32(AMAX_FLOOR))
    # A NaN makes its block's scale NaN (so every value of the block NaN), whatever XLA's
    # reduction does with NaN (it kept it at some sizes and dropped it at others): the quiet
    # NaN 0x7FC00000 on every processor (a GPU's NaN product would be 0x7FFFFFFF).
    poisoned = jnp.isnan(blocks).any(axis=-1)
    scales = jnp.where(poisoned, jnp.float32(jnp.nan), amax * jnp.float32(INV_FP8_MAX))
    scaled = blocks * (1.0 / scales)[..., None]
    # A NaN element is the byte 0x7F whatever the sign of the NaN product, which differs
    # between processors (x86 gives inf * 0 a negative NaN, a GPU a positive one).
    scaled = jnp.where(jnp.isnan(scaled), jnp.float32(jnp.nan), scaled)
    x_fp8 = scaled.astype(FP8_DTYPE)
    return x_fp8.reshape(x.shape), scales


def dequantize(
    x_fp8: jax.Array, scales: jax.Array, out_dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Inverse of `quantize`: float32(x_fp8) * scale per block, returned in `out_dtype`."""
    op = "jax_ep.fp8.dequantize"
    check_pair(op, "x_fp8", x_fp8, scales)
    out = canonical(_blocks(x_fp8.astype(jnp.float32)) * scales[..., None])
    return out.reshape(x_fp8.shape).astype(out_dtype)


def canonical(v: jax.Array) -> jax.Array:
    """A float32 product of dequantization as every platform computes it: magnitudes below
    2^-126 as zeros of their sign (XLA's CPU arithmetic flushes them, a GPU's need not) and
    every NaN the positive quiet NaN (x86 gives inf * 0 a negative NaN, a GPU a positive one).
    The kernels' dequantize_row (cuda/cast.h) applies the same rule."""
    tiny = jnp.abs(v) < jnp.float32(2.0**-126)
    v = jnp.where(tiny, jnp.copysign(jnp.float32(0), v), v)
    return jnp.where(jnp.isnan(v), jnp.float32(jnp.nan), v)


def check_pair(op: str, name: str, x_fp8: jax.Array, scales: jax.Array) -> None:
    """`(x_fp8 [..., H] float8_e4m3fn, scales float32 [..., H/128])` with matching shapes."""
    _checks.check_array(
        op, name, x_fp8, dtypes=(FP8_DTYPE,), expect="float8_e4m3fn [..., H]",
        fix="Produce the pair with jax_ep.fp8.quantize(x).",
    )
    check_hidden(op, name, x_fp8.shape[-1])
    want = (*x_fp8.shape[:-1], x_fp8.shape[-1] // BLOCK)
    _checks.check_array(
        op, "scales", scales, dtypes=(jnp.float32,), shape=want, ndim=len(want),
        expect=f"float32 {list(want)} (one scale per {BLOCK} channels of {name})",
    )
