"""Virtual ranks (jax_ep.virtual): the kernel bodies of cuda/exchange.h, run by the CPU
handlers, and the portable backend under vmap, against the NumPy reference, bit for bit.

On a CPU the "cuda" backend runs the exact phase functions that the CUDA kernels run (one
lane instead of a warp), so these tests check the kernels' addressing and arithmetic without
a GPU. Covers every routing kind, invalid ids, R in {1, 2, 3, 4, 8}, both layouts, capacity
cuts, FP8 pairs, float32/bfloat16/float16 rows, and the split low-latency forms.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_ep import _exchange_ffi, _ffi, quant, virtual
from jax_ep.placement import Placement
from jax_ep.tools import reference
from jax_ep.tools.bench.routings import make_routing

BACKENDS = ["cuda", "xla"]
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

needs_extension = pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")


def assert_bitwise(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    size = got.dtype.itemsize
    g, w = got.view(f"u{size}" if size > 1 else np.uint8), want.view(
        f"u{size}" if size > 1 else np.uint8)
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {bad[0].tolist()}"


def nan_padding(rows, count):
    """rows [..., N, C] with NaN in the rows n >= count[...], the padding (docs/contract.md):
    a combine that read them would return NaN."""
    rows = np.array(rows)
    past = np.arange(rows.shape[-2]) >= np.asarray(count)[..., None]
    rows[past] = np.nan
    return rows


def routing(rng, R, T, K, E, kind, invalid=False):
    idx, w = make_routing(rng, num_ranks=R, num_tokens=T, top_k=K, num_experts=E, kind=kind)
    idx = idx.astype(np.int32)
    if invalid:  # ids outside [-1, E): counted, never used as addresses
        bad = rng.random(idx.shape) < 0.1
        idx = np.where(bad, rng.choice([E, E + 7, -2, -1000], size=idx.shape), idx)
        idx = idx.astype(np.int32)
    return idx, w.astype(np.float32)


CASES = [
    # R, T, K, E, H, kind
    (1, 9, 2, 4, 16, "uniform"),
    (2, 13, 3, 6, 24, "masked"),
    (3, 7, 4, 9, 8, "duplicates"),
    (4, 11, 4, 8, 32, "empty_ranks"),
    (4, 10, 3, 12, 16, "hot_expert"),
    (8, 5, 4, 16, 8, "uniform"),
    (2, 6, 10, 12, 16, "uniform"),  # more than 8 destinations: a row is read twice
    (3, 7, 5, 9, 13, "masked"),  # rows of 13 values: no 16-byte words, value by value
    (3, 300, 6, 12, 8, "hot_expert"),  # 5 chunks of 64 tokens for the count
    (2, 40, 3, 1030, 8, "duplicates"),  # 1033 counters: two windows of the count's tally
]
# The portable backend under vmap on the cases that differ for it (a rank alone, odd widths,
# empty ranks, 8 ranks): the others exercise the kernels' chunks and windows, and every case
# costs the portable backend a compile of several seconds.
XLA_CASES = [CASES[i] for i in (0, 3, 5, 7)]


def backend_cases(cases, xla_cases):
    """(backend, case) pairs: every case on the kernels, `xla_cases` on the portable
    backend."""
    return [pytest.param(b, c, id=f"{b}-R{c[0]}-{c[5]}")
            for b, some in (("cuda", cases), ("xla", xla_cases)) for c in some]


@needs_extension
@pytest.mark.parametrize("backend,case", backend_cases(CASES, XLA_CASES))
def test_dispatch_combine(backend, case):
    """Each case in a layout drawn by the run's seed (both, over runs; the suite's cost
    halves), every dtype likewise."""
    R, T, K, E, H, kind = case
    rng = np.random.default_rng()
    expert_major = bool(rng.integers(2))
    dtype = DTYPES[rng.choice(list(DTYPES))]
    idx, w = routing(rng, R, T, K, E, kind, invalid=bool(rng.integers(2)))
    x = rng.standard_normal((R, T, H)).astype(dtype)
    # Sometimes a capacity that cuts rows (entries), exercising drops.
    capacity = None if rng.random() < 0.5 else int(rng.integers(1, R * T + 1))
    want = reference.dispatch(x, idx, w, num_experts=E, capacity=capacity,
                              expert_major=expert_major)
    recv, handle = virtual.dispatch(x, idx, w, num_experts=E, capacity=capacity,
                                    expert_major=expert_major, backend=backend)
    recv = recv.with_zero_padding()
    for key in ("x", "topk_idx", "topk_weights", "tokens_per_expert", "num_dropped",
                "num_invalid"):
        assert_bitwise(getattr(recv, key), want[key], f"dispatch {key}")
    assert_bitwise(recv.num_tokens, want["num_tokens"], "dispatch num_tokens")
    if expert_major:
        assert_bitwise(recv.group_sizes, want["group_sizes"], "group_sizes")

    cap = want["x"].shape[1]
    kw = dict(num_experts=E, capacity=capacity, expert_major=expert_major)
    if backend == "cuda":  # another array along the handle (cuda/dispatch_rows.h), no count
        x2 = rng.standard_normal((R, T, 3)).astype(np.float32)  # 12-byte rows
        rows = _exchange_ffi.dispatch_rows(x2, handle.recv_src,
                                           handle.entry_row if expert_major else None,
                                           num_ranks=R, capacity=cap)
        assert_bitwise(rows, reference.dispatch(x2, idx, w, **kw)["x"], "rows along the handle")
    y = nan_padding(rng.standard_normal((R, cap, H)), want["num_tokens"]).astype(dtype)
    yw = rng.random((R, cap)).astype(np.float32)
    assert_bitwise(virtual.combine(y, handle, backend=backend),
                   reference.combine(y, idx, **kw), "combine")
    assert_bitwise(virtual.combine(y, handle, topk_weights=yw, backend=backend),
                   reference.combine(y, idx, weights=yw, **kw), "weighted combine")


@needs_extension
@pytest.mark.parametrize("expert_major", [False, True])
def test_handles_match_portable_backend(expert_major):
    """The kernels build the same handle (recv_src, src_row, entries) as the portable ops."""
    rng = np.random.default_rng()
    R, T, K, E, H = 4, 17, 4, 12, 8
    idx, w = routing(rng, R, T, K, E, "duplicates", invalid=True)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    capacity = int(rng.integers(R * T // 2, R * T))
    handles = [virtual.dispatch(x, idx, w, num_experts=E, capacity=capacity,
                                expert_major=expert_major, backend=b)[1] for b in BACKENDS]
    for field in ("topk_idx", "recv_src", "src_row", "entry_row", "entry_choice",
                  "row_entries"):
        got, want = (getattr(h, field) for h in handles)
        if want is None:
            assert got is None, field
        else:
            assert_bitwise(got, want, f"handle.{field}")


@needs_extension
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("expert_major", [False, True])
def test_dispatch_fp8_pair(backend, expert_major):
    rng = np.random.default_rng()
    R, T, K, E, H = 4, 9, 3, 8, 256
    idx, w = routing(rng, R, T, K, E, "masked")
    x_fp8, scales = reference.quantize(rng.standard_normal((R, T, H)).astype(np.float32))
    want = reference.dispatch((x_fp8, scales), idx, w, num_experts=E, expert_major=expert_major)
    recv, _ = virtual.dispatch((x_fp8, scales), idx, w, num_experts=E,
                               expert_major=expert_major, backend=backend)
    recv = recv.with_zero_padding()
    assert_bitwise(recv.x, want["x"], "x_fp8")
    assert_bitwise(recv.scales, want["scales"], "scales")


@needs_extension
def test_padding_is_never_written():
    """Rows past the counts are not written (docs/contract.md, "Padding"): the CPU handlers
    leave the NaN bytes they put there before the op; zero_padding=True (the backward of
    combine) writes zeros."""
    rng = np.random.default_rng()
    R, T, K, E, H = 4, 9, 3, 8, 128
    idx, w = routing(rng, R, T, K, E, "hot_expert")
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    want = reference.dispatch(x, idx, w, num_experts=E, expert_major=True)
    past = np.arange(want["x"].shape[1]) >= want["num_tokens"][:, None]  # [R, capacity]
    assert past.any()
    for zero in (False, True):
        out = _exchange_ffi.dispatch(x, None, idx, w, num_ranks=R, num_experts=E,
                                     capacity=want["x"].shape[1], expert_major=True,
                                     zero_padding=zero)
        got = np.asarray(out["x"]).view(np.uint16)
        assert (got[past] == (0 if zero else 0xFFFF)).all(), f"zero_padding={zero}"
        assert_bitwise(np.asarray(out["x"])[~past], want["x"][~past], "rows that carry data")

    recv, _ = virtual.low_latency_dispatch(x, idx, num_experts=E, use_fp8=True)
    want = reference.low_latency_dispatch(x, idx, num_experts=E, use_fp8=True)
    past = np.arange(R * T) >= want["count"][..., None]  # [R, E/R, R*T]
    assert (np.asarray(recv.x).view(np.uint8)[past] == 0xFF).all()
    assert (np.asarray(recv.scales).view(np.uint32)[past] == 0xFFFFFFFF).all()


LL_CASES = [
    # R, T, K, E, H, kind
    (1, 5, 2, 4, 128, "uniform"),
    (2, 7, 4, 6, 256, "duplicates"),
    (3, 6, 3, 9, 128, "masked"),
    (4, 9, 4, 8, 128, "empty_ranks"),
    (8, 4, 3, 16, 128, "hot_expert"),
    (2, 5, 10, 12, 128, "uniform"),  # more than 8 messages per token
    (2, 150, 6, 8, 128, "duplicates"),  # 3 chunks of 64 tokens for the count
    (2, 20, 3, 1030, 128, "uniform"),  # 1031 counters: two windows of the count's tally
    (1, 700, 6, 8, 128, "duplicates"),  # one rank past the send's own count (4,096 entries)
]
XLA_LL_CASES = [LL_CASES[i] for i in (0, 2, 4)]


@needs_extension
@pytest.mark.parametrize("backend,case", backend_cases(LL_CASES, XLA_LL_CASES))
def test_low_latency(backend, case):
    """Each case with FP8 or not and in one call or split into send and receive, drawn by the
    run's seed (all four, over runs)."""
    R, T, K, E, H, kind = case
    rng = np.random.default_rng()
    use_fp8, split = bool(rng.integers(2)), bool(rng.integers(2))
    idx, w = routing(rng, R, T, K, E, kind, invalid=bool(rng.integers(2)))
    # Varied magnitudes per block, so that FP8 scales differ between blocks and rows.
    x = (rng.standard_normal((R, T, H)) * rng.choice([1e-3, 1.0, 300.0], size=(R, T, 1)))
    x = x.astype(ml_dtypes.bfloat16)
    want = reference.low_latency_dispatch(x, idx, num_experts=E, use_fp8=use_fp8)
    if split:
        pending = virtual.low_latency_dispatch_send(x, idx, num_experts=E, use_fp8=use_fp8,
                                                    backend=backend)
        recv, handle = virtual.low_latency_dispatch_recv(pending)
    else:
        recv, handle = virtual.low_latency_dispatch(x, idx, num_experts=E, use_fp8=use_fp8,
                                                    backend=backend)
    recv = recv.with_zero_padding()
    for key in ("x", "count", "num_invalid"):
        assert_bitwise(getattr(recv, key), want[key], f"ll dispatch {key}")
    if use_fp8:
        assert_bitwise(recv.scales, want["scales"], "ll dispatch scales")

    y = nan_padding(rng.standard_normal(want["x"].shape), want["count"])
    y = y.astype(ml_dtypes.bfloat16)
    if split:
        out = virtual.low_latency_combine_recv(
            virtual.low_latency_combine_send(y, idx, w, handle, backend=backend))
    else:
        out = virtual.low_latency_combine(y, idx, w, handle, backend=backend)
    assert_bitwise(out, reference.low_latency_combine(y, idx, w, num_experts=E), "ll combine")


