"""The account (jax_ep.tools.account) against what the code does: the CPU handlers run the phase
bodies and op sequences the GPU runs and count their launches, barriers and bytes of row data
(cuda/meter.h); for random routings (skewed, masked and invalid ids, empty ranks, capacity
cuts, sizes that are not powers of two) the counts must equal the account's, exactly.
"""

from __future__ import annotations

import functools
import operator
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from harness import sharded
from test_host_peers import (
    host_peers,  # noqa: F401  (the fixture: host peers initialized)
    host_peers_with,
    node_peers,  # noqa: F401  (host peers in nodes, one test)
    put_peers,  # noqa: F401  (host peers reached by puts, one test)
    streamed_peers,  # noqa: F401  (host peers streaming through rings, one test)
)
from test_virtual import routing

import jax_ep
from jax_ep import _exchange_ffi, _ffi, fp8, quant, runtime
from jax_ep.dispatch import default_capacity
from jax_ep.tools import account

pytestmark = pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")


@pytest.fixture(autouse=True)
def _dispatch_in_phases(monkeypatch):
    """The tests count the normal ops in phases unless they stream them (streamed_peers):
    host peers that stream (the default) are initialized again in phases for the test."""
    if runtime.channels() is None:
        yield
        return
    with host_peers_with(monkeypatch, **{k: os.environ[k] for k in (
            "JAX_EP_PEER_ACCESS", "JAX_EP_RANKS_PER_NODE") if k in os.environ}):
        yield
KINDS = ["uniform", "hot_expert", "empty_ranks", "duplicates"]
AXIS = "ep"


def metered(fn, *args, **kwargs):
    """fn(*args, **kwargs) run to completion, and what the ops in it counted (cuda/meter.h)."""
    _ffi.EXT.meter(reset=True)
    out = jax.block_until_ready(fn(*args, **kwargs))
    return _ffi.EXT.meter(reset=True), out


def assert_counts(got: dict, want: account.Account, ranks_running: int = 1):
    """The meter's counts equal the account; launches and barriers are summed over the
    `ranks_running` ranks that each ran the op (one per device between devices); the warps of
    the smallest launch are each rank's; the messages where the account counts them (over
    puts; none are sent otherwise)."""
    expected = {"launches": want.launches * ranks_running,
                "barriers": want.barriers * ranks_running,
                "read": want.read, "written": want.written, "smallest_launch": want.warps,
                "messages": want.messages or 0}
    if want.messages is None and got["messages"]:
        expected["messages"] = "counted by the account (it has None)"
    got = {k: v for k, v in got.items() if k not in ("recordings", "replays")}  # replays
    assert got == expected, f"{want.op}: counted {got}, the account says {expected}"


def draw(rng, R, kind=None, invalid=False):
    T, E = int(rng.integers(3, 12)), R * int(rng.integers(1, 4))
    # dispatch requires K <= E; up to 10, past the 8 destinations of one read (FAN_OUT)
    K = int(rng.integers(1, min(10, E) + 1))
    H = 128 * int(rng.integers(1, 3))
    kind = kind or str(rng.choice(KINDS))
    idx, w = routing(rng, R, T, K, E, kind, invalid=invalid)
    return T, K, E, H, idx, w


# ---------------------------------------------------------------------------------------------
# Virtual ranks: the targets called directly


