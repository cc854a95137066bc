"""A differential fuzz of the ops against a NumPy model of docs/contract.md written here (not
jax_ep.tools.reference): random shapes (T and H not powers of two), routings with masked, invalid
and repeated choices, a hot expert and ranks nobody picks, capacities that cut, both layouts,
row weights, the FP8 pair, every wire format (a dispatched `Quantized`, the low-latency
send's), expert alignment, rows dispatched along a handle, T = 0, rings at their extremes and
the low-latency ops, through whatever path the run takes
($JAX_EP_BACKEND, $JAX_EP_XLA_TRANSPORT, $JAX_EP_TEST_MESH, host peers over stores, puts or
nodes, $JAX_EP_CPU_GRID). Seeded by the suite's seed (tests/conftest.py); each test draws
cases until its time budget is spent, so it stays within a minute on CI's machine.
"""

from __future__ import annotations

import os
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import sharded, to_numpy

import jax_ep
from jax_ep import _ffi, quant, runtime

# Seconds per test ($JAX_EP_FUZZ_BUDGET_S, 8 by default; CI's paths give 5): the newer
# features' tests get 5/8 of it, each ring shape 3/8 (every one runs on every CI path).
BUDGET_S = float(os.environ.get("JAX_EP_FUZZ_BUDGET_S", "") or 8.0)
FEATURE_BUDGET_S = BUDGET_S * 5 / 8
MAX_CASES = 200
F32 = np.float32
DTYPES = (np.float32, ml_dtypes.bfloat16, np.float16)


def draw_path(rng) -> tuple[str, int]:
    """A backend and R the run can exchange with: the run's backend ($JAX_EP_BACKEND), and
    besides the portable one the cuda backend's CPU handlers at R = 1 (between devices they
    need host peers, which `JAX_EP_BACKEND=cuda` sets up)."""
    paths = [("cuda" if runtime.is_initialized() else "xla", int(rng.integers(1, 5)))]
    if jax_ep.backends.resolve("auto") == "xla" and _ffi.EXT is not None:
        paths.append(("cuda", 1))
    return paths[int(rng.integers(len(paths)))]


