"""python -m jax_ep.tools.bench: every op on every available backend, side by side, in one run.

On a CPU-only machine it runs on 8 virtual devices, with DeepEP's setups scaled down so that
the default run takes well under two minutes on 2 cores; on a GPU machine it uses the GPUs and
DeepEP's setups (4096 tokens per rank, hidden 7168, top-8 of 256 experts; 128 tokens per rank
in low-latency mode). --virtual runs all R ranks on one device through jax_ep.virtual (the
way to time the kernels' exchange between R ranks on a single GPU). It prints progress on
stderr, then a table on stdout: median time, device time (jax.profiler: the GPU's kernels, or
XLA:CPU's operations), bytes moved per rank (DeepEP's count), GB/s, the memory-copy floor and
each time's fraction of it, and the ratio to the pure-XLA backend. --json PATH writes every
number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import textwrap
import time
import traceback
from typing import Any

from jax_ep.tools.bench import FP8_VARIANTS, OPS
from jax_ep.tools.bench.routings import KINDS

CPU_DEFAULTS = {"ranks": 8, "tokens": 512, "ll_tokens": 32, "hidden": 2048, "repeat": 10}
GPU_DEFAULTS = {"tokens": 4096, "ll_tokens": 128, "hidden": 7168, "repeat": 50}
DTYPES = ("bfloat16", "float16", "float32")
# Calls profiled per op for its device time (at most --repeat).
DEVICE_CALLS = 5
# Platforms whose profiler traces hold the device's own events (the `source` of
# jax_ep.tools.profile.device_events is the platform's name).
DEVICE_PLATFORMS = frozenset({"gpu", "cpu"})


class UsageError(Exception):
    """Flags that describe a run the ops would reject: reported as argparse reports its own
    errors (`python -m jax_ep.tools.bench: error: ...`, exit status 2)."""


def make_parser() -> argparse.ArgumentParser:
    """The command line; the size flags left unset take the platform's defaults later."""
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.tools.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", type=int, help="EP ranks R (default: 8 on CPU, every GPU)")
    p.add_argument("--tokens", type=int, help="tokens per rank, normal mode (CPU 512, GPU 4096)")
    p.add_argument("--ll-tokens", type=int, help="tokens per rank, low-latency (CPU 32, GPU 128)")
    p.add_argument("--hidden", type=int, help="hidden size, a multiple of 128 (CPU 2048, GPU 7168)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, default=256, help="experts E (default 256)")
    p.add_argument("--routing", default="uniform", choices=KINDS, help="routing generator")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=DTYPES,
        help="normal-mode payload (low-latency is always bfloat16)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="also run the FP8 variants (dispatch_fp8, ll_dispatch_fp8)",
    )
    p.add_argument(
        "--ops",
        nargs="+",
        choices=OPS,
        metavar="OP",
        help=f"ops to time (default: all but the FP8 ones): {', '.join(OPS)}",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        metavar="NAME",
        help="backends to time (default: all of jax_ep.backends.BACKENDS)",
    )
    p.add_argument(
        "--virtual",
        action="store_true",
        help="all R ranks on one device (jax_ep.virtual; default R = 8)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after the compiling one")
    p.add_argument("--repeat", type=int, help="timed calls per op (default 10 on CPU, 50 on GPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and the tokens")
    p.add_argument(
        "--model",
        default="auto",
        choices=("auto", "H800", "H100", "H200"),
        help="hardware of the performance model's column (jax_ep.tools.perfmodel). auto: this "
        "machine's copy bandwidth when one memory holds every rank (CPU devices, --virtual), "
        "else the GPU's preset",
    )
    p.add_argument(
        "--device-time",
        default="auto",
        choices=("auto", "on", "off"),
        help="also time each op's device work under jax.profiler (a few more calls): on a GPU "
        "its kernels, on CPU XLA:CPU's operations. auto (the default): where the platform's "
        "trace holds such events (GPU, CPU), else off; on: likewise, saying why where it "
        "cannot; off: never",
    )
    p.add_argument("--json", metavar="PATH", help="write every number to PATH")
    p.add_argument(
        "--require",
        nargs="+",
        default=[],
        metavar="NAME",
        help="exit non-zero unless every op of these backends was timed (no n/a rows): "
        "e.g. --require cuda, so that a run without the compiled kernels cannot pass",
    )
    return p


