"""Train a small decoder-only MoE language model with jax_ep, on CPU devices or GPUs.

The text is the Python standard library's own source code (read from this interpreter's
installation, no download), modelled byte by byte. Every block is causal self-attention
followed by `jax_ep.nn.MoE` (routed SwiGLU experts over the "ep" mesh axis, one shared
expert, auxiliary-loss-free balancing). The jitted step runs over a (data x ep) mesh; the loss
is compared with the corpus's unigram entropy (what a model that ignores context achieves).

    python examples/train_moe.py                       # 8 CPU devices: data 2 x ep 4
    python examples/train_moe.py --steps 600 --backend cuda --png loss.png
    python examples/train_moe.py --wire-format e4m3 --width 128     # tokens sent as FP8
    python examples/train_moe.py --width 128 --steps 200 --minutes 30 \
        --wire-format none,e4m3,e4m3_ue8m0,mxfp8,nvfp4                # the wires side by side

Several wire formats train one after another from the same seed (same initial parameters,
same batches): a table of their final losses and one plot of their curves.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import quant  # noqa: E402
from jax_ep.nn import MoE, RouterConfig  # noqa: E402


def corpus(max_bytes: int) -> np.ndarray:
    """The standard library's .py files, concatenated, as bytes (deterministic order)."""
    root = os.path.dirname(os.__file__)
    chunks, size = [], 0
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "test", "tests"))
        for name in sorted(files):
            if name.endswith(".py") and size < max_bytes:
                with open(os.path.join(directory, name), "rb") as f:
                    chunks.append(f.read())
                size += len(chunks[-1])
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def unigram_entropy(data: np.ndarray) -> float:
    p = np.bincount(data, minlength=256) / len(data)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())  # nats per byte


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, moe: MoE, *, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1, self.norm2 = nnx.RMSNorm(width, rngs=rngs), nnx.RMSNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(width, width, use_bias=False, rngs=rngs)
        self.moe = moe

    def __call__(self, x):
        B, S, D = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (a.reshape(B, S, self.heads, D // self.heads) for a in (q, k, v))
        logits = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(D // self.heads)
        logits = jnp.where(jnp.tril(jnp.ones((S, S), bool)), logits, -1e9)
        attn = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, -1), v)
        x = x + self.proj(attn.reshape(B, S, D))
        y, stats = self.moe(self.norm2(x))
        return x + y, stats


class Model(nnx.Module):
    def __init__(self, args, mesh, wire_format: str | None, *, rngs: nnx.Rngs):
        W = args.width
        self.embed = nnx.Embed(256, W, rngs=rngs)
        self.position = nnx.Param(jax.random.normal(rngs.params(), (args.seq, W)) * 0.02)
        router = RouterConfig(num_experts=args.experts, top_k=args.top_k, score="sigmoid",
                              num_groups=args.groups, top_groups=max(1, args.groups // 2))
        self.blocks = nnx.List([
            Block(W, args.heads, MoE(W, args.ffn, router, mesh=mesh, num_shared_experts=1,
                                     wire_format=wire_format, bias_rate=args.bias_rate,
                                     backend=args.backend, rngs=rngs), rngs=rngs)
            for _ in range(args.layers)])
        self.norm = nnx.RMSNorm(W, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position[...][: tokens.shape[1]]
        stats = []
        for block in self.blocks:
            x, s = block(x)
            stats.append(s)
        return self.embed.attend(self.norm(x)), stats


def parse_args(argv) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps at most")
    p.add_argument("--minutes", type=float, default=4.5, help="stop training after this long")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence")
    p.add_argument("--width", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--ffn", type=int, default=64, help="width of each expert")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--experts", type=int, default=16, help="E")
    p.add_argument("--top-k", type=int, default=2, help="K experts per token")
    p.add_argument("--groups", type=int, default=4, help="expert groups (group-limited routing)")
    p.add_argument("--ep", type=int, default=4, help="devices on the expert-parallel axis")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--aux-loss", type=float, default=0.0, help="weight of the balance loss")
    p.add_argument("--bias-rate", type=float, default=1e-2, help="balancing bias step")
    p.add_argument("--backend", default="auto", choices=("auto", "xla", "cuda"),
                   help="jax_ep backend")
    p.add_argument("--wire-format", default="none",
                   help="how the tokens travel to the experts: 'none' (the model's dtype) or "
                   f"a jax_ep.quant format ({', '.join(quant.FORMATS)}); a comma-separated "
                   "list trains each from the same seed and compares them")
    p.add_argument("--fp8", action="store_true", help="deprecated: --wire-format e4m3")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="training text to read (MB)")
    p.add_argument("--log-every", type=int, default=25, help="steps between log lines")
    p.add_argument("--png", default="train_moe_loss.png", help="loss curve ('' for none)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    args = p.parse_args(argv)
    if args.fp8:
        print("--fp8 is deprecated: it is --wire-format e4m3")
        args.wire_format = "e4m3"
    args.wire_formats = args.wire_format.split(",")
    for f in args.wire_formats:
        if f != "none" and f not in quant.FORMATS:
            p.error(f"--wire-format: {f!r} is not 'none' or one of {', '.join(quant.FORMATS)}.")
        if f != "none" and args.width % quant.BLOCKS[f]:
            p.error(f"--wire-format {f} quantizes blocks of {quant.BLOCKS[f]} channels: --width "
                    f"must be a multiple of {quant.BLOCKS[f]}; got {args.width}. Try --width 128.")
    if args.ep < 1 or len(jax.devices()) % args.ep:
        p.error(f"--ep {args.ep} must divide the {len(jax.devices())} devices.")
    return p, args


def main(argv) -> int:
    parser, args = parse_args(argv)
    devices = jax.devices()
    if args.backend == "cuda":  # its kernels exchange through a buffer sized for the calls
        jax_ep.initialize(jax_ep.BufferConfig(
            num_tokens=args.batch * args.seq // len(devices), hidden=-(-args.width // 128) * 128,
            top_k=args.top_k, num_experts=args.experts, num_ranks=args.ep, expert_major=True,
            low_latency_tokens=0))
    mesh = jax.make_mesh((len(devices) // args.ep, args.ep), ("data", "ep"))
    data = corpus(int(args.corpus_mb * 2**20))
    entropy = unigram_entropy(data)
    split = int(0.95 * len(data))
    train_data, held_out = data[:split], data[split:]
    print(f"corpus: {len(data) / 2**20:.1f} MiB of standard-library source; unigram entropy "
          f"{entropy:.3f} nats/byte; mesh {dict(mesh.shape)} on {devices[0].platform}")

    runs = {}
    for f in args.wire_formats:
        if len(args.wire_formats) > 1:
            print(f"--- wire format {f}")
        runs[f] = train(args, parser, mesh, train_data, held_out, entropy,
                        None if f == "none" else f)
    if len(runs) > 1:
        first = args.wire_formats[0]
        print(f"{'wire format':>12} {'steps':>6} {'train loss':>11} {'held-out':>9} "
              f"{'vs ' + first:>10}")
        for f, (history, held) in runs.items():
            change = (held - runs[first][1]) / runs[first][1]
            print(f"{f:>12} {len(history):6d} {np.mean(history[-10:]):11.3f} {held:9.3f} "
                  f"{change:+10.2%}")
    if args.png:
        plot(args.png, runs, entropy)
    return 0


def train(args, parser, mesh, train_data, held_out, entropy, wire_format):
    """Trains the model from args.seed with the tokens sent as `wire_format`; returns the
    train losses and the final held-out loss."""
    with jax.set_mesh(mesh):
        try:
            model = Model(args, mesh, wire_format, rngs=nnx.Rngs(args.seed))
        except ValueError as error:  # sizes the layer rejects: --experts, --groups, --top-k
            parser.error(str(error))
        optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)

    def loss_fn(model, tokens):
        logits, stats = model(tokens[:, :-1])
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        aux = sum(s.aux_loss for s in stats) / len(stats)
        return xent + args.aux_loss * aux, (xent, stats)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        grads, (xent, stats) = nnx.grad(loss_fn, has_aux=True)(model, tokens)
        optimizer.update(model, grads)
        for block, s in zip(model.blocks, stats, strict=True):
            block.moe.update_bias(s.load)
        return xent, stats

    @nnx.jit
    def eval_loss(model, tokens):
        return loss_fn(model, tokens)[1][0]

    def batch(source, rng):
        starts = rng.integers(0, len(source) - args.seq - 1, args.batch)
        return jnp.asarray(np.stack([source[s:s + args.seq + 1] for s in starts]), jnp.int32)

    # The same batches, and held-out batches, for every wire format.
    rng, held_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)

    history, started = [], time.perf_counter()
    tokens_per_step = args.batch * args.seq
    with jax.set_mesh(mesh):
        for step in range(1, args.steps + 1):
            xent, stats = train_step(model, optimizer, batch(train_data, rng))
            history.append(float(xent))
            elapsed = time.perf_counter() - started
            if step % args.log_every == 0 or step == 1 or step == args.steps:
                load = np.asarray(stats[-1].load)
                print(f"step {step:5d}  loss {history[-1]:.3f}  "
                      f"{tokens_per_step * step / elapsed:8.0f} tokens/s  "
                      f"expert load max/mean {load.max() / load.mean():.2f}", flush=True)
            if elapsed > args.minutes * 60:
                print(f"stopping after {elapsed:.0f} s (--minutes {args.minutes})")
                break
        held = float(np.mean([eval_loss(model, batch(held_out, held_rng)) for _ in range(8)]))
    final = float(np.mean(history[-10:]))
    print(f"final: {len(history)} steps in {time.perf_counter() - started:.0f} s; train loss "
          f"{final:.3f}, held-out loss {held:.3f} nats/byte vs unigram entropy {entropy:.3f} "
          f"({'below' if held < entropy else 'NOT below'})")
    return history, held


def plot(path: str, runs: dict, entropy: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for f, (history, _) in runs.items():
        label = "train loss" if len(runs) == 1 else f"wire {f}"
        ax.plot(np.arange(1, len(history) + 1), history, lw=1, label=label)
    ax.axhline(entropy, color="gray", ls="--", label="unigram entropy")
    ax.set(xlabel="step", ylabel="nats / byte", title="MoE LM on stdlib source (jax_ep)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