@pytest.mark.parametrize("backend,format", [("cuda", f) for f in quant.FORMATS]
                         + [("xla", None)])
def test_low_latency_wire_format(backend, format):
    """The send's cast to each wire format (in the kernel, cuda backend) against
    jax_ep.quant.quantize of the same rows on the CPU, bit for bit; rows of every kind
    (zeros, subnormals, ties, a format's largest values, NaN and infinity); in one call or
    split, drawn by the run's seed, as is the portable backend's format."""
    from test_fuzz import draw_routing
    from test_quant import _assert_quantized_slots, _low_latency_rows

    if backend == "cuda" and _ffi.EXT is None:
        pytest.skip("compiled extension missing")
    rng = np.random.default_rng()
    format = format or str(rng.choice(quant.FORMATS))
    R, T, K = 3, 9, 3
    E, H = 2 * R, 128 * int(rng.integers(1, 4))
    split = bool(rng.integers(2))
    idx, _ = draw_routing(rng, R, T, K, E)
    x = _low_latency_rows(rng, R, T, H)
    if split:
        recv, _ = virtual.low_latency_dispatch_recv(virtual.low_latency_dispatch_send(
            x, idx, num_experts=E, wire_format=format, backend=backend))
    else:
        recv, _ = virtual.low_latency_dispatch(x, idx, num_experts=E, wire_format=format,
                                               backend=backend)
    plain, _ = virtual.low_latency_dispatch(x, idx, num_experts=E, backend=backend)
    _assert_quantized_slots(recv.x, np.asarray(plain.x), np.asarray(plain.count), format,
                            f"{backend} H {H}")
    padded = recv.with_zero_padding().x
    assert not np.asarray(padded.data)[0, 0, int(plain.count[0, 0]):].any()


