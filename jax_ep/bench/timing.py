"""Wall-clock timing of jitted programs, and the machine's memory-copy bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def time_calls(fn: Callable[..., Any], args: tuple, *, warmup: int, repeat: int) -> dict:
    """Seconds per call of `fn(*args)`, each call waited for with block_until_ready.

    The warm-up calls (the first compiles) are not timed. Returns median, min, max and all.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "all": times}


def copy_bandwidth(platform: str, nbytes: int = 256 << 20, repeat: int = 7) -> float:
    """Bytes per second of a large memory copy, counting bytes read plus bytes written."""
    if platform == "cpu":
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)

        def run():
            np.copyto(dst, src)
    else:
        src = jax.device_put(np.ones(nbytes // 4, np.float32), jax.devices()[0])
        copy = jax.jit(lambda a: a + 0.0)

        def run():
            jax.block_until_ready(copy(src))

    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)
