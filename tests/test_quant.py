"""jax_ep.quant against a NumPy reference written here from the rules of docs/contract.md
("Wire formats"): random rows of every magnitude, blocks of zeros, values at each format's
largest value and at rounding ties, subnormal-range inputs, NaN and infinity."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_ep import quant

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
NORMAL = F32(2.0**-126)


def _flush(x):
    x = np.asarray(x, F32)
    return np.where(np.abs(x) < NORMAL, F32(0), x).astype(F32)


def _amax(blocks):
    with np.errstate(invalid="ignore"):
        return np.max(np.abs(blocks), axis=-1)  # NaN propagates in NumPy


def _exponent_field(v):
    return (np.asarray(v, F32).view(np.int32) >> 23) & 0xFF


def _pow2(k):
    """2^k in float32 for k in [-149, 127] (NumPy keeps subnormals)."""
    return np.ldexp(F32(1), np.asarray(k, np.int32)).astype(F32)


def reference(x, format, packed=False):
    """(data, scales, global_scale) by the contract's rules."""
    if format == "e4m3":
        return _reference_e4m3(x)
    x = _flush(x)
    block = quant.BLOCKS[format]
    if format == "nvfp4":
        return _reference_nvfp4(x)
    blocks = x.reshape(*x.shape[:-1], -1, block)
    amax = _amax(blocks)
    finite = np.isfinite(amax)
    with np.errstate(invalid="ignore", over="ignore"):
        if format == "e4m3_ue8m0":
            s = (np.maximum(amax, F32(1e-4)) * F32(1 / 448)).astype(F32)
            mant, exp = np.frexp(np.where(finite, s, F32(1)))  # s = mant * 2^exp, mant in [0.5, 1)
            k = np.where(mant == 0.5, exp - 1, exp)  # ceil(log2 s)
        else:
            _, exp = np.frexp(np.where(finite & (amax > 0), amax, F32(1)))
            k = np.where(amax > 0, np.clip(exp - 1 - 8, -127, 127), -127)
        biased = np.where(finite, k + 127, 255).astype(np.uint8)
        scaled = (blocks * np.where(finite, _pow2(-k), F32(0))[..., None]).astype(F32)
        if format == "mxfp8":
            scaled = np.clip(scaled, -448, 448)
        scaled = np.where(finite[..., None], scaled, F32(np.nan))  # elements 0x7F
    data = scaled.astype(E4M3).reshape(x.shape)
    if packed:
        n = biased.shape[-1]
        padded = np.concatenate([biased, np.zeros(biased.shape[:-1] + (-n % 4,), np.uint8)], -1)
        return data, padded.view("<i4"), None
    return data, biased, None


def _reference_e4m3(x):
    """e4m3: scale max(amax, 1e-4) / 448 in float32, elements times its reciprocal; a NaN
    element is the byte 0x7F (NumPy on x86 gives inf * 0 a negative NaN)."""
    blocks = x.reshape(*x.shape[:-1], -1, 128)
    s = (np.maximum(_amax(blocks), F32(1e-4)) * F32(1 / 448)).astype(F32)
    s = np.where(np.isnan(s), F32(np.nan), s)  # the quiet NaN 0x7FC00000, whatever the input's
    with np.errstate(invalid="ignore"):
        scaled = (blocks * (F32(1) / s)[..., None]).astype(F32)
    scaled = np.where(np.isnan(scaled), F32(np.nan), scaled)
    return scaled.astype(E4M3).reshape(x.shape), s, None


