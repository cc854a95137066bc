"""jax_ep: expert-parallel communication for Mixture-of-Experts models in JAX.

The DeepEP contract (layout, dispatch, combine, low-latency dispatch/combine, FP8, handles,
backward) as shard_map-friendly functions with static shapes. See docs/contract.md.
"""

from jax_ep import _moved, backends, checks, eplb, fp8, overlap, quant, runtime, virtual
from jax_ep._ffi import build_info
from jax_ep.checks import checked
from jax_ep.dispatch import DEFAULT_NUM_SMS, capacity_from_factor, combine, dispatch
from jax_ep.layout import get_dispatch_layout
from jax_ep.low_latency import (
    low_latency_combine,
    low_latency_combine_recv,
    low_latency_combine_send,
    low_latency_dispatch,
    low_latency_dispatch_recv,
    low_latency_dispatch_send,
)
from jax_ep.runtime import BufferConfig, finalize, initialize
from jax_ep.structs import (
    DispatchHandle,
    DispatchLayout,
    LowLatencyHandle,
    LowLatencyReceived,
    Received,
)

__version__ = "0.1.0"

# Modules reached as attributes on first use (`jax_ep.pipeline`, `jax_ep.nn`, `jax_ep.tools`):
# importing them here would slow `import jax_ep` (Flax) or run them twice under `python -m`.
_ON_FIRST_USE = ("nn", "pipeline", "tools")

# The tools' old homes (`jax_ep.account`, ...) still import, with a DeprecationWarning.
_moved.install()


def __getattr__(name: str):
    if name in _ON_FIRST_USE or name in _moved.MOVED:
        import importlib

        return importlib.import_module(f"jax_ep.{name}")
    raise AttributeError(f"module 'jax_ep' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_ON_FIRST_USE])

__all__ = [
    "BufferConfig",
    "DEFAULT_NUM_SMS",
    "DispatchHandle",
    "DispatchLayout",
    "LowLatencyHandle",
    "LowLatencyReceived",
    "Received",
    "backends",
    "build_info",
    "capacity_from_factor",
    "checked",
    "checks",
    "combine",
    "dispatch",
    "eplb",
    "finalize",
    "fp8",
    "get_dispatch_layout",
    "initialize",
    "low_latency_combine",
    "low_latency_combine_recv",
    "low_latency_combine_send",
    "low_latency_dispatch",
    "low_latency_dispatch_recv",
    "low_latency_dispatch_send",
    "nn",
    "overlap",
    "pipeline",
    "quant",
    "runtime",
    "tools",
    "virtual",
]
