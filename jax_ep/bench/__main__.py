"""python -m jax_ep.bench: every op on every available backend, side by side, in one run.

On a CPU-only machine it runs on 8 virtual devices with DeepEP's setups scaled to the machine;
on GPUs it uses DeepEP's setups (4096 tokens, hidden 7168, top-8, 256 experts; 128 tokens for
low-latency). Prints a table (median time, bytes moved per rank, GB/s, the copy floor, the
ratio to the pure-XLA backend); --json PATH writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host_platform
import shlex
import sys
import time

CPU_DEFAULTS = {"tokens": 256, "ll_tokens": 32, "hidden": 1024, "repeat": 10}
GPU_DEFAULTS = {"tokens": 4096, "ll_tokens": 128, "hidden": 7168, "repeat": 50}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_ep.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, help="EP ranks (default: 8 on CPU, all GPUs)")
    p.add_argument("--tokens", type=int, help="tokens per rank, normal mode")
    p.add_argument("--ll-tokens", type=int, help="tokens per rank, low-latency mode")
    p.add_argument("--hidden", type=int, help="hidden size (a multiple of 128)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--routing", default="uniform",
                   help="uniform | hot_expert | masked | empty_ranks | duplicates")
    p.add_argument("--dtype", default="bfloat16", help="payload of normal mode")
    p.add_argument("--fp8", action="store_true", help="also run the FP8 dispatches")
    p.add_argument("--ops", nargs="+", help="subset of ops (default: all)")
    p.add_argument("--backends", nargs="+", help="subset of backends (default: all)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, help="timed calls per op (default 10 CPU, 50 GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write all numbers to PATH")
    return p.parse_args(argv)


def gpu_present() -> bool:
    """Whether a CUDA plugin is installed (decided before jax starts its backends)."""
    import importlib.util

    return any(importlib.util.find_spec(name) for name in ("jax_cuda13_plugin",
                                                           "jax_cuda12_plugin"))


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    on_gpu = gpu_present() and os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu")
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    if not on_gpu:  # virtual devices must be requested before jax starts
        ranks = args.ranks or 8
        flag = f"--xla_force_host_platform_device_count={ranks}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax

    from jax_ep import backends
    from jax_ep.bench import suite, timing

    devices = jax.devices()
    ranks = args.ranks or len(devices)
    setup = suite.Setup(
        ranks=ranks,
        tokens=args.tokens or defaults["tokens"],
        ll_tokens=args.ll_tokens or defaults["ll_tokens"],
        hidden=args.hidden or defaults["hidden"],
        top_k=args.top_k,
        experts=args.experts,
        routing=args.routing,
        dtype=args.dtype,
        seed=args.seed,
    )
    repeat = args.repeat or defaults["repeat"]
    ops = args.ops or [op for op in suite.OPS if args.fp8 or op not in suite.FP8_OPS]
    names = args.backends or list(backends.BACKENDS)
    mesh = suite.make_mesh(ranks)
    device = f"{devices[0].device_kind} x{ranks}" + (" (virtual)" if not on_gpu else "")
    command = "python -m jax_ep.bench " + shlex.join(argv)
    print(f"jax_ep.bench on {device}, jax {jax.__version__}: R={ranks} T={setup.tokens} "
          f"T_ll={setup.ll_tokens} H={setup.hidden} K={setup.top_k} E={setup.experts} "
          f"routing={setup.routing} dtype={setup.dtype} repeat={repeat}", file=sys.stderr)

    bandwidth = timing.copy_bandwidth(devices[0].platform)
    rows, skipped, started = [], [], time.time()
    for name in names:
        print(f"[{name}] compiling {len(ops)} programs ...", file=sys.stderr, flush=True)
        cases = suite.build_cases(setup, mesh, ops, name)
        for i, case in enumerate(cases, 1):
            if isinstance(case, str):
                skipped.append(f"{name} {case}")
                continue
            t = timing.time_calls(case.fn, case.args, warmup=args.warmup, repeat=repeat)
            # All ranks share one memory on CPU; each GPU has its own.
            moved = case.bytes_per_rank * (ranks if not on_gpu else 1)
            floor = 2 * moved / bandwidth
            rows.append({"op": case.op, "backend": name, "time": t,
                         "bytes_per_rank": case.bytes_per_rank,
                         "gbps": case.bytes_per_rank / t["median"] / 1e9,
                         "floor_s": floor, "of_floor": floor / t["median"]})
            print(f"[{i}/{len(cases)}] {case.op:<17} {name:<5} {fmt_time(t['median'])}",
                  file=sys.stderr, flush=True)

    xla = {r["op"]: r["time"]["median"] for r in rows if r["backend"] == "xla"}
    print(f"\n{device}, jax {jax.__version__}; R={ranks}, T={setup.tokens} "
          f"(low-latency {setup.ll_tokens}), H={setup.hidden}, K={setup.top_k}, "
          f"E={setup.experts}, routing {setup.routing}, {setup.dtype}; median of {repeat}")
    print(f"rerun: {command}")
    header = f"{'op':<17} {'backend':<8} {'time':>10} {'MB/rank':>9} {'GB/s':>7} " \
             f"{'floor':>10} {'of floor':>9} {'vs xla':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        vs = xla.get(r["op"])
        print(f"{r['op']:<17} {r['backend']:<8} {fmt_time(r['time']['median']):>10} "
              f"{r['bytes_per_rank'] / 1e6:>9.3f} {r['gbps']:>7.2f} {fmt_time(r['floor_s']):>10} "
              f"{r['of_floor']:>9.3f} {vs / r['time']['median'] if vs else float('nan'):>6.2f}x")
    for name in names:
        missing = [line.split(":")[0] for line in skipped if line.startswith(f"{name} ")]
        if missing:
            reasons = {line.split(": ", 1)[1] for line in skipped if line.startswith(f"{name} ")}
            print(f"n/a on {name}: {', '.join(m.split(' ', 1)[1] for m in missing)} "
                  f"({'; '.join(sorted(reasons))})")
    print(f"\ntime: median wall time of one call of the jitted shard_map program (all ranks).\n"
          f"MB/rank, GB/s: bytes each rank receives (DeepEP's count: rows incl. its own x H x "
          f"bytes; low-latency: one message per token and expert) over that time.\n"
          f"floor: those bytes read and written once at the copy bandwidth measured here "
          f"({bandwidth / 1e9:.1f} GB/s"
          f"{', shared by all virtual ranks' if not on_gpu else ''}); of floor = floor / time.\n"
          f"vs xla: the xla backend's time over this row's (higher is faster).\n"
          f"Timed with on_overflow='drop', on_invalid='mask' (the default checks add a host "
          f"callback per call). Total {time.time() - started:.0f} s.")

    if args.json:
        record = {
            "command": command, "device": device, "platform": devices[0].platform,
            "jax": jax.__version__, "host": host_platform.node(), "setup": vars(setup),
            "repeat": repeat, "copy_bandwidth_Bps": bandwidth, "rows": rows,
            "skipped": skipped,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