def selected_ops(args: argparse.Namespace) -> list[str]:
    """--ops (default: every op but the FP8 ones), plus each one's FP8 variant with --fp8."""
    ops = set(args.ops or [op for op in OPS if op not in FP8_VARIANTS.values()])
    if args.fp8:
        ops |= {FP8_VARIANTS[op] for op in ops if op in FP8_VARIANTS}
    return [op for op in OPS if op in ops]


def rerun_command(args: argparse.Namespace, settings: dict[str, Any]) -> str:
    """The command line that reruns this configuration, every size spelled out (with the
    environment variables that choose a backend's path)."""
    words = [f"{name}={os.environ[name]}" for name in ("JAX_EP_BACKEND", "JAX_EP_XLA_TRANSPORT")
             if os.environ.get(name)]
    words += ["python", "-m", "jax_ep.tools.bench"]
    for name, value in settings.items():
        words += [f"--{name.replace('_', '-')}", str(value)]
    # Left at their defaults, these select the same ops and backends again.
    if args.fp8:
        words.append("--fp8")
    if args.virtual:
        words.append("--virtual")
    if args.ops:
        words += ["--ops", *args.ops]
    if args.backends:
        words += ["--backends", *args.backends]
    if args.model != "auto":
        words += ["--model", args.model]
    if args.device_time != "auto":
        words += ["--device-time", args.device_time]
    if args.json:
        words += ["--json", args.json]
    return shlex.join(words)


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def run_case(
    op: str,
    backend: str,
    inputs: Any,
    warmup: int,
    repeat: int,
    unavailable: str | None,
    virtual: bool = False,
    device_source: str | None = None,
    one_memory: bool = False,
) -> dict[str, Any]:
    """Times one (op, backend) and returns its row, with status "ok", "n/a" or "error".

    n/a: the backend cannot run at all (`unavailable` says why) or does not implement the op.
    error: anything else went wrong; the traceback goes to stderr and the run goes on (the
    exit status will be 1).
    device_source: "gpu" or "cpu" to add the device time of min(DEVICE_CALLS, repeat) more
    calls (`device_s`, per call, with the longest `kernels`), None for none. Where it cannot
    be read the row is still timed, with `device_s` None and `device_reason`.
    one_memory: one memory holds every rank (CPU devices, virtual ranks): device time is
    every device's work on one timeline.
    """
    from jax_ep.tools.bench import suite, timing, virtual_cases

    row: dict[str, Any] = {"op": op, "backend": backend, "status": "ok"}
    if unavailable is not None:
        return {**row, "status": "n/a", "reason": f"backend unavailable: {unavailable}"}
    try:
        case = suite.build_case(op, inputs, backend,
                                virtual_cases.CASES if virtual else None)
        t = timing.time_calls(case.fn, case.args, warmup=warmup, repeat=repeat)
        device = device_time_of(case, device_source, min(DEVICE_CALLS, repeat), one_memory)
    except NotImplementedError as error:
        return {**row, "status": "n/a", "reason": str(error)}
    except Exception as error:  # report it, time the rest, fail at the end
        traceback.print_exc(file=sys.stderr)
        return {**row, "status": "error", "reason": f"{type(error).__name__}: {error}"}
    if backend == "xla":
        from jax_ep.backends import xla
        from jax_ep.virtual import VMAP_TRANSPORT

        row["transport"] = VMAP_TRANSPORT if virtual else xla.transport(inputs.setup.ranks)
    out = {
        **row,
        "time": dataclasses.asdict(t),
        "bytes_per_rank": case.bytes_per_rank,
        "gbps": case.bytes_per_rank / t.median / 1e9,
        **device,
    }
    account = suite.case_account(op, inputs, virtual) if backend == "cuda" else None
    if account is not None:
        out["account"] = {**dataclasses.asdict(account), "ratio": account.ratio}
    return out


