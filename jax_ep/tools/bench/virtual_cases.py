"""The benchmark's programs with virtual ranks: all R ranks on one device (`--virtual`).

The same ops, shapes and byte counts as `suite`'s cases, run through `jax_ep.virtual`: the
"cuda" backend is our kernels moving rows between R slices of one device's memory (the CPU
handlers on a CPU), the "xla" backend the portable ops under `vmap`. Every byte of every rank
goes through the one device's memory, so the floor is the bytes of all ranks over the copy
bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jax_ep import fp8, virtual
from jax_ep.tools.bench.suite import (
    Case,
    Inputs,
    _check_received,
    _expect,
    _messages_bytes,
    _rows_bytes,
)


def _dispatch(inp: Inputs, backend: str):
    def dispatch(x, idx, w):
        return virtual.dispatch(x, idx, w, num_experts=inp.setup.experts, backend=backend)

    return dispatch


def _ll_dispatch(inp: Inputs, backend: str, use_fp8: bool):
    def ll_dispatch(x, idx):
        return virtual.low_latency_dispatch(
            x, idx, num_experts=inp.setup.experts, use_fp8=use_fp8, backend=backend
        )

    return ll_dispatch


def layout_case(inp: Inputs, backend: str) -> Case:
    s = inp.setup
    fn = jax.jit(lambda idx: virtual.get_dispatch_layout(idx, num_experts=s.experts,
                                                         backend=backend))
    read = s.tokens * s.top_k * 4
    written = (s.ranks + s.experts + 1) * 4 + s.tokens * s.ranks
    return Case(fn, (inp.idx,), read + written,
                check=lambda out: _expect("layout rows to send", out.num_tokens_per_rank,
                                          inp.rows))


def dispatch_case(inp: Inputs, backend: str) -> Case:
    return Case(jax.jit(_dispatch(inp, backend)), (inp.x, inp.idx, inp.w), _rows_bytes(inp),
                check=_check_received("dispatch", inp))


def dispatch_fp8_case(inp: Inputs, backend: str) -> Case:
    x_fp8, scales = jax.jit(fp8.quantize)(inp.x)
    dispatch = _dispatch(inp, backend)
    fn = jax.jit(lambda q, s, idx, w: dispatch((q, s), idx, w))
    return Case(fn, (x_fp8, scales, inp.idx, inp.w), _rows_bytes(inp, fp8=True),
                check=_check_received("dispatch_fp8", inp))


def combine_case(inp: Inputs, backend: str) -> Case:
    received, handle = jax.jit(_dispatch(inp, backend))(inp.x, inp.idx, inp.w)
    fn = jax.jit(lambda y, hd: virtual.combine(y, hd, backend=backend))
    return Case(fn, (received.x, handle), _rows_bytes(inp))


def round_trip_case(inp: Inputs, backend: str) -> Case:
    dispatch = _dispatch(inp, backend)

    def round_trip(x, idx, w):
        received, handle = dispatch(x, idx, w)
        return virtual.combine(received.x, handle, backend=backend)

    return Case(jax.jit(round_trip), (inp.x, inp.idx, inp.w), 2 * _rows_bytes(inp))


def ll_dispatch_case(inp: Inputs, backend: str, use_fp8: bool = False) -> Case:
    return Case(jax.jit(_ll_dispatch(inp, backend, use_fp8)), (inp.ll_x, inp.ll_idx),
                _messages_bytes(inp, fp8=use_fp8),
                check=lambda out: _expect("low-latency messages", out[0].count, inp.messages))


def ll_combine_case(inp: Inputs, backend: str) -> Case:
    received, handle = jax.jit(_ll_dispatch(inp, backend, False))(inp.ll_x, inp.ll_idx)
    fn = jax.jit(lambda y, idx, w, hd: virtual.low_latency_combine(y, idx, w, hd,
                                                                   backend=backend))
    return Case(fn, (received.x, inp.ll_idx, inp.ll_w, handle), _messages_bytes(inp))


def ll_round_trip_case(inp: Inputs, backend: str) -> Case:
    ll_dispatch = _ll_dispatch(inp, backend, False)

    def ll_round_trip(x, idx, w):
        received, handle = ll_dispatch(x, idx)
        return virtual.low_latency_combine(received.x, idx, w, handle, backend=backend)

    return Case(jax.jit(ll_round_trip), (inp.ll_x, inp.ll_idx, inp.ll_w),
                2 * _messages_bytes(inp))


CASES: dict[str, Callable[[Inputs, str], Case]] = {
    "layout": layout_case,
    "dispatch": dispatch_case,
    "dispatch_fp8": dispatch_fp8_case,
    "combine": combine_case,
    "dispatch+combine": round_trip_case,
    "ll_dispatch": ll_dispatch_case,
    "ll_dispatch_fp8": lambda inp, backend: ll_dispatch_case(inp, backend, use_fp8=True),
    "ll_combine": ll_combine_case,
    "ll_round_trip": ll_round_trip_case,
}
