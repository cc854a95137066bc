"""A sweep of the streamed normal dispatch and combine's settings, against the phased ops.

Run: python tools/gpu_tune.py [--processes 4,2] [--rings C,CHUNK,CHUNKS[,WARPS] ...]
         [--num-sms 20,28] [--json OUT/tune.json] [--table OUT/tuned_entry.py]
     python tools/gpu_tune.py --cpu [--json FILE]     (the rehearsal: CPU devices, tiny)

For each R of --processes, R processes on the one GPU (jax.distributed on 127.0.0.1, real
NVSHMEM, as tools/gpu_multiprocess_smoke.py) under CUDA MPS, each limited to 1/R of the SMs
($CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, which also gives NVSHMEM its full multi-process mode), so
that their kernels run at once: the links are the GPU's own memory, so this compares the
protocols and their parallelism, not NVLink. The processes time the rank-major normal
dispatch and combine (bf16; DeepSeek-like shapes scaled to one GPU: T 4096, H 7168, top-8 of
256 experts) in phases (no rings, as `JAX_EP_CHANNELS=off`) and streamed through each ring
shape of --rings (`jax_ep.runtime.Channels`: channels, chunk_tokens, ring_chunks, warps; 0
warps: the platform's default), each at every `num_sms` of --num-sms (the argument of
jax_ep.dispatch and jax_ep.combine; on a GPU it also bounds the channels that stream,
runtime.stream_plan).

The rings are fixed at jax_ep.initialize(), so the processes start once and initialize once
per ring shape (jax_ep.finalize() between), and build one jitted program per point and op.
Each program makes --calls calls of the op in a lax.fori_loop, so that its wall-clock time
over --calls is the device time of one call with a launch's overhead spread over them; the
median over --repeats runs (after a warm-up run that compiles) is the point's time, the
slowest process's where they differ. GB/s counts the rows actually received (the rank's own
included, as jax_ep.tools.bench) x H x 2 bytes, per rank. Every process compares its
results (the received rows up to their count, the routing metadata, the handle, the combined
tokens) with the first point's (phased) bit for bit: a setting that breaks them is reported
as wrong, never as fast. A time budget (--budget-s, shared by the sets of processes) bounds
the sweep: the points it leaves are listed as skipped, and the grid's order puts the phased
ops and the default rings first.

Without an MPS control daemon that answers (`nvidia-cuda-mps-control`, at
$CUDA_MPS_PIPE_DIRECTORY), the processes would time-slice the GPU and the times would mean
nothing: the tool prints "skipped: no MPS (reason)" and exits 0, unless --without-mps (the
points then run and are checked, their times marked not meaningful). tools/gpu_check.sh
starts the daemon for its `mps` and `tune` steps.

--cpu rehearses the same code without a GPU: one process per R with R CPU devices
(--xla_force_host_platform_device_count), backend="cuda" between them through the host peers,
tiny shapes and a tiny grid; its times mean nothing either.

Output: a markdown table per set and op on stdout (fastest first, with the phased time at the
same num_sms and the streamed/phased ratio) and, with --json, every point and the fastest
streamed settings per op keyed by the GPU's name (jax.devices()[0].device_kind) and R.
Last, the entry for the table the runtime reads its defaults from (jax_ep/tuned.py, keyed
by the GPU's name): one ring shape for both ops (the buffer has one), or the phased ops,
whichever has the least dispatch + combine time, and each op's fastest num_sms at it, from
the set of the most ranks; printed, in the JSON's table_entry, and with --table written to
a file. Committed with the report that measured it, it becomes that GPU's default
(docs/gpu/README.md).

Not done: the copy-rate microbenchmark (a row copy alone at one warp per SM on 8/16/32 SMs with
4/8/16 loads in flight) needs a kernel of its own, which the extension does not have.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

OPS = ("dispatch", "combine")
# One setting at a time away from the library's default rings (runtime.Channels()).
SWEEP = {"chunk_tokens": (2, 8), "ring_chunks": (2, 4), "warps": (1, 2), "channels": (64,)}
GPU_DEFAULTS = dict(tokens=4096, hidden=7168, top_k=8, experts=256, calls=8, repeats=5)
CPU_DEFAULTS = dict(tokens=16, hidden=128, top_k=2, experts=8, calls=2, repeats=2,
                    rings=["2,1,2", "4,2,2,1"], num_sms=[1, 20])
NOT_DONE = ("the copy-rate microbenchmark (row copy alone at 1 warp per SM on 8/16/32 SMs, "
            "4/8/16 loads in flight) needs a kernel of its own: not done")
SKIPPED = "skipped: over the time budget"


@dataclasses.dataclass(frozen=True)
class Point:
    """One setting: `rings` (channels, chunk_tokens, ring_chunks, warps), or None: phased."""

    rings: tuple[int, int, int, int] | None
    num_sms: int

    def label(self) -> dict:
        keys = ("channels", "chunk_tokens", "ring_chunks", "warps")
        rings = dict(zip(keys, self.rings, strict=True)) if self.rings else dict.fromkeys(keys)
        return {"mode": "streamed" if self.rings else "phased", **rings,
                "num_sms": self.num_sms}


def parse_rings(text: str) -> tuple[int, int, int, int]:
    """"C,CHUNK,CHUNKS[,WARPS]" (as $JAX_EP_CHANNELS) as a checked 4-tuple."""
    from jax_ep.runtime import Channels

    parts = text.split(",")
    if len(parts) not in (3, 4) or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"--rings {text!r}: give each ring shape as channels,chunk_tokens,ring_chunks"
            f"[,warps] (e.g. 40,4,3 or 40,4,3,2)")
    rings = Channels(*(int(p) for p in parts))
    try:
        rings.check()
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--rings {text!r}: {error}") from None
    return dataclasses.astuple(rings)


def default_rings() -> list[tuple[int, int, int, int]]:
    """runtime.Channels(), then each SWEEP value in its place, one at a time."""
    from jax_ep.runtime import Channels

    base = Channels()
    shapes = [base] + [dataclasses.replace(base, **{name: value})
                       for name, values in SWEEP.items() for value in values
                       if value != getattr(base, name)]
    return [dataclasses.astuple(s) for s in shapes]


def grid(rings: list, num_sms: list[int], ranks: int) -> list[Point]:
    """The points in the order they run: phased first, then each ring shape at every num_sms;
    a point whose launches equal an earlier one's (runtime.stream_plan) is left out."""
    from jax_ep.runtime import Channels, stream_plan

    points = [Point(None, s) for s in num_sms]
    seen = set()
    for shape in rings:
        for s in num_sms:
            channels = Channels(*shape)
            plans = tuple(dataclasses.astuple(stream_plan(op, channels, ranks, num_sms=s))
                          for op in OPS)
            key = (shape[1], shape[2], s, plans)
            if key not in seen:
                seen.add(key)
                points.append(Point(tuple(shape), s))
    return points