def _e2m1_code(v):
    """e2m1 codes of float32 v in [-6, 6], rounding to nearest, ties to the even code."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)
    d = np.abs(np.abs(v)[..., None] - grid)  # exact: every term is a float32 of few bits
    nearest = d == d.min(axis=-1, keepdims=True)
    even = nearest & (np.arange(8) % 2 == 0)
    best = np.where(even.any(-1), np.argmax(even, -1), np.argmax(nearest, -1))
    return (best | np.where(np.signbit(v), 8, 0)).astype(np.uint8)


def _reference_nvfp4(x):
    rows = _amax(x)
    finite = np.isfinite(rows)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = (rows * F32(1 / 2688)).astype(F32)
        zero = (rows == 0) | (g < NORMAL)
        g = np.where(zero | ~finite, F32(1), g).astype(F32)
        blocks = x.reshape(*x.shape[:-1], -1, 16)
        r = (F32(1) / (F32(6) * g).astype(F32)).astype(F32)
        s_b = np.minimum((_amax(blocks) * r[..., None]).astype(F32), F32(448)).astype(E4M3)
        q = (s_b.astype(F32) * g[..., None]).astype(F32)
        empty = (s_b.astype(F32) == 0) | (q < NORMAL) | zero[..., None]
        inv = np.where(empty, F32(0), (F32(1) / np.where(empty, F32(1), q)).astype(F32))
        e = np.clip((blocks * inv[..., None]).astype(F32), -6, 6)
        e = np.where(finite[..., None, None], e, F32(0))
    codes = _e2m1_code(e).reshape(*x.shape[:-1], -1, 2)
    data = (codes[..., 0] | codes[..., 1] << 4).astype(np.uint8)
    scales = np.where(finite[..., None], s_b.astype(F32), F32(np.nan)).astype(E4M3)
    return data, scales, np.where(finite, g, F32(np.nan)).astype(F32)


def assert_bytes(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape,
                                                                 got.dtype, want.dtype)
    g, w = got.view(np.uint8), want.view(np.uint8)
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{what}: {len(bad)} bytes differ, first at {bad[0].tolist()}"


def rows_of_every_kind(rng, n, H):
    """Rows of random magnitudes with, mixed in: blocks of zeros, subnormal-range and
    near-subnormal values, values at 448 and 6 times a power of two (each format's largest),
    rounding ties, a NaN (negative, with a payload) and an infinity."""
    x = rng.standard_normal((n, H)) * 10.0 ** rng.uniform(-8, 8, (n, 1))
    x = x.astype(F32)
    x[0, :32] = 0  # zero blocks
    x[1] = 0  # a row of zeros
    x[2, :16] = rng.choice([1e-40, -3e-39, 2.0**-126, 2.0**-125], 16)  # subnormal range
    x[3, :8] = [448, -448, 6, 0.25, 0.75, 2.5, 5.0, 3.5]  # largest values, e2m1 ties
    x[4, 5] = np.uint32(0xFFC10000).view(F32)  # a negative NaN with a payload (bfloat16's too)
    x[5, 40] = np.inf
    x[6] = rng.standard_normal(H) * 2.0**-118  # rows near the bottom of the normal range
    return x


@pytest.mark.parametrize("format", quant.FORMATS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_quantize_against_the_reference(format, dtype):
    rng = np.random.default_rng()
    H = 128 * int(rng.integers(1, 5))
    x = rows_of_every_kind(rng, 9, H).astype(dtype)
    for packed in (False, True) if format == "e4m3_ue8m0" else (False,):
        q = jax.jit(lambda x, packed=packed: quant.quantize(x, format, packed=packed))(x)
        assert q.format == format and q.packed == packed
        want = reference(np.asarray(x, F32), format, packed)
        assert_bytes(q.data, want[0], f"{format} data")
        assert_bytes(q.scales, want[1], f"{format} scales")
        if want[2] is None:
            assert q.global_scale is None
        else:
            assert_bytes(q.global_scale, want[2], f"{format} global_scale")


@pytest.mark.parametrize("format", quant.FORMATS)
def test_dequantize_is_close_and_nan_where_the_input_was(format):
    """Round trip: within the format's relative step of each block's largest value, NaN
    exactly in the blocks (nvfp4: rows) that held a NaN or an infinity."""
    rng = np.random.default_rng()
    H = 256
    x = (rng.standard_normal((6, H)) * 10.0 ** rng.uniform(-3, 3, (6, 1))).astype(F32)
    x[2, 17], x[4, 100] = np.nan, -np.inf
    q = quant.quantize(x, format)
    back = np.asarray(quant.dequantize(q))
    block = quant.BLOCKS[format]
    unit = H if format == "nvfp4" else block
    poisoned = np.repeat(~np.isfinite(x).reshape(6, -1, unit).all(-1), unit, axis=-1)
    np.testing.assert_array_equal(np.isnan(back), poisoned)
    step = {"e4m3": 2**-3, "e4m3_ue8m0": 2**-3, "mxfp8": 2**-3, "nvfp4": 0.5}[format]
    blocks = np.abs(np.where(poisoned, 0, x)).reshape(6, -1, block).max(-1, keepdims=True)
    bound = np.repeat(blocks * step * 2, block, axis=-1).reshape(6, H)
    ok = ~poisoned
    assert (np.abs(back - x)[ok] <= bound[ok]).all(), format
    if format == "e4m3_ue8m0":
        packed = quant.quantize(x, format, packed=True)
        np.testing.assert_array_equal(np.asarray(quant.dequantize(packed)), back)


def test_quantized_is_a_pytree_with_a_static_format():
    q = quant.quantize(jnp.ones((2, 64)), "mxfp8")
    leaves, tree = jax.tree.flatten(q)
    assert len(leaves) == 2 and jax.tree.unflatten(tree, leaves).format == "mxfp8"
    out = jax.jit(lambda q: q)(q)
    assert out.format == "mxfp8" and out.data.dtype == E4M3 and out.scales.dtype == np.uint8
    q4 = quant.quantize(jnp.ones((3, 32)), "nvfp4")
    assert q4.data.shape == (3, 16) and q4.scales.shape == (3, 2) and q4.global_scale.shape == (3,)


def test_bad_arguments_name_the_rule():
    with pytest.raises(ValueError, match="format must be one of"):
        quant.quantize(jnp.ones((2, 128)), "fp4")
    with pytest.raises(ValueError, match=r"blocks of 32 channels: the hidden size \(48\) must "
                                         r"be a multiple of 32"):
        quant.quantize(jnp.ones((2, 48)), "mxfp8")
    with pytest.raises(ValueError, match="packed=True packs UE8M0 exponents"):
        quant.quantize(jnp.ones((2, 128)), "mxfp8", packed=True)
    with pytest.raises(TypeError, match="x must be a float array"):
        quant.quantize(jnp.ones((2, 128), jnp.int32), "nvfp4")
    with pytest.raises(TypeError, match="q must be a jax_ep.quant.Quantized"):
        quant.dequantize((jnp.ones((2, 128)), jnp.ones((2, 1))))


@pytest.mark.parametrize("format", quant.FORMATS)
@pytest.mark.parametrize("expert_major", [False, True])
def test_dispatch_carries_every_format_bit_for_bit(format, expert_major):
    """A Quantized dispatched arrives as a Quantized of its format: each received row (entry)
    holds its source row's bytes, scales and global scale included (NaN and 0xFF scales too),
    on the run's path ($JAX_EP_BACKEND, transport, mesh, peers)."""
    from harness import sharded, to_numpy
    from test_fuzz import draw_routing, model_normal

    import jax_ep

    rng = np.random.default_rng()
    R = 2 if jax_ep.backends.resolve("auto") == "xla" or jax_ep.runtime.is_initialized() else 1
    T, K, E, H = 7, 2, 2 * R, 256
    idx, w = draw_routing(rng, R, T, K, E)
    x = rows_of_every_kind(rng, R * T, H).reshape(R, T, H)
    q = quant.quantize(x, format, packed=format == "e4m3_ue8m0")
    capacity = int(rng.integers(1, R * T * (K if expert_major else 1) + 1))

    def per_shard(data, scales, global_scale, idx, w):
        q_local = quant.Quantized(data, scales, None if q.global_scale is None else global_scale,
                                  q.format, q.packed)
        recv, _ = jax_ep.dispatch(q_local, idx, w, num_experts=E, capacity=capacity,
                                  expert_major=expert_major, on_overflow="drop",
                                  on_invalid="mask")
        assert isinstance(recv.x, quant.Quantized) and recv.x.format == format
        return recv.with_zero_padding().x

    glob = q.global_scale if q.global_scale is not None else np.zeros((R, T), F32)
    got = to_numpy(sharded(per_shard, R)(q.data, q.scales, glob, idx, w))
    for name in ("data", "scales", "global_scale"):
        leaf = getattr(q, name)
        if leaf is None:
            continue
        leaf = np.asarray(leaf)
        rows = leaf if leaf.ndim == 3 else leaf[..., None]
        want = model_normal(rows, idx, w, E, capacity, expert_major)
        for d in range(R):
            expect = want[d]["x"] if leaf.ndim == 3 else want[d]["x"][..., 0]
            assert_bytes(getattr(got, name)[d], expect, f"{format} {name} on rank {d}")


def _row_bytes(data, words):
    """A dispatch's rows as they travel (quant.to_rows), one float32 row each: the reference
    copies them bit for bit."""
    data, words = np.asarray(data), np.asarray(words)
    lead = data.shape[:-1]
    row = np.concatenate([data.view(np.uint8).reshape(*lead, -1),
                          words.view(np.uint8).reshape(*lead, -1)], axis=-1)
    return np.ascontiguousarray(row).view(F32)


def _kernel_routing(rng, T: int):
    """(R, T, K, E, H, topk_idx, topk_weights) for the kernels' wire formats: 4 host-peer
    ranks where the runtime runs them, else one; skewed routing (a hot expert, ranks nobody
    picks, masked and invalid ids), and the last rank receiving nothing."""
    from test_fuzz import draw_routing

    import jax_ep

    R = 4 if jax_ep.runtime.is_initialized() else 1
    K, E, H = 3, 4 * R, 256
    idx, w = draw_routing(rng, R, T, K, E)
    if R > 1:  # the last rank's experts' choices masked
        idx = np.where(idx // (E // R) == R - 1, -1, idx).astype(np.int32)
    return R, T, K, E, H, idx, w


@pytest.mark.parametrize("format", quant.FORMATS)
@pytest.mark.parametrize("expert_major", [False, True])
def test_dispatch_send_quantizes_bfloat16_rows(format, expert_major):
    """dispatch(x, ..., wire_format=f) of bfloat16 x on the cuda backend: its send casts each
    row itself (no quantization pass in XLA, the custom call's `wire`), and the received
    Quantized rows are, byte for byte, those of the dispatch of quant.quantize(x, f) (the
    path of the other backends and dtypes) and the reference's dispatch of those rows; with
    dequantize (the default) the unpack dequantizes them between devices (the custom call's
    `dequantize`, no pass in XLA), bit for bit the reference's dispatch of quant.dequantize's
    rows. Skewed
    routing (a hot expert, ranks nobody picks, masked and invalid ids), T not a power of two,
    a capacity that may drop, NaN and infinity in rows; on the run's path (host peers,
    $JAX_EP_CHANNELS, $JAX_EP_PEER_ACCESS, $JAX_EP_RANKS_PER_NODE), else one rank."""
    from harness import compiled_text, sharded, to_numpy

    import jax_ep
    from jax_ep.tools import reference

    rng = np.random.default_rng()
    R, T, K, E, H, idx, w = _kernel_routing(rng, 11)
    x = rows_of_every_kind(rng, R * T, H).astype(ml_dtypes.bfloat16).reshape(R, T, H)
    q = quant.quantize(jnp.asarray(x), format)
    capacity = int(rng.integers(1, R * T * (K if expert_major else 1) + 1))
    kw = dict(num_experts=E, capacity=capacity, expert_major=expert_major,
              on_overflow="drop", on_invalid="mask", backend="cuda")

    def per_shard(x, idx, w):
        fused, _ = jax_ep.dispatch(x, idx, w, wire_format=format, dequantize=False, **kw)
        unfused, _ = jax_ep.dispatch(quant.quantize(x, format), idx, w, **kw)
        rows, _ = jax_ep.dispatch(x, idx, w, wire_format=format, **kw)
        return ([(r.num_tokens, *quant.to_rows(r.with_zero_padding().x))
                 for r in (fused, unfused)], rows.with_zero_padding().x)

    text = compiled_text(
        lambda x, idx, w: jax_ep.dispatch(x, idx, w, wire_format=format, **kw)[0].x,
        R, x, idx, w)
    assert "wire = " in text and ("dequantize = " in text) == (R > 1)  # between devices
    where = dict(num_experts=E, capacity=capacity, expert_major=expert_major)
    want = reference.dispatch(_row_bytes(*quant.to_rows(q)), idx, w, **where)
    got, rows = to_numpy(sharded(per_shard, R)(x, idx, w))
    for name, (count, data, words) in zip(("fused", "unfused"), got, strict=True):
        np.testing.assert_array_equal(count, want["num_tokens"], err_msg=name)
        assert_bytes(_row_bytes(data, words), want["x"], f"{format} {name} rows")
    dequantized = np.asarray(quant.dequantize(q, jnp.bfloat16))
    assert_bytes(rows, reference.dispatch(dequantized, idx, w, **where)["x"],
                 f"{format} rows dequantized by the unpack")


@pytest.mark.parametrize("format", quant.FORMATS)
def test_wire_bytes_are_what_dispatch_moves(format):
    """quant.wire_bytes (the account's row size per format) is the size of quant.to_rows."""
    H = 7168
    data, rest = quant.to_rows(quant.quantize(jnp.ones((3, H)), format,
                                              packed=format == "e4m3_ue8m0"))
    assert quant.wire_bytes(format, H) == (data.shape[1] * data.dtype.itemsize,
                                           rest.shape[1] * rest.dtype.itemsize)


def test_the_account_shows_each_format_s_wire(capsys):
    from jax_ep.tools import account

    account.main(["--ranks", "4", "--tokens", "256", "--ll-tokens", "16"])
    dispatch, step = capsys.readouterr().out.split("One MoE layer's training step")
    for table in (dispatch, step):
        rows = {line.split("|")[1].strip(): line for line in table.splitlines()
                if line.startswith("| ") and line.split("|")[1].strip() in
                ("bfloat16", *quant.FORMATS)}
        assert set(rows) == {"bfloat16", *quant.FORMATS}
        assert "| 1.00 |" in rows["bfloat16"]
    assert "| nvfp4 | 4036 |" in dispatch


def _low_latency_rows(rng, R, T, H):
    """bfloat16 rows of every kind (rows_of_every_kind, in bfloat16: its subnormals too), and
    a routing that sends each to some experts."""
    x = rows_of_every_kind(rng, R * T, H).astype(ml_dtypes.bfloat16).reshape(R, T, H)
    x[0, 1, :3] = [9.2e-41, -3e-39, 1.2e-38]  # bfloat16 subnormals and the smallest normal
    return x


def _assert_quantized_slots(got: quant.Quantized, plain, count, format, what):
    """`got` (the rows of a low-latency dispatch in `format`) equals quant.quantize of the
    bfloat16 rows of the same dispatch without a format (`plain`), slot for slot up to each
    expert's count."""
    with jax.default_device(jax.devices("cpu")[0]):  # the portable rule, also on a GPU run
        want = quant.quantize(jnp.asarray(plain), format)
    assert isinstance(got, quant.Quantized) and got.format == format, what
    for name in ("data", "scales", "global_scale"):
        if getattr(want, name) is None:
            assert getattr(got, name) is None, (what, name)
            continue
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        for at in np.ndindex(*count.shape):
            n = int(count[at])
            assert_bytes(g[at][:n], w[at][:n], f"{what}: {name} of expert {at}")


@pytest.mark.parametrize("format", quant.FORMATS)
def test_low_latency_quantizes_to_every_format_bit_for_bit(format):
    """low_latency_dispatch(wire_format=F) quantizes each row before it is sent (the cuda
    backend: in its send kernel) to exactly quant.quantize of the row, on the run's path
    (virtual ranks: tests/test_virtual.py, test_low_latency_wire_format)."""
    from harness import sharded, to_numpy
    from test_fuzz import draw_routing

    import jax_ep

    rng = np.random.default_rng()
    R = 2 if jax_ep.backends.resolve("auto") == "xla" or jax_ep.runtime.is_initialized() else 1
    T, K, E, H = 9, 3, 4 * R, 128 * int(rng.integers(1, 4))
    idx, _ = draw_routing(rng, R, T, K, E)
    x = _low_latency_rows(rng, R, T, H)

    def per_shard(x, idx):
        recv, _ = jax_ep.low_latency_dispatch(x, idx, num_experts=E, wire_format=format,
                                              on_invalid="mask")
        plain, _ = jax_ep.low_latency_dispatch(x, idx, num_experts=E, on_invalid="mask")
        return recv.x, plain.x, plain.count

    got, plain, count = to_numpy(sharded(per_shard, R)(x, idx))
    _assert_quantized_slots(got, plain, count, format, f"R {R} H {H}")


def test_low_latency_wire_format_errors():
    from jax_ep import virtual

    x = np.zeros((1, 2, 128), ml_dtypes.bfloat16)
    idx = np.zeros((1, 2, 1), np.int32)
    with pytest.raises(ValueError, match="not both"):
        virtual.low_latency_dispatch(x, idx, num_experts=2, use_fp8=True, wire_format="mxfp8",
                                     backend="xla")
    with pytest.raises(ValueError, match="wire_format"):
        virtual.low_latency_dispatch(x, idx, num_experts=2, wire_format="fp4", backend="xla")


@pytest.mark.parametrize("format", ["e4m3_ue8m0", "mxfp8"])
def test_the_smallest_and_largest_scales_dequantize_exactly(format):
    """Each element times its power-of-two scale in float32, at both ends of the scale's
    range: 2^-127 (biased exponent 0, a subnormal scale whose products are normal) and
    2^127 (products overflow to infinity), against float64."""
    rng = np.random.default_rng()
    block = quant.BLOCKS[format]
    values = rng.choice([448.0, -448.0, 1.0, -0.5, 2.0**-6, 0.0], (4, 2 * block))
    data = values.astype(E4M3)
    biased = np.array([[0, 254], [1, 127], [0, 0], [254, 253]], np.uint8)
    for packed in (False, True) if format == "e4m3_ue8m0" else (False,):
        scales = np.asarray(quant._pack(jnp.asarray(biased))) if packed else biased
        got = np.asarray(quant.dequantize(quant.Quantized(jnp.asarray(data), jnp.asarray(scales),
                                                          None, format, packed)))
        scale = np.repeat(2.0 ** (biased.astype(np.float64) - 127), block, axis=-1)
        with np.errstate(over="ignore"):
            want = (data.astype(np.float64) * scale).astype(F32)
        # XLA:CPU flushes subnormal results: a product below 2^-126 may read 0.
        tiny = np.abs(want) < NORMAL
        np.testing.assert_array_equal(got[~tiny], want[~tiny], err_msg=f"packed {packed}")
        assert (got[tiny] == 0).all() | (got[tiny] == want[tiny]).all()


@pytest.mark.parametrize("format", quant.FORMATS)
def test_zero_tokens_in_every_format(format):
    """T = 0 on every op that moves a Quantized: dispatch (and along its handle) and the
    low-latency send in each wire format return their empty results."""
    from harness import sharded, to_numpy

    import jax_ep

    R = 2 if jax_ep.backends.resolve("auto") == "xla" or jax_ep.runtime.is_initialized() else 1
    E, H, K = 2 * R, 256, 2
    x = np.zeros((R, 0, H), ml_dtypes.bfloat16)
    idx = np.zeros((R, 0, K), np.int32)
    w = np.zeros((R, 0, K), F32)

    def per_shard(x, idx, w):
        q = quant.quantize(x, format, packed=format == "e4m3_ue8m0")
        recv, handle = jax_ep.dispatch(q, idx, w, num_experts=E, capacity=4)
        along = jax_ep.dispatch(q, handle=handle)
        low, _ = jax_ep.low_latency_dispatch(x, idx, num_experts=E, wire_format=format)
        return (recv.with_zero_padding().x, recv.num_tokens, along,
                low.count)

    recv, received, along, count = to_numpy(sharded(per_shard, R)(x, idx, w))
    assert isinstance(recv, quant.Quantized) and recv.format == format
    assert (np.asarray(received) == 0).all() and (np.asarray(count) == 0).all()
    for got in (recv, along):
        for name in ("data", "scales"):
            assert not np.asarray(getattr(got, name)).any(), name


def test_a_malformed_quantized_is_refused_naming_the_field():
    """dispatch (and dequantize) check a Quantized's format, dtypes and shapes at entry, on
    every backend, naming the field and the shape it must have."""
    from harness import sharded

    import jax_ep

    R = 2 if jax_ep.backends.resolve("auto") == "xla" or jax_ep.runtime.is_initialized() else 1
    T, H, K, E = 5, 256, 2, 2 * R
    x = jnp.ones((T, H), jnp.float32)
    good = {f: quant.quantize(x, f) for f in quant.FORMATS}
    bad = [
        (quant.Quantized(good["mxfp8"].data, good["mxfp8"].scales, None, "fp6"),
         r"x.format must be one of"),
        (quant.Quantized(good["mxfp8"].data, good["mxfp8"].scales[:, :4], None, "mxfp8"),
         r"x.scales must be uint8 \[5, 8\] for format 'mxfp8' rows of 256 channels; got "
         r"uint8 \[5, 4\]"),
        (quant.Quantized(good["nvfp4"].data, good["nvfp4"].scales, None, "nvfp4"),
         r"x.global_scale must be float32 \[5\] .*got None"),
        (quant.Quantized(x, good["e4m3"].scales, None, "e4m3"),
         r"x.data must be float8_e4m3fn \[5, 256\] .*got float32 \[5, 256\]"),
        (quant.Quantized(good["mxfp8"].data, good["mxfp8"].scales[:-1], None, "mxfp8"),
         r"x.scales must be uint8 \[5, 8\] .*got uint8 \[4, 8\]"),
        (quant.Quantized(good["e4m3"].data, good["e4m3"].scales, None, "e4m3", True),
         r"x.packed goes with format 'e4m3_ue8m0'"),
    ]
    idx = np.zeros((R, T, K), np.int32)
    w = np.ones((R, T, K), F32)
    for q, message in bad:
        def per_shard(idx, w, q=q):
            return jax_ep.dispatch(q, idx, w, num_experts=E)[0].num_tokens

        with pytest.raises((TypeError, ValueError), match=message):
            sharded(per_shard, R)(idx, w)
        with pytest.raises((TypeError, ValueError), match=message.replace("x.", "q.")):
            quant.dequantize(q)


@pytest.mark.parametrize("format", quant.FORMATS)
def test_dispatch_on_a_wire_format_and_its_gradient(format):
    """dispatch(x, ..., wire_format=f): recv.x is, bit for bit, the dispatch of x's rows
    quantized to f and dequantized to x's dtype (the reference's dispatch of those rows); x's
    gradient is the unweighted combine of the rows' (straight through the rounding) and
    topk_weights' is as without f, both against the reference's backward; dequantize=False
    gives the Quantized rows. Rows hold a NaN and an infinity. grad_wire_format drawn: x's
    gradient is then that combine with its rows on that wire."""
    from harness import sharded, to_numpy
    from test_fuzz import draw_routing, wire_rounding

    import jax_ep
    from jax_ep.tools import reference

    rng = np.random.default_rng()
    R = 2 if jax_ep.backends.resolve("auto") == "xla" or jax_ep.runtime.is_initialized() else 1
    T, K, E, H = 9, 2, 2 * R, 128
    expert_major = bool(rng.integers(2))
    dtype = (ml_dtypes.bfloat16, np.float16, np.float32)[int(rng.integers(3))]
    grad_format = (None, *quant.FORMATS)[int(rng.integers(len(quant.FORMATS) + 1))]
    idx, w = draw_routing(rng, R, T, K, E)
    x = (rng.standard_normal((R, T, H)) * 3).astype(dtype)
    # Non-finite values travel as the format has them (a NaN or infinity makes its block NaN).
    x[0, rng.integers(T), rng.integers(H)] = np.nan
    x[R - 1, rng.integers(T), rng.integers(H)] = -np.inf
    rounded = np.asarray(quant.dequantize(quant.quantize(jnp.asarray(x), format), dtype))
    kw = dict(num_experts=E, expert_major=expert_major)
    want = reference.dispatch(rounded, idx, w, **kw)
    d_rows = rng.standard_normal(want["x"].shape).astype(dtype)
    d_weights = rng.standard_normal(want["topk_weights"].shape).astype(F32)

    def per_shard(x, idx, w, d_rows, d_weights):
        def forward(x, w):
            recv, _ = jax_ep.dispatch(x, idx, w, wire_format=format, on_invalid="mask",
                                      grad_wire_format=grad_format, **kw)
            return (recv.x, recv.topk_weights), recv.num_tokens

        (rows, weights), vjp, count = jax.vjp(forward, x, w, has_aux=True)
        grads = vjp((d_rows, d_weights))
        raw, _ = jax_ep.dispatch(x, idx, w, wire_format=format, dequantize=False,
                                 on_invalid="mask", **kw)
        assert isinstance(raw.x, quant.Quantized) and raw.x.format == format
        return rows, weights, count, grads, quant.dequantize(raw.x, x.dtype)

    rows, weights, count, (gx, gw), raw = to_numpy(sharded(per_shard, R)(
        x, idx, w, d_rows, d_weights))
    for d in range(R):
        n = int(count[d])
        assert n == want["num_tokens"][d]
        assert_bytes(rows[d][:n], want["x"][d][:n], f"{format} rows on rank {d}")
        assert_bytes(raw[d][:n], want["x"][d][:n], f"{format} Quantized rows on rank {d}")
    np.testing.assert_array_equal(weights, want["topk_weights"])
    want_gx, want_gw = reference.dispatch_vjp(d_rows, d_weights, idx, **kw)
    if grad_format is not None:
        want_gx = reference.combine(d_rows, idx, wire=wire_rounding(grad_format), **kw)
    tol = 1e-6 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(gx.astype(F32), want_gx.astype(F32), rtol=tol, atol=tol)
    np.testing.assert_allclose(gw, want_gw, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("format", quant.FORMATS)
def test_combine_on_a_wire_format_and_its_gradient(format):
    """combine(y, handle, wire_format=f): each rank's float32 row for a token (expert-major
    its weighted partial sum, rank-major its weighted row) is quantized to f before it
    travels and summed at home from the dequantized values in rank order, bit for bit the
    reference's combine with that rounding on the wire; the gradients are the default's
    backward (straight through the rounding) against the reference's. Weights, the layout
    and y's dtype drawn; a row holds a NaN. grad_wire_format drawn: the backward's rows,
    d(out) on its way to the receivers, are rounded to it."""
    from harness import sharded, to_numpy
    from test_fuzz import draw_routing, wire_rounding

    import jax_ep
    from jax_ep.tools import reference

    rng = np.random.default_rng()
    R = 2 if jax_ep.backends.resolve("auto") == "xla" or jax_ep.runtime.is_initialized() else 1
    T, K, E, H = 11, 3, 3 * R, 128
    expert_major = bool(rng.integers(2))
    weighted = bool(rng.integers(2))
    dtype = (ml_dtypes.bfloat16, np.float16, np.float32)[int(rng.integers(3))]
    idx, w = draw_routing(rng, R, T, K, E)
    x = rng.standard_normal((R, T, H)).astype(dtype)
    kw = dict(num_experts=E, expert_major=expert_major)
    cap = reference.dispatch(x, idx, w, **kw)["x"].shape[1]
    y = (rng.standard_normal((R, cap, H)) * 2).astype(dtype)
    y[0, rng.integers(cap), rng.integers(H)] = np.nan
    yw = rng.random((R, cap)).astype(F32) if weighted else None
    d_out = rng.standard_normal((R, T, H)).astype(dtype)
    grad_format = (None, *quant.FORMATS)[int(rng.integers(len(quant.FORMATS) + 1))]

    def per_shard(x, idx, w, y, yw, d_out):
        _, handle = jax_ep.dispatch(x, idx, w, on_invalid="mask", **kw)

        def forward(y, yw):
            return jax_ep.combine(y, handle, topk_weights=yw, wire_format=format,
                                  grad_wire_format=grad_format)

        out, vjp = jax.vjp(forward, y, yw)
        return out, vjp(d_out)

    out, (dy, dyw) = to_numpy(sharded(per_shard, R)(x, idx, w, y, yw, d_out))

    want = reference.combine(y, idx, weights=yw, wire=wire_rounding(format), **kw)
    assert_bytes(out, want, f"{format} combine")
    sent = d_out if grad_format is None else np.asarray(
        quant.dequantize(quant.quantize(jnp.asarray(d_out), grad_format), dtype))
    want_dy, want_dyw = reference.combine_vjp(sent, y, idx, weights=yw, **kw)
    tol = 1e-6 if dtype == np.float32 else 1e-2
    finite = np.isfinite(want_dy)
    np.testing.assert_allclose(dy.astype(F32)[finite], want_dy.astype(F32)[finite],
                               rtol=tol, atol=tol)
    if weighted:
        finite = np.isfinite(want_dyw)
        np.testing.assert_allclose(dyw[finite], want_dyw[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("format", quant.FORMATS)
@pytest.mark.parametrize("expert_major", [False, True])
def test_combine_stages_cast_bfloat16_rows(format, expert_major):
    """combine(y, handle, wire_format=f, grad_wire_format=f) of bfloat16 y on the cuda
    backend between devices: the kernels carry the format themselves (the custom calls'
    `wire`; no quantization or dequantization in XLA): each rank's stage casts its float32
    row of a token (the weighted row, expert-major the weighted partial sum of its entries)
    and the home sums the rows dequantized in rank order, bit for bit the reference's
    combine with that rounding on the wire; the backward's dispatch of d(out) casts in its
    send and dequantizes in its unpack, bit for bit the reference's backward of d(out)
    rounded to the format. Rows with NaN, infinity, the subnormal range and e2m1 ties;
    weights drawn (zeros among them, so that an infinity times its weight may be a NaN), or
    none; skewed routing, an empty rank, T not a power of two, a capacity that may drop; on
    the run's path (host peers, $JAX_EP_CHANNELS, $JAX_EP_PEER_ACCESS,
    $JAX_EP_RANKS_PER_NODE), else one rank."""
    from harness import compiled_text, sharded, to_numpy
    from test_fuzz import wire_rounding

    import jax_ep
    from jax_ep.tools import reference

    rng = np.random.default_rng()
    R, T, K, E, H, idx, w = _kernel_routing(rng, 13)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    capacity = int(rng.integers(1, R * T * (K if expert_major else 1) + 1))
    kw = dict(num_experts=E, capacity=capacity, expert_major=expert_major)
    n = R * capacity  # rows of every kind (7 of them at least), shuffled
    y = rows_of_every_kind(rng, max(n, 7), H)[rng.permutation(max(n, 7))[:n]]
    y = y.astype(ml_dtypes.bfloat16).reshape(R, capacity, H)
    yw = None
    if rng.integers(2):
        yw = np.where(rng.random((R, capacity)) < 0.1, 0, rng.random((R, capacity))).astype(F32)

    d_out = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)

    def per_shard(x, idx, w, y, yw, d_out):
        _, handle = jax_ep.dispatch(x, idx, w, on_overflow="drop", on_invalid="mask",
                                    backend="cuda", **kw)

        def forward(y):
            return jax_ep.combine(y, handle, topk_weights=yw, wire_format=format,
                                  grad_wire_format=format, backend="cuda")

        out, vjp = jax.vjp(forward, y)
        return out, vjp(d_out)[0]

    # Between devices the combine and its backward's dispatch carry the format (virtual
    # ranks quantize in XLA).
    text = compiled_text(per_shard, R, x, idx, w, y, yw, d_out)
    assert text.count("wire = ") == (2 if R > 1 else 0)
    out, dy = to_numpy(sharded(per_shard, R)(x, idx, w, y, yw, d_out))
    want = reference.combine(y, idx, weights=yw, wire=wire_rounding(format), **kw)
    assert_bytes(out, want, f"{format} combine")
    # The backward: d(out) rounded to the format on its way to the receivers (the weighted
    # rows' float32 products are XLA's, exact here: nothing reaches the subnormal range).
    sent = np.asarray(quant.dequantize(quant.quantize(jnp.asarray(d_out), format),
                                       jnp.bfloat16))
    want_dy, _ = reference.combine_vjp(sent, y, idx, weights=yw, **kw)
    assert_bytes(dy, want_dy, f"{format} combine's backward")


def test_combine_wire_format_errors():
    from harness import sharded

    import jax_ep

    idx, w = np.zeros((1, 2, 1), np.int32), np.ones((1, 2, 1), np.float32)
    x = np.ones((1, 2, 40), np.float32)

    def call(**kw):
        def per_shard(x, idx, w):
            _, handle = jax_ep.dispatch(x, idx, w, num_experts=1, expert_major=True)
            return jax_ep.combine(jnp.ones((handle.capacity, 40)), handle, **kw)

        return sharded(per_shard, 1)(x, idx, w)

    with pytest.raises(ValueError, match="wire_format must be one of"):
        call(wire_format="fp4")
    with pytest.raises(ValueError, match=r"blocks of 32 channels: y's hidden size \(40\)"):
        call(wire_format="mxfp8")
    with pytest.raises(ValueError, match="partial_dtype or wire_format, not both"):
        call(wire_format="nvfp4", partial_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"grad_wire_format 'mxfp8' quantizes blocks of 32"):
        call(grad_wire_format="mxfp8")


def test_the_kernels_dequantize_one_rank_per_device():
    """The dispatch custom call's `dequantize` (the unpack writes bfloat16 rows) needs a wire
    format and one rank per device: virtual ranks, all in one call, are refused, naming it."""
    from jax_ep import _exchange_ffi, _ffi

    if _ffi.EXT is None:
        pytest.skip("compiled extension missing")
    x = jnp.ones((2, 4, 128), jnp.bfloat16)
    idx = jnp.zeros((2, 4, 1), jnp.int32)
    w = jnp.ones((2, 4, 1), jnp.float32)
    with pytest.raises(Exception, match="dequantize needs a wire format and one rank per device"):
        jax.block_until_ready(_exchange_ffi.dispatch(
            x, None, idx, w, num_ranks=2, num_experts=2, capacity=8, expert_major=False,
            wire="e4m3", dequantize=True))


def test_the_kernels_combine_in_a_format_one_rank_per_device():
    """The combine custom call's `wire` (the stages cast, the sums dequantize) needs bfloat16
    y, whole blocks and one rank per device: virtual ranks, all in one call, float32 rows
    and a hidden size of no whole blocks are refused, each naming what is wrong."""
    from jax_ep import _exchange_ffi, _ffi

    if _ffi.EXT is None:
        pytest.skip("compiled extension missing")
    src_row = jnp.zeros((2, 8), jnp.int32)

    def call(y, **kw):
        return jax.block_until_ready(_exchange_ffi.combine(
            y, None, src_row[: y.shape[0]], None, num_ranks=2, top_k=1, expert_major=False,
            **kw))

    with pytest.raises(Exception, match="needs one rank per device"):
        call(jnp.ones((2, 8, 128), jnp.bfloat16), wire="e4m3")
    with pytest.raises(Exception, match="cast bfloat16 rows to a wire format 3; y is float32"):
        call(jnp.ones((2, 8, 128), jnp.float32), wire="mxfp8")
    with pytest.raises(Exception, match="casts blocks of 16 channels; H = 24"):
        call(jnp.ones((2, 8, 24), jnp.bfloat16), wire="nvfp4")


def test_dispatch_wire_format_errors():
    from harness import sharded

    import jax_ep

    x = np.ones((2, 4, 128), np.float32)
    idx = np.zeros((2, 4, 1), np.int32)
    w = np.ones((2, 4, 1), np.float32)

    def call(**kw):
        def per_shard(x, idx, w):
            return jax_ep.dispatch(x, idx, w, num_experts=2, **kw)[0].num_tokens
        return sharded(per_shard, 2)(x, idx, w)

    with pytest.raises(ValueError, match="wire_format must be one of"):
        call(wire_format="fp4")
    with pytest.raises(TypeError, match="dequantize must be a bool"):
        call(wire_format="mxfp8", dequantize=1)
    with pytest.raises(ValueError, match="grad_wire_format must be one of"):
        call(grad_wire_format="e5m2")
    with pytest.raises(ValueError, match="grad_wire_format needs dequantize=True"):
        call(wire_format="e4m3", grad_wire_format="e4m3", dequantize=False)
    with pytest.raises(ValueError, match=r"blocks of 32 channels: x's hidden size \(40\)"):
        sharded(lambda x, i, w: jax_ep.dispatch(x[:, :40], i, w, num_experts=2,
                                                grad_wire_format="mxfp8")[0].num_tokens,
                2)(x, idx, w)
    with pytest.raises(TypeError, match="x must be \\[T, H\\] in bfloat16, float16 or float32"):
        sharded(lambda x, i, w: jax_ep.dispatch(x.astype(jnp.int32), i, w, num_experts=2,
                                                wire_format="e4m3")[0].num_tokens, 2)(x, idx, w)