def device_time_of(case: Any, source: str | None, calls: int, one_memory: bool
                   ) -> dict[str, Any]:
    """The row's device-time fields for `run_case`: {} when not asked for; else `device_s`
    (seconds per call: every device's work on one timeline where one memory holds every
    rank, else the busiest device's) and `kernels`, or `device_s` None and `device_reason`."""
    from jax_ep.tools.bench import timing

    if source is None:
        return {}
    try:
        measured = timing.device_time(case.fn, case.args, calls=calls, source=source)
    except Exception as error:  # the profiler's failure costs the column, not the row
        return {"device_s": None, "device_reason": f"{type(error).__name__}: {error}"}
    if measured is None or measured.seconds(one_memory) <= 0:
        return {"device_s": None, "device_reason": f"jax.profiler's trace holds no {source} "
                "device events with a duration (jax_ep.tools.profile.device_events)"}
    return {"device_s": measured.seconds(one_memory), "device_calls": calls,
            "kernels": measured.kernels}


# Which prediction of jax_ep.tools.perfmodel each op is: (mode, FP8 dispatch, parts).
MODELLED = {
    "dispatch": ("normal", False, ("dispatch",)),
    "dispatch_fp8": ("normal", True, ("dispatch",)),
    "combine": ("normal", False, ("combine",)),
    "dispatch+combine": ("normal", False, ("dispatch", "combine")),
    "ll_dispatch": ("low_latency", False, ("dispatch",)),
    "ll_dispatch_fp8": ("low_latency", True, ("dispatch",)),
    "ll_combine": ("low_latency", False, ("combine",)),
    "ll_round_trip": ("low_latency", False, ("dispatch", "combine")),
}


def model_hardware(choice: str, shared: bool, device_kind: str, bandwidth: float) -> Any:
    """The perfmodel hardware of the "model" column (see --model)."""
    from jax_ep.tools import perfmodel

    if choice != "auto":
        return perfmodel.PRESETS[choice]
    if shared:
        return perfmodel.SharedDevice("this machine, all ranks", copy_gbps=bandwidth / 1e9)
    return next((perfmodel.PRESETS[n] for n in ("H800", "H200", "H100") if n in device_kind),
                perfmodel.H100)


def add_predictions(rows: list[dict[str, Any]], setup: Any, hardware: Any) -> None:
    """Adds model_s, jax_ep.tools.perfmodel's time for the row's op at this run's sizes (uniform
    routing assumed), to every row whose op the model covers."""
    from jax_ep.tools import perfmodel

    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[setup.dtype]
    for r in rows:
        if r["op"] not in MODELLED:
            continue
        mode, use_fp8, parts = MODELLED[r["op"]]
        low_latency = mode == "low_latency"
        config = perfmodel.Config(
            num_tokens=setup.ll_tokens if low_latency else setup.tokens, hidden=setup.hidden,
            num_topk=setup.top_k, num_experts=setup.experts, num_ranks=setup.ranks,
            fp8_dispatch=use_fp8, dtype_bytes=2 if low_latency else itemsize)
        prediction = perfmodel.predict(config, hardware, mode=mode)
        r["model_s"] = sum(getattr(prediction, f"{part}_s") for part in parts)