# ------------------------------------------------------------------------------------------
# One process of a set: runs every point on its shards.


def default_num_sms(ranks: int) -> list[int]:
    """The library's default num_sms (20) and 28: both fit the SMs each of up to 4 processes
    gets under MPS on a GPU of 132 SMs (an H100 or H200: 33 each). A streaming launch is
    cooperative, refused when its blocks cannot all be resident at once, so more processes, or
    a smaller GPU, need --num-sms."""
    return [20, 28] if ranks <= 4 else [max(132 // ranks * 3 // 4, 1)]


def agree(key: str, value: bool) -> bool:
    """Process 0's `value`, in every process (the ranks must run the same points)."""
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return value
    if jax.process_index() == 0:
        client.key_value_set_bytes(key, b"1" if value else b"0")
        return value
    return client.blocking_key_value_get_bytes(key, 10 * 60 * 1000) == b"1"


def differences(got: dict, want: dict) -> list[str]:
    """The results of `got` ({(rank, name): array}) that are not `want`'s bit for bit (NaN
    payloads and signed zeros included), or that `want` lacks."""
    import numpy as np

    def same(a, b) -> bool:
        return (a.shape == b.shape and a.dtype == b.dtype and
                np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))

    return sorted(f"rank {rank} {name or 'output'}" for (rank, name), a in got.items()
                  if (rank, name) not in want or not same(a, want[rank, name]))


def local_shards(tree) -> dict:
    """{(rank, leaf name): numpy array} of this process's shards of a result pytree."""
    import jax
    import numpy as np

    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path)
        for shard in leaf.addressable_shards:
            out[shard.index[0].start or 0, name] = np.asarray(shard.data)[0]
    return out