@needs_extension
@pytest.mark.parametrize("backend", BACKENDS)
def test_layout(backend):
    rng = np.random.default_rng()
    R, T, K, E = 3, 14, 4, 9
    idx, _ = routing(rng, R, T, K, E, "duplicates", invalid=True)
    got = virtual.get_dispatch_layout(idx, num_experts=E, backend=backend)
    want = reference.dispatch_layout(idx, num_experts=E)
    for key, value in want.items():
        assert_bitwise(getattr(got, key), value, key)


@needs_extension
def test_jit_and_errors():
    rng = np.random.default_rng()
    idx, w = routing(rng, 2, 4, 2, 4, "uniform")
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    jitted = jax.jit(
        lambda x, i, w: virtual.dispatch(x, i, w, num_experts=4)[0].with_zero_padding().x)
    assert_bitwise(jitted(x, idx, w), reference.dispatch(x, idx, w, num_experts=4)["x"], "jit")
    with pytest.raises(ValueError, match="num_experts"):
        virtual.dispatch(x, idx, w, num_experts=5)
    with pytest.raises(ValueError, match="backend"):
        virtual.dispatch(x, idx, w, num_experts=4, backend="nccl")
    with pytest.raises(ValueError, match=r"x must be \[R, T, H\]"):
        virtual.dispatch(x[:, :3], idx, w, num_experts=4)
    _, handle = virtual.dispatch(x, idx, w, num_experts=4)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        virtual.combine(np.zeros((2, 8, 8), np.float64), handle)


