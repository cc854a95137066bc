"""The program of the multi-process test, shared by the worker and the single-process run."""

import ml_dtypes
import numpy as np
from harness import sharded

import jax_ep
from jax_ep.tools.bench.routings import make_routing

R, T, K, E, H = 8, 10, 4, 24, 128


def run(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    idx, w = make_routing(rng, num_ranks=R, num_tokens=T, top_k=K, num_experts=E, kind="masked")
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    y = rng.standard_normal((R, E // R, R * T, H)).astype(ml_dtypes.bfloat16)

    def per_shard(x, idx, w, y):
        layout = jax_ep.get_dispatch_layout(idx, num_experts=E)
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=True)
        out = jax_ep.combine(recv.x, handle, topk_weights=recv.topk_weights)
        ll, ll_handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E, use_fp8=True)
        ll = ll.with_zero_padding()
        ll_out = jax_ep.low_latency_combine(y, idx, w, ll_handle)
        return {
            "num_tokens_per_rank": layout.num_tokens_per_rank,
            "recv_x": recv.with_zero_padding().x,
            "group_sizes": recv.group_sizes,
            "combined": out,
            "ll_x": ll.x,
            "ll_scales": ll.scales,
            "ll_count": ll.count,
            "ll_combined": ll_out,
        }

    return sharded(per_shard, R)(x, idx, w, y)