def dispatch_results(recv, handle) -> dict:
    """What a dispatch defines: the rows up to their count (the rest is unspecified,
    docs/contract.md "Padding"), the metadata and the handle."""
    shards = local_shards((recv, handle))
    rows = {r: int(a) for (r, name), a in shards.items() if name == "[0].num_tokens"}
    return {key: a[:rows[key[0]]] if key[1] == "[0].x" else a for key, a in shards.items()}


def make_inputs(args, ranks: int, sharding) -> tuple:
    """x [R, T, H] bf16, topk_idx [R, T, K] and weights (uniform top-K routing), each rank's
    block drawn from its own seed, the same in every process, made only where it is held."""
    import jax
    import ml_dtypes
    import numpy as np

    from jax_ep.tools.bench.routings import make_routing

    T, H, K = args.tokens, args.hidden, args.top_k
    blocks = {}

    def block(rank: int) -> tuple:
        if rank not in blocks:
            rng = np.random.default_rng([args.seed, rank])
            idx, w = make_routing(rng, num_ranks=1, num_tokens=T, top_k=K,
                                  num_experts=args.experts)
            x = rng.standard_normal((1, T, H), dtype=np.float32).astype(ml_dtypes.bfloat16)
            blocks[rank] = x, idx, w
        return blocks[rank]

    return tuple(jax.make_array_from_callback(
        shape, sharding, lambda index, i=i: block(index[0].start or 0)[i])
        for i, shape in enumerate(((ranks, T, H), (ranks, T, K), (ranks, T, K))))


def looped(call, calls: int):
    """`call` made `calls` times in one program (a fori_loop, whose carry is the results and
    whose exchanges the ordered effect keeps in the loop); the last call's results."""
    import jax

    def program(*operands):
        first = call(*operands)
        return jax.lax.fori_loop(1, calls, lambda i, out: call(*operands), first)
    return program


def timed(args, fn, *operands) -> tuple:
    """fn's results (its first run compiles it) and its --repeats times per call."""
    import jax

    out = jax.block_until_ready(fn(*operands))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*operands))
        times.append((time.perf_counter() - start) / args.calls)
    return out, times


def measure(args, mesh, inputs, point: Point) -> dict:
    """{op: (times per call, this process's results, rows received by its ranks)} at `point`
    (the buffer initialized with its rings)."""
    import jax_ep
    from jax_ep.tools.bench.suite import stacked

    s, E = point.num_sms, args.experts
    dispatch = stacked(looped(lambda x, i, w: jax_ep.dispatch(
        x, i, w, num_experts=E, backend="cuda", num_sms=s), args.calls), mesh)
    combine = stacked(looped(lambda y, h: jax_ep.combine(
        y, h, backend="cuda", num_sms=s), args.calls), mesh)
    (recv, handle), dispatch_times = timed(args, dispatch, *inputs)
    combined, combine_times = timed(args, combine, recv.x, handle)
    rows = sum(int(a) for (_, name), a in local_shards(recv).items() if name == ".num_tokens")
    return {"dispatch": (dispatch_times, dispatch_results(recv, handle), rows),
            "combine": (combine_times, local_shards(combined), rows)}


