"""Dispatch tokens to experts and combine them back, on 8 CPU devices (the README example)."""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ep

argparse.ArgumentParser(description=__doc__).parse_args()  # --help says what this runs
R, T, H, E, K = 8, 64, 256, 32, 4  # ranks, tokens per rank, hidden, experts, top-k
mesh = jax.make_mesh((R,), ("ep",))
experts = jax.random.normal(jax.random.key(0), (E, H, H)) / H**0.5  # expert e on rank e // 4


def moe(x, logits, w):  # per shard: x [T, H], logits [T, E], w [E/R, H, H]
    weights, idx = jax.lax.top_k(jax.nn.softmax(logits), K)
    recv, handle = jax_ep.dispatch(x, idx.astype(jnp.int32), weights, num_experts=E,
                                   expert_major=True)
    y = jax.lax.ragged_dot(recv.x, w, recv.group_sizes)  # each local expert on its rows
    return jax_ep.combine(y, handle, topk_weights=recv.topk_weights)


x = jax.random.normal(jax.random.key(1), (R * T, H))
logits = jax.random.normal(jax.random.key(2), (R * T, E))
step = jax.jit(jax.shard_map(moe, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
with jax.set_mesh(mesh):
    out = step(*(jax.device_put(a, jax.NamedSharding(mesh, P("ep"))) for a in (x, logits, experts)))
print(out.shape, out.dtype, float(jnp.abs(out).mean()))

# The same MoE computed densely: every token through its top-k experts.
weights, idx = jax.lax.top_k(jax.nn.softmax(logits), K)
dense = jnp.einsum("tk,tkh->th", weights, jnp.einsum("th,tkhg->tkg", x, experts[idx]))
print("max |expert-parallel - dense| =", float(jnp.abs(out - dense).max()))
