"""The quickstart's MoE step with its tokens dispatched in a wire format (jax_ep.quant), on 8
CPU devices: the experts see the dequantized rows; the error against the step in bfloat16."""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import quant

parser = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--format", default="mxfp8", choices=quant.FORMATS, help="wire format")
parser.add_argument("--tokens", type=int, default=64, help="tokens per rank")
args = parser.parse_args()

R, T, H, E, K = 8, args.tokens, 256, 32, 4  # ranks, tokens per rank, hidden, experts, top-k
mesh = jax.make_mesh((R,), ("ep",))
experts = jax.random.normal(jax.random.key(0), (E, H, H)) / H**0.5  # expert e on rank e // 4


def moe(x, logits, w, wire):  # per shard: x [T, H], logits [T, E], w [E/R, H, H]
    weights, idx = jax.lax.top_k(jax.nn.softmax(logits), K)
    tokens = quant.quantize(x, wire) if wire else x.astype(jnp.bfloat16)
    recv, handle = jax_ep.dispatch(tokens, idx.astype(jnp.int32), weights, num_experts=E,
                                   expert_major=True)
    rows = quant.dequantize(recv.x) if wire else recv.x.astype(jnp.float32)
    y = jax.lax.ragged_dot(rows, w, recv.group_sizes)  # each local expert on its rows
    return jax_ep.combine(y, handle, topk_weights=recv.topk_weights)


x = jax.random.normal(jax.random.key(1), (R * T, H))
logits = jax.random.normal(jax.random.key(2), (R * T, E))
inputs = [jax.device_put(a, jax.NamedSharding(mesh, P("ep"))) for a in (x, logits, experts)]
outs = {}
with jax.set_mesh(mesh):
    for wire in (None, args.format):
        step = jax.jit(jax.shard_map(lambda x, g, w, wire=wire: moe(x, g, w, wire), mesh=mesh,
                                     in_specs=P("ep"), out_specs=P("ep")))
        outs[wire or "bfloat16"] = step(*inputs)

q = quant.quantize(x, args.format)
wire_bytes = sum(a.nbytes for a in jax.tree.leaves(q)) / T / R
error = jnp.linalg.norm(outs[args.format] - outs["bfloat16"]) / jnp.linalg.norm(outs["bfloat16"])
print(f"{args.format}: {wire_bytes:.0f} bytes per token row (bfloat16: {2 * H}); "
      f"relative error of the MoE output against bfloat16 dispatch = {float(error):.4f}")
