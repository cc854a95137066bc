"""Wall-clock and device timing of jitted programs, and the machine's memory-copy bandwidth."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_ep.tools import profile


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call: the median, the extremes, and every timed call in order."""

    median: float
    min: float
    max: float
    all: list[float]

    @classmethod
    def of(cls, times: list[float]) -> Timing:
        return cls(statistics.median(times), min(times), max(times), list(times))


def _seconds(run: Callable[[], Any], repeat: int) -> list[float]:
    """Wall time of each of `repeat` calls of `run` (which must wait for its own result)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def time_calls(fn: Callable[..., Any], args: tuple, *, warmup: int, repeat: int) -> Timing:
    """Times `fn(*args)`, waiting for each call's outputs with `jax.block_until_ready`.

    Args:
      fn: a jitted program (the first call compiles it).
      args: its arguments, already on their devices.
      warmup: untimed calls first (at least one is made, so compilation is never timed).
      repeat: timed calls.

    Returns:
      The Timing of the `repeat` timed calls.
    """
    for _ in range(max(warmup, 1)):
        jax.block_until_ready(fn(*args))
    return Timing.of(_seconds(lambda: jax.block_until_ready(fn(*args)), repeat))


def device_time(fn: Callable[..., Any], args: tuple, *, calls: int,
                source: str) -> profile.DeviceTime | None:
    """Runs `fn(*args)` (compiled already) `calls` times under `jax.profiler` and reads the
    device's time out of the trace (`jax_ep.tools.profile.device_time`; `source` "gpu" or
    "cpu"), or None when the trace holds no such events."""
    with tempfile.TemporaryDirectory(prefix="jax_ep_bench_") as log_dir:
        started = time.time() - 1.0  # file times have a coarse resolution on some systems
        with jax.profiler.trace(log_dir):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        trace = profile.load_trace(log_dir, started)
    return profile.device_time(trace, calls, source)


# The accelerator's copy: COPIES copies of COPY_BYTES in one program (an H200 takes about 8
# ms for them, against some 10-50 us to launch and wait for a program).
COPY_BYTES, COPIES = 1 << 30, 16


def copy_bandwidth(device: jax.Device, nbytes: int | None = None, copies: int = COPIES,
                   repeat: int = 5) -> float:
    """Bytes per second of a large memory copy, counting the bytes read plus those written.

    On CPU the copy is NumPy's (one core streaming through the memory that all virtual devices
    share). On an accelerator it is `device_copy_rate`: many copies in one program, so that
    the program's launch and wait are under 1 % of what is timed (one `a + 1` of 256 MB is
    0.13 ms on an H200, and timed alone by wall clock it read half the rate: docs/gpu).

    Args:
      device: the device whose memory is measured.
      nbytes: size of the array copied (default 256 MiB on CPU, COPY_BYTES on an
        accelerator).
      copies: copies per timed program (accelerator).
      repeat: timed calls; the median is used.

    Returns:
      2 * nbytes / (median seconds per copy).
    """
    if device.platform != "cpu":
        return device_copy_rate(device, nbytes or COPY_BYTES, copies, repeat)
    nbytes = nbytes or 256 << 20
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)

    def run() -> None:
        np.copyto(dst, src)

    run()  # first touch of the pages
    return 2 * nbytes / statistics.median(_seconds(run, repeat))


def copy_program(copies: int) -> Callable[[jax.Array], jax.Array]:
    """A jitted program of `copies` elementwise copies of its input, one after another, each
    reading and writing every byte once: `a + 1` (XLA may drop a plain copy or `a + 0`), each
    behind an optimization barrier so that XLA cannot fuse them into one pass."""

    def program(a: jax.Array) -> jax.Array:
        for _ in range(copies):
            a = jax.lax.optimization_barrier(a + 1.0)
        return a

    return jax.jit(program)


def device_copy_rate(device: jax.Device, nbytes: int, copies: int, repeat: int) -> float:
    """2 * nbytes * copies / (median wall time of `copy_program(copies)` on a float32 array
    of nbytes on `device`), in bytes per second: each call launches and waits once for
    `copies` copies, so the copies' device time dominates what is timed."""
    src = jax.device_put(np.ones(nbytes // 4, np.float32), device)
    program = copy_program(copies)

    def run() -> None:
        jax.block_until_ready(program(src))

    run()  # compilation
    return 2 * nbytes * copies / statistics.median(_seconds(run, repeat))
