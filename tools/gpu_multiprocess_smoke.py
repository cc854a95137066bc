"""Smoke test of the exchange between GPUs through real NVSHMEM: N processes on one GPU.

Run: python tools/gpu_multiprocess_smoke.py --processes 2 [--peer-access put]
    [--ranks-per-node N]
Each process joins jax.distributed (127.0.0.1), calls jax_ep.initialize() (with
$JAX_EP_PEER_ACCESS set to --peer-access: `put` reaches the peers with NVSHMEM's puts, as
between nodes, which NVSHMEM's P2P transport serves on one GPU too; --ranks-per-node sets
$JAX_EP_RANKS_PER_NODE, node-aware: stores within each simulated node), runs dispatch and
combine (both layouts) and the low-latency round trip with backend="cuda" inside shard_map
over the N processes, and compares its shard with jax_ep.reference bit for bit. Several
processes on one GPU run NVSHMEM's "limited MPG" mode: functional only (no NVLink, slow
time-sliced waits); timings mean nothing here.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

T, K, E, H, TL = 12, 3, 8, 256, 4


def worker(rank: int, num_processes: int, port: int) -> None:
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, rank)
    import ml_dtypes
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep import reference

    R = num_processes
    jax_ep.initialize(jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E,
                                          num_ranks=R, expert_major=True,
                                          low_latency_tokens=TL))
    rng = np.random.default_rng(1234)  # the same inputs in every process
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(R)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    w = rng.random((R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    mesh = jax.make_mesh((R,), ("ep",))
    sharding = NamedSharding(mesh, P("ep"))

    def put(a):
        return jax.make_array_from_process_local_data(sharding, a[rank:rank + 1])

    def run(per_shard, *arrays):
        fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        with jax.set_mesh(mesh):
            out = fn(*(put(a) for a in arrays))
        return np.asarray(out.addressable_shards[0].data)

    for em in (False, True):
        def normal(x, idx, w, em=em):
            recv, handle = jax_ep.dispatch(x[0], idx[0], w[0], num_experts=E, expert_major=em,
                                           backend="cuda")
            weights = recv.topk_weights if em else None
            return jax_ep.combine(recv.x, handle, topk_weights=weights, backend="cuda")[None]

        got = run(normal, x, idx, w)
        kw = dict(num_experts=E, expert_major=em)
        recv = reference.dispatch(x, idx, w, **kw)
        want = reference.combine(recv["x"], idx, weights=recv["topk_weights"] if em else None,
                                 **kw)[rank:rank + 1]
        assert got.tobytes() == want.tobytes(), f"combine(dispatch) differs (expert_major={em})"

    ll_x, ll_idx, ll_w = x[:, :TL], idx[:, :TL], w[:, :TL]

    def low_latency(x, idx, w):
        recv, handle = jax_ep.low_latency_dispatch(x[0], idx[0], num_experts=E,
                                                   backend="cuda")
        return jax_ep.low_latency_combine(recv.x, idx[0], w[0], handle, backend="cuda")[None]

    got = run(low_latency, ll_x, ll_idx, ll_w)
    ll = reference.low_latency_dispatch(ll_x, ll_idx, num_experts=E)
    want = reference.low_latency_combine(ll["x"], ll_idx, ll_w, num_experts=E)[rank:rank + 1]
    assert got.tobytes() == want.tobytes(), "low-latency round trip differs"
    state = jax_ep.runtime.state()
    access = state["peer_access"] + (f", nodes of {state['ranks_per_node']}"
                                     if state["ranks_per_node"] else "")
    jax_ep.finalize()
    print(f"process {rank}/{R} ({access}): ok", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--peer-access", choices=("store", "put"), default="store",
                        help="how the ranks reach each other's buffers ($JAX_EP_PEER_ACCESS)")
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="simulated nodes of this many ranks ($JAX_EP_RANKS_PER_NODE; "
                        "needs --peer-access put)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks_per_node and args.peer_access != "put":
        parser.error("--ranks-per-node needs --peer-access put (the nodes reach each other "
                     "with puts)")
    if args.worker is not None:
        worker(args.worker, args.processes, args.port)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", NVSHMEM_DISABLE_NCCL="1",
               XLA_PYTHON_CLIENT_MEM_FRACTION="0.1", JAX_EP_PEER_ACCESS=args.peer_access)
    if args.ranks_per_node:
        env["JAX_EP_RANKS_PER_NODE"] = str(args.ranks_per_node)
    procs = [subprocess.Popen([sys.executable, __file__, "--processes", str(args.processes),
                               "--worker", str(i), "--port", str(port)], env=env)
             for i in range(args.processes)]
    status = 0
    for i, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"smoke: no result within {args.timeout} s; killing the processes")
            for p in procs:
                p.kill()
            return 1
        if code:
            how = f"signal {-code}" if code < 0 else f"exit {code}"
            print(f"process {i}: {how}", flush=True)
        status |= code != 0
    nodes = f", nodes of {args.ranks_per_node}" if args.ranks_per_node else ""
    print(f"smoke with {args.processes} processes ({args.peer_access}{nodes}): "
          f"{'ok' if status == 0 else 'FAILED'}")
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