def run_set(args, ranks: int, budget_s: float, started: float, log) -> None:
    """Every point of the grid at `ranks` on this process's shards, until the budget (seconds
    since `started`) is spent; one JSON line per point and op into `log`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep.runtime import Channels, stream_plan

    device = jax.devices()[0]
    points = grid(args.rings, args.num_sms or default_num_sms(ranks), ranks)
    log({"device": device.device_kind, "platform": device.platform,
         "core_count": getattr(device, "core_count", None),
         "grid": [{"index": n, **p.label()} for n, p in enumerate(points)]})
    mesh = jax.make_mesh((ranks,), ("ep",))
    inputs = make_inputs(args, ranks, NamedSharding(mesh, P("ep")))
    first: dict = {}  # op: (index, results) of the first point that ran
    stopped = False
    current: object = "none yet"
    for n, point in enumerate(points):
        record = {"ranks": ranks, "index": n, **point.label()}
        if point.rings:
            record["plans"] = {op: dataclasses.asdict(stream_plan(
                op, Channels(*point.rings), ranks, num_sms=point.num_sms)) for op in OPS}
        stopped = stopped or not agree(f"jax_ep_tune/{ranks}/{n}",
                                       time.monotonic() - started < budget_s)
        if stopped:
            for op in OPS:
                log({**record, "op": op, "status": SKIPPED})
            continue
        try:
            if point.rings != current:  # the rings are the buffer's: a new one per shape
                jax_ep.finalize()
                jax_ep.initialize(jax_ep.BufferConfig(
                    num_tokens=args.tokens, hidden=args.hidden, top_k=args.top_k,
                    num_experts=args.experts, num_ranks=ranks, low_latency_tokens=0,
                    channels=Channels(*point.rings) if point.rings else None))
                current = point.rings
            results = measure(args, mesh, inputs, point)
        except Exception as error:  # noqa: BLE001 (recorded; the next ring shape starts over)
            for op in OPS:
                log({**record, "op": op, "status": "failed", "error": str(error)[:2000]})
            jax_ep.finalize()
            current = "none yet"
            continue
        for op, (times, arrays, rows) in results.items():
            against, want = first.setdefault(op, (n, arrays))
            wrong = differences(arrays, want)
            log({**record, "op": op, "status": "wrong" if wrong else "ok", "times_s": times,
                 "rows": rows, "checked_against": against, "differs": wrong[:8]})
    jax_ep.finalize()


def worker(args) -> None:
    started = time.monotonic()
    import jax

    if args.processes_in_set > 1:
        jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes_in_set,
                                   args.worker)
    path = os.path.join(args.out, f"worker{args.worker}.jsonl")
    with open(path, "a") as f:
        def log(record):
            f.write(json.dumps(record) + "\n")
            f.flush()  # a set stopped at its timeout keeps the points it finished

        run_set(args, args.ranks, args.set_budget_s, started, log)


# ------------------------------------------------------------------------------------------
# The launcher: a set of processes per R, then the merged points, the tables and the JSON.


def control(command: str) -> subprocess.CompletedProcess:
    """`command` sent to the MPS control daemon at $CUDA_MPS_PIPE_DIRECTORY."""
    return subprocess.run(["nvidia-cuda-mps-control"], input=command + "\n",
                          capture_output=True, text=True, timeout=30)


def check_mps() -> int:
    """Whether this process, a CUDA client, gets through an MPS control daemon: the daemon
    answers, and a server of its lists this process among its clients (a client that finds no
    daemon runs without MPS, silently). Prints what it found; why not on its last line."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    if shutil.which("nvidia-cuda-mps-control") is None:
        print("nvidia-cuda-mps-control is not on PATH")
        return 1
    answer = control("get_server_list")
    if answer.returncode != 0:
        said = (answer.stdout + answer.stderr).strip().replace("\n", " ")
        print(f"no MPS control daemon answers at {pipe} ({said or 'no answer'}); start one "
              f"with nvidia-cuda-mps-control -d (tools/gpu_check.sh does)")
        return 1
    os.environ.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a context, no more
    import jax

    device = jax.devices()[0]
    jax.block_until_ready(jax.numpy.ones(8) + 1)  # a context on the GPU, through MPS if it is
    if device.platform != "gpu":
        print(f"no GPU here ({device.platform}): MPS serves GPUs only")
        return 1
    servers = control("get_server_list").stdout.split()
    for server in servers:
        if str(os.getpid()) in control(f"get_client_list {server}").stdout.split():
            print(f"MPS: server {server} serves this client ({device.device_kind}, "
                  f"{getattr(device, 'core_count', '?')} SMs reported at "
                  f"{os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}%)")
            return 0
    log = os.path.join(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"),
                       "control.log")
    try:
        with open(log) as f:
            tail = f.read().strip().splitlines()[-1:]
    except OSError:
        tail = []
    print(f"a CUDA client did not get through the MPS daemon at {pipe} (servers: "
          f"{' '.join(servers) or 'none'}; its log: {tail[0] if tail else 'empty'})")
    return 1