@pytest.mark.parametrize("R", [1, 3, 4])
@pytest.mark.parametrize("expert_major", [False, True])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_virtual_dispatch_and_combine(R, expert_major, use_fp8):
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R, invalid=True)
    full = account.default_capacity(R, T, K, E, expert_major)
    capacity = int(rng.integers(1, full + 1))  # often cuts
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    if use_fp8:
        data, scales = (np.asarray(a) for a in fp8.quantize(x.astype(ml_dtypes.bfloat16)))
        row, scale_bytes = H, H // fp8.BLOCK * 4
    else:
        data, scales, row, scale_bytes = x.astype(ml_dtypes.bfloat16), None, 2 * H, 0
    for zero_padding in (False, True):
        counted, out = metered(_exchange_ffi.dispatch, data, scales, idx, w, num_ranks=R,
                               num_experts=E, capacity=capacity, expert_major=expert_major,
                               zero_padding=zero_padding)
        assert_counts(counted, account.dispatch(
            idx, num_experts=E, row_bytes=row, scale_bytes=scale_bytes, capacity=capacity,
            expert_major=expert_major, zero_padding=zero_padding))

    for y_dtype in (np.float32, ml_dtypes.bfloat16):
        y = rng.standard_normal((R, capacity, H)).astype(y_dtype)
        for weighted in (False, True):
            weights = rng.random((R, capacity)).astype(np.float32) if weighted else None
            counted, _ = metered(_exchange_ffi.combine, y, weights, out["src_row"],
                                 out["row_entries"] if expert_major else None, num_ranks=R,
                                 top_k=K, expert_major=expert_major)
            assert_counts(counted, account.combine(
                idx, num_experts=E, row_bytes=H * np.dtype(y_dtype).itemsize,
                capacity=capacity, expert_major=expert_major))


@pytest.mark.parametrize("R", [1, 3, 4])
@pytest.mark.parametrize("expert_major", [False, True])
def test_virtual_dispatch_rows(R, expert_major):
    """Rows along a dispatch's routing: one launch; each slot gets the source row its
    recv_src names (expert-major, through entry_row), the others zeros."""
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R, invalid=True)
    capacity = int(rng.integers(1, account.default_capacity(R, T, K, E, expert_major) + 1))
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    out = _exchange_ffi.dispatch(x, None, idx, w, num_ranks=R, num_experts=E,
                                 capacity=capacity, expert_major=expert_major)
    values = rng.standard_normal((R, T, 3)).astype(np.float32)  # 12-byte rows
    entry_row = out["entry_row"] if expert_major else None
    counted, rows = metered(_exchange_ffi.dispatch_rows, values, out["recv_src"], entry_row,
                            num_ranks=R, capacity=capacity)
    assert_counts(counted, account.dispatch_rows(idx, num_experts=E, row_bytes=12,
                                                 capacity=capacity, expert_major=expert_major))
    recv_src = np.asarray(out["recv_src"])
    slot_row = (np.asarray(entry_row) if expert_major
                else np.broadcast_to(np.arange(capacity), (R, capacity)))
    src = np.where(slot_row >= 0, np.take_along_axis(recv_src, np.maximum(slot_row, 0), 1), -1)
    want = np.where((src >= 0)[..., None], values.reshape(R * T, 3)[np.maximum(src, 0)], 0)
    np.testing.assert_array_equal(np.asarray(rows), want)


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("wire", _exchange_ffi.WIRES)
def test_virtual_low_latency(R, wire):
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R, invalid=True)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    want_send, want_recv = account.low_latency_dispatch(idx, num_experts=E, hidden=H,
                                                        wire=wire)
    counted, sent = metered(_exchange_ffi.ll_dispatch_send, x, idx, num_ranks=R, num_experts=E,
                            wire=wire)
    assert_counts(counted, want_send)
    counted, (_, _, src_row, _) = metered(_exchange_ffi.ll_dispatch_recv, sent, num_ranks=R,
                                          num_experts=E)
    assert_counts(counted, want_recv)

    want_send, want_recv = account.low_latency_combine(idx, num_experts=E, hidden=H)
    y = rng.standard_normal((R, E // R, R * T, H)).astype(ml_dtypes.bfloat16)
    # With virtual ranks there is no send: the receive reads y in place.
    assert (want_send.launches, want_send.bytes) == (0, 0)
    counted, _ = metered(_exchange_ffi.ll_combine_recv, y, src_row, sent["clean_idx"], w,
                         num_ranks=R, num_experts=E)
    assert_counts(counted, want_recv)


# ---------------------------------------------------------------------------------------------
# One rank per device: host peers, the GPU's code between devices


def over_puts() -> bool:
    """Whether the host peers are reached by puts ($JAX_EP_PEER_ACCESS=put)."""
    return runtime.state()["peer_access"] == "put"


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("expert_major", [False, True])
def test_between_devices_round_trip(R, expert_major):
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    weighted = bool(rng.integers(2))

    def program(x, idx, w):
        received, handle = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                           expert_major=expert_major, backend="cuda")
        weights = received.topk_weights
        if weighted and not expert_major:
            weights = weights.sum(axis=1)
        return jax_ep.combine(received.x, handle, topk_weights=weights if weighted else None,
                              backend="cuda")

    run = sharded(program, R)
    jax.block_until_ready(run(x, idx, w))  # compiles
    counted, _ = metered(run, x, idx, w)
    puts = over_puts()
    want = (account.dispatch(idx, num_experts=E, row_bytes=2 * H, expert_major=expert_major,
                             between=True, puts=puts,
                             ranks_per_node=runtime.state()["ranks_per_node"])
            + account.combine(idx, num_experts=E, row_bytes=2 * H, expert_major=expert_major,
                              between=True, puts=puts, weighted=weighted))
    assert_counts(counted, want, ranks_running=R)


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("expert_major", [False, True])
def test_between_devices_dispatch_along_a_handle(R, expert_major):
    """A dispatch, then another array along its handle: stores stage and pull it (no count);
    over puts the dispatch runs again."""
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    x2 = rng.standard_normal((R, T, 8)).astype(np.float32)

    def program(x, x2, idx, w):
        _, handle = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                    expert_major=expert_major, backend="cuda")
        return jax_ep.dispatch(x2, handle=handle, backend="cuda")

    run = sharded(program, R)
    jax.block_until_ready(run(x, x2, idx, w))  # compiles
    counted, _ = metered(run, x, x2, idx, w)
    where = dict(num_experts=E, expert_major=expert_major, between=True, puts=over_puts(),
                 ranks_per_node=runtime.state()["ranks_per_node"])
    want = (account.dispatch(idx, row_bytes=2 * H, **where)
            + account.dispatch_rows(idx, row_bytes=8 * 4, **where))
    assert_counts(counted, want, ranks_running=R)


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("expert_major", [False, True])
def test_between_devices_dispatch_along_a_handle_over_puts(put_peers, R,  # noqa: F811
                                                           expert_major):
    test_between_devices_dispatch_along_a_handle(R, expert_major)


