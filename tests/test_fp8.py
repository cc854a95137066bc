"""FP8 quantize/dequantize against the NumPy reference, and round-trip error bounds."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_ep import fp8
from jax_ep.tools import reference


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (7, 384), (3, 5, 256)])
def test_quantize_matches_reference_bitwise(dtype, shape):
    rng = np.random.default_rng()
    x = (rng.standard_normal(shape) * rng.choice([1e-6, 1e-2, 1, 300], size=shape)).astype(dtype)
    q, s = fp8.quantize(jnp.asarray(x))
    want_q, want_s = reference.quantize(x)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(
        np.asarray(fp8.dequantize(q, s)), reference.dequantize(want_q, want_s)
    )


def test_reference_follows_the_nan_rule():
    """Blocks holding +-inf or a NaN of either sign: the reference writes what the contract
    says and fp8.quantize writes (scale the quiet NaN or inf, NaN elements the byte 0x7F,
    an infinity's finite neighbours 0), byte for byte."""
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 256)).astype(np.float32)
    negative_nan = np.array(0xFFC00000, np.uint32).view(np.float32)
    x[0, 3], x[1, 200], x[2, 5], x[3, 130] = np.inf, -np.inf, negative_nan, np.nan
    want_q, want_s = reference.quantize(x)
    q, s = fp8.quantize(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(s).view(np.uint32), want_s.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    nan_bytes = want_q.view(np.uint8) == 0x7F
    assert nan_bytes[0, 3] and nan_bytes[1, 200] and nan_bytes[2, :128].all()
    beside_inf = want_q.view(np.uint8)[0, :128][np.arange(128) != 3]
    assert not (beside_inf & 0x7F).any()  # +-0


def test_round_trip_error_bound():
    """e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, and an absolute
    error <= half the smallest subnormal step (2^-10 * scale) near zero."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((64, 1024)) * np.exp(rng.uniform(-8, 8, (64, 1)))).astype(np.float32)
    q, s = fp8.quantize(jnp.asarray(x))
    back = np.asarray(fp8.dequantize(q, s)).astype(np.float64)
    scale = np.repeat(np.asarray(s, np.float64), 128, axis=1)
    bound = np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert np.all(np.abs(back - x) <= bound)
    assert np.all(np.abs(np.asarray(q, np.float32)) <= 448)


def test_amax_floor_and_exact_values():
    x = np.zeros((2, 256), np.float32)
    x[1, :128] = 448.0 * np.arange(128) / 127  # a block whose amax is exactly 448
    q, s = fp8.quantize(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(s)[0], np.float32(1e-4) / np.float32(448))
    assert np.asarray(s)[1, 0] == 1.0
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32)[0], 0)
    assert np.asarray(q).astype(np.float32)[1, 127] == 448.0
