"""Smoke test of the exchange between GPUs through real NVSHMEM: N processes on one GPU.

Run: python tools/gpu_multiprocess_smoke.py --processes 2 [--peer-access put]
    [--ranks-per-node N] [--data D] [--channels C,CHUNK,CHUNKS]
     python tools/gpu_multiprocess_smoke.py --local [--data D]
Each process joins jax.distributed (127.0.0.1), calls jax_ep.initialize() (with
$JAX_EP_PEER_ACCESS set to --peer-access: `put` reaches the peers with NVSHMEM's puts, as
between nodes, which NVSHMEM's P2P transport serves on one GPU too; --ranks-per-node sets
$JAX_EP_RANKS_PER_NODE, node-aware: stores within each simulated node; --channels sets
$JAX_EP_CHANNELS: the rings the rank-major dispatch and combine stream through, or off), runs
dispatch and combine (both layouts), dispatch and combine on every wire format (the send
quantizes and the unpack dequantizes; the combine's stages cast and its sums dequantize) and the
low-latency round trip with backend="cuda" inside
shard_map over a (data D, ep N/D) mesh of the N processes (D = 1: the EP axis alone; D > 1: D
EP groups, each with its own inputs), and compares its shard with jax_ep.tools.reference of its
group bit for bit. Several processes on one GPU run NVSHMEM's "limited MPG" mode: functional
only (no NVLink, slow time-sliced waits); timings mean nothing here. With --local the same
check runs in this one process over every device it sees: several GPUs through CUDA peer
access (cuda/local_exchange.cu; skipped with fewer than 2), or CPU devices through host peers
(XLA_FLAGS=--xla_force_host_platform_device_count=8, a rehearsal that CI runs).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

T, K, E, H, TL = 12, 3, 8, 256, 4


def check(data: int) -> str:
    """Every exchange on a (data, ep) mesh of every device, each shard this process holds
    against jax_ep.tools.reference of its EP group, bit for bit; returns how the ranks met."""
    import jax
    import ml_dtypes
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep.tools import reference

    D, R = data, jax.device_count() // data  # data groups, EP ranks per group
    jax_ep.initialize(jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E,
                                          num_ranks=R, expert_major=True,
                                          low_latency_tokens=TL))
    rng = np.random.default_rng(1234)  # the same inputs in every process
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(D * R)]).astype(np.int32).reshape(D, R, T, K)
    idx[rng.random(idx.shape) < 0.2] = -1
    w = rng.random((D, R, T, K)).astype(np.float32)
    x = rng.standard_normal((D, R, T, H)).astype(ml_dtypes.bfloat16)
    mesh = jax.make_mesh((D, R), ("data", "ep"))
    spec = P("data", "ep")
    sharding = NamedSharding(mesh, spec)

    def place(device):  # (group, rank) of a device
        return tuple(int(i[0]) for i in np.nonzero(mesh.devices == device))

    def run(per_shard, *arrays):
        """{(group, rank): result} for the shards of this process."""
        def body(*args):
            return per_shard(*(a[0] for a in args))[None]

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        placed = [jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i])
                  for a in arrays]
        with jax.set_mesh(mesh):
            out = fn(*placed)
        return {place(s.device): np.asarray(s.data)[0, 0] for s in out.addressable_shards}

    def compare(got, want, what):
        for (d, r), shard in got.items():
            assert shard.tobytes() == want(d)[r].tobytes(), f"{what} differs (group {d}, rank {r})"

    for em in (False, True):
        def normal(x, idx, w, em=em):
            recv, handle = jax_ep.dispatch(x[0], idx[0], w[0], num_experts=E, expert_major=em,
                                           backend="cuda")
            weights = recv.topk_weights if em else None
            return jax_ep.combine(recv.x, handle, topk_weights=weights, backend="cuda")[None]

        def want(d, em=em):
            kw = dict(num_experts=E, expert_major=em)
            recv = reference.dispatch(x[d], idx[d], w[d], **kw)
            return reference.combine(recv["x"], idx[d],
                                     weights=recv["topk_weights"] if em else None, **kw)

        compare(run(normal, x, idx, w), want, f"combine(dispatch) (expert_major={em})")

    # The send quantizes the bfloat16 rows and the unpack dequantizes them (wire_format).
    for f in jax_ep.quant.FORMATS:
        def on_wire(x, idx, w, f=f):
            recv, _ = jax_ep.dispatch(x[0], idx[0], w[0], num_experts=E, wire_format=f,
                                      backend="cuda")
            return recv.with_zero_padding().x[None]

        def wire_want(d, f=f):
            rounded = jax_ep.quant.dequantize(jax_ep.quant.quantize(x[d], f), x.dtype)
            return reference.dispatch(np.asarray(rounded), idx[d], w[d], num_experts=E)["x"]

        compare(run(on_wire, x, idx, w), wire_want, f"dispatch on the {f} wire")

    # The combine's stages cast each rank's float32 rows and its sums dequantize them
    # (wire_format), expert-major for the formats of even index, rank-major for the others.
    for i, f in enumerate(jax_ep.quant.FORMATS):
        em = i % 2 == 0

        def combine_on_wire(x, idx, w, f=f, em=em):
            recv, handle = jax_ep.dispatch(x[0], idx[0], w[0], num_experts=E, expert_major=em,
                                           backend="cuda")
            weights = recv.topk_weights if em else None
            return jax_ep.combine(recv.x, handle, topk_weights=weights, wire_format=f,
                                  backend="cuda")[None]

        def combine_want(d, f=f, em=em):
            kw = dict(num_experts=E, expert_major=em)
            recv = reference.dispatch(x[d], idx[d], w[d], **kw)

            def rounding(rows):  # what travelling as f does to the float32 rows
                return np.asarray(jax_ep.quant.dequantize(jax_ep.quant.quantize(rows, f)))

            return reference.combine(recv["x"], idx[d], weights=recv["topk_weights"] if em
                                     else None, wire=rounding, **kw)

        compare(run(combine_on_wire, x, idx, w), combine_want,
                f"combine on the {f} wire (expert_major={em})")

    ll_x, ll_idx, ll_w = x[:, :, :TL], idx[:, :, :TL], w[:, :, :TL]

    def low_latency(x, idx, w):
        recv, handle = jax_ep.low_latency_dispatch(x[0], idx[0], num_experts=E,
                                                   backend="cuda")
        return jax_ep.low_latency_combine(recv.x, idx[0], w[0], handle, backend="cuda")[None]

    def ll_want(d):
        ll = reference.low_latency_dispatch(ll_x[d], ll_idx[d], num_experts=E)
        return reference.low_latency_combine(ll["x"], ll_idx[d], ll_w[d], num_experts=E)

    compare(run(low_latency, ll_x, ll_idx, ll_w), ll_want, "low-latency round trip")
    state = jax_ep.runtime.state()
    refused_in = check_refusal(run, x, idx, w)
    # The group works again after a new initialization.
    jax_ep.initialize(jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E,
                                          num_ranks=R, low_latency_tokens=TL))
    compare(run(low_latency, ll_x, ll_idx, ll_w), ll_want,
            "low-latency round trip after a refused send")
    jax_ep.finalize()
    groups = f", {D} EP groups" if D > 1 else ""
    nodes = f", nodes of {state['ranks_per_node']}" if state["ranks_per_node"] else ""
    return (f"{state['platform']}, {state['peer_access']}{nodes}{groups}; a refused send "
            f"reported in {refused_in:.2f} s")


def check_refusal(run, x, idx, w) -> float:
    """Two low-latency dispatches sent on buffer 0 before a receive, then a dispatch and
    combine: the second send's first launch refuses it on every rank (status 5), the kernels
    after it give up at once, and a later call reports it, naming the fix, well within the op
    timeout (no rank waits for another). Finalizes; returns the seconds to the report."""
    import time

    import jax

    import jax_ep

    def sends_then_normal(x, idx, w):
        for _ in range(2):
            jax_ep.low_latency_dispatch_send(x[0][:TL], idx[0][:TL], num_experts=E,
                                             backend="cuda", buffer=0)
        recv, handle = jax_ep.dispatch(x[0], idx[0], w[0], num_experts=E, backend="cuda")
        return jax_ep.combine(recv.x, handle, backend="cuda")[None]

    start = time.monotonic()
    error = ""
    for _ in range(2):  # a GPU reports it in the first call whose handler runs after it
        try:
            jax.block_until_ready(run(sends_then_normal, x, idx, w))
        except Exception as e:  # noqa: BLE001 (the refusal, whatever XLA wraps it in)
            error = str(e)
            break
    took = time.monotonic() - start
    assert "low-latency buffer 0 still holds" in error, f"the refusal is reported: {error!r}"
    jax_ep.finalize()
    return took


def worker(rank: int, num_processes: int, port: int, data: int) -> None:
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, rank)
    print(f"process {rank}/{num_processes} ({check(data)}): ok", flush=True)


def local(data: int) -> int:
    """The check in this process, over every device it sees."""
    import jax

    devices = jax.devices()
    if len(devices) < 2 or len(devices) % data:
        print(f"smoke --local: skipped: {len(devices)} {devices[0].platform} device(s) here; "
              f"it needs 2 or more, a multiple of --data {data}")
        return 0
    print(f"smoke in one process with {len(devices)} devices ({check(data)}): ok")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--peer-access", choices=("store", "put"), default="store",
                        help="how the ranks reach each other's buffers ($JAX_EP_PEER_ACCESS)")
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="simulated nodes of this many ranks ($JAX_EP_RANKS_PER_NODE; "
                        "needs --peer-access put)")
    parser.add_argument("--data", type=int, default=1,
                        help="data groups: a (data D, ep N/D) mesh, D EP groups (default 1)")
    parser.add_argument("--channels", default="",
                        help="rings C,CHUNK,CHUNKS ($JAX_EP_CHANNELS): the rank-major dispatch "
                        "and combine streamed through them, or off: in phases (default: the "
                        "buffer's, runtime.Channels())")
    parser.add_argument("--local", action="store_true",
                        help="one process with every device it sees instead (several GPUs: "
                        "CUDA peer access; CPU devices: host peers)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks_per_node and args.peer_access != "put":
        parser.error("--ranks-per-node needs --peer-access put (the nodes reach each other "
                     "with puts)")
    if args.data < 1 or (not args.local and args.processes % args.data):
        parser.error(f"--data {args.data} must divide --processes {args.processes}")
    if args.local:
        return local(args.data)
    if args.worker is not None:
        worker(args.worker, args.processes, args.port, args.data)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", NVSHMEM_DISABLE_NCCL="1",
               XLA_PYTHON_CLIENT_MEM_FRACTION="0.1", JAX_EP_PEER_ACCESS=args.peer_access)
    if args.ranks_per_node:
        env["JAX_EP_RANKS_PER_NODE"] = str(args.ranks_per_node)
    env.pop("JAX_EP_CHANNELS", None)
    if args.channels:
        env["JAX_EP_CHANNELS"] = args.channels
    procs = [subprocess.Popen([sys.executable, __file__, "--processes", str(args.processes),
                               "--data", str(args.data), "--worker", str(i), "--port",
                               str(port)], env=env)
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
    groups = f", {args.data} EP groups" if args.data > 1 else ""
    rings = f", rings {args.channels}" if args.channels else ""
    print(f"smoke with {args.processes} processes ({args.peer_access}{nodes}{groups}{rings}): "
          f"{'ok' if status == 0 else 'FAILED'}")
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
