"""The large GPU case: DeepEP's shapes on 8 virtual ranks, GPU against the CPU handlers.

Run: python3 tools/gpu_large_case.py [--profile DIR] [--json PATH]

Normal mode (T 4096 per rank, H 7168, top-8 of 256 experts, bfloat16, both layouts, plain and
weighted combine, the FP8 pair) and low-latency mode (T 128, bfloat16 and FP8, split) run with
backend="cuda" twice on the same inputs: on the GPU (the CUDA kernels) and on the CPU (the same
kernel bodies in the extension's CPU handlers). Every output is compared byte for byte. With
--profile, the GPU ops then run under jax.profiler and the device time of every kernel is
summed per kernel name (medians per call are in the bench; this is where the time goes).
Exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import ml_dtypes
import numpy as np

from jax_ep import virtual
from jax_ep.tools import profile as jax_profile
from jax_ep.tools import reference
from jax_ep.tools.bench.routings import make_routing

R, T, H, K, E, LL_T = 8, 4096, 7168, 8, 256, 128


def leaves(tree) -> dict[str, np.ndarray]:
    """The arrays of a result (named tuples and dataclasses flattened with their paths)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def differences(gpu, cpu) -> list[str]:
    gpu, cpu = leaves(gpu), leaves(cpu)
    if gpu.keys() != cpu.keys():
        return [f"different leaves: {sorted(gpu)} vs {sorted(cpu)}"]
    out = []
    for key, g in gpu.items():
        c = cpu[key]
        if g.shape != c.shape or g.dtype != c.dtype:
            out.append(f"{key}: {g.shape} {g.dtype} vs {c.shape} {c.dtype}")
            continue
        gb, cb = g.reshape(-1).view(np.uint8), c.reshape(-1).view(np.uint8)
        bad = np.flatnonzero(gb != cb)
        if bad.size:
            first = np.unravel_index(bad[0] // g.itemsize, g.shape)
            out.append(f"{key}: {bad.size} bytes differ, first element {list(map(int, first))}")
    return out


def cases(rng):
    """(name, function of the inputs, inputs as NumPy arrays)."""
    idx, w = make_routing(rng, num_ranks=R, num_tokens=T, top_k=K, num_experts=E,
                          kind="uniform")
    idx, w = idx.astype(np.int32), w.astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)

    def normal(expert_major):
        def run(x, idx, w):
            recv, handle = virtual.dispatch(x, idx, w, num_experts=E, expert_major=expert_major)
            # A weight per received row, drawn from the data so that the GPU and CPU runs agree.
            yw = abs(recv.x[:, :, 0].astype(np.float32))
            plain = virtual.combine(recv.x, handle)
            weighted = virtual.combine(recv.x, handle, topk_weights=yw)
            return recv.with_zero_padding(), handle, plain, weighted
        return run

    def fp8_dispatch(x8, scales, idx, w):
        return virtual.dispatch((x8, scales), idx, w, num_experts=E)[0].with_zero_padding()

    def low_latency(use_fp8):
        def run(x, idx, w):
            pending = virtual.low_latency_dispatch_send(x, idx, num_experts=E, use_fp8=use_fp8)
            recv, handle = virtual.low_latency_dispatch_recv(pending)
            y = recv.x.astype(ml_dtypes.bfloat16) if use_fp8 else recv.x
            out = virtual.low_latency_combine_recv(
                virtual.low_latency_combine_send(y, idx, w, handle))
            return recv.with_zero_padding(), handle, out
        return run

    x8, scales = reference.quantize(x.astype(np.float32))
    yield "dispatch+combine", normal(False), (x, idx, w)
    yield "dispatch+combine expert-major", normal(True), (x, idx, w)
    yield "dispatch fp8", fp8_dispatch, (x8, scales, idx, w)
    ll_idx, ll_w = idx[:, :LL_T], w[:, :LL_T]
    for fp8 in (False, True):
        yield f"low-latency round trip{' fp8' if fp8 else ''}", low_latency(fp8), \
            (x[:, :LL_T], ll_idx, ll_w)


def placed(device, fn, inputs):
    """`fn` jitted and its inputs on `device` (which then runs it)."""
    return jax.jit(fn), [jax.device_put(a, device) for a in inputs]


def run_on(device, fn, inputs):
    jitted, args = placed(device, fn, inputs)
    return jax.tree.map(np.asarray, jax.block_until_ready(jitted(*args)))


def profile(gpu, named_cases, trace_dir: str, calls: int = 5) -> dict:
    report = {}
    for name, fn, inputs in named_cases:
        jitted, args = placed(gpu, fn, inputs)
        jax.block_until_ready(jitted(*args))
        case_dir = os.path.join(trace_dir, name.replace(" ", "_").replace("+", "_"))
        with jax.profiler.trace(case_dir):
            for _ in range(calls):
                jax.block_until_ready(jitted(*args))
        rows = jax_profile.device_kernel_times(jax_profile.load_trace(case_dir), "gpu")
        report[name] = [{"kernel": k.name, "launches_per_call": k.launches / calls,
                         "ms_per_call": k.seconds * 1e3 / calls} for k in rows]
        print(f"\nper-kernel device time, {name} (per call, mean of {calls}):")
        for k in rows[:15]:
            print(f"  {k.seconds * 1e3 / calls:9.3f} ms  x{k.launches / calls:<5g} "
                  f"{k.name[:110]}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", metavar="DIR", help="also profile the GPU runs into DIR")
    parser.add_argument("--json", metavar="PATH", help="write the results to PATH")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    print(f"large case: R={R} virtual ranks, T={T}, H={H}, top-{K} of E={E}; low-latency "
          f"T={LL_T}; seed {seed} (rerun: --seed {seed})", flush=True)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        sys.exit("gpu_large_case.py: error: no GPU visible to JAX")
    gpu, cpu = gpus[0], jax.devices("cpu")[0]
    named_cases = list(cases(np.random.default_rng(seed)))
    results, failed = {}, 0
    for name, fn, inputs in named_cases:
        t0 = time.perf_counter()
        on_gpu = run_on(gpu, fn, inputs)
        t1 = time.perf_counter()
        on_cpu = run_on(cpu, fn, inputs)
        t2 = time.perf_counter()
        diff = differences(on_gpu, on_cpu)
        size = sum(a.nbytes for a in leaves(on_gpu).values())
        results[name] = {"identical": not diff, "differences": diff, "bytes_compared": size}
        failed += bool(diff)
        print(f"{'identical' if not diff else 'DIFFERENT'}  {name}: {size / 1e9:.2f} GB of "
              f"outputs (GPU {t1 - t0:.1f} s, CPU handlers {t2 - t1:.1f} s, compiles included)",
              flush=True)
        for line in diff:
            print("    " + line, flush=True)
    report = {"seed": seed, "cases": results}
    if args.profile:
        report["kernels"] = profile(gpu, named_cases, args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"\nlarge case: {len(results) - failed} identical, {failed} different")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
