"""Prefill with two micro-batches: the Flax MoE layer with `overlap=True`.

`jax_ep.nn.MoE(..., overlap=True)` splits each device's tokens in two and writes the block
(route, dispatch, experts, combine) so that one micro-batch's dispatch or combine shares a
step with the other's compute (`jax_ep.overlap.run` with whole, unsplit communication).
The script runs the same layer with and without overlap on a (data x ep) mesh of CPU
devices, checks that outputs and statistics agree, prints the program order and times both.

On CPU the two take about the same time (nothing runs concurrently there); on GPUs, XLA's
asynchronous collectives (the xla backend) can run under the other micro-batch's compute.

    python examples/prefill_overlap.py [--data 2 --ep 4] [--tokens 512] [--profile DIR]
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from flax import nnx

import jax_ep
from jax_ep.nn import MoE, RouterConfig
from jax_ep.overlap import Comm, Compute, describe, schedule


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=int, default=2, help="data-parallel mesh axis size")
    parser.add_argument("--ep", type=int, default=4, help="expert-parallel mesh axis size")
    parser.add_argument("--tokens", type=int, default=512, help="tokens in the batch")
    parser.add_argument("--hidden", type=int, default=256, help="H")
    parser.add_argument("--experts", type=int, default=32, help="E")
    parser.add_argument("--top-k", type=int, default=4, help="K experts per token")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per variant")
    parser.add_argument("--backend", default="auto", choices=("auto", "xla", "cuda"),
                        help="jax_ep backend")
    parser.add_argument("--profile", metavar="DIR", help="write a trace of the overlapped layer")
    args = parser.parse_args()
    if args.data * args.ep > len(jax.devices()):
        parser.error(f"--data {args.data} x --ep {args.ep} needs more than the "
                     f"{len(jax.devices())} devices.")
    if args.tokens < 1 or args.tokens % (2 * args.data * args.ep):
        parser.error(f"--tokens {args.tokens}: each of the {args.data * args.ep} devices splits "
                     f"its tokens in two; pass a multiple of {2 * args.data * args.ep}.")
    if args.backend == "cuda":  # its kernels exchange through a buffer sized for the calls
        jax_ep.initialize(jax_ep.BufferConfig(
            num_tokens=args.tokens // (args.data * args.ep), hidden=-(-args.hidden // 128) * 128,
            top_k=args.top_k, num_experts=args.experts, num_ranks=args.ep, expert_major=True,
            low_latency_tokens=0))
    mesh = jax.make_mesh((args.data, args.ep), ("data", "ep"))
    try:
        config = RouterConfig(num_experts=args.experts, top_k=args.top_k, score="sigmoid",
                              num_groups=4, top_groups=2)
    except ValueError as error:
        parser.error(str(error))
    x = jax.random.normal(jax.random.key(1), (args.tokens, args.hidden))

    outputs, times = {}, {}
    for overlap in (False, True):
        try:
            layer = MoE(args.hidden, 2 * args.hidden, config, mesh=mesh, num_shared_experts=1,
                        overlap=overlap, backend=args.backend, rngs=nnx.Rngs(0))
        except ValueError as error:  # sizes the layer rejects
            parser.error(str(error))
        forward = nnx.jit(lambda layer, x: layer(x))
        with jax.set_mesh(mesh):
            outputs[overlap] = jax.block_until_ready(forward(layer, x))
            samples = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                jax.block_until_ready(forward(layer, x))
                samples.append(time.perf_counter() - start)
            if overlap and args.profile:
                graph, state = nnx.split(layer)
                step = jax.jit(lambda state, x: nnx.merge(graph, state)(x)[0])  # noqa: B023
                trace = jax_ep.tools.profile.capture(step, state, x, log_dir=args.profile)
        times[overlap] = float(np.median(samples))
        name = "overlap" if overlap else "one batch"
        print(f"{name:>9}: median {times[overlap] * 1e3:.2f} ms over {args.repeat} calls")

    stages = [Compute("route", None), Comm("dispatch", None), Compute("experts", None),
              Comm("combine", None)]  # the layer's block, for its program order
    print("program order ('|': a barrier; no barrier between a communication and the other "
          "micro-batch's compute):\n  " + describe(schedule(stages)))
    (y0, stats0), (y1, stats1) = outputs[False], outputs[True]
    difference = float(np.abs(np.asarray(y0) - np.asarray(y1)).max())
    same_stats = (np.array_equal(stats0.load, stats1.load)
                  and int(stats0.dropped) == int(stats1.dropped))
    print(f"max |overlap - one batch| = {difference:.3g}; same expert load and drops: "
          f"{same_stats}")
    if args.profile:
        print(f"trace: {trace.path}; summarize it with\n"
              f"  python -m jax_ep.tools.trace_report {trace.path}")
    if difference > 1e-5 or not same_stats:
        parser.exit(1, f"{parser.prog}: error: the overlapped layer differs from the "
                       "one-batch layer\n")


if __name__ == "__main__":
    main()
