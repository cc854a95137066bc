"""A low-latency decode loop under XLA's command buffers (CUDA graphs): checked and timed.

Run: python tools/gpu_graph_case.py [--processes N] [--steps 32] [--json FILE]

One jitted program runs `--steps` decode steps, each a low-latency dispatch, a small expert
computation (a bf16 matmul per local expert) and a low-latency combine, with backend="cuda"
inside shard_map over every device of N processes (N = 1: one GPU, the EP axis of one rank;
N > 1: N processes on the GPUs they see, through NVSHMEM, several on one GPU in NVSHMEM's
limited MPG mode, where times mean nothing). It runs twice, each in processes of its own:
with command buffers off (XLA_FLAGS --xla_gpu_enable_command_buffer=) and on (XLA's default
command buffers, --xla_gpu_graph_min_graph_size=1). The check:
  - with command buffers on, XLA's dump shows the exchange calls inside a command buffer
    (the thunk sequence after XLA's thunk passes, or a command_buffer computation of the HLO);
  - each run's result equals the first's (XLA runs a step eagerly, then records, then
    replays), and the results with command buffers on equal those with them off, bit for bit;
  - the program compiled ahead of time and recorded, then run after jax_ep.finalize() and a
    new initialize(), is recorded again or refused with an error, never wrong in silence.
Then each mode times the program (median of repeats, after the warm-up): the bench row
`ll_roundtrip_graph`, microseconds per decode step with command buffers off and on, written
to --json. On CPU devices (no GPU) it runs as a rehearsal: host peers over
$XLA_FLAGS' CPU devices of one process, no command buffers and no dump to check.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

T, K, E, H = 8, 4, 16, 256
OFF = "--xla_gpu_enable_command_buffer="
ON = "--xla_gpu_graph_min_graph_size=1"
TARGETS = ("jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send",
           "jax_ep_ll_combine_recv")


def run_mode(steps: int, out_dir: str, repeats: int) -> dict:
    """The decode loop in this process (its XLA_FLAGS set the mode): saves this process's
    shards of each run's result; returns its timing."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep

    R = jax.device_count()
    jax_ep.initialize(jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E,
                                          num_ranks=R, low_latency_tokens=T))
    rng = np.random.default_rng(2026)  # the same inputs in every process and mode
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    idx = np.stack([[[rng.choice(E, K, replace=False) for _ in range(T)]
                     for _ in range(steps)] for _ in range(R)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    w = rng.random((R, steps, T, K)).astype(np.float32)
    weight = (rng.standard_normal((R, E // R, H, H)) / np.sqrt(H)).astype(ml_dtypes.bfloat16)
    mesh = jax.make_mesh((R,), ("ep",))
    spec = P("ep")

    def decode(x, idx, w, weight):
        h = x[0]
        for s in range(steps):
            recv, handle = jax_ep.low_latency_dispatch(h, idx[0, s], num_experts=E,
                                                       on_invalid="mask", backend="cuda")
            y = jnp.einsum("erh,ehg->erg", recv.x, weight[0],
                           preferred_element_type=jnp.float32)
            y = jnp.tanh(y).astype(jnp.bfloat16)
            h = jax_ep.low_latency_combine(y, idx[0, s], w[0, s], handle, backend="cuda")
        return h[None]

    fn = jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=spec, out_specs=spec))
    sharding = NamedSharding(mesh, spec)
    args = [jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i])
            for a in (x, idx, w, weight)]
    with jax.set_mesh(mesh):
        for run in range(3):  # eager warm-up, recording, replay
            out = jax.block_until_ready(fn(*args))
            for shard in out.addressable_shards:
                rank = mesh.devices.tolist().index(shard.device)
                np.save(os.path.join(out_dir, f"run{run}_rank{rank}.npy"),
                        np.asarray(shard.data).view(np.uint16))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        want = np.asarray(out.addressable_shards[0].data)
        stale = replay_after_finalize(fn, args, want, lambda: jax_ep.initialize(
            jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E, num_ranks=R,
                                low_latency_tokens=T)))
    jax_ep.finalize()
    return {"us_per_step": statistics.median(times) / steps * 1e6,
            "platform": jax.devices()[0].platform, "after_finalize": stale}


def replay_after_finalize(fn, args, want, initialize) -> str:
    """A program compiled ahead of time, run (and so recorded), then run again after
    jax_ep.finalize() and `initialize()`: its command buffer holds the old buffer's
    addresses. Either XLA records it again (its result is right) or its launches find the
    buffer changed, do nothing, and the next call reports it (docs/contract.md, "Command
    buffers"); never a wrong result without an error. Returns which happened."""
    import jax
    import numpy as np

    import jax_ep

    compiled = fn.lower(*args).compile()
    for _ in range(2):  # run, record and replay
        jax.block_until_ready(compiled(*args))
    jax_ep.finalize()
    initialize()
    try:
        out = jax.block_until_ready(compiled(*args))
        if np.array_equal(np.asarray(out.addressable_shards[0].data), want):
            return "recorded again: the same result"
        jax.block_until_ready(fn(*args))  # a fresh call's handler reports the stale replay
    except Exception as e:  # noqa: BLE001 (the report, whatever XLA wraps it in)
        assert "recorded before jax_ep.finalize()" in str(e), f"the stale replay: {e}"
        return "refused: the stale replay reported"
    raise AssertionError("a replay recorded before jax_ep.finalize() returned a wrong result "
                         "and no call reported it")