@pytest.mark.parametrize("R", [2, 4])
def test_between_devices_low_latency(R):
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    wire = str(rng.choice(_exchange_ffi.WIRES))
    wire_format = None if wire == "bf16" else wire

    def program(x, idx, w):
        received, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E, axis_name=AXIS,
                                                       wire_format=wire_format, backend="cuda")
        y = received.x if wire_format is None else jax_ep.quant.dequantize(received.x)
        return jax_ep.low_latency_combine(y.astype(x.dtype), idx, w, handle, backend="cuda")

    run = sharded(program, R)
    jax.block_until_ready(run(x, idx, w))
    counted, _ = metered(run, x, idx, w)
    puts = over_puts()
    parts = [*account.low_latency_dispatch(idx, num_experts=E, hidden=H, wire=wire,
                                           between=True, puts=puts),
             *account.low_latency_combine(idx, num_experts=E, hidden=H, between=True,
                                          puts=puts)]
    assert_counts(counted, functools.reduce(operator.add, parts), ranks_running=R)


def cpu_channel_warps(rings: runtime.Channels) -> int:
    """Warps per role per channel of a streaming launch on the CPU: the rings' own, or the
    grid's warps."""
    grid = os.environ.get("JAX_EP_CPU_GRID", "")
    return rings.warps or (int(grid.split(",")[1]) if grid else 1)