@needs_extension
def test_num_sms_bounds_the_blocks_not_the_results():
    """`num_sms` caps each launch's blocks (on the CPU, the blocks of $JAX_EP_CPU_GRID, which
    CI sets to 2): the items are spread over fewer blocks and every result is the same."""
    rng = np.random.default_rng()
    R, T, K, E, H = 3, 11, 4, 9, 256
    idx, w = routing(rng, R, T, K, E, "masked")
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)

    def every_op(num_sms):
        recv, handle = virtual.dispatch(x, idx, w, num_experts=E, num_sms=num_sms)
        y = virtual.combine(recv.with_zero_padding().x, handle, num_sms=num_sms)
        ll_recv, ll_handle = virtual.low_latency_dispatch(x, idx, num_experts=E,
                                                          num_sms=num_sms)
        ll_y = virtual.low_latency_combine(ll_recv.with_zero_padding().x, idx, w, ll_handle,
                                           num_sms=num_sms)
        return [recv.with_zero_padding().x, handle.src_row, y, ll_handle.src_row,
                ll_recv.count, ll_y]

    unbounded = every_op(None)
    for num_sms in (1, 2):
        for i, (got, want) in enumerate(zip(every_op(num_sms), unbounded, strict=True)):
            assert_bitwise(got, want, f"result {i} with num_sms={num_sms}")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_sms must be a positive int"):
            virtual.combine(x, virtual.dispatch(x, idx, w, num_experts=E)[1], num_sms=bad)
    with pytest.raises(Exception, match="num_sms must be in"):  # the handlers check it too
        _exchange_ffi.combine(x, None, np.zeros((R, R * T), np.int32), None, num_ranks=R,
                              top_k=K, expert_major=False,
                              placement=Placement(num_sms=-1))