def worker(args) -> None:
    import jax

    if args.processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.worker)
    timing = run_mode(args.steps, args.out, args.repeats)
    if args.worker == 0:
        with open(os.path.join(args.out, "timing.json"), "w") as f:
            json.dump(timing, f)


def launch(args, flags: str, out: str, dump: str | None) -> bool:
    """The loop in args.processes processes with XLA_FLAGS `flags`; whether all succeeded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), flags]))
    if dump:
        env["XLA_FLAGS"] += f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", NVSHMEM_DISABLE_NCCL="1",
               XLA_PYTHON_CLIENT_MEM_FRACTION=str(round(0.5 / args.processes, 3)))
    procs = [subprocess.Popen([sys.executable, __file__, "--processes", str(args.processes),
                               "--steps", str(args.steps), "--repeats", str(args.repeats),
                               "--worker", str(i), "--port", str(port), "--out", out], env=env)
             for i in range(args.processes)]
    ok = True
    for p in procs:
        try:
            ok &= p.wait(timeout=args.timeout) == 0
        except subprocess.TimeoutExpired:
            print(f"graph case: no result within {args.timeout} s; killing the processes")
            for q in procs:
                q.kill()
            return False
    return ok


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def recorded_in_command_buffer(dump: str) -> str | None:
    """Where XLA's dump shows an exchange call inside a command buffer, or None."""
    for path in sorted(glob.glob(os.path.join(dump, "*thunk_sequence*"))):
        text = read(path)
        # A command-buffer thunk lists the thunks it runs, indented below it.
        for block in re.split(r"\n(?=\S)", text):
            if "ommand" in block.splitlines()[0] and any(t in block for t in TARGETS):
                return os.path.basename(path)
    for path in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
        text = read(path)
        for comp in re.split(r"\n(?=\S)", text):
            if "command_buffer" in comp.split("{")[0] and any(t in comp for t in TARGETS):
                return os.path.basename(path)
    return None


def describe_dump(dump: str) -> None:
    """What the dump holds where the check looks, for the log of a failed check: the files,
    and the lines of the thunk sequences that name an exchange call or a command buffer."""
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(dump, "*")))
    print(f"graph case: the dump holds {len(names)} files; thunk sequences and optimized HLO:")
    for name in names:
        if "thunk" in name or "after_optimizations" in name:
            print(f"  {name}")
    for path in sorted(glob.glob(os.path.join(dump, "*thunk_sequence*")))[:2]:
        lines = [line for line in read(path).splitlines()
                 if "ommand" in line or any(t in line for t in TARGETS)]
        print(f"graph case: {os.path.basename(path)}, lines naming a command buffer or an "
              "exchange:", *lines[:40], sep="\n  ")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--json", help="write the bench row here")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return 0
    import numpy as np

    failures = []
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, flags in (("off", OFF), ("on", ON)):
            out = os.path.join(tmp, mode)
            os.makedirs(out)
            dump = os.path.join(tmp, "dump") if mode == "on" else None
            if not launch(args, flags, out, dump):
                print(f"graph case: the loop with command buffers {mode} failed")
                return 1
            with open(os.path.join(out, "timing.json")) as f:
                results[mode] = json.load(f)
            runs = {}
            for path in sorted(glob.glob(os.path.join(out, "run*_rank*.npy"))):
                run, rank = re.findall(r"run(\d+)_rank(\d+)", path)[0]
                runs[int(run), int(rank)] = np.load(path)
            for (run, rank), data in runs.items():
                if data.tobytes() != runs[0, rank].tobytes():
                    failures.append(f"command buffers {mode}: run {run} differs from run 0 "
                                    f"(rank {rank})")
            results[mode]["runs"] = runs
        platform = results["on"]["platform"]
        if platform == "gpu" or platform == "cuda":
            where = recorded_in_command_buffer(os.path.join(tmp, "dump"))
            if where is None:
                failures.append("XLA's dump shows no exchange call inside a command buffer")
                describe_dump(os.path.join(tmp, "dump"))
            else:
                print(f"graph case: exchanges recorded in a command buffer ({where})")
        for key, data in results["on"]["runs"].items():
            if data.tobytes() != results["off"]["runs"][key].tobytes():
                failures.append(f"run {key[0]}, rank {key[1]}: command buffers on differ from "
                                "off")
    print(f"graph case: a program compiled before jax_ep.finalize(), run after a new "
          f"initialize(): {results['on']['after_finalize']}")
    off, on = results["off"]["us_per_step"], results["on"]["us_per_step"]
    row = {"name": "ll_roundtrip_graph", "processes": args.processes, "steps": args.steps,
           "shape": {"T": T, "K": K, "E": E, "H": H}, "platform": platform,
           "us_per_step_off": off, "us_per_step_on": on, "speedup": off / on,
           "meaningful": platform != "cpu" and args.processes == 1}
    print(f"ll_roundtrip_graph ({args.processes} process(es), {platform}): {off:.1f} us per "
          f"step with command buffers off, {on:.1f} us on ({off / on:.2f}x)"
          + ("" if row["meaningful"] else "; times not meaningful here"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    for failure in failures:
        print(f"graph case: FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
