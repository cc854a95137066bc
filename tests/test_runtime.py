"""The CUDA backend's runtime on a machine without a GPU: sizes, checks, clear errors, and
host peers (jax_ep.initialize() on CPU devices).

NVSHMEM itself is never initialized here (it would end the process without a GPU); the GPU
check script (tools/gpu_check.sh) runs it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
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
    ("top_k", 0, r"top_k must be an int in \[1, 2\^31\)"),
    ("capacity", 0, r"capacity must be an int in \[1, 2\^31\)"),
    ("num_tokens", 2**31, r"num_tokens must be an int in \[1, 2\^31\) \(the ops count"),
    ("low_latency_tokens", -1, r"low_latency_tokens must be an int in \[0, 2\^31\)"),
])
def test_bad_config_names_the_field(field, value, message):
    config = runtime.BufferConfig(num_ranks=4, **{field: value})
    with pytest.raises(ValueError, match=message):
        runtime.required_bytes(config)


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
@pytest.mark.parametrize("access, nodes", [("store", 0), ("put", 0), ("put", 3)])
def test_sizes_at_the_settings_limits_grow_and_never_wrap(monkeypatch, access, nodes):
    """Each setting swept up to its limit (Channels' 2^20, counts below 2^31): the regions
    never shrink as it grows (a product that wrapped would), and a config past the ops'
    int32 counts or any machine's memory sizes as TOO_LARGE or more."""
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    base = runtime.BufferConfig(num_tokens=64, hidden=256, top_k=4, num_experts=16,
                                num_ranks=8, channels=runtime.Channels(2, 2, 2))
    sweeps = {"channels": [1, 2**10, 2**15, 2**20], "chunk_tokens": [1, 2**10, 2**15, 2**20],
              "ring_chunks": [1, 2**10, 2**15, 2**20],
              "num_tokens": [1, 2**10, 2**20, 2**28, 2**31 - 1],
              "hidden": [128, 2**20, 2**27, 2**31 - 128],
              "low_latency_tokens": [0, 2**10, 2**20, 2**31 - 1]}
    for name, values in sweeps.items():
        for channels in (base.channels, None):
            if channels is None and name in runtime.Channels.__dataclass_fields__:
                continue
            sizes = []
            for value in values:
                if name in runtime.Channels.__dataclass_fields__:
                    config = dataclasses.replace(
                        base, channels=dataclasses.replace(channels, **{name: value}))
                else:
                    config = dataclasses.replace(base, channels=channels, **{name: value})
                regions = runtime.buffer_regions(config, access=access, nodes=nodes)
                sizes.append((regions["normal"], regions["low_latency"]))
            for (n0, l0), (n1, l1) in zip(sizes, sizes[1:], strict=False):
                assert n0 <= n1 and l0 <= l1, (name, channels, sizes)
            if name in ("num_tokens", "low_latency_tokens"):  # past the ops' int32 counts
                assert sum(sizes[-1]) >= runtime.TOO_LARGE, (name, channels, sizes)
    huge = runtime.BufferConfig(num_ranks=8, channels=runtime.Channels(2**20, 2**20, 2**20))
    assert runtime.required_bytes(huge) >= runtime.TOO_LARGE


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
def test_initialize_refuses_a_buffer_past_memory_and_says_what_fits(monkeypatch):
    """A config whose buffer is larger than a rank's memory is refused before anything is
    allocated, with the largest value of each setting that alone makes it fit."""
    if runtime.is_initialized():
        pytest.skip("jax_ep.initialize() has run for the whole session (JAX_EP_BACKEND=cuda)")
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    memory = 64 << 20
    monkeypatch.setattr(runtime, "_memory_per_rank", lambda gpus: (memory, "a test's 64 MiB"))
    config = runtime.BufferConfig(num_tokens=64, hidden=1024, top_k=2, num_experts=8,
                                  low_latency_tokens=8, channels=runtime.Channels(4, 4, 2**16))
    with pytest.raises(ValueError, match=r"more than a test's 64 MiB") as error:
        jax_ep.initialize(config)
    assert not runtime.is_initialized()
    ring_chunks = int(re.search(r"Channels.ring_chunks <= (\d+) \(it is 65536\)",
                                str(error.value)).group(1))
    size = lambda n: runtime.required_bytes(dataclasses.replace(  # noqa: E731
        config, channels=runtime.Channels(4, 4, n)))
    assert size(ring_chunks) <= memory < size(ring_chunks + 1)
    assert "BufferConfig.low_latency_tokens" not in str(error.value)  # not alone enough
    # The same rings from $JAX_EP_CHANNELS: the same largest value.
    monkeypatch.setenv("JAX_EP_CHANNELS", "4,4,65536")
    with pytest.raises(ValueError, match=rf"Channels.ring_chunks <= {ring_chunks} \(it is "
                                         rf"65536\)"):
        jax_ep.initialize(dataclasses.replace(config, channels=runtime.Channels()))
    monkeypatch.delenv("JAX_EP_CHANNELS")
    with pytest.raises(ValueError, match=r"buffer_bytes=134217728 is more than a test's"):
        jax_ep.initialize(buffer_bytes=2 * memory)
    # Channels at their limits: sized past any machine, refused without allocating.
    monkeypatch.undo()
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    for rings, pattern in ((runtime.Channels(4, 2**20, 2**20), r"needs \d+ bytes per rank"),
                           (runtime.Channels(256, 2**20, 2**20), r"needs more than 2\^60 bytes")):
        with pytest.raises(ValueError, match=pattern + r".*no one setting alone makes it fit"):
            jax_ep.initialize(runtime.BufferConfig(channels=rings))
        assert not runtime.is_initialized()


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
def test_more_channels_than_the_host_peers_run_are_refused(monkeypatch):
    """On CPU devices every warp of a streaming launch is a thread: channels past the host
    peers' threads per launch are refused at initialize, naming the largest that runs."""
    if runtime.is_initialized():
        pytest.skip("jax_ep.initialize() has run for the whole session (JAX_EP_BACKEND=cuda)")
    most = _ffi.EXT.host_max_units // 4
    config = runtime.BufferConfig(num_tokens=16, hidden=128, top_k=2, num_experts=8,
                                  low_latency_tokens=0)
    for channels in (runtime.Channels(2**20, 1, 1), runtime.Channels(most + 1, 1, 1)):
        with pytest.raises(ValueError, match=rf"at most {most}\."):
            jax_ep.initialize(dataclasses.replace(config, channels=channels))
    monkeypatch.setenv("JAX_EP_CHANNELS", "1048576,1,1")
    with pytest.raises(ValueError, match=r"Channels.channels \(or \$JAX_EP_CHANNELS\)"):
        jax_ep.initialize(config)
    assert not runtime.is_initialized()
    monkeypatch.setenv("JAX_EP_CHANNELS", f"{most},1,1")  # the largest runs
    jax_ep.initialize(config)
    try:
        assert runtime.channels() == runtime.Channels(most, 1, 1)
    finally:
        jax_ep.finalize()


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


def _refuse_threads(self):
    raise RuntimeError("can't create new thread at interpreter shutdown")


def test_exit_finalizes_where_python_starts_no_thread_at_exit(monkeypatch):
    """Python 3.12 refuses a thread at exit: finalize() runs on the exiting thread, watched
    (a finalize that hangs ends the process with status 1, in a subprocess below)."""
    called = []
    monkeypatch.setattr(threading.Thread, "start", _refuse_threads)
    monkeypatch.setattr(runtime, "_state", {"platform": "gpu"})
    monkeypatch.setattr(runtime, "finalize", lambda: called.append(1))
    assert runtime._finalize_at_exit(5) is True and called == [1]
    monkeypatch.setattr(runtime, "finalize", lambda: 1 / 0)
    assert runtime._finalize_at_exit(5) is False
    script = ("import threading, time, test_runtime\n"
              "from jax_ep import runtime\n"
              "threading.Thread.start = test_runtime._refuse_threads\n"
              "runtime._state.update(platform='gpu')\n"
              "runtime.finalize = lambda: time.sleep(60)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(__file__),
                          env=dict(os.environ, JAX_EP_EXIT_TIMEOUT_S="0.5"))
    assert proc.returncode == 1 and "Timeout" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 30


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



_EXCHANGE_PROGRAM = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
import jax_ep

if {initialize}:
    jax_ep.initialize(jax_ep.BufferConfig(num_tokens=4, hidden=256, top_k=2, num_experts=4,
                                          dtype_bytes=4, low_latency_tokens=0, channels=None))
mesh = jax.make_mesh((2,), ("ep",))
T, H, K, E = {T}, 256, 2, 4

def per_shard(x, idx, w):
    return jax_ep.dispatch(x, idx, w, num_experts=E, backend="cuda")[0].x

step = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=jax.P("ep"), out_specs=jax.P("ep")))
rng = np.random.default_rng({seed})
args = (rng.standard_normal((2 * T, H)).astype(np.float32),
        rng.integers(0, E, (2 * T, K)).astype(np.int32), np.ones((2 * T, K), np.float32))