# --- the CUDA lowering of every op, on this CPU-only jaxlib -----------------------------------

TARGETS = ("jax_ep_dispatch", "jax_ep_combine", "jax_ep_ll_dispatch_send",
           "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv",
           "jax_ep_dispatch_rows")


@needs_extension
def test_every_target_has_handlers():
    registrations = _ffi.EXT.registrations()
    assert set(TARGETS) <= set(registrations["cpu"])
    if _ffi.cuda_kernels_compiled():
        assert set(TARGETS) <= set(registrations["CUDA"])


def _lower_for_cuda(fn, *args):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text(dialect="hlo")


@needs_extension
@pytest.mark.parametrize("expert_major", [False, True])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_lowers_for_cuda(expert_major, use_fp8):
    R, T, K, E, H = 4, 6, 3, 8, 256
    i32, f32, bf16 = np.int32, np.float32, jax.numpy.bfloat16
    spec = jax.ShapeDtypeStruct

    def normal(x, idx, w):
        recv, handle = virtual.dispatch(x, idx, w, num_experts=E, expert_major=expert_major)
        rows = _exchange_ffi.dispatch_rows(w, handle.recv_src,  # w along the handle
                                           handle.entry_row if expert_major else None,
                                           num_ranks=R, capacity=handle.capacity)
        return rows, virtual.combine(recv.x, handle, topk_weights=recv.topk_weights.reshape(
            R, -1) if expert_major else None)

    def low_latency(x, idx, w):
        recv, handle = virtual.low_latency_dispatch(x, idx, num_experts=E, use_fp8=use_fp8)
        y = recv.x.astype(bf16) if use_fp8 else recv.x
        return virtual.low_latency_combine(y, idx, w, handle)

    args = (spec((R, T, H), bf16), spec((R, T, K), i32), spec((R, T, K), f32))
    hlo = _lower_for_cuda(normal, *args) + _lower_for_cuda(low_latency, *args)
    # With virtual ranks low-latency dispatch has no receive (its send delivers) and
    # low-latency combine no send (its receive reads y in place).
    for target in TARGETS:
        lowered = f'custom_call_target="{target}"' in hlo
        assert lowered == (target not in ("jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send")), \
            target
    assert "api_version=API_VERSION_TYPED_FFI" in hlo
