"""The CUDA backend's runtime on a machine without a GPU: sizes, checks, clear errors, and
host peers (jax_ep.initialize() on CPU devices).

NVSHMEM itself is never initialized here (it would end the process without a GPU); the GPU
check script (tools/gpu_check.sh) runs it.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

import jax_ep
from jax_ep import _ffi, runtime


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
def test_buffer_bytes_by_hand(monkeypatch):
    monkeypatch.delenv("JAX_EP_PEER_ACCESS", raising=False)  # stores: no send areas
    # R=2, T=4, K=2, E=4, H=128, bf16, T_ll=2; every piece starts on a 256-byte boundary.
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    config = runtime.BufferConfig(num_tokens=4, hidden=128, top_k=2, num_experts=4, num_ranks=2,
                                  low_latency_tokens=2, channels=None)  # in phases
    # Normal dispatch, 8 rows: counts 48, rows 2048, FP8 scales 32, idx 64, weights 64,
    # recv_src 32 -> 256 + 2048 + 4 * 256 (combine needs less: 2560; src_row lands in XLA's
    # result, not here).
    # Low latency, 8 slots: counts 32, bf16 rows 2048, src_row 32, staging 1024 -> 256 +
    # 2048 + 256 + 1024 (FP8: rows 1024 and scales 32, less), twice (two regions).
    assert runtime.buffer_regions(config) == {"signals": 4096, "normal": 3328,
                                              "low_latency": 2 * 3584}
    assert runtime.required_bytes(config) == 4096 + 3328 + 2 * 3584


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
def test_expert_major_and_capacity_change_the_size(monkeypatch):
    """In phases the rows of a call set the size; streamed (the default), the rank-major
    calls hold rings only, and expert-major calls (in phases) still need their rows."""
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    base = dict(num_tokens=64, hidden=256, top_k=4, num_experts=16, num_ranks=4, channels=None)
    rank_major = runtime.required_bytes(runtime.BufferConfig(**base))
    expert_major = runtime.required_bytes(runtime.BufferConfig(**base, expert_major=True))
    small = runtime.required_bytes(runtime.BufferConfig(**base, capacity=16))
    assert expert_major > rank_major > small
    rings = dict(base, channels=runtime.Channels(2, 2, 2))
    streamed = runtime.required_bytes(runtime.BufferConfig(**rings))
    assert streamed == runtime.required_bytes(runtime.BufferConfig(**rings, capacity=16))
    assert runtime.required_bytes(runtime.BufferConfig(**rings, expert_major=True)) > streamed


@pytest.mark.parametrize("field, value, message", [
    ("hidden", 100, "multiple of 128"),
    ("num_experts", 6, "multiple of the number of ranks"),
    ("top_k", 0, "positive int"),
    ("capacity", 0, "capacity must be a positive int"),
])
def test_bad_config_names_the_field(field, value, message):
    config = runtime.BufferConfig(num_ranks=4, **{field: value})
    with pytest.raises(ValueError, match=message):
        runtime.required_bytes(config)


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
def test_initialize_on_cpu_sets_up_host_peers():
    if runtime.is_initialized():
        pytest.skip("jax_ep.initialize() has run for the whole session (JAX_EP_BACKEND=cuda)")
    with pytest.raises(ValueError, match="not both"):
        jax_ep.initialize(jax_ep.BufferConfig(), buffer_bytes=1 << 20)
    with pytest.raises(ValueError, match="low_latency_bytes goes with buffer_bytes"):
        jax_ep.initialize(jax_ep.BufferConfig(), low_latency_bytes=1 << 20)
    assert not runtime.is_initialized() and runtime.state() is None
    config = jax_ep.BufferConfig(num_tokens=16, hidden=128, top_k=2, num_experts=8,
                                 channels=None)
    jax_ep.initialize(config)
    try:
        assert runtime.state() == {
            "platform": "cpu", "rank": 0, "num_ranks": 8,
            "buffer_bytes": runtime.required_bytes(config),
            "low_latency_bytes": runtime.buffer_regions(config)["low_latency"],
            "peer_access": "store", "ranks_per_node": 0, "channels": None}
        assert _ffi.EXT.host_peers_buffer_bytes() == runtime.required_bytes(config)
        with pytest.raises(RuntimeError, match="already initialized"):
            jax_ep.initialize(config)
    finally:
        jax_ep.finalize()
    # With rings (the default) the buffer holds the streamed dispatch's, and the ops stream
    # through them.
    assert jax_ep.BufferConfig().channels == runtime.Channels()
    streamed = dataclasses.replace(config, channels=runtime.Channels(2, 2, 2))
    jax_ep.initialize(streamed)
    try:
        assert runtime.channels() == runtime.Channels(2, 2, 2)
        assert _ffi.EXT.host_peers_buffer_bytes() == runtime.required_bytes(streamed)
    finally:
        jax_ep.finalize()
    assert runtime.channels() is None
    assert not runtime.is_initialized() and _ffi.EXT.host_peers_buffer_bytes() == 0
    jax_ep.finalize()  # a no-op when not initialized


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
@pytest.mark.parametrize("low_latency", [0, 300, 1 << 20])
def test_rows_stage_fits_the_normal_region_to_the_byte(low_latency):
    """dispatch_rows' stage (T rows, rounded up to 256 bytes) against the normal region: the
    buffer less its low-latency bytes, rounded down to 256, less the signals."""
    T, row_bytes = 5, 100  # 500 bytes, 512 with the alignment
    enough = runtime.SIGNAL_BYTES + 512 + low_latency
    assert _ffi.EXT.rows_stage_fits(enough, low_latency, T, row_bytes)
    assert not _ffi.EXT.rows_stage_fits(enough - 1, low_latency, T, row_bytes)
    assert _ffi.EXT.rows_stage_fits(enough, low_latency, 1, 512)
    assert not _ffi.EXT.rows_stage_fits(enough, low_latency, 1, 513)  # 768 with the alignment


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
def test_extension_runtime_bindings_without_gpu():
    assert _ffi.EXT.runtime_state() is None
    if not _ffi.cuda_kernels_compiled():
        with pytest.raises(RuntimeError, match="without the CUDA kernels"):
            _ffi.EXT.runtime_initialize(b"\0" * 128, 0, 1, 0, 1 << 20, 0, False, 0, [0], [0])
    else:
        with pytest.raises(ValueError, match="128 bytes"):
            _ffi.EXT.runtime_initialize(b"\0" * 3, 0, 1, 0, 1 << 20, 0, False, 0, [0], [0])
        _ffi.EXT.runtime_finalize()  # nothing to finalize: no error


def test_exit_never_waits_long_for_a_finalize_that_hangs(monkeypatch, capsys):
    """At exit, finalize() is collective between GPUs: a dead peer must not hang the others."""
    release = threading.Event()
    monkeypatch.setattr(runtime, "finalize", lambda: release.wait())
    monkeypatch.setattr(runtime, "_state", {"platform": "gpu"})
    start = time.monotonic()
    try:
        assert runtime._finalize_at_exit(0.2) is False
    finally:
        release.set()
    assert time.monotonic() - start < 5
    assert "did not finish within 0.2 s at exit" in capsys.readouterr().err
    monkeypatch.setattr(runtime, "finalize", lambda: None)
    assert runtime._finalize_at_exit(5) is True


@pytest.mark.parametrize("gpus, processes, access, nodes, platform", [
    (0, 1, "store", 0, "none"), (1, 4, "put", 2, "nvshmem"), (8, 1, "store", 0, "local")])
def test_the_gpus_of_a_process_choose_their_platform(gpus, processes, access, nodes, platform):
    """One GPU per process: NVSHMEM; several GPUs of one process: CUDA peer access."""
    assert runtime.gpu_platform(gpus, processes, access, nodes) == platform


@pytest.mark.parametrize("processes, access, nodes, match", [
    (2, "store", 0, r"2 processes with 4 GPUs in this one.*one process per GPU"),
    (1, "put", 0, r"4 GPUs of this process reach each other with loads and stores"),
    (1, "store", 2, r"JAX_EP_RANKS_PER_NODE need one process per GPU")])
def test_what_no_gpu_platform_serves_is_refused(processes, access, nodes, match):
    with pytest.raises(RuntimeError, match=match):
        runtime.gpu_platform(4, processes, access, nodes)