def add_ratios(rows: list[dict[str, Any]], bandwidth: float, shared_memory_ranks: int) -> None:
    """Adds floor_s, of_floor and vs_xla to the timed rows (vs_xla None where not timed), and
    of_floor_device (the floor over the device time) to those with a device time.

    Args:
      rows: the rows of `run_case`.
      bandwidth: copy bandwidth in bytes/s, read + write.
      shared_memory_ranks: ranks whose bytes one memory moves (R on CPU, 1 per GPU).
    """
    xla = {r["op"]: r["time"]["median"] for r in rows if r["backend"] == "xla" and "time" in r}
    for r in rows:
        r["vs_xla"] = None
        if r["status"] != "ok":
            continue
        median = r["time"]["median"]
        r["floor_s"] = 2 * r["bytes_per_rank"] * shared_memory_ranks / bandwidth
        r["of_floor"] = r["floor_s"] / median
        if r.get("device_s"):
            r["of_floor_device"] = r["floor_s"] / r["device_s"]
        if r["op"] in xla:
            r["vs_xla"] = median / xla[r["op"]]


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per (op, backend); rows not timed show their status ("n/a", "error")."""
    header = (
        f"{'op':<17} {'backend':<8} {'time':>10} {'device':>10} {'bytes/rank':>11} {'GB/s':>8} "
        f"{'floor':>10} {'of floor':>9} {'(device)':>8} {'vs xla':>7} {'model':>10} "
        f"{'launches':>8} {'barriers':>8} {'moved/min':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        line = f"{r['op']:<17} {r['backend']:<8} "
        if r["status"] != "ok":
            print(line + f"{r['status']:>10}")
            continue
        vs_xla = f"{r['vs_xla']:.2f}" if r["vs_xla"] is not None else "-"
        model = fmt_time(r["model_s"]) if "model_s" in r else "-"
        device = fmt_time(r["device_s"]) if r.get("device_s") else "-"
        of_device = f"{r['of_floor_device']:.3g}" if "of_floor_device" in r else "-"
        a = r.get("account")
        account = (f"{a['launches']:>8} {a['barriers']:>8} {a['ratio']:>9.2f}" if a
                   else f"{'-':>8} {'-':>8} {'-':>9}")
        print(
            line + f"{fmt_time(r['time']['median']):>10} {device:>10} "
            f"{fmt_bytes(r['bytes_per_rank']):>11} {r['gbps']:>8.3g} {fmt_time(r['floor_s']):>10} "
            f"{r['of_floor']:>9.3g} {of_device:>8} {vs_xla:>7} {model:>10} {account}"
        )


def print_wire(wire: dict[str, dict[str, float]]) -> None:
    """Bytes each rank sends to the others per op: the routed minimum, then each transport's
    bytes and their ratio to the minimum."""
    from jax_ep.tools.bench.wire import TRANSPORTS

    header = f"{'op':<17} {'minimum':>11}" + "".join(
        f" {name:>11} {'x min':>6}" for name in TRANSPORTS)
    print("bytes sent to other ranks, per rank")
    print(header)
    print("-" * len(header))
    for op, w in wire.items():
        cells = "".join(
            f" {fmt_bytes(w[n]):>11} {w[n] / w['minimum'] if w['minimum'] else 1.0:>6.2f}"
            for n in TRANSPORTS)
        print(f"{op:<17} {fmt_bytes(w['minimum']):>11}" + cells)


def device_meaning(source: str | None, calls: int, shared: bool, why_not: str | None) -> str:
    """The footnote's paragraph on the device column: what device time is on this platform."""
    if source is None:
        return f"device: not measured ({why_not})."
    head = (f"device: device time of one call, from jax.profiler over {calls} more calls "
            "(--device-time): ")
    tail = (" of floor (device) = floor / device. The JSON rows also list the longest "
            "kernels (launches and ms per call, summed over the devices).")
    if source == "gpu":
        several = ("one GPU runs every virtual rank" if shared
                   else "the busiest GPU's where there are several")
        return (head + "the time the GPU's kernels and memory copies ran (the union of their "
                f"intervals, so concurrent streams count once; {several}). The launch, the "
                "host's wait and the gaps between kernels, all in the wall time, are not in "
                "it." + tail)
    return (head + "the time XLA:CPU ran the program's operations on the host's threads "
            "(the profiler's events with an hlo_op: one per operation and virtual device; a "
            "loop counted by its body's operations), their union over every virtual device, "
            "which share the cores and the memory that the floor counts. The host's dispatch "
            "of the program is not in it; an operation waiting for the other devices at a "
            "collective is, and so are the cuda backend's custom calls, which run the "
            "kernels' CPU emulation. device is a mean over its calls, time a median over "
            "its own: on a busy CPU one slow call can put device above time." + tail)


