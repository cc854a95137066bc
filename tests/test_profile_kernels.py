"""Device time from profiler traces (jax_ep.tools.profile.device_time and its kernels): a
synthetic GPU trace with hand-computed answers, and a real XLA:CPU capture."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep.tools import profile
from jax_ep.tools.bench import timing

T0 = 5_000_000.0  # microseconds; the trace's clock starts anywhere


def gpu_trace():
    """Two calls of one program on two GPUs, times in us after T0:

    GPU 0, stream 13: copy [0, 100) and [1000, 1120), small [100, 110) and [1120, 1130),
                      MemcpyD2D [500, 530)
    GPU 0, stream 20: combine [50, 150) and [1050, 1150), under the copies
    GPU 1, stream 13: copy [10, 410) and [1010, 1410)

    Not device work, to be ignored: the derived "XLA Ops" row of GPU 0 (it repeats a copy),
    and on the host the program's Python call, a launch, and the host annotation of the
    copy (which carries an hlo_op, as XLA:CPU's operations do).
    """
    def kernel(pid, tid, name, start, dur):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": T0 + start, "dur": dur,
                "args": {"correlation_id": str(int(start)), "hlo_op": name}}

    def meta(pid, name, tid=None):
        event = {"ph": "M", "pid": pid, "name": "thread_name" if tid else "process_name",
                 "args": {"name": name}}
        return event | ({"tid": tid} if tid else {})

    return {"traceEvents": [
        meta(1, "/host:CPU"), meta(2, "/device:GPU:0"), meta(3, "/device:GPU:1"),
        meta(2, "Stream #13(Compute)", 10), meta(2, "Stream #20(Collective)", 11),
        meta(2, "XLA Ops", 99), meta(3, "Stream #13(Compute)", 10),
        kernel(2, 10, "copy", 0, 100), kernel(2, 10, "small", 100, 10),
        kernel(2, 10, "MemcpyD2D", 500, 30),
        kernel(2, 10, "copy", 1000, 120), kernel(2, 10, "small", 1120, 10),
        kernel(2, 11, "combine", 50, 100), kernel(2, 11, "combine", 1050, 100),
        kernel(3, 10, "copy", 10, 400), kernel(3, 10, "copy", 1010, 400),
        {"ph": "X", "pid": 2, "tid": 99, "name": "copy", "ts": T0, "dur": 100,
         "args": {"hlo_op": "copy"}},
        {"ph": "X", "pid": 1, "tid": 5, "name": "PjitFunction(step)", "ts": T0 - 20,
         "dur": 2000},
        {"ph": "X", "pid": 1, "tid": 5, "name": "cudaLaunchKernel", "ts": T0 - 10, "dur": 5},
        {"ph": "X", "pid": 1, "tid": 6, "name": "copy", "ts": T0 - 10, "dur": 1000,
         "args": {"hlo_op": "copy", "hlo_module": "jit_step", "device_ordinal": "0"}},
    ]}


def test_gpu_kernels_per_name_over_every_gpu():
    got = [(k.name, k.launches, k.seconds) for k in profile.device_kernel_times(gpu_trace())]
    want = [("copy", 4, 1020e-6), ("combine", 2, 200e-6), ("MemcpyD2D", 1, 30e-6),
            ("small", 2, 20e-6)]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want], rel=1e-12)


def test_gpu_device_time_per_call():
    measured = profile.device_time(gpu_trace(), calls=2)
    assert measured.source == "gpu"
    assert measured.devices == ("/device:GPU:0", "/device:GPU:1")
    # GPU 0 is busy [0, 150) + [500, 530) + [1000, 1150): its streams overlap, and count once.
    assert measured.busy_s == pytest.approx({"/device:GPU:0": 330e-6 / 2,
                                             "/device:GPU:1": 800e-6 / 2}, rel=1e-12)
    assert measured.seconds(one_memory=False) == pytest.approx(400e-6, rel=1e-12)
    # Both GPUs on one timeline: [0, 410) + [500, 530) + [1000, 1410).
    assert measured.seconds(one_memory=True) == pytest.approx(850e-6 / 2, rel=1e-12)
    rows = {k["kernel"]: (k["launches_per_call"], k["ms_per_call"]) for k in measured.kernels}
    assert rows == {"copy": (2.0, pytest.approx(0.51)), "combine": (1.0, pytest.approx(0.1)),
                    "MemcpyD2D": (0.5, pytest.approx(0.015)), "small": (1.0, pytest.approx(0.01))}
    assert [k["kernel"] for k in profile.device_time(gpu_trace(), 2, top=2).kernels] == [
        "copy", "combine"]


def test_a_trace_without_the_platform_s_events_has_no_device_time():
    host_only = {"traceEvents": [e for e in gpu_trace()["traceEvents"] if e.get("pid") == 1]}
    assert profile.device_time(host_only, calls=1, source="gpu") is None
    # Asked for the CPU's operations, a GPU trace gives its host annotation, never a kernel.
    _, by_device = profile.device_events(gpu_trace(), "cpu")
    assert {e["name"] for events in by_device.values() for e in events} == {"copy"}
    assert all(e["pid"] == 1 for events in by_device.values() for e in events)
    with pytest.raises(ValueError, match="calls must be >= 1"):
        profile.device_time(gpu_trace(), calls=0)
    with pytest.raises(ValueError, match="source must be"):
        profile.device_events(gpu_trace(), "tpu")


def test_cpu_device_time_from_a_real_capture():
    """jax 0.10's XLA:CPU trace holds one event per operation run (args hlo_op, hlo_module,
    device_ordinal): a loop's body counts once per iteration and the loop itself not at all;
    every name is an instruction of the compiled program."""
    def program(a):
        return jax.lax.fori_loop(0, 3, lambda i, x: jnp.sin(x) * x + i, a) @ a

    fn = jax.jit(program)
    a = jax.device_put(np.ones((128, 128), np.float32), jax.devices()[0])
    hlo = fn.lower(a).compile().as_text()
    jax.block_until_ready(fn(a))
    measured = timing.device_time(fn, (a,), calls=3, source="cpu")
    assert measured is not None and measured.source == "cpu"
    assert measured.devices == ("/host:CPU device 0",)
    names = {k["kernel"] for k in measured.kernels}
    instructions = set(re.findall(r"%([\w.\-]+) = ", hlo))
    assert names <= instructions, names - instructions
    assert not any(n.startswith("while") for n in names), names
    launches = sorted({k["launches_per_call"] for k in measured.kernels})
    assert launches == [1.0, 3.0], measured.kernels  # the loop's body: 3 per call
    busy = measured.seconds(one_memory=True)
    assert 0 < busy <= sum(k["ms_per_call"] for k in measured.kernels) / 1e3 * (1 + 1e-9)