@pytest.mark.parametrize("R", [3, 4])
def test_streamed_ops(streamed_peers, R):  # noqa: F811
    """Streamed through rings (tiny ones, so that senders wait for space), in one node and in
    nodes: launches, barriers, bytes and, over puts, messages, exactly."""
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    capacity = int(rng.integers(1, R * T + 1))  # cuts rows: those are not sent

    def program(combine):
        def per_shard(x, idx, w):
            received, handle = jax_ep.dispatch(x, idx, w, num_experts=E, capacity=capacity,
                                               on_overflow="drop", axis_name=AXIS,
                                               backend="cuda")
            return jax_ep.combine(received.x, handle, backend="cuda") if combine else received.x

        return sharded(per_shard, R)

    counted = []
    for combine in (False, True):
        run = program(combine)
        jax.block_until_ready(run(x, idx, w))  # compiles
        counted.append(metered(run, x, idx, w)[0])
    state = runtime.state()
    puts = over_puts()
    shared = dict(num_experts=E, row_bytes=2 * H, capacity=capacity, between=True, puts=puts,
                  channels=state["channels"], channel_warps=cpu_channel_warps(state["channels"]))
    want = [account.dispatch(idx, ranks_per_node=state["ranks_per_node"], **shared)]
    want.append(want[0] + account.combine(idx, **shared))
    for got, wanted in zip(counted, want, strict=True):
        assert_counts(got, wanted, ranks_running=R)


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("expert_major", [False, True])
def test_between_devices_dispatch_on_a_wire_format(R, expert_major):
    """dispatch(x, wire_format=f) of bfloat16 x: the send reads each source row in bfloat16 and
    writes the format's bytes, the finish (streamed: the receivers) reads those and writes
    XLA's bfloat16 rows; no launch more than the plain dispatch's."""
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    f = str(rng.choice(quant.FORMATS))

    def program(x, idx, w):
        received, _ = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, wire_format=f,
                                      expert_major=expert_major, backend="cuda")
        return received.x

    run = sharded(program, R)
    jax.block_until_ready(run(x, idx, w))  # compiles
    counted, _ = metered(run, x, idx, w)
    state = runtime.state()
    streamed = dict(channels=state["channels"], channel_warps=cpu_channel_warps(
        state["channels"])) if state["channels"] is not None else {}
    data, rest = quant.wire_bytes(f, H)
    want = account.dispatch(idx, num_experts=E, row_bytes=data, scale_bytes=rest,
                            source_bytes=account.cast_source_bytes(f, H), result_bytes=2 * H,
                            expert_major=expert_major,
                            between=True, puts=over_puts(),
                            ranks_per_node=state["ranks_per_node"], **streamed)
    assert_counts(counted, want, ranks_running=R)


@pytest.mark.parametrize("R", [3, 4])
def test_between_devices_dispatch_on_a_wire_format_streamed(streamed_peers, R):  # noqa: F811
    test_between_devices_dispatch_on_a_wire_format(R, False)


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("expert_major", [False, True])
def test_between_devices_dispatch_on_a_wire_format_over_puts(put_peers, R,  # noqa: F811
                                                             expert_major):
    test_between_devices_dispatch_on_a_wire_format(R, expert_major)


@pytest.mark.parametrize("R", [4, 5])
def test_between_devices_dispatch_on_a_wire_format_in_nodes(node_peers, R):  # noqa: F811
    test_between_devices_dispatch_on_a_wire_format(R, bool(np.random.default_rng().integers(2)))


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("expert_major", [False, True])
def test_between_devices_combine_on_a_wire_format(R, expert_major):
    """combine(y, wire_format=f) of bfloat16 y: each stage reads its rows of y (nvfp4 twice)
    and writes the format's bytes, the sums read those and write the bfloat16 output; no
    launch more than the plain combine's, no weight sent."""
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    f = str(rng.choice(quant.FORMATS))
    weighted = bool(rng.integers(2))

    def program(x, idx, w):
        received, handle = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                           expert_major=expert_major, backend="cuda")
        weights = received.topk_weights
        if weighted and not expert_major:
            weights = weights.sum(axis=1)
        return jax_ep.combine(received.x, handle, topk_weights=weights if weighted else None,
                              wire_format=f, backend="cuda")

    run = sharded(program, R)
    jax.block_until_ready(run(x, idx, w))  # compiles
    counted, _ = metered(run, x, idx, w)
    state = runtime.state()
    shared = dict(num_experts=E, row_bytes=2 * H, expert_major=expert_major, between=True,
                  puts=over_puts())
    if state["channels"] is not None:
        shared.update(channels=state["channels"],
                      channel_warps=cpu_channel_warps(state["channels"]))
    want = (account.dispatch(idx, ranks_per_node=state["ranks_per_node"], **shared)
            + account.combine(idx, weighted=weighted, wire_format=f, **shared))
    assert_counts(counted, want, ranks_running=R)


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("expert_major", [False, True])
def test_between_devices_combine_backward_on_a_wire_format(R, expert_major):
    """combine(y, grad_wire_format=f)'s backward of bfloat16 d(out): the dispatch along the
    handle's routing again, its send casting each row and its unpack dequantizing it (zero
    padding): the account of that dispatch."""
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    f = str(rng.choice(quant.FORMATS))

    def program(x, idx, w):
        received, handle = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                           expert_major=expert_major, backend="cuda")
        out, vjp = jax.vjp(lambda y: jax_ep.combine(y, handle, grad_wire_format=f,
                                                    backend="cuda"), received.x)
        return vjp(jax.numpy.ones_like(out))[0]

    run = sharded(program, R)
    jax.block_until_ready(run(x, idx, w))  # compiles
    counted, _ = metered(run, x, idx, w)
    state = runtime.state()
    shared = dict(num_experts=E, expert_major=expert_major, between=True, puts=over_puts(),
                  ranks_per_node=state["ranks_per_node"])
    data, rest = quant.wire_bytes(f, H)
    want = (account.dispatch(idx, row_bytes=2 * H, **shared)
            + account.combine(idx, num_experts=E, row_bytes=2 * H, expert_major=expert_major,
                              between=True, puts=over_puts())
            + account.dispatch(idx, row_bytes=data, scale_bytes=rest, zero_padding=True,
                               source_bytes=account.cast_source_bytes(f, H),
                               result_bytes=2 * H, **shared))
    assert_counts(counted, want, ranks_running=R)