with jax.set_mesh(mesh):
    out = step(*(jax.device_put(a, jax.NamedSharding(mesh, jax.P("ep"))) for a in args))
print("shape", out.shape)
"""


def _exchange_process(**fields):
    script = _EXCHANGE_PROGRAM.format(seed=int(np.random.default_rng().integers(1 << 30)),
                                      **fields)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_EP_BACKEND")}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=240, env=env)


@pytest.mark.skipif(_ffi.EXT is None, reason="needs the compiled extension")
def test_a_failed_exchange_never_exits_0():
    """A program that never reads its results (it prints a shape): an exchange that failed
    (a call larger than the buffer) ends the process with status 1 and the error, which names
    the call's sizes in BufferConfig's fields; a call that fits exits 0."""
    proc = _exchange_process(initialize=True, T=64)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "shape" in proc.stdout  # the program ran to its end
    assert re.search(r"an exchange failed, so the process exits with status 1: .*jax_ep_dispatch: "
                     r"needs \d+ bytes of normal-mode region", proc.stderr), proc.stderr[-3000:]
    assert ("BufferConfig at least this call's sizes (num_ranks=2, num_tokens=64, top_k=2, "
            "num_experts=4, capacity=128, hidden x dtype_bytes >= 1024)") in proc.stderr
    fits = _exchange_process(initialize=True, T=4)
    assert fits.returncode == 0 and "shape (16, 256)" in fits.stdout, fits.stderr[-3000:]


@pytest.mark.skipif(_ffi.EXT is None, reason="needs the compiled extension")
def test_a_missing_initialize_is_refused_when_the_step_is_compiled():
    proc = _exchange_process(initialize=False, T=4)
    assert proc.returncode == 1 and "shape" not in proc.stdout, proc.stdout
    assert re.search(r"RuntimeError: jax_ep: the cuda backend's dispatch between devices needs "
                     r"jax_ep.initialize\(\) first, before its program is compiled",
                     proc.stderr), proc.stderr[-3000:]
