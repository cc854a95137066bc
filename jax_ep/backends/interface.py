"""What a backend provides: `Backend`, the functions the ops call, with their signatures.

Every function runs per shard inside `shard_map` over `axis_name` (the handles carry theirs).
`placement` says where the "cuda" backend runs its kernels (jax_ep.placement); the "xla"
backend leaves placement to XLA and ignores it. The backends are modules (jax_ep.backends.xla,
jax_ep.backends.cuda) that implement this protocol; tests/test_package.py checks each against
it, and a type checker accepts them where a `Backend` is expected.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jax_ep.placement import Placement
from jax_ep.structs import (
    DispatchHandle,
    DispatchLayout,
    LowLatencyHandle,
    LowLatencyReceived,
    Received,
)


class Backend(Protocol):
    NAME: str

    def get_dispatch_layout(self, topk_idx: jax.Array, *, num_experts: int,
                            num_ranks: int) -> DispatchLayout:
        """The layout of this rank's routing (docs/contract.md, "get_dispatch_layout")."""

    def dispatch(self, x: jax.Array, scales: jax.Array | None, topk_idx: jax.Array,
                 topk_weights: jax.Array, *, num_experts: int, axis_name: str, capacity: int,
                 expert_major: bool, drop_by_source: bool,
                 placement: Placement) -> tuple[Received, DispatchHandle, jax.Array]:
        """(received, handle, rows or entries this rank needed before the capacity cut);
        `drop_by_source`: an expert-major capacity keeps entries by source, then expert."""

    def combine(self, y: jax.Array, weights: jax.Array | None, handle: DispatchHandle, *,
                placement: Placement) -> jax.Array:
        """The (weighted) sum of each token's rows at its home rank."""

    def rows_for_receivers(self, values: jax.Array, handle: DispatchHandle, *,
                           placement: Placement) -> jax.Array:
        """[T, W] values where the handle's dispatch put its rows, zeros past the count."""

    def weights_to_sources(self, d_weights: jax.Array, received_idx: jax.Array,
                           handle: DispatchHandle, *, placement: Placement) -> jax.Array:
        """The received weights' cotangent back at the sources, [T, K]."""

    def low_latency_dispatch_send(self, x: jax.Array, topk_idx: jax.Array, *,
                                  num_experts: int, axis_name: str, wire: str,
                                  placement: Placement) -> Any:
        """The send half: what low_latency_dispatch_recv takes."""

    def low_latency_dispatch_recv(self, sent: Any, *, num_experts: int, axis_name: str,
                                  placement: Placement
                                  ) -> tuple[LowLatencyReceived, LowLatencyHandle]:
        """The receive half: the rows in per-expert slots, and the handle."""

    def low_latency_combine_send(self, y: jax.Array, handle: LowLatencyHandle, *,
                                 placement: Placement) -> jax.Array:
        """The send half: what low_latency_combine_recv takes."""

    def low_latency_combine_recv(self, parts: jax.Array, topk_weights: jax.Array,
                                 handle: LowLatencyHandle, *,
                                 placement: Placement) -> jax.Array:
        """The receive half: each token's weighted sum at its home rank."""