def mps_state() -> tuple[bool, str]:
    """check_mps() in a process of its own (this one never touches the GPU), and why not."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--check-mps"], capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "a CUDA client under MPS did not start within 120 s"
    lines = (proc.stdout + proc.stderr).strip().splitlines() or ["nothing printed"]
    return proc.returncode == 0, lines[-1]


def launch(args, ranks: int, budget_s: float, out: str) -> bool:
    """One set: `ranks` ranks in ranks processes (one with --cpu); whether all finished."""
    processes = 1 if args.cpu else ranks
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_EP_CHANNELS", "JAX_EP_RANKS_PER_NODE", "XLA_FLAGS")}
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_EP_PEER_ACCESS=args.peer_access)
    if args.cpu:
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={ranks}")
    else:
        env.pop("JAX_PLATFORMS", None)
        env.update(NVSHMEM_DISABLE_NCCL="1",
                   XLA_PYTHON_CLIENT_MEM_FRACTION=str(round(0.8 / ranks, 3)))
        if args.mps:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // ranks)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [sys.executable, __file__, "--ranks", str(ranks), "--port", str(port),
              "--processes-in-set", str(processes), "--set-budget-s", str(budget_s),
              "--out", out, *forwarded(args)]
    procs = [subprocess.Popen(common + ["--worker", str(i)], env=env) for i in range(processes)]
    deadline = time.monotonic() + budget_s + args.timeout
    ok = True
    for i, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            print(f"tune: {ranks} ranks: no result within {budget_s + args.timeout:.0f} s; "
                  f"killing the processes")
            for p in procs:
                p.kill()
            return False
        if code:
            print(f"tune: {ranks} ranks: process {i}: "
                  f"{f'signal {-code}' if code < 0 else f'exit {code}'}")
        ok &= code == 0
    return ok


def forwarded(args) -> list[str]:
    """The worker's copy of the settings."""
    out = ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--top-k",
           str(args.top_k), "--experts", str(args.experts), "--calls", str(args.calls),
           "--repeats", str(args.repeats), "--seed", str(args.seed), "--rings",
           *(",".join(map(str, r)) for r in args.rings)]
    if args.num_sms:
        out += ["--num-sms", ",".join(map(str, args.num_sms))]
    return out + (["--cpu"] if args.cpu else [])


def merge(lines_per_worker: list[list[dict]], ranks: int, hidden: int) -> dict:
    """One set's points from its workers' lines, every point of its grid: a point's time is
    the slowest process's median, its rows the sum over the processes; wrong or failed in any
    process is wrong or failed, and a point some process did not report is missing."""
    header = next((line for lines in lines_per_worker for line in lines if "grid" in line),
                  {})
    reports: dict = {}
    for lines in lines_per_worker:
        for line in lines:
            if "op" in line:
                reports.setdefault((line["index"], line["op"]), []).append(line)
    merged = []
    for label in header.get("grid", []):
        for op in OPS:
            parts = reports.get((label["index"], op), [])
            point = {**label, "op": op}
            if parts and "plans" in parts[0]:
                point["plan"] = parts[0]["plans"][op]
            statuses = {p["status"] for p in parts}
            if len(parts) < len(lines_per_worker):
                statuses.add("missing")
            point["status"] = next((s for s in ("failed", "wrong", "missing", SKIPPED)
                                    if s in statuses), "ok")
            errors = [p.get("error") or ", ".join(p.get("differs", [])) for p in parts]
            point["error"] = next((e for e in errors if e), "")
            point["checked_against"] = parts[0].get("checked_against") if parts else None
            if parts and all("times_s" in p for p in parts):
                point["median_s"] = max(statistics.median(p["times_s"]) for p in parts)
                point["times_s"] = parts[0]["times_s"]
                point["rows"] = sum(p["rows"] for p in parts)
                point["gbps"] = point["rows"] / ranks * hidden * 2 / point["median_s"] / 1e9
            merged.append(point)
    return {"ranks": ranks, "device": header.get("device", "unknown device"),
            "platform": header.get("platform"), "core_count": header.get("core_count"),
            "points": merged}