def device_notes(rows: list[dict[str, Any]], why_not: str | None) -> list[str]:
    """Why device time is missing: for the whole run (`why_not`, with --device-time on),
    and per reason, the rows timed without it."""
    notes = [f"device time, every op: {why_not}"] if why_not else []
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] == "ok" and r.get("device_reason"):
            reasons.setdefault(r["device_reason"], []).append(f"{r['op']} {r['backend']}")
    return notes + [f"device time, {', '.join(which)}: {why}" for why, which in reasons.items()]


def footnote(bandwidth: float, shared: bool, backends: list[str], on_cpu: bool,
             hardware: Any, device: str) -> list[str]:
    """Paragraphs explaining the table's columns (`device`: `device_meaning`'s)."""
    scope = "all R ranks' bytes: the ranks share one memory" if shared else "per GPU"
    lines = [
        "time: median wall time of one call of the jitted program over all R ranks, "
        "waited for with block_until_ready (the first call compiles and is not timed).",
        device,
        "bytes/rank: bytes moved per rank, DeepEP's count averaged over the ranks. Normal mode: "
        "rows received (the rank's own included) x H x bytes per element (FP8: x (H + H/128 x 4 "
        "bytes of scales)); combine the same rows; dispatch+combine both. Low-latency: one "
        "message per (token, expert) selection, x H x 2 (FP8: x (H + H/128 x 4)); combine the "
        "same; round trip both. layout: topk_idx read + outputs written.",
        "GB/s: bytes/rank / time.",
        f"floor: time to read and write those bytes once at this machine's copy bandwidth "
        f"({bandwidth / 1e9:.1f} GB/s counting read + write; {scope}; "
        f"{'a NumPy copy' if on_cpu else '16 copies of 1 GiB in one program, timed together'}"
        f"); of floor = floor / time (1.0 = at the floor).",
        "vs xla: time / the xla backend's time for the same op (below 1 = faster than xla).",
        f"model: jax_ep.tools.perfmodel's prediction for {hardware.name} (uniform routing; "
        "docs/perfmodel.md; --model picks the hardware).",
        "launches, barriers, moved/min (cuda rows): jax_ep.tools.account's count of what the "
        "kernels do, per rank's stream: kernel launches, barriers between "
        "ranks, and bytes of row data read + written over the bytes that must move (targets: "
        "dispatch <= 3 launches, combine <= 2, low latency <= 2 per half; moved/min <= 1.15). "
        "Checked against the CPU handlers' own counts in tests/test_account.py.",
        "bytes sent to other ranks (jax_ep.tools.bench.wire, from the routing): the routed minimum "
        "(normal mode and low-latency dispatch: one row per token and other rank it goes to; "
        "low-latency combine: one row per token and distinct expert on another rank), and "
        "what each transport sends: the xla backend's all_gather (every token to every rank) "
        "and ragged (ragged_all_to_all of the routed rows with their routing, and an "
        "all_gather of the counts; the header says which one the xla rows ran, "
        "$JAX_EP_XLA_TRANSPORT chooses), and the cuda kernels (row data; low latency: one "
        "message per token and expert).",
        "Timed with the default arguments: their value checks compile to nothing, and the "
        "default capacity never drops a row.",
    ]
    if on_cpu and "cuda" in backends:
        lines.append(
            "On CPU the cuda backend's rows time the kernels' CPU emulation: the same phase "
            "bodies run on host threads, one per lane of each 32-lane warp, and between "
            "devices through host peers that jax_ep.initialize() set up (the benchmark calls "
            "it). They show that the ops run, not how fast a GPU runs them: a low-latency "
            "round trip, whose kernels wait on each other's flags, can take 10-100x the xla "
            "backend's time here.")
    return lines