def draw_routing(rng, R: int, T: int, K: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 [R, T, K] ids and float32 weights: uniform, a hot expert, ranks nobody picks,
    repeated choices; masked (-1) and invalid ids sprinkled over any of them."""
    kind = rng.choice(["uniform", "hot", "empty_ranks", "repeats"])
    idx = rng.integers(0, E, (R, T, K))
    if kind == "hot":
        idx = np.where(rng.random(idx.shape) < 0.6, int(rng.integers(E)), idx)
    elif kind == "empty_ranks" and R > 1:
        El = E // R
        live = rng.choice(R, size=int(rng.integers(1, R)), replace=False)
        idx = live[rng.integers(0, len(live), idx.shape)] * El + rng.integers(0, El, idx.shape)
    elif kind == "repeats" and K > 1:
        idx[..., 1] = np.where(rng.random((R, T)) < 0.5, idx[..., 0], idx[..., 1])
    idx = np.where(rng.random(idx.shape) < 0.15, -1, idx)
    idx = np.where(rng.random(idx.shape) < 0.05, rng.choice([E, E + 5, -2]), idx)
    w = rng.standard_normal((R, T, K)).astype(F32)
    return idx.astype(np.int32), w


# ---------------------------------------------------------------------------------------------
# The model, from docs/contract.md


def model_normal(x, idx, w, E: int, capacity: int, expert_major: bool,
                 by_source: bool = False):
    """Per receiver d: (x rows zero-padded, topk_idx, topk_weights, num_tokens, num_dropped),
    and the map from each kept row (entry) to its (s, t, weight of the row). `by_source`:
    the capacity keeps entries by source, then expert (drop_order="source")."""
    R, T, K = idx.shape
    El = E // R
    valid = (idx >= 0) & (idx < E)
    out = []
    for d in range(R):
        on_d = valid & (idx // El == d)
        rows = [(s, t) for s in range(R) for t in range(T) if on_d[s, t].any()]
        rx = np.zeros((capacity, x.shape[-1]), x.dtype)
        if not expert_major:
            kept = rows[:capacity]
            ridx = np.full((capacity, K), -1, np.int32)
            rw = np.zeros((capacity, K), F32)
            for i, (s, t) in enumerate(kept):
                rx[i] = x[s, t]
                ridx[i] = np.where(on_d[s, t], idx[s, t] - d * El, -1)
                rw[i] = np.where(on_d[s, t], w[s, t], 0)
            out.append(dict(x=rx, topk_idx=ridx, topk_weights=rw, num_tokens=len(kept),
                            num_dropped=len(rows) - len(kept), source=kept))
            continue
        entries = [(int(idx[s, t, k] - d * El), i, k, s, t) for i, (s, t) in enumerate(rows)
                   for k in range(K) if on_d[s, t, k]]
        if by_source:  # the first by source, expert, token, choice; then laid out by expert
            first = sorted(entries, key=lambda e: (e[3], e[0]))[:capacity]
            entries.sort(key=lambda e: e[0])
            kept = [e for e in entries if e in first]
        else:
            entries.sort(key=lambda e: e[0])  # stable: by expert, then row, then k
            kept = entries[:capacity]
        ridx = np.full((capacity,), -1, np.int32)
        rw = np.zeros((capacity,), F32)
        for n, (j, _, k, s, t) in enumerate(kept):
            rx[n], ridx[n], rw[n] = x[s, t], j, w[s, t, k]
        out.append(dict(x=rx, topk_idx=ridx, topk_weights=rw, num_tokens=len(kept),
                        num_dropped=len(entries) - len(kept),
                        source=[(s, t, i) for (_, i, _, s, t) in kept]))
    return out


def model_aligned(received, A: int, capacity: int, El: int):
    """`model_normal`'s expert-major receivers laid out with expert_alignment=A (docs/
    contract.md): expert j's entries from P_j = sum over i < j of round_up(n_i, A), n_i its
    entries in the unaligned layout; an entry is kept while its row is under the capacity.
    "rows" maps each kept entry (in entry order) to its row."""
    out = []
    for r in received:
        n_entries = r["num_tokens"]
        experts = r["topk_idx"][:n_entries]
        n = np.bincount(experts, minlength=El)
        first = np.concatenate([[0], np.cumsum(-(-n // A) * A)])[:-1]
        x, idx = np.zeros_like(r["x"]), np.full_like(r["topk_idx"], -1)
        w, rows, source = np.zeros_like(r["topk_weights"]), [], []
        for m in range(n_entries):
            j = experts[m]
            row = first[j] + m - np.searchsorted(experts, j)  # m-th entry, m counted in j
            if row < capacity:
                x[row], idx[row], w[row] = r["x"][m], j, r["topk_weights"][m]
                rows.append(row)
                source.append(r["source"][m])
        kept = np.bincount(idx[idx >= 0], minlength=El).astype(np.int32)
        groups = (-(-kept // A) * A).astype(np.int32)
        out.append(dict(x=x, topk_idx=idx, topk_weights=w, num_tokens=int(groups.sum()),
                        num_dropped=r["num_dropped"] + n_entries - len(rows),
                        group_sizes=groups, tokens_per_expert=kept, rows=rows, source=source))
    return out


def model_combine(received, ys, weights, R: int, T: int, expert_major: bool, wire=None):
    """The home sums of docs/contract.md ("combine"), [R, T, H] in y's dtype; `wire` maps
    the float32 rows that travel home [N, H] to what arrives (a wire format's rounding)."""
    H, dtype = ys[0].shape[-1], ys[0].dtype
    terms = []  # (home s, token t, float32 row), in rank order
    for d in range(R):
        if not expert_major:
            terms += [(s, t, ys[d][i].astype(F32) * weights[d][i])
                      for i, (s, t) in enumerate(received[d]["source"])]
            continue
        partial: dict[tuple[int, int], np.ndarray] = {}  # per rank-major row, in entry order
        for n, (s, t, _) in enumerate(received[d]["source"]):
            row = partial.setdefault((s, t), np.zeros(H, F32))
            row += ys[d][n].astype(F32) * weights[d][n]
        terms += [(s, t, row) for (s, t), row in partial.items()]
    if wire is None and expert_major:  # partial sums travel in y's dtype
        def wire(rows):
            return rows.astype(dtype).astype(F32)
    if wire is not None and terms:
        arrived = wire(np.stack([row for _, _, row in terms]))
        terms = [(s, t, row) for (s, t, _), row in zip(terms, arrived, strict=True)]
    acc = np.zeros((R, T, H), F32)
    for s, t, row in terms:
        acc[s, t] += row
    return acc.astype(dtype)


def wire_rounding(format: str | None):
    """What travelling as `format` does to float32 rows (None: nothing)."""
    if format is None:
        return None
    return lambda rows: np.asarray(quant.dequantize(quant.quantize(jnp.asarray(rows), format)))


def model_low_latency(x, idx, w, E: int, y_scale: float):
    """Low-latency dispatch (x zero-padded, count) per receiver, and the combine of the
    experts' outputs y = x * y_scale."""
    R, T, K = idx.shape
    El, H = E // R, x.shape[-1]
    valid = (idx >= 0) & (idx < E)
    slots = [[[] for _ in range(El)] for _ in range(R)]
    for s in range(R):
        for t in range(T):
            for e in dict.fromkeys(idx[s, t][valid[s, t]].tolist()):  # once per expert
                slots[e // El][e % El].append((s, t))
    rx = np.zeros((R, El, R * T, H), x.dtype)
    for d in range(R):
        for j in range(El):
            for i, (s, t) in enumerate(slots[d][j]):
                rx[d, j, i] = x[s, t]
    y = (rx.astype(F32) * F32(y_scale)).astype(x.dtype)
    out = np.zeros((R, T, H), F32)
    for s in range(R):
        for t in range(T):
            for k in range(K):  # in k order; a repeated choice adds its row again
                e = idx[s, t, k]
                if valid[s, t, k]:
                    i = slots[e // El][e % El].index((s, t))
                    out[s, t] += w[s, t, k] * y[e // El, e % El, i].astype(F32)
    count = np.array([[len(slots[d][j]) for j in range(El)] for d in range(R)], np.int32)
    return rx, count, out.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# The tests


def assert_same(got, want, what: str):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    g = got.view(np.uint8).reshape(got.shape + (got.dtype.itemsize,))  # T = 0 too
    w = want.view(np.uint8).reshape(want.shape + (want.dtype.itemsize,))
    bad = np.argwhere((g != w).any(axis=-1))
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {bad[0].tolist()}"


def cases(rng, budget_s: float = BUDGET_S):
    """Yields a fresh rng per case until the budget is spent (one case at least)."""
    start = time.monotonic()
    for n in range(MAX_CASES):
        if n and time.monotonic() - start > budget_s:
            return
        yield np.random.default_rng(rng.integers(2**32))


def test_normal_mode_against_the_model():
    rng = np.random.default_rng()
    for case in cases(rng):
        check_normal_case(case, *draw_path(case))


@pytest.mark.parametrize("rings", ["256,1,1", "1,1,1", "3,64,1"])
def test_rings_at_their_extremes_against_the_model(monkeypatch, rings):
    """Streamed through rings at the edges of what runs on host peers: the most channels
    they run (all of them: num_sms=None), each ring one slot; one channel of one slot; chunks
    larger than any call's tokens."""
    from conftest import initialize_host_peers

    if runtime.is_initialized() or _ffi.EXT is None:
        pytest.skip("needs the extension, and host peers of its own rings (not the session's)")
    monkeypatch.setenv("JAX_EP_CHANNELS", rings)
    initialize_host_peers()
    try:
        for case in cases(np.random.default_rng(), budget_s=BUDGET_S * 3 / 8):
            check_normal_case(case, "cuda", int(case.integers(2, 5)), num_sms=None)
    finally:
        jax_ep.finalize()


def check_normal_case(case, backend: str, R: int, **placement):
    """One drawn dispatch and combine on `backend` between R ranks, against the model;
    `placement` (num_sms=) goes to both ops."""
    E = R * int(case.integers(1, 4))
    T, K, H = int(case.integers(1, 23)), int(case.integers(1, min(5, E) + 1)), \
        int(case.choice([8, 13, 40, 128]))
    expert_major, fp8 = bool(case.integers(2)), bool(case.integers(4) == 0) and H % 128 == 0
    dtype = ml_dtypes.float8_e4m3fn if fp8 else DTYPES[int(case.integers(len(DTYPES)))]
    idx, w = draw_routing(case, R, T, K, E)
    full = R * T * (min(K, E // R) if expert_major else 1)
    capacity = int(case.integers(1, full + 1)) if case.integers(2) else full
    by_source = expert_major and bool(case.integers(2))
    x = case.standard_normal((R, T, H)).astype(dtype)
    scales = case.random((R, T, H // 128)).astype(F32) + 0.5 if fp8 else None
    want = model_normal(x, idx, w, E, capacity, expert_major, by_source)
    what = f"{backend} R {R} T {T} K {K} E {E} H {H} {np.dtype(dtype).name} capacity " \
           f"{capacity} expert_major {expert_major} drop by source {by_source}"

    def per_shard(x, scales, idx, w):
        recv, handle = jax_ep.dispatch((x, scales) if fp8 else x, idx, w, num_experts=E,
                                       capacity=capacity, expert_major=expert_major,
                                       on_overflow="drop", on_invalid="mask",
                                       drop_order="source" if by_source else None,
                                       backend=backend, **placement)
        rows = recv.x.astype(jnp.float32) if fp8 else recv.x
        weights = recv.topk_weights if expert_major else recv.topk_weights.sum(axis=1)
        out = jax_ep.combine(rows, handle, topk_weights=weights, backend=backend, **placement)
        return recv.with_zero_padding(), out

    scales_in = scales if fp8 else np.zeros((R, T, 1), F32)
    recv, out = to_numpy(sharded(per_shard, R)(x, scales_in, idx, w))
    for d in range(R):
        for key in ("x", "topk_idx", "topk_weights"):
            assert_same(recv.x[d] if key == "x" else getattr(recv, key)[d], want[d][key],
                        f"{what}: rank {d} {key}")
        for key in ("num_tokens", "num_dropped"):
            assert int(getattr(recv, key)[d]) == want[d][key], (what, d, key)
    ys = [want[d]["x"].astype(F32) if fp8 else want[d]["x"] for d in range(R)]
    weights = [want[d]["topk_weights"] if expert_major else want[d]["topk_weights"].sum(1)
               for d in range(R)]
    assert_same(out, model_combine(want, ys, weights, R, T, expert_major), f"{what}: combine")


def test_formats_alignment_and_rows_along_against_the_model():
    """Normal mode with the newer features, each drawn per case: a `Quantized` of every wire
    format (received bit for bit, rows whose bytes are no multiple of 16 among them,
    combined from its dequantized rows, the combine's rows travelling in a wire format or
    not), expert alignment, another array dispatched along the handle, and T = 0."""
    rng = np.random.default_rng()
    for case in cases(rng, FEATURE_BUDGET_S):
        backend, R = draw_path(case)
        E = R * int(case.integers(1, 4))
        El = E // R
        T = 0 if case.integers(5) == 0 else int(case.integers(1, 19))
        K = int(case.integers(1, min(5, E) + 1))
        fmt = str(case.choice(quant.FORMATS))
        # nvfp4 at H 48 moves rows of 24 bytes of data: no multiple of 16.
        H = int(case.choice([48, 128, 256] if fmt == "nvfp4" else [128, 256]))
        fits = [f for f in quant.FORMATS if H % quant.BLOCKS[f] == 0]
        back = None if case.integers(2) else str(case.choice(fits))  # the combine's
        expert_major = bool(case.integers(2))
        A = int(case.choice([2, 3, 8])) if expert_major and case.integers(2) else 1
        idx, w = draw_routing(case, R, T, K, E)
        full = R * T * (min(K, El) if expert_major else 1) + El * (A - 1)
        capacity = -(-int(case.integers(1, max(full, 1) + 1)) // A) * A  # a multiple of A
        q = quant.quantize(jnp.asarray(case.standard_normal((R, T, H)), jnp.float32), fmt)
        leaves = (np.asarray(q.data), np.asarray(q.scales),
                  np.zeros((R, T), F32) if q.global_scale is None else np.asarray(q.global_scale))
        along = case.standard_normal((R, T, int(case.choice([3, 8, 13])))).astype(
            DTYPES[int(case.integers(len(DTYPES)))])
        what = f"{backend} R {R} T {T} K {K} E {E} H {H} {fmt} capacity {capacity} " \
               f"expert_major {expert_major} alignment {A} combined on wire {back}"

        def per_shard(data, scales, global_scale, along, idx, w, fmt=fmt, E=E, A=A,
                      expert_major=expert_major, capacity=capacity, backend=backend,
                      back=back):
            q = quant.Quantized(data, scales, global_scale if fmt == "nvfp4" else None, fmt)
            recv, handle = jax_ep.dispatch(q, idx, w, num_experts=E, capacity=capacity,
                                           expert_major=expert_major, expert_alignment=A,
                                           on_overflow="drop", on_invalid="mask",
                                           backend=backend)
            moved = jax_ep.dispatch(along, handle=handle)  # zeros past the count
            weights = recv.topk_weights if expert_major else recv.topk_weights.sum(axis=1)
            out = jax_ep.combine(quant.dequantize(recv.x, jnp.float32), handle,
                                 topk_weights=weights, wire_format=back, backend=backend)
            return recv.with_zero_padding(), moved, out

        recv, moved, out = to_numpy(sharded(per_shard, R)(*leaves, along, idx, w))
        fields = [("data", 0), ("scales", 1)] + ([("global_scale", 2)] if fmt == "nvfp4" else [])
        models = {}
        for name, i in fields:
            rows = leaves[i] if leaves[i].ndim == 3 else leaves[i][..., None]
            models[name] = model_normal(rows, idx, w, E, capacity, expert_major)
            if A > 1:
                models[name] = model_aligned(models[name], A, capacity, El)
        want_along = model_normal(along, idx, w, E, capacity, expert_major)
        if A > 1:
            want_along = model_aligned(want_along, A, capacity, El)
        want = models["data"]
        for d in range(R):
            for name, _ in fields:
                got = getattr(recv.x, name)[d]
                assert_same(got, models[name][d]["x"].reshape(got.shape), f"{what}: {d} {name}")
            assert_same(moved[d], want_along[d]["x"], f"{what}: rank {d} along the handle")
            for key in ("topk_idx", "topk_weights") + (
                    ("group_sizes", "tokens_per_expert") if A > 1 else ()):
                got = getattr(recv, key)[d]
                assert_same(got, np.asarray(want[d][key], got.dtype), f"{what}: rank {d} {key}")
            for key in ("num_tokens", "num_dropped"):
                assert int(getattr(recv, key)[d]) == want[d][key], (what, d, key)
        # The model's received rows of each rank as a Quantized, dequantized.
        ys = [np.asarray(quant.dequantize(quant.Quantized(
            *(models[name][d]["x"].reshape(getattr(recv.x, name)[d].shape)
              for name, _ in fields), format=fmt), jnp.float32)) for d in range(R)]
        weights = [want[d]["topk_weights"] if expert_major else want[d]["topk_weights"].sum(1)
                   for d in range(R)]
        if A > 1:  # the kept entries' rows, in entry order
            ys = [ys[d][want[d]["rows"]] for d in range(R)]
            weights = [weights[d][want[d]["rows"]] for d in range(R)]
        assert_same(out, model_combine(want, ys, weights, R, T, expert_major,
                                       wire_rounding(back)), f"{what}: combine")


def test_low_latency_against_the_model():
    rng = np.random.default_rng()
    for case in cases(rng):
        backend, R = draw_path(case)
        E = R * int(case.integers(1, 4))
        T, K, H = int(case.integers(1, 21)), int(case.integers(1, min(5, E) + 1)), \
            int(case.choice([128, 256]))
        idx, w = draw_routing(case, R, T, K, E)
        x = case.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
        want_x, want_count, want_out = model_low_latency(x, idx, w, E, 0.5)

        def per_shard(x, idx, w, E=E, backend=backend):
            recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E, on_invalid="mask",
                                                       backend=backend)
            y = (recv.x.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)
            out = jax_ep.low_latency_combine(y, idx, w, handle, backend=backend)
            return recv.with_zero_padding(), out

        recv, out = to_numpy(sharded(per_shard, R)(x, idx, w))
        what = f"{backend} R {R} T {T} K {K} E {E} H {H}"
        assert_same(recv.x, want_x, f"{what}: x")
        assert_same(recv.count, want_count, f"{what}: count")
        assert_same(out, want_out, f"{what}: combine")


def test_low_latency_wire_formats_against_the_model():
    """The low-latency send in every wire format, T = 0 included: each slot holds its
    token's row quantized (jax_ep.quant, bit for bit: data, scales, global scale), and the
    combine of the dequantized rows sums as the model does."""
    rng = np.random.default_rng()
    for case in cases(rng, FEATURE_BUDGET_S):
        backend, R = draw_path(case)
        E = R * int(case.integers(1, 4))
        T = 0 if case.integers(5) == 0 else int(case.integers(1, 17))
        K, H = int(case.integers(1, min(5, E) + 1)), int(case.choice([128, 256]))
        fmt = str(case.choice(quant.FORMATS))
        idx, w = draw_routing(case, R, T, K, E)
        x = case.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
        q = quant.quantize(jnp.asarray(x), fmt)
        sent = {"data": np.asarray(q.data), "scales": np.asarray(q.scales)}
        if fmt == "nvfp4":
            sent["global_scale"] = np.asarray(q.global_scale)[..., None]
        # The model moves each field's rows; the combine's rows are the dequantized ones.
        dequantized = np.asarray(quant.dequantize(q, jnp.bfloat16))
        _, want_count, want_out = model_low_latency(dequantized, idx, w, E, 0.5)

        def per_shard(x, idx, w, E=E, fmt=fmt, backend=backend):
            recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E, wire_format=fmt,
                                                       on_invalid="mask", backend=backend)
            y = (quant.dequantize(recv.x, jnp.bfloat16).astype(jnp.float32) * 0.5).astype(
                jnp.bfloat16)
            out = jax_ep.low_latency_combine(y, idx, w, handle, backend=backend)
            return recv.with_zero_padding(), out

        recv, out = to_numpy(sharded(per_shard, R)(x, idx, w))
        what = f"{backend} R {R} T {T} K {K} E {E} H {H} {fmt}"
        for name, rows in sent.items():
            got = getattr(recv.x, name)
            want = model_low_latency(rows, idx, w, E, 0.5)[0]
            assert_same(got, want.reshape(got.shape), f"{what}: {name}")
        assert_same(recv.count, want_count, f"{what}: count")
        assert_same(out, want_out, f"{what}: combine")


@pytest.mark.parametrize("factor", [0.5, 1.1, 2.0])
def test_capacity_factor_against_the_model(factor):
    """The capacity a factor stands for (docs/contract.md), from its shortest decimal."""
    from fractions import Fraction
    from math import ceil, comb

    rng = np.random.default_rng()
    for _ in range(20):
        R = int(rng.integers(1, 9))
        E, T = R * int(rng.integers(1, 5)), int(rng.integers(0, 300))
        K = int(rng.integers(1, E + 1))
        f = Fraction(str(factor))
        rows = R * T * (1 - Fraction(comb(E - E // R, K), comb(E, K)))
        want = min(R * T, ceil(f * rows))
        got = jax_ep.capacity_from_factor(factor, num_ranks=R, num_tokens=T, top_k=K,
                                          num_experts=E)
        assert got == want, (R, E, T, K, factor)
        want = min(R * T * min(K, E // R), ceil(f * T * K))
        got = jax_ep.capacity_from_factor(factor, num_ranks=R, num_tokens=T, top_k=K,
                                          num_experts=E, expert_major=True)
        assert got == want, (R, E, T, K, factor, "expert-major")
