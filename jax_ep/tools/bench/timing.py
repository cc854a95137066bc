"""Wall-clock timing of jitted programs, and the machine's memory-copy bandwidth."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


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


def copy_bandwidth(device: jax.Device, nbytes: int = 256 << 20, repeat: int = 7) -> float:
    """Bytes per second of a large memory copy, counting the bytes read plus those written.

    On CPU the copy is NumPy's (one core streaming through the memory that all virtual devices
    share); on an accelerator it is a jitted elementwise op on `device`, which reads and writes
    every byte once (`a + 1`: XLA may drop a plain copy or `a + 0`, leaving nothing to time).

    Args:
      device: the device whose memory is measured.
      nbytes: size of the array copied.
      repeat: timed copies; the median is used.

    Returns:
      2 * nbytes / (median seconds per copy).
    """
    if device.platform == "cpu":
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)

        def run() -> None:
            np.copyto(dst, src)

    else:
        src = jax.device_put(np.ones(nbytes // 4, np.float32), device)
        plus_one = jax.jit(lambda a: a + 1.0)

        def run() -> None:
            jax.block_until_ready(plus_one(src))

    run()  # first touch of the pages, or compilation
    return 2 * nbytes / statistics.median(_seconds(run, repeat))