def readings(rows: list[dict[str, Any]], setup: Any, hardware: Any, on_cpu: bool,
             virtual: bool) -> list[str]:
    """Paragraphs on numbers that look wrong at first sight, printed where they occur."""
    from jax_ep.tools import perfmodel

    notes = []
    median = {(r["op"], r["backend"]): r["time"]["median"] for r in rows if r["status"] == "ok"}
    if on_cpu and isinstance(hardware, perfmodel.SharedDevice) and any(
            "model_s" in r for r in rows):
        notes.append(
            "model on CPU: a floor, not a forecast. It is one launch plus the bytes at this "
            "machine's copy bandwidth (perfmodel.SharedDevice), so the times sit 10-100x above "
            "it: the program also fills the receive buffers it returns (padding included), "
            "moves what the transport sends (x min in the table above), and sorts, scatters "
            f"and gathers rows on {os.cpu_count()} cores"
            + ("" if virtual else ", its R device threads meeting at every collective")
            + ". On a GPU the column is the model fitted to DeepEP's tables (--model "
            "H800|H100|H200).")
    slots = setup.experts * setup.ranks * setup.ll_tokens * setup.hidden * 2  # all ranks
    for backend in dict.fromkeys(r["backend"] for r in rows):
        trip, alone = median.get(("ll_round_trip", backend)), median.get(("ll_dispatch", backend))
        if trip is not None and alone is not None and trip < alone:
            notes.append(
                f"ll_round_trip < ll_dispatch ({backend}): low-latency dispatch returns its "
                f"whole receive buffer, E/R local experts x R*T slots x H per rank "
                f"({slots / 1e6:.0f} MB over the ranks here, mostly empty slots), and that "
                "buffer is written when it is made. In the round trip it stays inside one "
                "program, where the combine reads only the filled slots and XLA need not "
                "write the rest. bytes/rank counts the messages only.")
    return notes


def notes_for(rows: list[dict[str, Any]], unavailable: dict[str, str]) -> list[str]:
    """Why rows were not timed: per unavailable backend, per backend's missing ops, per error."""
    notes = [f"n/a, {name} (every op): {why}" for name, why in unavailable.items()]
    for name in dict.fromkeys(r["backend"] for r in rows):
        if name in unavailable:
            continue
        reasons: dict[str, list[str]] = {}
        for r in rows:
            if r["backend"] == name and r["status"] == "n/a":
                reasons.setdefault(r["reason"], []).append(r["op"])
        notes += [f"n/a, {name}: {', '.join(ops)}: {why}." for why, ops in reasons.items()]
    notes += [
        f"error, {r['op']} {r['backend']}: {r['reason']}" for r in rows if r["status"] == "error"
    ]
    return notes


def make_setup(args: argparse.Namespace, num_devices: int, on_cpu: bool) -> tuple[Any, int]:
    """The run's Setup and repeat count: the flags given, else the platform's defaults.

    Raises UsageError when the flags describe a run the ops would reject.
    """
    from jax_ep.tools.bench import suite

    defaults = CPU_DEFAULTS if on_cpu else GPU_DEFAULTS

    def pick(value: int | None, name: str) -> int:
        return defaults[name] if value is None else value

    ranks = num_devices if args.ranks is None else args.ranks  # on CPU: the count asked for
    if args.virtual and args.ranks is None:
        ranks = CPU_DEFAULTS["ranks"]
    if ranks > num_devices and not args.virtual:
        raise UsageError(f"--ranks {ranks}: only {num_devices} devices are available.")
    setup = suite.Setup(
        ranks=ranks,
        tokens=pick(args.tokens, "tokens"),
        ll_tokens=pick(args.ll_tokens, "ll_tokens"),
        hidden=pick(args.hidden, "hidden"),
        top_k=args.top_k,
        experts=args.experts,
        routing=args.routing,
        dtype=args.dtype,
        seed=args.seed,
    )
    try:
        setup.check()
    except ValueError as error:
        raise UsageError(str(error)) from None
    return setup, pick(args.repeat, "repeat")


