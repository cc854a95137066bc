"""Expert parallelism across nodes: every GPU of every node in one EP group.

One process per GPU, all joined by `jax.distributed`, the processes of a node with
consecutive ids; `jax_ep.initialize()` bootstraps NVSHMEM through jax.distributed's key-value
store and allocates the symmetric buffer. GPUs of different nodes cannot load or store each
other's memory: initialize() sees from the processes' hosts that they span several nodes, and
the ranks reach the other nodes with puts, the normal dispatch crossing to each node once
(docs/cuda.md, "Across nodes", has the NVSHMEM settings for InfiniBand and RoCE). Two nodes
of 8 GPUs, on node n (0 or 1):

    for i in $(seq 0 7); do
      CUDA_VISIBLE_DEVICES=$i python examples/across_nodes.py \\
          --coordinator node0:12345 --num-processes 16 --process-id $((8 * n + i)) &
    done; wait

Each step dispatches every rank's tokens to their experts (expert-major), applies the experts
(a scale per expert stands in for the MLPs) and combines. The first step is checked bit for
bit against jax_ep.tools.reference, then the steps are timed. Without --coordinator the script runs
in one process on CPU devices (host peers: the same ops, buffer carving and flags), a
rehearsal on any machine, here as two nodes of 4:

    JAX_EP_PEER_ACCESS=put JAX_EP_RANKS_PER_NODE=4 python examples/across_nodes.py \\
        [--cpu-devices 8] [--tokens 64]
"""

import argparse
import os
import statistics
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Dispatch, experts and combine over every GPU of every node.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (jax.distributed); "
                        "without it, one process on CPU devices")
    parser.add_argument("--num-processes", type=int, default=1, help="processes in all")
    parser.add_argument("--process-id", type=int, default=0, help="this process")
    parser.add_argument("--cpu-devices", type=int, default=8,
                        help="ranks of the one-process run on CPU")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256, help="H")
    parser.add_argument("--top-k", type=int, default=4, help="K experts per token")
    parser.add_argument("--experts-per-rank", type=int, default=2, help="E / R")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    args = parser.parse_args()
    if args.coordinator is None and args.num_processes != 1:
        parser.error(f"--num-processes {args.num_processes} needs --coordinator HOST:PORT")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id {args.process_id} must lie in [0, --num-processes "
                     f"{args.num_processes})")
    for name in ("cpu_devices", "tokens", "hidden", "top_k", "experts_per_rank", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.coordinator is None:
        os.environ.setdefault("XLA_FLAGS",
                              f"--xla_force_host_platform_device_count={args.cpu_devices}")
    import jax

    if args.coordinator is not None:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep.tools import reference

    R, T, H, K = jax.device_count(), args.tokens, args.hidden, args.top_k
    E = R * args.experts_per_rank
    if K > E:
        raise SystemExit(f"across_nodes.py: error: --top-k {K} exceeds the {E} experts")
    jax_ep.initialize(jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E,
                                          num_ranks=R, expert_major=True))
    state = jax_ep.runtime.state()
    me = jax.process_index()
    say = print if me == 0 else (lambda *a, **k: None)
    nodes = (f", nodes of {state['ranks_per_node']} (node-aware dispatch)"
             if state["ranks_per_node"] else "")
    say(f"{R} ranks in {jax.process_count()} processes ({state['platform']}), peers reached "
        f"with {state['peer_access']}s{nodes}; T={T} H={H} K={K} E={E}")

    # The same inputs in every process; each process places the rows of its own devices.
    rng = np.random.default_rng(0)
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(R)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1  # masked choices
    w = rng.random((R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    scale = (1.0 + np.arange(E // R, dtype=np.float32) / 8)  # expert j's "MLP": a scale

    def experts(rows, local_expert):
        y = rows.astype(jnp.float32) * jnp.asarray(scale)[jnp.maximum(local_expert, 0)][..., None]
        return jnp.where(local_expert[..., None] >= 0, y, 0).astype(rows.dtype)

    def step(x, idx, w):
        recv, handle = jax_ep.dispatch(x[0], idx[0], w[0], num_experts=E, expert_major=True,
                                       backend="cuda")
        y = experts(recv.x, recv.topk_idx)
        return jax_ep.combine(y, handle, topk_weights=recv.topk_weights, backend="cuda")[None]

    mesh = jax.make_mesh((R,), ("ep",))
    sharding = NamedSharding(mesh, P("ep"))
    inputs = [jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i])
              for a in (x, idx, w)]
    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    recv = reference.dispatch(x, idx, w, num_experts=E, expert_major=True)
    want = reference.combine(np.asarray(experts(recv["x"], recv["topk_idx"])), idx,
                             weights=recv["topk_weights"], num_experts=E, expert_major=True)
    with jax.set_mesh(mesh):
        out = run(*inputs)
        same = all(np.asarray(s.data).tobytes() == want[s.index].tobytes()
                   for s in out.addressable_shards)
        print(f"process {me}: first step equals jax_ep.tools.reference bit for bit: {same}",
              flush=True)
        if not same:
            raise SystemExit(1)
        times = []
        for i in range(args.steps):
            start = time.perf_counter()
            jax.block_until_ready(run(*inputs))
            times.append(time.perf_counter() - start)
            if (i + 1) % max(1, args.steps // 4) == 0:
                say(f"step {i + 1}/{args.steps}: {1e3 * times[-1]:.2f} ms", flush=True)
    say(f"median step (dispatch, experts, combine): {1e3 * statistics.median(times):.2f} ms "
        f"over {args.steps} steps")
    jax_ep.finalize()


if __name__ == "__main__":
    main()
