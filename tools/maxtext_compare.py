"""MaxText's own routed MoE layer beside jax_ep's in its place, on CPU devices (docs/maxtext.md).

    pip install --no-deps maxtext==0.2.5   # then the modules it asks for (the doc lists them)
    python tools/maxtext_compare.py [--dtype bfloat16] [--backend cuda]

Builds MaxText's `RoutedMoE` (its sparse path, `sparse_matmul=True`; expert parallelism 1,
since its EP exchange, `ragged_all_to_all`, does not run on XLA:CPU) and
`jax_ep.nn.maxtext.RoutedMoE` over an "ep" axis of every device with the same parameters,
runs both on the same tokens, and prints, per array (output, the balance loss, the gradients
of the input and of each parameter), the largest difference, relative to the largest value
of MaxText's. Not part of CI: MaxText's install is large, and it needs Python 3.12.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tools/maxtext_compare.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the computation dtype of both layers (parameters float32)")
    parser.add_argument("--backend", choices=("xla", "cuda"), default="xla",
                        help="jax_ep's backend (cuda: the kernels, through host peers on CPU)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={args.devices}").strip()

    import jax
    import jax.numpy as jnp
    import maxtext
    import numpy as np
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.layers import initializers, moe
    from maxtext.utils import maxtext_utils

    import jax_ep
    from jax_ep.nn import RouterConfig
    from jax_ep.nn.maxtext import RoutedMoE

    E, K, H, F, B, S = 8, 2, 128, 64, args.devices, 16
    lb_weight = 0.01
    dtype = jnp.dtype(args.dtype)
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    cfg = pyconfig.initialize(
        ["", base], run_name="jax_ep_compare", model_name="default", num_experts=E,
        num_experts_per_tok=K, emb_dim=H, base_emb_dim=H, mlp_dim=F, base_mlp_dim=F,
        moe_mlp_dim=F, base_moe_mlp_dim=F, sparse_matmul=True, megablox=False,
        capacity_factor=-1.0, dtype=args.dtype, weight_dtype="float32",
        load_balance_loss_weight=lb_weight, per_device_batch_size=1, max_target_length=S,
        enable_checkpointing=False, skip_jax_distributed_system=True)
    theirs_mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
    with jax.set_mesh(theirs_mesh):
        theirs = moe.RoutedMoE(
            config=cfg, num_experts=E, num_experts_per_tok=K, mesh=theirs_mesh,
            kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
            kernel_axes=("embed", None), rngs=nnx.Rngs(args.seed), intermediate_dim=F,
            dtype=dtype, weight_dtype=jnp.float32)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(theirs, nnx.Param)))

    if args.backend == "cuda":
        jax_ep.initialize(jax_ep.BufferConfig(num_tokens=B * S // args.devices, hidden=H,
                                              top_k=K, num_experts=E, dtype_bytes=4,
                                              expert_major=True, low_latency_tokens=0))
    ours_mesh = jax.make_mesh((args.devices,), ("ep",))
    with jax.set_mesh(ours_mesh):
        ours = RoutedMoE(H, F, RouterConfig(num_experts=E, top_k=K, normalize_topk=True),
                         mesh=ours_mesh, backend=args.backend, dtype=dtype,
                         partial_dtype=jnp.float32, load_balance_loss_weight=lb_weight,
                         rngs=nnx.Rngs(0))
        for where, value in (("gate", params["gate"]["kernel"]), ("wi_0", params["wi_0"]),
                             ("wi_1", params["wi_1"]), ("wo", params["wo"])):
            variable = ours.gate.kernel if where == "gate" else getattr(ours, where)
            variable[...] = jax.device_put(jnp.asarray(value), variable[...].sharding)

    rng = np.random.default_rng(args.seed)
    x = jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32)

    def run(layer, mesh):
        def loss(layer, x):
            out, lb_loss, _ = layer(x)
            return jnp.sum(out.astype(jnp.float32) * cotangent), (out, lb_loss)

        with jax.set_mesh(mesh):
            step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
            (_, (out, lb_loss)), (d_layer, d_x) = step(layer, x)
        grads = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(d_layer, nnx.Param)))
        return {"output": out, "lb_loss": lb_loss, "d inputs": d_x,
                "d gate.kernel": grads["gate"]["kernel"], "d wi_0": grads["wi_0"],
                "d wi_1": grads["wi_1"], "d wo": grads["wo"]}

    want, got = run(theirs, theirs_mesh), run(ours, ours_mesh)
    print(f"MaxText {getattr(maxtext, '__version__', '?')} RoutedMoE (sparse_matmul, EP 1) vs "
          f"jax_ep {jax_ep.__version__} nn.maxtext.RoutedMoE (backend {args.backend}, EP "
          f"{args.devices}); jax {jax.__version__}; {args.dtype}; E {E}, top-{K}, H {H}, "
          f"F {F}, {B}x{S} tokens")
    print("\n| array | max abs difference | relative to max abs |\n|---|---|---|")
    for name, a in want.items():
        a = np.asarray(a, np.float64)
        b = np.asarray(got[name], np.float64)
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(a))) or 1.0
        print(f"| {name} | {diff:.3g} | {diff / scale:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
