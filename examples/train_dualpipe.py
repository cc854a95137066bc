"""Train a small MoE model with pipeline (DualPipe) x expert parallelism on CPU devices.

A mesh of ("pp", "ep") devices. Each pipeline stage is a residual MoE block whose experts
are spread over the "ep" axis (jax_ep.dispatch / combine inside the stage); the stages run
under a `jax_ep.pipeline` schedule on the "pp" axis. DualPipe's overlapped forward+backward
ops use a hook that issues the forward chunk's dispatch, runs the other chunk's backward,
and only then the forward's experts and combine: on a GPU cluster the dispatch travels while
the backward computes. The task: fit a fixed random teacher network (regression).

The first step is checked against the same model run stage after stage without a pipeline
(losses equal bit for bit); then the loss is printed as training goes.

    python examples/train_dualpipe.py [--schedule dualpipe] [--pp 2 --ep 4] [--steps 60]
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import pipeline


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--schedule", default="dualpipe", choices=sorted(pipeline.SCHEDULES),
                   help="pipeline schedule")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    p.add_argument("--ep", type=int, default=4, help="expert-parallel ranks")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--tokens", type=int, default=64, help="tokens per micro-batch")
    p.add_argument("--hidden", type=int, default=32, help="model width")
    p.add_argument("--experts", type=int, default=8, help="E")
    p.add_argument("--top-k", type=int, default=2, help="K experts per token")
    p.add_argument("--steps", type=int, default=60, help="training steps")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    return p


def main():
    parser = make_parser()
    args = parser.parse_args()
    H, E, K, F = args.hidden, args.experts, args.top_k, 2 * args.hidden
    for wrong, message in (
        (args.pp * args.ep > len(jax.devices()),
         f"--pp {args.pp} x --ep {args.ep} needs more than the {len(jax.devices())} devices"),
        (E % args.ep, f"--experts {E}: must be a multiple of --ep {args.ep}"),
        (args.tokens % args.ep, f"--tokens {args.tokens}: must be a multiple of --ep {args.ep}"),
        (not 0 < K <= E, f"--top-k {K}: must be between 1 and --experts {E}"),
        (args.steps < 1 or args.log_every < 1, "--steps and --log-every must be at least 1"),
    ):
        if wrong:
            parser.error(message + ".")
    try:
        schedule = pipeline.make_schedule(args.schedule, args.pp, args.micro_batches)
    except ValueError as error:
        parser.error(str(error))
    S, M = schedule.num_stages, schedule.num_micro_batches
    mesh = jax.make_mesh((args.pp, args.ep), ("pp", "ep"))

    def stage_head(p, x):
        """Route and dispatch (the part whose communication the hook hides)."""
        weights, idx = jax.lax.top_k(jax.nn.softmax(x @ p["router"]), K)
        received, handle = jax_ep.dispatch(x, idx.astype(jnp.int32), weights, num_experts=E,
                                           axis_name="ep", expert_major=True, backend="xla")
        return x, received, handle

    def stage_tail(p, x, received, handle):
        """The local experts on their rows, combine, residual."""
        h = jax.nn.gelu(jax.lax.ragged_dot(received.x, p["w_in"], received.group_sizes))
        y = jax.lax.ragged_dot(h, p["w_out"], received.group_sizes)
        out = jax_ep.combine(y, handle, topk_weights=received.topk_weights, backend="xla")
        return x + out

    def stage(p, x):
        return stage_tail(p, *stage_head(p, x))

    def overlapped(params_f, x_f, params_b, x_b, dy_b):
        head = stage_head(params_f, x_f)                      # F's dispatch is issued
        head, x_b, dy_b = jax.lax.optimization_barrier((head, x_b, dy_b))
        _, vjp = jax.vjp(stage, params_b, x_b)                 # B computes meanwhile
        d_params, d_x = vjp(dy_b)
        head, d_x, d_params = jax.lax.optimization_barrier((head, d_x, d_params))
        return stage_tail(params_f, *head), d_x, d_params     # then F's experts, combine

    def loss(y, target):  # this EP shard's tokens
        return jnp.mean((y - target) ** 2)

    keys = jax.random.split(jax.random.key(0), 6)
    stage_params = {  # [S, ...]; the experts of a stage are sharded over "ep"
        "router": jax.random.normal(keys[0], (S, H, E)) * H**-0.5,
        "w_in": jax.random.normal(keys[1], (S, E, H, F)) * H**-0.5,
        "w_out": jax.random.normal(keys[2], (S, E, F, H)) * F**-0.5 * 0.1,
    }
    specs = {"router": P("pp"), "w_in": P("pp", None, "ep"), "w_out": P("pp", None, "ep")}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
              for k, v in pipeline.place_stages(schedule, stage_params).items()}
    teacher = (jax.random.normal(keys[3], (H, 4 * H)) * H**-0.5,
               jax.random.normal(keys[4], (4 * H, H)) * (4 * H) ** -0.5)

    def batch(step):
        x = jax.random.normal(jax.random.fold_in(keys[5], step), (M, args.tokens, H))
        return x, jnp.sin(jax.nn.relu(x @ teacher[0]) @ teacher[1]) + x

    data = NamedSharding(mesh, P(None, "ep"))  # micro-batch tokens split over EP

    def per_device(params, x, t):
        step = pipeline.pipeline_step(stage, loss, schedule, overlapped=overlapped)
        losses, grads = step(params, x, t)
        # Each EP shard's loss covers its tokens: the loss is the mean over shards. Expert
        # gradients already sum every shard's contribution (through combine's and
        # dispatch's VJPs); the replicated router's come from local tokens only.
        n = jax.lax.axis_size("ep")
        grads = {"router": jax.lax.psum(grads["router"], "ep") / n,
                 "w_in": grads["w_in"] / n, "w_out": grads["w_out"] / n}
        return jax.lax.psum(losses, "ep") / n, grads

    train_grads = jax.jit(jax.shard_map(
        per_device, mesh=mesh, in_specs=(specs, P(None, "ep"), P(None, "ep")),
        out_specs=(P(), specs)))

    def sequential(params, x, t):  # the same model without a pipeline, per EP shard
        def one(xm, tm):
            h = xm
            for s in range(S):
                h = stage(jax.tree.map(lambda a, s=s: a[s], params), h)
            return loss(h, tm)

        losses = jnp.stack([one(x[m], t[m]) for m in range(M)])
        return jax.lax.psum(losses, "ep") / jax.lax.axis_size("ep")

    seq_specs = {"router": P(), "w_in": P(None, "ep"), "w_out": P(None, "ep")}
    reference = jax.jit(jax.shard_map(sequential, mesh=mesh, in_specs=(
        seq_specs, P(None, "ep"), P(None, "ep")), out_specs=P()))

    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)

    @jax.jit
    def update(params, grads, opt_state):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    print(f"{args.schedule}: {args.pp} pipeline ranks x {args.ep} EP ranks, {S} stages, "
          f"{M} micro-batches of {args.tokens} tokens, {E} experts top-{K}, hidden {H}; "
          f"{pipeline.tick_table(schedule).num_ticks} ticks per step")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, t = (jax.device_put(a, data) for a in batch(step))
        losses, grads = train_grads(params, x, t)
        if step == 1:
            want = reference(jax.device_put(stage_params, {
                k: NamedSharding(mesh, v) for k, v in seq_specs.items()}), x, t)
            same = np.array_equal(np.asarray(losses), np.asarray(want))
            print(f"step 1: pipeline losses == sequential model losses bit for bit: {same}")
            if not same:
                parser.exit(1, f"{parser.prog}: error: the pipeline differs from the "
                               "sequential model\n")
        params, opt_state = update(params, grads, opt_state)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            print(f"step {step:4d}  loss {float(jnp.mean(losses)):.4f}  "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