@pytest.mark.parametrize("R", [2, 3])
def test_between_devices_combine_backward_on_a_wire_format_over_puts(put_peers,  # noqa: F811
                                                                     R):
    test_between_devices_combine_backward_on_a_wire_format(
        R, bool(np.random.default_rng().integers(2)))


@pytest.mark.parametrize("R", [3, 4])
def test_between_devices_combine_on_a_wire_format_streamed(streamed_peers, R):  # noqa: F811
    test_between_devices_combine_on_a_wire_format(R, False)


@pytest.mark.parametrize("R", [2, 3])
def test_between_devices_combine_on_a_wire_format_over_puts(put_peers, R):  # noqa: F811
    test_between_devices_combine_on_a_wire_format(R, bool(np.random.default_rng().integers(2)))


@pytest.mark.parametrize("R", [4, 5])
def test_between_devices_combine_on_a_wire_format_in_nodes(node_peers, R):  # noqa: F811
    test_between_devices_combine_on_a_wire_format(R, bool(np.random.default_rng().integers(2)))


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("expert_major", [False, True])
def test_between_devices_round_trip_over_puts(put_peers, R, expert_major):  # noqa: F811
    """Over puts: a stage launch per send, the rows copied into the send areas, and combine's
    rows put into the homes' buffers."""
    test_between_devices_round_trip(R, expert_major)


@pytest.mark.parametrize("R", [2, 4])
def test_between_devices_low_latency_over_puts(put_peers, R):  # noqa: F811
    test_between_devices_low_latency(R)


@pytest.mark.parametrize("R", [2, 4])
def test_rank_major_dispatch_sends_one_put_per_row(put_peers, R):  # noqa: F811
    """Over puts a rank-major row travels with its FP8 scales and its metadata (source, ids,
    weights) in one put: the dispatch's messages are the published counts and one per
    delivered row, none per value or per (token, receiver)."""
    rng = np.random.default_rng()
    T, K, E, H, idx, w = draw(rng, R, invalid=True)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    capacity = int(rng.integers(1, R * T + 1))  # cuts rows: those are not sent

    def program(x, idx, w):
        received, _ = jax_ep.dispatch(jax_ep.fp8.quantize(x), idx, w, num_experts=E,
                                      capacity=capacity, on_overflow="drop", axis_name=AXIS,
                                      backend="cuda")
        return received.x

    run = sharded(program, R)
    jax.block_until_ready(run(x, idx, w))
    counted, _ = metered(run, x, idx, w)
    rows = int(account.kept_rows(idx, E, capacity).sum())
    assert counted["messages"] == R * (R - 1) + rows  # the count's totals: a row per rank


