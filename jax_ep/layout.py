"""get_dispatch_layout: where this rank's tokens go (purely local, no communication)."""

from __future__ import annotations

import jax

from jax_ep import _checks, backends
from jax_ep._scopes import scoped
from jax_ep.structs import DispatchLayout


@scoped("jax_ep.get_dispatch_layout")
def get_dispatch_layout(
    topk_idx: jax.Array, *, num_experts: int, axis_name: str = "ep", backend: str = "auto"
) -> DispatchLayout:
    """Counts tokens per rank and per expert (per shard, inside shard_map).

    Args:
      topk_idx: int32 [T, K] expert ids in [0, E); -1 masks a choice. Ids outside
        [-1, E) are ignored and counted in `num_invalid`.
      num_experts: E, a multiple of the size R of mesh axis `axis_name`.
      axis_name: the mesh axis of the expert-parallel group.
      backend: "auto", "xla" or "cuda".

    Returns:
      DispatchLayout: num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E],
      is_token_in_rank bool [T, R], num_invalid int32 [].
    """
    op = "jax_ep.get_dispatch_layout"
    num_ranks = _checks.axis_size(op, axis_name)
    _, top_k = _checks.check_topk_idx(op, topk_idx)
    _checks.check_num_experts(op, num_experts, num_ranks, axis_name)
    _checks.check_top_k(op, top_k, num_experts)
    return backends.get(backend).get_dispatch_layout(topk_idx, num_experts=num_experts,
                                                     num_ranks=num_ranks)