def check_json_path(path: str | None) -> None:
    """Raises UsageError before any timing when --json cannot be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--json {path}: the folder {folder} does not exist.")
    if not os.access(folder, os.W_OK) or os.path.isdir(path):
        raise UsageError(f"--json {path}: cannot write a file there.")


def check_memory(setup: Any, memory_bytes: int | None, shared: bool) -> None:
    """Raises UsageError when the run's largest buffers will not fit: per rank, the tokens
    gathered from every rank, the rows received and combine's blocks (R x T x H each, normal
    mode), and the low-latency slots (E/R x R x T x H). `shared`: one memory holds every
    rank's buffers."""
    if memory_bytes is None:
        return
    s = setup
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[s.dtype]
    per_rank = 3 * s.ranks * s.tokens * s.hidden * itemsize
    per_rank += 3 * (s.experts // s.ranks) * s.ranks * s.ll_tokens * s.hidden * 2
    need = per_rank * (s.ranks if shared else 1)
    if need > memory_bytes:
        raise UsageError(
            f"--ranks {s.ranks} --tokens {s.tokens} --ll-tokens "
            f"{s.ll_tokens} --hidden {s.hidden} need about {need / 2**30:.1f} GiB "
            f"({'all ranks in this memory' if shared else 'per device'}), more than the "
            f"{memory_bytes / 2**30:.1f} GiB {'this machine' if shared else 'a device'} "
            f"holds; lower them."
        )


def memory_of(device: Any) -> int | None:
    """Bytes the device can hold: the host's memory on the CPU, else its allocator limit."""
    if device.platform == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


def main(argv: list[str]) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as error:
        parser.error(str(error))


def run(args: argparse.Namespace) -> int:
    if (args.repeat is not None and args.repeat < 1) or args.warmup < 0:
        raise UsageError("--repeat must be at least 1 and --warmup at least 0")
    check_json_path(args.json)
    # Virtual CPU devices must be asked for before jax starts a backend: XLA reads XLA_FLAGS
    # then (importing the jax_ep package imports jax, which starts none). The flag shapes only
    # the host platform: where jax finds GPUs it uses them, and the flag changes nothing.
    count = args.ranks or CPU_DEFAULTS["ranks"]
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    ).strip()

    import jax

    import jax_ep
    from jax_ep.tools.bench import suite, timing

    devices = jax.devices()
    platform = devices[0].platform
    on_cpu = platform == "cpu"
    setup, repeat = make_setup(args, len(devices), on_cpu)
    check_memory(setup, memory_of(devices[0]), on_cpu or args.virtual)
    shared = on_cpu or args.virtual  # one memory moves every rank's bytes
    device_source = (platform if args.device_time != "off" and platform in DEVICE_PLATFORMS
                     else None)
    device_calls = min(DEVICE_CALLS, repeat)
    why_not = None
    if args.device_time == "off":
        why_not = "--device-time off"
    elif device_source is None:
        why_not = (f"jax_ep reads device time from GPU and CPU traces only; this run's "
                   f"platform is {platform}")
    ops = selected_ops(args)
    names = args.backends or list(jax_ep.backends.BACKENDS)
    unknown = [n for n in names if n not in jax_ep.backends.BACKENDS]
    if unknown:
        raise UsageError(f"--backends: unknown {unknown}; choose from "
                         f"{list(jax_ep.backends.BACKENDS)}.")
    settings = {**dataclasses.asdict(setup), "warmup": args.warmup, "repeat": repeat}
    command = rerun_command(args, settings)
    device = f"{devices[0].device_kind} x{setup.ranks}"
    if args.virtual:
        device = f"{devices[0].device_kind} x1 with {setup.ranks} virtual ranks"
    elif on_cpu:
        device += f" (virtual devices on {os.cpu_count()} cores)"

    started = time.perf_counter()
    print(f"jax_ep.tools.bench on {device}: measuring the copy bandwidth ...", file=sys.stderr)
    bandwidth = timing.copy_bandwidth(devices[0])
    inputs = suite.make_inputs(setup, None if args.virtual else suite.make_mesh(setup.ranks))
    # A backend that cannot run at all (no compiled extension) is skipped with a note.
    unavailable = {n: why for n in names if (why := suite.backend_unavailable(n, platform))}
    if "cuda" in names and "cuda" not in unavailable and not args.virtual and setup.ranks > 1:
        suite.initialize_for(setup)  # its exchanges between devices
    rows: list[dict[str, Any]] = []
    total = len(ops) * len(names)
    for op in ops:
        for name in names:
            counter = f"[{len(rows) + 1}/{total}]"
            progress = f"{counter:>{2 * len(str(total)) + 3}} {op:<17} {name:<5} ..."
            print(progress, end=" ", file=sys.stderr, flush=True)
            row = run_case(
                op, name, inputs, args.warmup, repeat, unavailable.get(name), args.virtual,
                device_source, shared,
            )
            done = fmt_time(row["time"]["median"]) if row["status"] == "ok" else row["status"]
            if row.get("device_s"):
                done += f" (device {fmt_time(row['device_s'])})"
            print(done, file=sys.stderr, flush=True)
            rows.append(row)
    wire = {op: w for op in ops if (w := suite.case_wire(op, inputs)) is not None}
    add_ratios(rows, bandwidth, setup.ranks if shared else 1)
    hardware = model_hardware(args.model, shared, devices[0].device_kind, bandwidth)
    add_predictions(rows, setup, hardware)
    notes = readings(rows, setup, hardware, on_cpu, args.virtual)
    not_timed = notes_for(rows, unavailable)
    no_device = device_notes(rows, why_not if args.device_time == "on" else None)
    device_paragraph = device_meaning(device_source, device_calls, shared, why_not)
    elapsed = time.perf_counter() - started

    print(f"\njax_ep.tools.bench on {device}, jax {jax.__version__}, jax_ep {jax_ep.__version__}")
    print(
        f"R={setup.ranks}; normal: T={setup.tokens}/rank, H={setup.hidden}, {setup.dtype}; "
        f"low-latency: T={setup.ll_tokens}/rank, bfloat16; top-{setup.top_k} of "
        f"E={setup.experts}; routing {setup.routing}; median of {repeat} calls after "
        f"{args.warmup} warm-up"
    )
    transports = {r["transport"] for r in rows if "transport" in r}
    if transports:
        print(f"xla backend's transport: {', '.join(sorted(transports))}")
    print(f"rerun: {command}\n")
    if not_timed:  # before the table, so that its n/a rows are explained where they are read
        print("Not timed (n/a or error in the table below):")
        for paragraph in not_timed:
            print(textwrap.fill(paragraph, width=100, initial_indent="- ",
                                subsequent_indent="  "))
        print()
    if no_device:  # likewise for the device column's "-"
        print("Device time not read (- in the device column below):")
        for paragraph in no_device:
            print(textwrap.fill(paragraph, width=100, initial_indent="- ",
                                subsequent_indent="  "))
        print()
    print_table(rows)
    print()
    print_wire(wire)
    print()
    ran = [n for n in names if n not in unavailable]
    for paragraph in footnote(bandwidth, shared, ran, on_cpu, hardware,
                              device_paragraph) + notes:
        print(textwrap.fill(paragraph, width=100, subsequent_indent="  "))
    print(f"Total {elapsed:.0f} s.")

    if args.json:
        record = {
            "command": command,
            "device": {
                "kind": devices[0].device_kind,
                "platform": platform,
                "ranks": setup.ranks,
                "virtual": on_cpu,
                "virtual_ranks": args.virtual,
                "cpu_cores": os.cpu_count(),
            },
            "jax": jax.__version__,
            "jax_ep": jax_ep.__version__,
            "config": {**settings, "ops": ops, "backends": names},
            "copy_bandwidth_Bps": bandwidth,
            "model_hardware": hardware.name,
            "device_time": {"mode": args.device_time, "source": device_source,
                            "calls": device_calls if device_source else None,
                            "meaning": device_paragraph},
            "rows": rows,
            "wire_bytes_per_rank": wire,
            "notes": notes + not_timed + no_device,
            "total_s": elapsed,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    missing = [f"{r['op']} {r['backend']}" for r in rows
               if r["backend"] in args.require and r["status"] != "ok"]
    missing += [f"backend {n} (not selected)" for n in args.require if n not in names]
    if missing:
        print(f"python -m jax_ep.tools.bench: error: --require: not timed: {', '.join(missing)}",
              file=sys.stderr)
        return 1
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