@pytest.mark.parametrize("R", [4, 5])
@pytest.mark.parametrize("expert_major", [False, True])
def test_between_devices_round_trip_in_nodes(node_peers, R, expert_major):  # noqa: F811
    """Node-aware: the send puts to the receivers of its node and once to each other node's
    relay, which stores the row into its targets there."""
    test_between_devices_round_trip(R, expert_major)


def test_puts_need_ranks_on_devices():
    idx = np.zeros((2, 3, 1), np.int32)
    with pytest.raises(ValueError, match="between=True"):
        account.dispatch(idx, num_experts=2, row_bytes=256, puts=True)


def test_deepseek_table_runs():
    """`python -m jax_ep.tools.account`'s table: every op at DeepSeek's shapes, both placements."""
    for between in (False, True):
        accounts = account.deepseek_accounts(num_ranks=4, between=between, tokens=64,
                                             ll_tokens=16, hidden=256, num_experts=32)
        text = account.table(accounts)
        assert all(a.op in text for a in accounts)
        assert all(a.minimum > 0 for a in accounts if a.op.startswith(("dispatch", "combine")))


def test_the_table_shows_each_launch_s_parallelism(capsys):
    """`python -m jax_ep.tools.account` prints its shapes, the warps of work in each op's smallest
    launch against what fills an H100, and why every row that misses a target does."""
    account.main(["--ranks", "4", "--tokens", "256", "--ll-tokens", "128"])
    out = capsys.readouterr().out
    assert "Shapes: R 4; normal mode T 256, low latency T 128; H 7168" in out
    assert "warps of the smallest launch" in out and "132 SMs" in out
    sends = [line for line in out.splitlines() if line.startswith("| ll_dispatch_send |")]
    # With virtual ranks the count launch has a warp per 64 tokens; between devices the send
    # counts its own messages (no count launch) and every launch fills the GPU.
    assert len(sends) == 3 and "(under)" in sends[0]
    assert not any("(under)" in line for line in sends[1:])
    assert "Expected misses:" in out and "not explained" not in out
    assert "One MoE layer's training step" in out and "| nvfp4 |" in out
    # Over puts, each op's messages per rank; between devices, the symmetric buffer per rank.
    assert "puts per rank |" in out and out.count("Symmetric buffer per rank") == 2
    over_puts = out.split("peers reached by puts")[1]
    assert all(line.split("|")[-2].strip() != "-" for line in over_puts.splitlines()
               if line.startswith("| dispatch |"))


def test_a_training_step_moves_the_wire_format_s_bytes_forward():
    """account.training_step: the forward dispatch moves each format's row (its data and
    other bytes) instead of bfloat16's, its send reading the bfloat16 rows it quantizes and its
    finish writing the bfloat16 rows it dequantizes (each received entry once), and the three
    other ops stay bfloat16's."""
    R, T, H, K, E = 4, 96, 256, 4, 16
    kw = dict(num_ranks=R, tokens=T, hidden=H, top_k=K, num_experts=E, seed=3)
    base = account.training_step(None, **kw)
    assert [a.op for a in base] == [
        "dispatch", "combine", "combine backward", "dispatch backward"]
    idx = account.uniform_routing(np.random.default_rng(3), R, T, K, E)
    entries = int(account.kept_entries(idx, E, default_capacity(R, T, K, E, True)).sum())
    for f in quant.FORMATS:
        ops = account.training_step(f, **kw)
        data, rest = quant.wire_bytes(f, H)
        as_travelled = dict(num_experts=E, row_bytes=data, scale_bytes=rest, expert_major=True,
                            between=True)
        source = account.cast_source_bytes(f, H)
        want = account.dispatch(idx, source_bytes=source, result_bytes=2 * H, **as_travelled)
        cast = account.dispatch(idx, source_bytes=source, **as_travelled)
        unfused = account.dispatch(idx, **as_travelled)
        assert (ops[0].read, ops[0].written) == (want.read, want.written), f
        assert want.read == cast.read == unfused.read + R * T * (source - data - rest), f
        grown = entries * (2 * H - data - rest)
        assert want.written - cast.written == want.minimum - cast.minimum == grown, f
        assert ops[0].bytes < base[0].bytes and ops[1:] == base[1:], f


