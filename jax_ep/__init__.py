"""jax_ep: expert-parallel communication for Mixture-of-Experts models in JAX.

The DeepEP contract (layout, dispatch, combine, low-latency dispatch/combine, FP8, handles,
backward) as shard_map-friendly functions with static shapes. See docs/contract.md.
"""

from jax_ep import backends, checks, eplb, fp8, overlap, profile, runtime, virtual
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

__all__ = [
    "BufferConfig",
    "DEFAULT_NUM_SMS",
    "DispatchHandle",
    "DispatchLayout",
    "LowLatencyHandle",
    "LowLatencyReceived",
    "Received",
    "backends",
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
    "overlap",
    "profile",
    "runtime",
    "virtual",
]
