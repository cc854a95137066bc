"""Decode with two micro-batches: low-latency dispatch/combine of one under the other's compute.

One MoE block per step (attention stand-in and router, low-latency dispatch, expert MLPs,
low-latency combine) on an EP group of CPU devices. `jax_ep.overlap.run` splits each rank's
tokens in two and interleaves the micro-batches so that every send/receive pair has the
other micro-batch's compute between its halves. The script checks the overlapped program
against the same steps run one micro-batch after the other (bit for bit) and against a
dense NumPy computation, prints the schedule and times both orders.

On CPU the two orders take about the same time: the CPU backend has no concurrent
communication to hide. The point on a GPU cluster is that the sends (jax_ep's CUDA kernels
or XLA's asynchronous collectives) proceed while the other micro-batch computes.

    python examples/decode_overlap.py [--ranks 8] [--tokens 64] [--profile DIR]
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import overlap


def decode_block(params, *, num_experts, top_k, backend):
    """The MoE block as stages over a carry dict (per shard, inside shard_map)."""
    w_attn, w_router, w_in, w_out = params

    def attention(c):  # any pre-MoE compute; here a residual dense layer and the router
        x = c["x"].astype(jnp.float32)
        h = x + jnp.tanh(x @ w_attn)
        weights, idx = jax.lax.top_k(jax.nn.softmax(h @ w_router), top_k)
        return {"h": h.astype(jnp.bfloat16), "idx": idx.astype(jnp.int32), "w": weights}

    def dispatch_send(c):
        pending = jax_ep.low_latency_dispatch_send(
            c["h"], c["idx"], num_experts=num_experts, backend=backend)
        return {**c, "pending": pending}

    def dispatch_recv(c):
        received, handle = jax_ep.low_latency_dispatch_recv(c.pop("pending"))
        return {**c, "rows": received.x, "handle": handle}

    def experts(c):  # rows [E_local, R*T, H] through each local expert's MLP
        rows = c.pop("rows").astype(jnp.float32)
        hidden = jax.nn.gelu(jnp.einsum("esh,ehf->esf", rows, w_in))
        return {**c, "y": jnp.einsum("esf,efh->esh", hidden, w_out).astype(jnp.bfloat16)}

    def combine_send(c):
        pending = jax_ep.low_latency_combine_send(
            c.pop("y"), c["idx"], c["w"], c.pop("handle"), backend=backend)
        return {**c, "pending": pending}

    def combine_recv(c):
        return c["h"] + jax_ep.low_latency_combine_recv(c["pending"])

    return [
        overlap.Compute("attention", attention),
        overlap.Comm("dispatch", dispatch_send, dispatch_recv),
        overlap.Compute("experts", experts),
        overlap.Comm("combine", combine_send, combine_recv),
    ]


def dense_reference(x, params, top_k):
    """float64 NumPy: every token through its top-k experts (bf16 roundings where the
    block has them)."""
    w_attn, w_router, w_in, w_out = (np.asarray(p, np.float64) for p in params)

    def bf16(a):
        return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)

    x = np.asarray(x, np.float64)
    h = x + np.tanh(x @ w_attn)
    logits = h @ w_router
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    idx = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, idx, 1)
    hb = bf16(h)
    out = np.zeros_like(h)
    for k in range(top_k):
        e = idx[:, k]
        z = np.einsum("th,thf->tf", hb, w_in[e])
        gelu = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
        out += weights[:, k:k + 1] * np.einsum("tf,tfh->th", gelu, w_out[e])
    return hb + out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8, help="EP ranks (CPU devices)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank (even)")
    parser.add_argument("--hidden", type=int, default=256, help="H, a multiple of 128")
    parser.add_argument("--experts", type=int, default=32, help="E")
    parser.add_argument("--top-k", type=int, default=4, help="K experts per token")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per order")
    parser.add_argument("--backend", default="auto", choices=("auto", "xla", "cuda"),
                        help="jax_ep backend")
    parser.add_argument("--profile", metavar="DIR", help="write a trace of the overlapped step")
    args = parser.parse_args()
    R, T, H, E, K = args.ranks, args.tokens, args.hidden, args.experts, args.top_k
    for wrong, message in (
        (not 0 < R <= len(jax.devices()), f"--ranks {R}: {len(jax.devices())} devices exist"),
        (T < 2 or T % 2, f"--tokens {T}: the two micro-batches need an even count"),
        (H < 128 or H % 128, f"--hidden {H}: FP8 dispatch needs a multiple of 128"),
        (E % R, f"--experts {E}: must be a multiple of --ranks {R}"),
        (not 0 < K <= E, f"--top-k {K}: must be between 1 and --experts {E}"),
    ):
        if wrong:
            parser.error(message + ".")
    if args.backend == "cuda":  # its kernels exchange through a buffer sized for the calls
        jax_ep.initialize(jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E,
                                              num_ranks=R, expert_major=True,
                                              low_latency_tokens=T))
    F = 2 * H
    mesh = jax.make_mesh((R,), ("ep",))
    keys = jax.random.split(jax.random.key(0), 5)
    params = (jax.random.normal(keys[0], (H, H)) * H**-0.5,
              jax.random.normal(keys[1], (H, E)),
              jax.random.normal(keys[2], (E, H, F)) * H**-0.5,
              jax.random.normal(keys[3], (E, F, H)) * F**-0.5)
    x = jax.random.normal(keys[4], (R * T, H)).astype(jnp.bfloat16)
    specs = (P(), P(), P("ep"), P("ep"))

    def step(order):
        def per_shard(x, *params):
            block = decode_block(params, num_experts=E, top_k=K, backend=args.backend)
            return overlap.run(block, {"x": x}, order=order)

        return jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("ep"), *specs),
                                     out_specs=P("ep")))

    placed = [jax.device_put(a, NamedSharding(mesh, s))
              for a, s in zip((x, *params), (P("ep"), *specs), strict=True)]
    block = decode_block(params, num_experts=E, top_k=K, backend=args.backend)
    print("overlapped program order ('|': a barrier):")
    print("  " + overlap.describe(overlap.schedule(block)))

    results, times = {}, {}
    for order in ("sequential", "overlap"):
        fn = step(order)
        results[order] = jax.block_until_ready(fn(*placed))
        samples = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            jax.block_until_ready(fn(*placed))
            samples.append(time.perf_counter() - start)
        times[order] = float(np.median(samples))
        print(f"{order:>10}: median {times[order] * 1e3:.2f} ms over {args.repeat} calls")

    same = np.array_equal(np.asarray(results["overlap"], np.float32),
                          np.asarray(results["sequential"], np.float32))
    print(f"overlapped == sequential bit for bit: {same}")
    reference = dense_reference(np.asarray(x, np.float32), params, K)
    error = np.abs(np.asarray(results["overlap"], np.float64) - reference).max()
    print(f"max |overlapped - dense float64 reference| = {error:.3g} (bfloat16 output)")
    if args.profile:
        trace = jax_ep.tools.profile.capture(step("overlap"), *placed, log_dir=args.profile)
        print(f"trace: {trace.path} ({trace.labelled} labelled events); summarize it with\n"
              f"  python -m jax_ep.tools.trace_report {trace.path}")
    if not same:
        parser.exit(1, f"{parser.prog}: error: the overlapped program differs from the "
                       "sequential one\n")


if __name__ == "__main__":
    main()