def rank_points(points: list[dict], op: str) -> list[dict]:
    """The op's measured points, fastest first, each with the phased time at its num_sms
    (else the fastest phased) and its ratio to it."""
    timed = sorted((p for p in points if p["op"] == op and p["status"] == "ok"),
                   key=lambda p: p["median_s"])
    phased = {p["num_sms"]: p["median_s"] for p in timed if p["mode"] == "phased"}
    fastest_phased = min(phased.values(), default=None)
    out = []
    for p in timed:
        against = phased.get(p["num_sms"], fastest_phased)
        out.append({**p, "phased_s": against,
                    "vs_phased": p["median_s"] / against if against else None})
    return out


def best(points: list[dict]) -> dict:
    """Per op, the fastest streamed point that ran right, with the fastest phased time and the
    ratio of the two."""
    out = {}
    for op in OPS:
        ranked = rank_points(points, op)
        streamed = [p for p in ranked if p["mode"] == "streamed"]
        phased = [p["median_s"] for p in ranked if p["mode"] == "phased"]
        if not streamed:
            continue
        top = streamed[0]
        out[op] = {k: top[k] for k in ("channels", "chunk_tokens", "ring_chunks", "warps",
                                       "num_sms", "median_s", "gbps")}
        out[op]["plan"] = top.get("plan")
        out[op]["phased_s"] = min(phased) if phased else None
        out[op]["streamed_over_phased"] = top["median_s"] / min(phased) if phased else None
    return out


def table_entry(record: dict) -> tuple[str, dict] | None:
    """The entry of jax_ep.tuned.TABLE the sweep measured: (GPU name, entry), or None when no
    set timed both ops. The rings are the buffer's, one shape for both ops, so the entry takes
    the shape (or the phased ops) with the least dispatch + combine time, each op at its
    fastest num_sms; from the set of the most ranks that timed both (the most contention)."""
    for run in sorted(record.get("sets", []), key=lambda run: -run["ranks"]):
        # {shape or None (phased): {op: (median, num_sms)}}, the fastest num_sms per op
        fastest: dict = {}
        for p in run["points"]:
            if p["status"] != "ok" or "median_s" not in p:
                continue
            shape = None if p["mode"] == "phased" else tuple(
                p[k] for k in ("channels", "chunk_tokens", "ring_chunks", "warps"))
            mine = fastest.setdefault(shape, {})
            if p["op"] not in mine or p["median_s"] < mine[p["op"]][0]:
                mine[p["op"]] = (p["median_s"], p["num_sms"])
        both = {shape: ops for shape, ops in fastest.items() if set(ops) == set(OPS)}
        if not both:
            continue
        shape, ops = min(both.items(), key=lambda item: sum(t for t, _ in item[1].values()))
        keys = ("channels", "chunk_tokens", "ring_chunks", "warps")
        times = ", ".join(f"{op} {ops[op][0] * 1e6:.1f} us" for op in OPS)
        phased = fastest.get(None, {})
        against = ", ".join(f"{op} {phased[op][0] * 1e6:.1f} us" for op in OPS if op in phased)
        shown = record["shape"]
        measured = (f"tools/gpu_tune.py {datetime.date.today()}, {run['ranks']} ranks "
                    f"({run['how']}), T "
                    f"{shown['tokens']} H {shown['hidden']} top-{shown['top_k']} of "
                    f"{shown['experts']}: {'phased' if shape is None else 'streamed'} "
                    f"{times}" + (f"; phased {against}" if against and shape else ""))
        return run["device"], {
            "measured": measured,
            "channels": None if shape is None else dict(zip(keys, shape, strict=True)),
            "num_sms": {op: ops[op][1] for op in OPS}}
    return None