def test_combine_moves_its_minimum():
    """Both layouts' combine move what must move, with virtual ranks and between devices:
    expert-major writes no partial row where a token has no entry (virtual ranks write none)."""
    for between in (False, True):
        accounts = account.deepseek_accounts(num_ranks=8, between=between, tokens=256,
                                             hidden=512)
        for a in accounts:
            if a.op.startswith("combine"):
                assert a.read + a.written == a.minimum, a
                assert a.launches == (2 if between else 1), a


def test_low_latency_rows_fill_the_gpu_at_decode_sizes():
    """At T 128 the send and the combine's receive split each row into column segments of
    whole FP8 blocks, enough for 1,024 warps per rank (at least 528 fill an H100); only the
    count launch of virtual ranks, which moves no rows, has fewer (between devices the send
    numbers its own messages). An NVFP4 segment's warp reads the whole row for its global
    scale, a read of the row per segment more, so that send cuts its launch's rows: between
    devices a rank's (8 segments at T 128), with virtual ranks every rank's (1 at R 8); the
    account's bytes follow (each row read once plus once per segment)."""
    assert account.ll_segments(128, 7168) == 8 and account.ll_segments(4096, 7168) == 1
    assert account.ll_segments(1, 7168) == 56 and account.ll_segments(128, 200) == 1
    idx = account.uniform_routing(np.random.default_rng(), 8, 128, 8, 256)
    reads = account._fan_out_reads(account.messages(idx, 256).sum(axis=2)) * 2 * 7168
    for between, segments in ((False, 1), (True, 8)):
        send, _ = account.low_latency_dispatch(idx, num_experts=256, hidden=7168,
                                               wire="nvfp4", between=between)
        assert send.read == reads * (1 + segments), (between, send)
        assert send.row_warps == (1 if between else 8) * 128 * segments
    for between in (False, True):
        accounts = account.deepseek_accounts(num_ranks=8, between=between, tokens=256,
                                             ll_tokens=128)
        (recv,) = [a for a in accounts if a.op == "ll_combine_recv"]
        assert recv.warps >= account.WARPS_TARGET, recv
        for send in [a for a in accounts if a.op.startswith("ll_dispatch_send")]:
            assert send.row_warps >= account.WARPS_TARGET, send
            assert (send.warps >= account.WARPS_TARGET) == between, send


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
def test_bytes_in_flight_follow_the_kernels_launch_parameters():
    """The account's bytes in flight rest on the kernels' own numbers (jax_ep._ext.
    kernel_parameters(): loads in flight per lane and their bytes, warps per block, the copy
    kernels' blocks per SM, a streaming launch's loads, blocks per SM and warps per channel on a
    GPU, forwarders, destinations per read), so they cannot drift from the code."""
    p = _ffi.EXT.kernel_parameters()
    assert (p["words_in_flight"], p["word_bytes"]) == (account.WORDS_IN_FLIGHT,
                                                       account.WORD_BYTES)
    assert (p["phase_warps"], p["copy_blocks_per_sm"]) == (account.PHASE_WARPS,
                                                           account.COPY_BLOCKS_PER_SM)
    assert (p["stream_words_in_flight"], p["sum_batch"]) == (account.STREAM_WORDS_IN_FLIGHT,
                                                             account.SUM_BATCH)
    assert (p["phase_warps"], p["stream_blocks_per_sm"]) == (runtime.STREAM_BLOCK_WARPS,
                                                             runtime.STREAM_BLOCKS_PER_SM)
    assert (p["dispatch_channel_warps"], p["combine_channel_senders"],
            p["max_channel_warps"]) == (runtime.DISPATCH_CHANNEL_WARPS,
                                        runtime.COMBINE_CHANNEL_SENDERS,
                                        runtime.MAX_CHANNEL_WARPS)
    assert (p["forwarders"], p["fan_out"]) == (runtime.FORWARDERS, account.FAN_OUT)


