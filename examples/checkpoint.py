"""Save a training run of `jax_ep.nn.MoE` with Orbax, and go on from it in a fresh process on
a different data-parallel size.

The layer is DeepSeek-V3's MoE block (`jax_ep.nn.configs.deepseek_v3()`: 256 experts, top-8
of 4 groups out of 8, sigmoid scores, one shared expert; widths scaled down for CPU) learning
a fixed random function. The checkpoint holds the layer's state (parameters and balancing
bias) and the optimizer's; restoring places each array as the new mesh wants it (experts
over "ep", from the parameters' sharding metadata), so the loss goes on where it stopped.

    pip install "jax-ep[checkpoint]"     # Orbax
    python examples/checkpoint.py save --dir /tmp/moe_ckpt --data 2 --ep 4 --steps 30
    python examples/checkpoint.py restore --dir /tmp/moe_ckpt --data 1 --ep 4 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ep.nn import configs  # noqa: E402

CONFIG = configs.deepseek_v3()
TOKENS = 256  # per step, over all devices


def batch(step: int) -> tuple[jax.Array, jax.Array]:
    """Step `step`'s inputs and targets: the same on every mesh."""
    H = CONFIG.hidden
    a, b = jax.random.normal(jax.random.key(0), (2, H, H)) / H**0.5
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), step), (TOKENS, H))
    return x, jnp.sin(x @ a) @ b


def build(mesh: jax.sharding.Mesh):
    model = CONFIG.layer(mesh=mesh, rngs=nnx.Rngs(0), bias_rate=1e-3)
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


def loss_fn(model, x, y):
    out, stats = model(x)
    return jnp.mean((out - y) ** 2), stats


@nnx.jit
def train_step(model, optimizer, x, y):
    (loss, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, y)
    optimizer.update(model, grads)
    model.update_bias(stats.load)
    return loss


def train(model, optimizer, mesh, first: int, steps: int) -> float:
    tokens = jax.NamedSharding(mesh, P(mesh.axis_names))
    for step in range(first, first + steps):
        x, y = (jax.device_put(a, tokens) for a in batch(step))
        loss = float(train_step(model, optimizer, x, y))
        if step == first or (step + 1) % 10 == 0 or step == first + steps - 1:
            print(f"step {step:4d}  loss {loss:.6f}", flush=True)
    return loss


def checkpoint_paths(folder: str) -> tuple[str, str]:
    folder = os.path.abspath(folder)
    return os.path.join(folder, "state"), os.path.join(folder, "progress.json")


class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The description as written, and every option's default."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    parser.add_argument("action", choices=("save", "restore"),
                        help="save: train from scratch and save; restore: load and go on")
    parser.add_argument("--dir", required=True, help="the checkpoint folder")
    parser.add_argument("--data", type=int, default=2, help="data-parallel size")
    parser.add_argument("--ep", type=int, default=4, help="expert-parallel size")
    parser.add_argument("--steps", type=int, default=30, help="training steps to run")
    args = parser.parse_args(argv)
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        parser.error('needs Orbax: pip install "jax-ep[checkpoint]"')
    devices = args.data * args.ep
    if devices > len(jax.devices()) or TOKENS % devices:
        parser.error(f"--data {args.data} x --ep {args.ep} needs {devices} devices dividing "
                     f"{TOKENS} tokens; {len(jax.devices())} are available.")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1; got {args.steps}.")
    mesh = jax.make_mesh((args.data, args.ep), ("data", "ep"),
                         devices=jax.devices()[:devices])
    state_path, progress_path = checkpoint_paths(args.dir)
    if args.action == "save" and os.path.exists(state_path):
        parser.error(f"--dir {args.dir} already holds a checkpoint; pick a new folder.")
    checkpointer = ocp.StandardCheckpointer()
    print(f"mesh data {args.data} x ep {args.ep}; {CONFIG.router.num_experts} experts, "
          f"{CONFIG.router.num_experts // args.ep} per device", flush=True)

    with jax.set_mesh(mesh):
        if args.action == "save":
            model, optimizer = build(mesh)
            train(model, optimizer, mesh, 0, args.steps)
            # The loss the next step will report, for the restored run to compare with.
            x, y = batch(args.steps)
            next_loss = float(nnx.jit(loss_fn)(model, x, y)[0])
            checkpointer.save(state_path, nnx.state((model, optimizer)))
            checkpointer.wait_until_finished()
            with open(progress_path, "w") as f:
                json.dump({"step": args.steps, "next_loss": next_loss}, f)
            print(f"saved step {args.steps} to {state_path}; next loss {next_loss:.6f}")
            return 0

        if not os.path.exists(progress_path):
            parser.error(f"--dir {args.dir} holds no checkpoint; run `save` first.")
        with open(progress_path) as f:
            progress = json.load(f)
        # The model built abstractly on this mesh: shapes, dtypes and, from the parameters'
        # sharding metadata, where each array goes. Orbax reads each shard into place.
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(mesh)))
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract, nnx.get_named_sharding(abstract, mesh))
        model, optimizer = nnx.merge(graphdef, checkpointer.restore(state_path, target))
        print(f"restored step {progress['step']}; the saved run's next loss "
              f"{progress['next_loss']:.6f}", flush=True)
        train(model, optimizer, mesh, progress["step"], args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