def literal(value) -> str:
    """`value` (None, int, str, or dicts of them) as Python source on one line."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {literal(v)}" for k, v in value.items()) + "}"
    return "None" if value is None else json.dumps(value)


def render_entry(device: str, entry: dict) -> str:
    """The entry as the lines to paste into jax_ep/tuned.py's TABLE (a long string split
    into adjacent literals, within the project's 100 columns)."""
    lines = [f"    {json.dumps(device)}: {{"]
    for key, value in entry.items():
        if isinstance(value, str) and len(value) > 60:
            pieces = textwrap.wrap(value, 76, drop_whitespace=False, break_long_words=False)
            lines.append(f"        {json.dumps(key)}: (")
            lines += [f"            {json.dumps(piece)}" for piece in pieces]
            lines.append("        ),")
        else:
            lines.append(f"        {json.dumps(key)}: {literal(value)},")
    return "\n".join([*lines, "    },"])


def table(run: dict, op: str) -> list[str]:
    """The markdown table of one set's op."""
    lines = [f"{op}, {run['ranks']} ranks ({run['how']}):", "",
             "| mode | channels | chunk_tokens | ring_chunks | warps | num_sms | streams "
             "(channels x warps) | us per call | GB/s | phased us | streamed/phased |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(value, fmt="{}"):
        return "-" if value is None else fmt.format(value)

    for p in rank_points(run["points"], op):
        plan = p.get("plan")
        streams = f"{plan['channels']} x {plan['warps']}" if plan else "-"
        lines.append(
            f"| {p['mode']} | {cell(p['channels'])} | {cell(p['chunk_tokens'])} | "
            f"{cell(p['ring_chunks'])} | {cell(p['warps'])} | {p['num_sms']} | {streams} | "
            f"{p['median_s'] * 1e6:.1f} | {p['gbps']:.4g} | "
            f"{cell(p['phased_s'] and p['phased_s'] * 1e6, '{:.1f}')} | "
            f"{cell(p['vs_phased'], '{:.2f}')} |")
    others = [p for p in run["points"] if p["op"] == op and p["status"] != "ok"]
    for p in others:
        lines.append(f"- {p['mode']} {p['channels']},{p['chunk_tokens']},{p['ring_chunks']},"
                     f"{p['warps']} num_sms {p['num_sms']}: {p['status'].upper()}"
                     + (f": {p['error'][:300]}" if p["error"] else ""))
    return lines


def read_lines(path: str) -> list[dict]:
    """A worker's JSON lines; a line cut short by a killed process is left out."""
    out = []
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def write_json(path: str | None, record: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give whole numbers separated by commas (e.g. 20,28)") from None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int_list, default=[4, 2],
                        help="the sets of processes: R values separated by commas (default "
                        "4,2)")
    parser.add_argument("--tokens", type=int, help="T per rank (default 4096; --cpu 16)")
    parser.add_argument("--hidden", type=int, help="H (default 7168; --cpu 128)")
    parser.add_argument("--top-k", type=int, help="K (default 8; --cpu 2)")
    parser.add_argument("--experts", type=int, help="E (default 256; --cpu 8)")
    parser.add_argument("--rings", nargs="+", type=parse_rings,
                        help="ring shapes C,CHUNK,CHUNKS[,WARPS] (default: runtime.Channels() "
                        f"and one change at a time: {SWEEP})")
    parser.add_argument("--num-sms", type=int_list,
                        help="num_sms values separated by commas (default 20,28 for up to 4 "
                        "processes; --cpu 1,20)")
    parser.add_argument("--calls", type=int, help="op calls per timed program (default 8)")
    parser.add_argument("--repeats", type=int, help="timed runs per point (default 5)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--peer-access", choices=("store", "put"), default="store",
                        help="how the ranks reach each other ($JAX_EP_PEER_ACCESS)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="seconds for every set together, process start included; the "
                        "points past it are skipped (default 150)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a set may run past its budget before it is stopped")
    parser.add_argument("--json", help="write every point and the best settings here")
    parser.add_argument("--table", help="write the entry for jax_ep/tuned.py's TABLE here "
                        "(it is printed, and in the JSON's table_entry, either way)")
    parser.add_argument("--cpu", action="store_true",
                        help="rehearse on CPU devices (host peers), tiny shapes and grid")
    parser.add_argument("--check-mps", action="store_true",
                        help="only check that a CUDA client gets through an MPS daemon (exit "
                        "status 0 when it does)")
    parser.add_argument("--mps-checked", action="store_true",
                        help="the caller checked MPS (tools/gpu_check.sh): skip the check")
    parser.add_argument("--without-mps", action="store_true",
                        help="on a GPU without MPS, run and check the points anyway (times "
                        "not meaningful)")
    # A worker's place in its set (the launcher passes them).
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--processes-in-set", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--set-budget-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check_mps:
        return args
    for name, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, [parse_rings(r) for r in value] if name == "rings" else value)
    args.rings = args.rings or default_rings()
    for r in args.processes:
        if r < 2 or args.experts % r:
            parser.error(f"--processes: each R must be 2 or more and divide --experts "
                         f"({args.experts}); got {r}")
    if min(args.calls, args.repeats, *(args.num_sms or [1])) < 1:
        parser.error("--calls, --repeats and every --num-sms must be positive")
    return args