def test_bytes_in_flight_bound_each_op_s_copy_rate():
    """Little's law per op: its least parallel row-moving launch's warps (at most what its SM
    budget holds at once) x 32 lanes x the loads in flight, over a load's latency (NVLink
    between GPUs, HBM with virtual ranks). Every warp of a streaming launch moves rows, 8
    loads per lane (the combine's receiver 4 rows' loads), in the channels its num_sms holds
    (2 blocks of 8 warps per SM); a phased send is capped by num_sms (4 blocks per SM)."""
    rng = np.random.default_rng()
    R, T, K, E = 8, int(rng.integers(600, 900)), 8, 64
    idx = account.uniform_routing(rng, R, T, K, E)
    per_warp = account.LANES * account.WORDS_IN_FLIGHT * account.WORD_BYTES
    per_stream_warp = account.LANES * account.STREAM_WORDS_IN_FLIGHT * account.WORD_BYTES
    channels = runtime.Channels()
    streamed = account.dispatch(idx, num_experts=E, row_bytes=1024, between=True,
                                channels=channels)
    f = account.flight(streamed, between=True)
    # 4 senders and 4 receivers per channel; 40 channels fill the default 20 SMs' 2 blocks
    assert f.warps == channels.channels * 2 * runtime.DISPATCH_CHANNEL_WARPS == 20 * 2 * 8
    assert f.bytes == f.warps * per_stream_warp and f.latency_s == account.NVLINK_LATENCY_S
    assert f.bound_bps == pytest.approx(f.bytes / 2e-6) and f.meets
    # The combine: 8 senders (one per home) and a receiver summing 4 rows at once, in the
    # 35 channels that 20 SMs hold.
    f = account.flight(account.combine(idx, num_experts=E, row_bytes=1024, between=True,
                                       channels=channels), between=True)
    assert f.warps == 35 * 9
    assert f.bytes == 35 * (8 * per_stream_warp + account.SUM_BATCH * 16 * 32) and f.meets
    # A smaller budget streams through fewer channels.
    f = account.flight(account.dispatch(idx, num_experts=E, row_bytes=1024, between=True,
                                        channels=channels, num_sms=5), between=True)
    assert f.warps == 5 * 2 * 8 and not f.meets
    phased = account.dispatch(idx, num_experts=E, row_bytes=1024, between=True)
    f = account.flight(phased, between=True, num_sms=5)
    assert f.warps == 5 * account.COPY_BLOCKS_PER_SM * account.PHASE_WARPS  # T warps, capped
    assert f.bytes == f.warps * per_warp
    assert account.flight(phased, between=True, num_sms=200).warps == min(
        phased.row_warps, 200 * account.COPY_BLOCKS_PER_SM * account.PHASE_WARPS)
    virtual = account.flight(account.dispatch(idx, num_experts=E, row_bytes=1024),
                             between=False)
    assert virtual.latency_s == account.HBM_LATENCY_S
    assert virtual.link_bps == account.H100_COPY_BPS
    # Meeting the target: a bound of 1.2 x the link's rate.
    assert virtual.meets == (virtual.bytes / 1e-6 >= 1.2 * 3.35e12)


def test_the_low_latency_receive_follows_the_messages():
    """Between GPUs the low-latency receive's items follow the messages, not the slots: W
    warps per (local expert, source) pair, about twice the messages a receiver gets, and one
    per 32 tokens for src_row (at DeepSeek's decode shapes 2,080 items for 1,024 messages per
    rank, where one per slot was 32,768); at least one warp per pair and at most T."""
    R, T, K, E = 8, 128, 8, 256
    idx = account.uniform_routing(np.random.default_rng(), R, T, K, E)
    _, recv = account.low_latency_dispatch(idx, num_experts=E, hidden=7168, between=True)
    per_receiver = int(account.messages(idx, E).sum()) // R
    assert recv.warps == recv.row_warps == account.ll_finish_items(R, T, K, E) == 2080
    assert recv.warps <= 2 * per_receiver + R * T // 32
    assert account.ll_finish_items(2, 1, 1, 256) == 256 + 1  # a warp per pair at least
    assert account.ll_finish_items(2, 4, 8, 8) == 8 * 4 + 1  # at most T per pair