def how(args, ranks: int) -> str:
    if args.cpu:
        return "CPU devices, host peers: times not meaningful"
    if args.mps:
        return f"{ranks} processes on one GPU under MPS, {100 // ranks}% of the SMs each"
    return f"{ranks} processes time-slicing one GPU without MPS: times not meaningful"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.check_mps:
        return check_mps()
    if args.worker is not None:
        worker(args)
        return 0
    args.mps, why = ((False, "CPU devices") if args.cpu else (True, "") if args.mps_checked
                     else mps_state())
    if not args.cpu and not args.mps and not args.without_mps:
        print(f"tune: skipped: no MPS ({why})")
        write_json(args.json, {"skipped": f"no MPS ({why})", "not_done": NOT_DONE})
        return 0
    record = {"command": " ".join(["tools/gpu_tune.py", *sys.argv[1:]]),
              "platform": "cpu" if args.cpu else "gpu", "mps": args.mps,
              "meaningful": args.mps,
              "shape": {"tokens": args.tokens, "hidden": args.hidden, "top_k": args.top_k,
                        "experts": args.experts, "dtype": "bfloat16"},
              "calls": args.calls, "repeats": args.repeats, "peer_access": args.peer_access,
              "not_done": NOT_DONE, "sets": [], "best": {}}
    started = time.monotonic()
    finished = True
    with tempfile.TemporaryDirectory() as tmp:
        for n, ranks in enumerate(args.processes):
            # What is left of the budget, shared by the sets still to run.
            left = args.budget_s - (time.monotonic() - started)
            out = os.path.join(tmp, f"r{ranks}")
            os.makedirs(out)
            finished &= launch(args, ranks, max(left / (len(args.processes) - n), 1.0), out)
            run = merge([read_lines(os.path.join(out, f"worker{i}.jsonl"))
                         for i in range(1 if args.cpu else ranks)], ranks, args.hidden)
            run["how"] = how(args, ranks)
            run["best"] = best(run["points"])
            record["sets"].append(run)
            record["device"] = run["device"]
            record["best"].setdefault(run["device"], {})[str(ranks)] = run["best"]
            for op in OPS:
                print("\n".join(["", *table(run, op)]))
            write_json(args.json, record)  # after every set: a stopped run keeps the first
    found = table_entry(record)
    if found:
        record["table_entry"] = render_entry(*found)
        write_json(args.json, record)
        print("\ntune: the entry for jax_ep/tuned.py's TABLE (docs/gpu/README.md)"
              + ("" if record["meaningful"] else "; times not meaningful here, not for the "
                 "table") + ":\n\n" + record["table_entry"])
        if args.table:
            with open(args.table, "w") as f:
                f.write(record["table_entry"] + "\n")
    else:
        print("\ntune: no entry for jax_ep/tuned.py: no set timed both ops")
    points = [p for run in record["sets"] for p in run["points"]]
    bad = [p for p in points if p["status"] not in ("ok", SKIPPED)]
    skipped = sum(p["status"] == SKIPPED for p in points)
    print(f"\ntune: {len(points) - len(bad) - skipped} of {len(points)} points ran and match "
          f"the first point bit for bit; {skipped} skipped (time budget); {len(bad)} wrong, "
          f"failed or missing" + ("" if record["meaningful"] else "; times not meaningful"))
    print(f"tune: not done: {NOT_DONE}")
    return 0 if finished and not bad and points else 1


if __name__ == "__main__":
    sys.exit(main())
