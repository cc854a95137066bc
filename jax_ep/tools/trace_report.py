"""Communication and compute in a profiler trace: busy time, overlap, SMs, phases.

`python -m jax_ep.tools.trace_report TRACE [--png OUT] [--json OUT] ...` reads a Chrome trace
(JSON, optionally gzipped, or a directory holding one) written by the PyTorch profiler or by
`jax.profiler` (raw, or labelled by `jax_ep.tools.profile.capture`) and prints, for one device:

- per-stream busy time in the analysis window (by default from the first kernel's start to
  the last kernel's end),
- the fraction of communication time that compute runs under:
  |union(comm) ∩ union(compute)| / |union(comm)|, per stream and in total,
- the blocks and SMs that communication kernels use (SMs = min(blocks, SM count)),
- a breakdown per phase: the innermost user annotation active when the kernel was launched
  on the CPU (found through the launch's correlation id or flow event), or the kernel's own
  named scope in JAX traces.

Which events count as the device's work is an explicit choice (`events`): "gpu" takes GPU
kernels, memory copies and memsets (PyTorch `kernel`/`gpu_memcpy`/`gpu_memset` events, or
the stream threads of a JAX `/device:GPU:N` process); "host-xla" takes the XLA operations
that XLA:CPU runs on host threads (events with an `hlo_op`), for traces taken without a GPU;
"auto" takes "gpu" when the trace has GPU work, else "host-xla".

Kernels are communication when their name matches one of the built-in families below
(DeepEP, jax_ep, NVSHMEM, NCCL, XLA collectives, peer copies) or a user pattern; memory
copies and memsets are "other"; everything else is compute. Names are searched as written in
the trace; in labelled JAX traces they include the named scope, so every operation under a
`jax_ep.*` scope counts as communication, its local work included.

Communication kernels that wait for their peers by spinning stay resident while they wait,
so their busy time is an upper bound on the time spent moving data.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gzip
import json
import math
import re
import sys
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

Interval = tuple[float, float]
Kind = Literal["comm", "compute", "other"]
EventSelection = Literal["auto", "gpu", "host-xla"]
EVENT_SELECTIONS = ("auto", "gpu", "host-xla")

# Communication families, tried in order; the first match names the kernel's family.
BUILTIN_FAMILIES: tuple[tuple[str, str], ...] = (
    ("DeepEP", r"\b(?:dpsk::ep|deep_ep)::"),
    ("jax_ep", r"jax_ep"),
    ("NVSHMEM", r"(?i)nvshmem"),
    ("NCCL", r"(?i)nccl"),
    ("XLA collective", r"(?<!\w)(?:(?:ragged[-_])?all[-_]to[-_]all|all[-_]gather|all[-_]reduce"
                       r"|reduce[-_]scatter|collective[-_]permute|collective[-_]broadcast"
                       r"|psum\w*|ppermute|pbroadcast)"),
    ("peer copy", r"(?i)memcpy\W*(?:ptop|p2p|peer)"),
)
CUSTOM_FAMILY = "custom"

# PyTorch's GPU event categories -> whether the event is a memory operation.
_PYTORCH_DEVICE_CATEGORIES = {"kernel": False, "gpu_memcpy": True, "gpu_memset": True}
_MEMORY_OP = re.compile(r"(?i)^\s*mem(?:cpy|set)")
_GPU_PROCESS = re.compile(r"/device:GPU:(\d+)|\bGPU (\d+)\b")
_GRID = re.compile(r"grid:\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)")
_OP_NUMBER = re.compile(r"\.\d+$")  # all-to-all.3 -> all-to-all
_TRACE_FILE = re.compile(r"\.(?:trace\.)?json(?:\.gz)?$")
# Leading scope components that only say the code was jitted or mapped.
_WRAPPER_SCOPE = re.compile(r"^(?:jit|pjit|pmap|xla_pmap)[(_].*$|^shard_map$")


# ----------------------------------------------------------------------------- reading


def load_trace(path: str | Path) -> tuple[dict[str, Any], Path]:
    """Reads a Chrome trace from a `.json`/`.json.gz` file or the newest one below a directory.

    Returns:
      The trace as a dict with `traceEvents`, and the file it was read from.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace_report: trace {str(path)!r} does not exist; pass a .json or "
                         ".json.gz Chrome trace, or a jax.profiler log directory.")
    if path.is_dir():
        candidates = [p for p in path.rglob("*") if p.is_file() and _TRACE_FILE.search(p.name)]
        if not candidates:
            raise ValueError(f"trace_report: no *.json or *.json.gz trace below directory "
                             f"{str(path)!r}; pass the trace file itself.")
        path = max(candidates, key=lambda p: (p.stat().st_mtime, p.name))
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, EOFError, zlib.error, ValueError) as error:  # ValueError: JSON, UTF-8
        raise ValueError(f"trace_report: {str(path)!r} is not a (gzipped) JSON trace in UTF-8: "
                         f"{type(error).__name__}: {error}") from error
    except RecursionError as error:
        raise ValueError(f"trace_report: {str(path)!r} nests its JSON too deeply to be a "
                         "Chrome trace.") from error
    if isinstance(data, list):  # the Chrome format also allows a bare event array
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"trace_report: {str(path)!r} has no 'traceEvents' list; is it a "
                         "Chrome trace?")
    data["traceEvents"], skipped = well_formed(data["traceEvents"])
    if skipped:  # reported by the command line beside the report
        data["skipped"] = skipped
    return data, path


# Event phases that sit on the timeline, so need a time stamp.
_TIMED_PHASES = frozenset("XBEiIsftCbne")


def _number(value: Any) -> bool:
    """A finite int or float (not a bool, not a string)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _malformed(event: Any) -> str | None:
    """Why `event` cannot be used (the field at fault), or None."""
    if not isinstance(event, dict):
        return "not a JSON object"
    args = event.get("args")
    if args is not None and not isinstance(args, dict):
        return "'args' is not an object"
    timed = "ts" in event or event.get("ph") in _TIMED_PHASES
    if timed and not _number(event.get("ts")):
        return "'ts' missing or not a finite number"
    if "dur" in event and not (_number(event["dur"]) and event["dur"] >= 0):
        return "'dur' not a finite number >= 0"
    args = args or {}
    grid = args.get("grid")
    if grid is not None and not (isinstance(grid, list | tuple)
                                 and all(isinstance(g, int) and g >= 0 for g in grid)):
        return "'args.grid' not a list of block counts"
    device = args.get("device")
    if device is not None and not (isinstance(device, int) and not isinstance(device, bool)
                                   and device >= 0):
        return "'args.device' not a device index"
    return None


def well_formed(events: list[Any]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The events the report can use, and how many were skipped for each reason (an event
    with a bad time, duration, argument list, grid or device is left out and counted, never
    half-used)."""
    kept, skipped = [], {}
    for event in events:
        why = _malformed(event)
        if why is None:
            kept.append(event)
        else:
            skipped[why] = skipped.get(why, 0) + 1
    return kept, skipped


# ------------------------------------------------------------------------ classification


@dataclasses.dataclass(frozen=True)
class Classifier:
    """Decides whether a kernel is communication, compute or other.

    Attributes:
      comm: extra regexes (searched in the kernel name) that mean communication.
      compute: regexes that mean compute; they override the built-in communication families.
      builtin: whether the built-in families (`BUILTIN_FAMILIES`) apply.
    User patterns come first: `comm`, then `compute`, then the built-in families.
    """

    comm: tuple[str, ...] = ()
    compute: tuple[str, ...] = ()
    builtin: bool = True

    def __post_init__(self) -> None:
        for field in ("comm", "compute"):
            for pattern in getattr(self, field):
                try:
                    re.compile(pattern)
                except re.error as error:
                    raise ValueError(f"trace_report: {field} pattern {pattern!r} is not a "
                                     f"valid regular expression ({error}); fix or quote "
                                     "it.") from error

    def classify(self, name: str, memory_op: bool = False) -> tuple[Kind, str | None]:
        """(kind, communication family or None) for a kernel called `name`."""
        if any(re.search(p, name) for p in self.comm):
            return "comm", CUSTOM_FAMILY
        if any(re.search(p, name) for p in self.compute):
            return "compute", None
        if self.builtin:
            for family, pattern in BUILTIN_FAMILIES:
                if re.search(pattern, name):
                    return "comm", family
        return ("other" if memory_op else "compute"), None


def short_name(name: str) -> str:
    """A kernel's name for grouping: a C++ name without return type, template arguments and
    parameters; a labelled XLA operation `scope/path/primitive (op.12)` as `primitive (op)`."""
    name = re.sub(r"^void\s+", "", name.strip())
    if "/" in name and name.endswith(")") and " (" in name:
        scope, op = name[:-1].rsplit(" (", 1)
        primitive = scope.rstrip(")").split(":")[0].split("/")[-1]
        return f"{primitive} ({_OP_NUMBER.sub('', op)})"
    if "/" in name:  # a scope path without an operation
        return name.split("/")[-1]
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            if ch == "(":
                break
            out.append(ch)
    return "".join(out).strip() or name


# --------------------------------------------------------------------------- event model


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One interval of device work.

    Attributes:
      name: the name as written in the trace.
      stream: the stream (GPU) or host thread (XLA:CPU) it ran on.
      start, duration: microseconds, on the trace's clock.
      kind: "comm", "compute" or "other" (memory copies and memsets).
      family: the communication family ("DeepEP", "NCCL", ...) or None.
      blocks: thread blocks in the launch grid, None where the trace does not say.
      phase: the user annotation or named scope it belongs to, None where there is none.
      instance: which occurrence of `phase` (an annotation event, or a run of kernels in one
        scope), None without a phase.
    """

    name: str
    stream: str
    start: float
    duration: float
    kind: Kind
    family: str | None = None
    blocks: int | None = None
    phase: str | None = None
    instance: int | None = None

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclasses.dataclass(frozen=True)
class DeviceTrace:
    """The kernels of one device, with what is known about the device.

    Attributes:
      kernels: sorted by start.
      device: the device index (`--gpu`).
      description: which device and which events, in words.
      devices: every device index that has work in the trace.
      num_sms: streaming multiprocessors of the device, None where unknown.
      phase_source: how phases were found, in words.
      events: the events taken as the device's work: "gpu" or "host-xla".
    """

    kernels: tuple[Kernel, ...]
    device: int
    description: str
    devices: tuple[int, ...]
    num_sms: int | None
    phase_source: str
    events: str


def process_names(events: list[dict[str, Any]]) -> tuple[dict[Any, str], dict[Any, str]]:
    """pid -> process name (with labels), (pid, tid) -> thread name, from metadata events."""
    processes: dict[Any, str] = {}
    threads: dict[Any, str] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        value = str((e.get("args") or {}).get("name", (e.get("args") or {}).get("labels", "")))
        if e.get("name") in ("process_name", "process_labels"):
            processes[e.get("pid")] = (processes.get(e.get("pid"), "") + " " + value).strip()
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = value.strip()
    return processes, threads


def _blocks(args: dict[str, Any]) -> int | None:
    grid = args.get("grid")
    if isinstance(grid, list | tuple) and grid:
        return math.prod(int(g) for g in grid)
    match = _GRID.search(str(args.get("kernel_details", "")))
    if match:
        return math.prod(int(g) for g in match.groups())
    return None


def _device_of_process(name: str) -> int | None:
    match = _GPU_PROCESS.search(name)
    return int(match.group(1) or match.group(2)) if match else None


def gpu_events(events: list[dict[str, Any]], processes: dict[Any, str],
                threads: dict[Any, str]) -> list[tuple[int, dict[str, Any], bool]]:
    """(device, event, is a memory op) for every GPU kernel, memcpy and memset."""
    found = []
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        category = e.get("cat")
        if category in _PYTORCH_DEVICE_CATEGORIES:
            device = args.get("device", _device_of_process(processes.get(e.get("pid"), "")))
            device = int(device) if device is not None else int(e.get("pid", 0))
            found.append((device, e, _PYTORCH_DEVICE_CATEGORIES[category]))
            continue
        process = processes.get(e.get("pid"), "")
        if "/device:GPU:" not in process:
            continue
        # JAX GPU traces add derived rows (XLA Ops, XLA Modules, Steps) beside the streams.
        thread = threads.get((e.get("pid"), e.get("tid")), "")
        if thread.startswith("Stream") or "kernel_details" in args or "correlation_id" in args:
            found.append((_device_of_process(process), e,
                          bool(_MEMORY_OP.match(str(e.get("name", ""))))))
    return found


def host_xla_events(events: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any], bool]]:
    """(device ordinal, event, False) for XLA operations run on host threads."""
    found = []
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args:
            found.append((int(args.get("device_ordinal", 0)), e, False))
    return _leaves(found)


def _leaves(found: list[tuple[int, dict[str, Any], bool]]
            ) -> list[tuple[int, dict[str, Any], bool]]:
    """Drops operations that enclose others on their thread (while loops, calls): their
    children are the work, and the container would count it twice."""
    by_thread: dict[Any, list[tuple[int, dict[str, Any], bool]]] = defaultdict(list)
    for item in found:
        by_thread[(item[1].get("pid"), item[1].get("tid"))].append(item)
    kept = []
    for items in by_thread.values():
        items.sort(key=lambda it: (float(it[1]["ts"]), -float(it[1].get("dur", 0))))
        for i, item in enumerate(items):
            end = float(item[1]["ts"]) + float(item[1].get("dur", 0))
            nxt = items[i + 1][1] if i + 1 < len(items) else None
            if nxt is None or float(nxt["ts"]) >= end:
                kept.append(item)
    return kept


def scope_phase(scope: str, depth: int | None = None) -> str | None:
    """The phase named by a named-scope path: the path without its last component (the
    primitive) and without leading `jit(...)`/`shard_map` wrappers, cut to `depth` parts.

    An operation that XLA merged from several scopes, `(a/x:b/y)`, counts in the first.
    """
    scope = scope.strip()
    parts = scope.split("/")
    while parts and _WRAPPER_SCOPE.match(parts[0]):
        parts.pop(0)
    rest = "/".join(parts)
    if rest.startswith("(") and rest.endswith(")"):
        rest = rest[1:-1].split(":")[0]
    parts = [p for p in rest.split("/")[:-1] if p]
    if depth is not None:
        parts = parts[:depth]
    return "/".join(parts) or None


class _Annotations:
    """User annotations per host thread, for 'which one was open at time t' queries."""

    def __init__(self, events: Iterable[dict[str, Any]]) -> None:
        self.by_thread: dict[Any, list[tuple[float, float, int, str]]] = defaultdict(list)
        for index, e in enumerate(events):
            start = float(e["ts"])
            self.by_thread[(e.get("pid"), e.get("tid"))].append(
                (start, start + float(e.get("dur", 0)), index, str(e.get("name"))))
        for spans in self.by_thread.values():
            spans.sort()
        self.starts = {key: [s[0] for s in spans] for key, spans in self.by_thread.items()}

    def _innermost(self, key: Any, t: float) -> tuple[float, float, int, str] | None:
        spans = self.by_thread.get(key, [])
        # Nested spans: the innermost open one is the latest-starting span still open.
        for i in range(bisect.bisect_right(self.starts.get(key, []), t) - 1, -1, -1):
            if spans[i][1] > t:
                return spans[i]
        return None

    def at(self, pid: Any, tid: Any, t: float) -> tuple[str, int] | None:
        """(name, instance) of the innermost annotation open at `t` on thread (pid, tid);
        failing that, of the latest-starting one open on another thread of the process
        (PyTorch launches backward kernels from its autograd thread)."""
        own = self._innermost((pid, tid), t)
        if own is None:
            others = [self._innermost(k, t) for k in self.by_thread if k[0] == pid]
            others = [o for o in others if o is not None]
            own = max(others, default=None)
        return (own[3], own[2]) if own else None


def _launches(events: list[dict[str, Any]], device_pids: set[Any]
              ) -> tuple[dict[int, tuple[Any, Any, float]], dict[tuple[Any, Any, float], int]]:
    """Correlation id -> (pid, tid, ts) of the host launch; GPU flow-end key -> flow id."""
    launches: dict[int, tuple[Any, Any, float]] = {}
    flow_ends: dict[tuple[Any, Any, float], int] = {}
    flow_starts: dict[int, tuple[Any, Any, float]] = {}
    for e in events:
        ph, pid = e.get("ph"), e.get("pid")
        if ph == "s" and "id" in e:
            flow_starts[int(e["id"])] = (pid, e.get("tid"), float(e["ts"]))
        elif ph == "f" and "id" in e and pid in device_pids:
            flow_ends[(pid, e.get("tid"), float(e["ts"]))] = int(e["id"])
        elif ph == "X" and pid not in device_pids:
            args = e.get("args") or {}
            corr = args.get("correlation", args.get("correlation_id"))
            if corr is not None:
                launches[int(corr)] = (pid, e.get("tid"), float(e["ts"]))
    for flow_id, start in flow_starts.items():
        launches.setdefault(flow_id, start)
    return launches, flow_ends


def _num_sms(trace: dict[str, Any], device: int) -> int | None:
    for props in trace.get("deviceProperties") or []:
        if int(props.get("id", -1)) == device and props.get("numSms"):
            return int(props["numSms"])
    return None


class _PhaseFinder:
    """The phase of a device event and a key naming its occurrence.

    In order: the event's own named scope (`args.scope` from `jax_ep.tools.profile`, or `tf_op`);
    a GPU-side annotation around it; the innermost CPU annotation open at its launch, found
    through the correlation id or the flow event that links launch and kernel.
    """

    def __init__(self, raw: list[dict[str, Any]], device_pids: set[Any],
                 pattern: str | None, depth: int | None) -> None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"trace_report: phase_pattern {pattern!r} is not a valid "
                                 f"regular expression ({error}).") from error

        def annotations(category: str) -> _Annotations:
            return _Annotations(e for e in raw if e.get("ph") == "X" and e.get("cat") == category
                                and (pattern is None or re.search(pattern, str(e.get("name")))))

        self.cpu = annotations("user_annotation")
        self.gpu = annotations("gpu_user_annotation")
        self.launches, self.flow_ends = _launches(raw, device_pids)
        self.depth = depth
        self.sources: set[str] = set()

    def of(self, e: dict[str, Any]) -> tuple[str | None, tuple[Any, ...] | None]:
        """(phase, occurrence key); the key is None for a named scope without run ids."""
        args = e.get("args") or {}
        scope = args.get("scope") or args.get("tf_op")
        if scope:
            self.sources.add("named scopes")
            phase = scope_phase(str(scope), self.depth)
            # One occurrence per execution of the program where the trace numbers them.
            run = args.get("run_id", args.get("group_id"))
            return phase, None if run is None else ("execution", phase, run)
        on_gpu = self.gpu.at(e.get("pid"), e.get("tid"), float(e["ts"]))
        if on_gpu:
            self.sources.add("GPU annotations")
            return on_gpu[0], ("gpu annotation", on_gpu[1])
        corr = args.get("correlation", args.get("correlation_id"))
        launch = self.launches.get(int(corr)) if corr is not None else None
        if launch is None:
            flow = self.flow_ends.get((e.get("pid"), e.get("tid"), float(e["ts"])))
            launch = self.launches.get(flow) if flow is not None else None
        on_cpu = self.cpu.at(*launch) if launch is not None else None
        if on_cpu:
            self.sources.add("CPU annotations at launch")
            return on_cpu[0], ("annotation", on_cpu[1])
        return None, None


def extract(
    trace: dict[str, Any],
    *,
    events: EventSelection = "auto",
    device: int | None = None,
    classifier: Classifier | None = None,
    phase_pattern: str | None = None,
    phase_depth: int | None = None,
    num_sms: int | None = None,
) -> DeviceTrace:
    """The kernels of one device, classified and attributed to phases.

    Args:
      trace: a Chrome trace dict (`load_trace`).
      events: "gpu", "host-xla" or "auto" (see the module docstring).
      device: the device index; by default the lowest one with kernels.
      classifier: communication/compute patterns; `Classifier()` by default.
      phase_pattern: only user annotations whose name matches this regex are phases.
      phase_depth: keep this many components of named-scope phases (JAX traces).
      num_sms: SM count, overriding the trace's `deviceProperties`.

    Returns:
      A `DeviceTrace`.
    """
    if events not in EVENT_SELECTIONS:
        raise ValueError(f"trace_report: events must be one of {EVENT_SELECTIONS}; got "
                         f"{events!r}.")
    if phase_depth is not None and phase_depth < 1:
        raise ValueError(f"trace_report: phase_depth must be >= 1; got {phase_depth}.")
    if num_sms is not None and num_sms < 1:
        raise ValueError(f"trace_report: num_sms must be >= 1; got {num_sms}.")
    classifier = classifier or Classifier()
    raw = [e for e in trace["traceEvents"] if isinstance(e, dict)]
    processes, threads = process_names(raw)
    selection = events
    found = gpu_events(raw, processes, threads) if events in ("auto", "gpu") else []
    if events == "auto":
        selection = "gpu" if found else "host-xla"
    if selection == "host-xla":
        found = host_xla_events(raw)
    if not found:
        what = {"auto": "GPU kernels and no XLA operations (events with an hlo_op)",
                "gpu": "GPU kernels", "host-xla": "XLA operations (events with an hlo_op)"}
        raise ValueError(f"trace_report: the trace has no {what[events]}; "
                         + ("is it a profile of device work?" if events == "auto" else
                            "try --events auto."))
    devices = tuple(sorted({d for d, _, _ in found}))
    if device is None:
        device = devices[0]
    elif device not in devices:
        raise ValueError(f"trace_report: device {device} has no kernels in this trace; pick "
                         f"one of {list(devices)} with --gpu.")
    chosen = [(e, memory) for d, e, memory in found if d == device]
    device_pids = {e.get("pid") for _, e, _ in found}

    phases = _PhaseFinder(raw, device_pids, phase_pattern, phase_depth)
    rows = []
    for e, memory in chosen:
        args = e.get("args") or {}
        name = str(e.get("name", ""))
        kind, family = classifier.classify(name, memory)
        thread = threads.get((e.get("pid"), e.get("tid")))
        if selection == "gpu":
            stream = f"stream {args['stream']}" if "stream" in args else (thread or
                                                                          f"stream {e.get('tid')}")
        else:
            stream = f"{(thread or 'thread').split('/')[0]} {e.get('tid')}"
        phase, instance = phases.of(e)
        rows.append((Kernel(name, stream, float(e["ts"]), float(e.get("dur", 0)), kind, family,
                            _blocks(args), phase), instance))
    rows.sort(key=lambda r: (r[0].start, r[0].end))
    kernels = _number_instances(rows)

    sms = num_sms or _num_sms(trace, device)
    if selection == "gpu":
        label = processes.get(next(iter(chosen))[0].get("pid"), "")
        name = next((p.get("name") for p in trace.get("deviceProperties") or []
                     if int(p.get("id", -1)) == device), None) or label or "GPU"
        description = f"GPU {device} ({name}"
        description += f", {sms} SMs)" if sms else ", SM count unknown: pass --sms)"
    else:
        description = f"XLA:CPU device {device} (XLA operations on host threads)"
    if len(devices) > 1:
        description += f"; devices with work: {list(devices)}, pick one with --gpu"
    phase_source = " + ".join(sorted(phases.sources)) or "none found"
    return DeviceTrace(kernels, device, description, devices, sms, phase_source, selection)


def _number_instances(rows: list[tuple[Kernel, tuple[Any, ...] | None]]
                      ) -> tuple[Kernel, ...]:
    """Numbers each phase occurrence: one per key (annotation event, program execution),
    and for named scopes without a key, one per run of consecutive kernels in the scope."""
    numbers: dict[tuple[Any, ...], int] = {}
    kernels, scope, run = [], None, -1
    for kernel, key in rows:
        if kernel.phase is not None:
            if key is None:
                if kernel.phase != scope:
                    scope, run = kernel.phase, run + 1
                key = ("run", run)
            kernel = dataclasses.replace(kernel, instance=numbers.setdefault(key, len(numbers)))
        kernels.append(kernel)
    return tuple(kernels)


# ---------------------------------------------------------------------- interval algebra


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points as `intervals`."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: Iterable[Interval]) -> float:
    """Total length of the union of `intervals`."""
    return sum(e - s for s, e in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Intersection of two sets of intervals, as disjoint intervals."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of `intervals` inside [lo, hi]."""
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


# ------------------------------------------------------------------------------ analysis


@dataclasses.dataclass(frozen=True)
class Window:
    """The analysed time range (microseconds, trace clock) and how it was chosen."""

    start: float
    end: float
    description: str

    @property
    def duration(self) -> float:
        return self.end - self.start


def resolve_window(device_trace: DeviceTrace, trace: dict[str, Any],
                   start: str | float | None = None, end: str | float | None = None) -> Window:
    """The analysis window: by default the span of the device's kernels.

    `start`/`end` may be microseconds after the first kernel's start, or the name of an
    annotation: then the first start (for `start`) or last end (for `end`) of the kernels
    attributed to that phase, or of the annotation events themselves when none are.
    """
    kernels = device_trace.kernels
    first, last = kernels[0].start, max(k.end for k in kernels)

    def bound(value: str | float | None, is_start: bool) -> tuple[float, str]:
        argument = "window_from" if is_start else "window_to"
        if value is None:
            return (first, "first kernel start") if is_start else (last, "last kernel end")
        try:
            offset = float(value)
        except ValueError:
            offset = None
        if offset is not None and not math.isfinite(offset):
            raise ValueError(f"trace_report: {argument}: {value!r} is not a finite number of "
                             "microseconds after the first kernel (or an annotation name).")
        if offset is not None:
            return first + offset, f"{offset:g} us after the first kernel"
        spans = [(k.start, k.end) for k in kernels if k.phase == value]
        what = f"kernels of phase {value!r}"
        if not spans:
            spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                     for e in trace["traceEvents"]
                     if isinstance(e, dict) and e.get("ph") == "X" and e.get("name") == value]
            what = f"annotation {value!r}"
        if not spans:
            raise ValueError(f"trace_report: {argument}: no phase or event named {value!r} "
                             "in the trace; give an annotation name or a number of "
                             "microseconds after the first kernel.")
        if is_start:
            return min(s for s, _ in spans), f"start of the first {what}"
        return max(e for _, e in spans), f"end of the last {what}"

    lo, lo_text = bound(start, True)
    hi, hi_text = bound(end, False)
    if hi <= lo:
        raise ValueError(f"trace_report: the window is empty ({lo_text} at {lo:.1f} us is not "
                         f"before {hi_text} at {hi:.1f} us); adjust --window-from/--window-to.")
    return Window(lo, hi, f"{lo_text} .. {hi_text}")


@dataclasses.dataclass(frozen=True)
class StreamStats:
    """One stream's work in the window (microseconds; fractions of the window or of comm)."""

    stream: str
    kernels: int
    busy_us: float
    comm_us: float
    compute_us: float
    other_us: float
    comm_overlapped: float | None  # this stream's comm time under compute on any stream


@dataclasses.dataclass(frozen=True)
class CommKernelStats:
    """One communication kernel (by short name): its launches, time and SMs."""

    name: str
    family: str
    count: int
    time_us: float  # summed kernel durations in the window
    blocks_min: int | None
    blocks_max: int | None
    sms_min: int | None
    sms_max: int | None


@dataclasses.dataclass(frozen=True)
class FamilyStats:
    """One communication family: busy time and the SMs its kernels hold."""

    family: str
    kernels: int
    busy_us: float
    sms_max: int | None  # most SMs held by the family's kernels at one time
    sms_mean: float | None  # SMs held, averaged over the family's busy time


@dataclasses.dataclass(frozen=True)
class PhaseStats:
    """One phase: its kernels' busy time by kind and the wall span they cover."""

    phase: str
    occurrences: int
    kernels: int
    comm_us: float
    compute_us: float
    other_us: float
    comm_overlapped: float | None  # the phase's comm time under compute (of any phase)
    span_us: float  # summed over occurrences: last kernel end - first kernel start


@dataclasses.dataclass(frozen=True)
class Occurrence:
    """One occurrence of a phase on the device's timeline."""

    phase: str
    start: float
    end: float
    kernels: int


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything `format_report` prints (times in microseconds)."""

    source: str
    device: str
    events: str
    num_sms: int | None
    window: Window
    kernels: int
    streams: tuple[StreamStats, ...]
    busy_us: float
    comm_us: float
    compute_us: float
    comm_overlapped_us: float
    comm_overlapped: float | None
    comm_sms_max: int | None
    comm_kernels: tuple[CommKernelStats, ...]
    families: tuple[FamilyStats, ...]
    phase_source: str
    phases: tuple[PhaseStats, ...]
    occurrences: tuple[Occurrence, ...]


def sms_used(blocks: int | None, num_sms: int | None) -> int | None:
    """SMs a launch can occupy: one per block, at most all of them."""
    if blocks is None:
        return None
    return min(blocks, num_sms) if num_sms else blocks


def _peak(weighted: list[tuple[float, float, int]]) -> int:
    """Largest sum of weights over intervals open at one time (ends close before starts)."""
    steps = sorted([(s, 1, w) for s, _, w in weighted] + [(e, 0, -w) for _, e, w in weighted])
    level = peak = 0
    for _, _, w in steps:
        level += w
        peak = max(peak, level)
    return peak


def _spans(kernels: Iterable[Kernel], window: Window) -> list[Interval]:
    return clip(((k.start, k.end) for k in kernels), window.start, window.end)


_EVENT_WORDS = {"gpu": "GPU kernels, memcpy and memset",
                "host-xla": "XLA operations on host threads"}


def analyze(device_trace: DeviceTrace, window: Window, source: str = "") -> Report:
    """Busy time, overlap, SMs and phases of `device_trace` inside `window`."""
    inside = [k for k in device_trace.kernels
              if min(k.end, window.end) > max(k.start, window.start)
              or window.start <= k.start < window.end]
    by_kind = {kind: [k for k in inside if k.kind == kind] for kind in ("comm", "compute",
                                                                       "other")}
    compute_union = union(_spans(by_kind["compute"], window))
    num_sms = device_trace.num_sms

    def overlapped(comm: list[Kernel]) -> tuple[float, float | None]:
        spans = _spans(comm, window)
        total = length(spans)
        under = length(intersect(spans, compute_union))
        return under, (under / total if total > 0 else None)

    streams = []
    for stream in sorted({k.stream for k in inside}, key=_natural):
        mine = [k for k in inside if k.stream == stream]
        kind_us = {kind: length(_spans([k for k in mine if k.kind == kind], window))
                   for kind in ("comm", "compute", "other")}
        streams.append(StreamStats(stream, len(mine), length(_spans(mine, window)),
                                   kind_us["comm"], kind_us["compute"], kind_us["other"],
                                   overlapped([k for k in mine if k.kind == "comm"])[1]))

    comm = by_kind["comm"]
    comm_kernels = []
    groups: dict[tuple[str, str], list[Kernel]] = defaultdict(list)
    for k in comm:
        groups[(short_name(k.name), k.family or "")].append(k)
    for (name, family), ks in sorted(groups.items(), key=lambda g: -sum(
            e - s for s, e in _spans(g[1], window))):
        blocks = [k.blocks for k in ks if k.blocks is not None]
        sms = [sms_used(b, num_sms) for b in blocks]
        comm_kernels.append(CommKernelStats(
            name, family, len(ks), sum(e - s for s, e in _spans(ks, window)),
            min(blocks, default=None), max(blocks, default=None),
            min(sms, default=None), max(sms, default=None)))

    def held(ks: list[Kernel]) -> tuple[int | None, float | None]:
        weighted = [(s, e, sms_used(k.blocks, num_sms)) for k in ks if k.blocks is not None
                    for s, e in _spans([k], window)]
        if not weighted:
            return None, None
        busy = length((s, e) for s, e, _ in weighted)
        mean = sum((e - s) * w for s, e, w in weighted) / busy if busy > 0 else None
        return _peak(weighted), mean

    families = []
    for family in sorted({k.family or "" for k in comm}):
        ks = [k for k in comm if (k.family or "") == family]
        peak, mean = held(ks)
        families.append(FamilyStats(family, len(ks), length(_spans(ks, window)), peak, mean))

    phases, occurrences = _phases(inside, window, compute_union)
    under, fraction = overlapped(comm)
    return Report(
        source=source, device=device_trace.description,
        events=_EVENT_WORDS[device_trace.events], num_sms=num_sms,
        window=window, kernels=len(inside), streams=tuple(streams),
        busy_us=length(_spans(inside, window)), comm_us=length(_spans(comm, window)),
        compute_us=length(compute_union), comm_overlapped_us=under, comm_overlapped=fraction,
        comm_sms_max=held(comm)[0], comm_kernels=tuple(comm_kernels),
        families=tuple(families), phase_source=device_trace.phase_source,
        phases=tuple(phases), occurrences=tuple(occurrences))


_NO_PHASE = "(no phase)"


def _phases(kernels: list[Kernel], window: Window, compute: list[Interval]
            ) -> tuple[list[PhaseStats], list[Occurrence]]:
    by_instance: dict[tuple[str, int | None], list[Kernel]] = defaultdict(list)
    for k in kernels:
        by_instance[(k.phase or _NO_PHASE, k.instance)].append(k)
    occurrences = []
    for (phase, _), ks in by_instance.items():
        spans = _spans(ks, window)
        if spans and phase != _NO_PHASE:
            occurrences.append(Occurrence(phase, min(s for s, _ in spans),
                                          max(e for _, e in spans), len(ks)))
    occurrences.sort(key=lambda o: (o.start, o.end))
    order = list(dict.fromkeys(o.phase for o in occurrences))
    if any(k.phase is None for k in kernels):
        order.append(_NO_PHASE)
    stats = []
    for phase in order:
        ks = [k for k in kernels if (k.phase or _NO_PHASE) == phase]
        mine = [o for o in occurrences if o.phase == phase]
        comm = _spans([k for k in ks if k.kind == "comm"], window)
        comm_us = length(comm)
        stats.append(PhaseStats(
            phase, len(mine), len(ks), comm_us,
            *(length(_spans([k for k in ks if k.kind == kind], window))
              for kind in ("compute", "other")),
            length(intersect(comm, compute)) / comm_us if comm_us > 0 else None,
            sum(o.end - o.start for o in mine)))
    return stats, occurrences


def _natural(text: str) -> list[Any]:
    """Sort key that orders 'stream 7' before 'stream 23'."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


# -------------------------------------------------------------------------------- output


def _ms(us: float) -> str:
    return f"{us / 1e3:.3f}"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


# A trace of XLA:CPU has operations on host threads, not kernels on streams and SMs.
_HOST_WORDS = ((r"\bkernels\b", "operations"), (r"\bkernel\b", "operation"),
               (r"\bStreams\b", "Threads"), (r"\bstreams\b", "threads"),
               (r"\bstream\b", "thread"))


def format_report(report: Report) -> str:
    """The report as Markdown-flavoured plain text (in a host trace's words for one)."""
    text = _format_report(report)
    if report.events != _EVENT_WORDS["host-xla"]:
        return text
    lines, in_table = [], False
    for line in text.split("\n"):
        data_row = in_table and line.startswith("|")  # names from the trace stay as they are
        in_table = line.startswith("|") and (in_table or line.startswith("|---"))
        if not data_row:
            for pattern, word in _HOST_WORDS:
                line = re.sub(pattern, word, line)
        lines.append(line)
    return "\n".join(lines)


def _format_report(report: Report) -> str:
    w = report.window
    lines = [
        f"trace: {report.source}",
        f"device: {report.device}",
        f"events: {report.events}; {report.kernels} in the window",
        f"window: {_ms(w.duration)} ms ({w.description})",
        "",
        "## Streams (busy = time with at least one kernel running, in the window)",
        "",
    ]
    lines += _table(
        ("stream", "kernels", "busy ms", "busy", "comm ms", "compute ms", "other ms",
         "comm under compute"),
        [(s.stream, s.kernels, _ms(s.busy_us), _pct(s.busy_us / w.duration), _ms(s.comm_us),
          _ms(s.compute_us), _ms(s.other_us), _pct(s.comm_overlapped)) for s in report.streams]
        + [("all (union)", report.kernels, _ms(report.busy_us),
            _pct(report.busy_us / w.duration), _ms(report.comm_us), _ms(report.compute_us),
            "", _pct(report.comm_overlapped))])
    exposed = report.comm_us - report.comm_overlapped_us
    lines += [
        "",
        "## Communication and compute",
        "",
        f"- communication busy: {_ms(report.comm_us)} ms "
        f"({_pct(report.comm_us / w.duration)} of the window)",
        f"- compute busy: {_ms(report.compute_us)} ms "
        f"({_pct(report.compute_us / w.duration)} of the window)",
        f"- communication with compute running: {_ms(report.comm_overlapped_us)} ms = "
        f"{_pct(report.comm_overlapped)} of communication time",
        f"- communication alone (no compute running): {_ms(exposed)} ms",
        f"- no kernel running: {_ms(w.duration - report.busy_us)} ms",
        "",
    ]
    if report.comm_kernels:
        if all(c.blocks_max is None for c in report.comm_kernels):
            heading = "the trace gives no grid sizes"
        elif report.num_sms:
            heading = f"SMs = min(blocks, {report.num_sms})"
        else:
            heading = "SMs = blocks; SM count unknown, pass --sms"
        lines += [f"## Communication kernels ({heading})", ""]
        lines += _table(
            ("kernel", "family", "launches", "time ms", "blocks", "SMs"),
            [(c.name, c.family, c.count, _ms(c.time_us), _range(c.blocks_min, c.blocks_max),
              _range(c.sms_min, c.sms_max)) for c in report.comm_kernels])
        lines += [""]
        lines += _table(
            ("family", "kernels", "busy ms", "most SMs at once", "mean SMs while busy"),
            [(f.family, f.kernels, _ms(f.busy_us), _range(f.sms_max, f.sms_max),
              "-" if f.sms_mean is None else f"{f.sms_mean:.1f}") for f in report.families])
        lines += [""]
        if report.comm_sms_max is not None:
            lines += [f"Communication kernels held at most {report.comm_sms_max} SMs at once."]
        lines += ["A communication kernel is busy while it waits for its peers too (DeepEP's "
                  "and NCCL's kernels spin on flags), so communication busy time is an upper "
                  "bound on the time spent moving data.", ""]
    else:
        lines += ["No communication kernels matched the patterns.", ""]
    lines += [f"## Phases ({report.phase_source}; times are busy time of the phase's kernels "
              "in the window; span = first kernel start to last kernel end, summed over "
              "occurrences)", ""]
    lines += _table(
        ("phase", "occurrences", "kernels", "comm ms", "compute ms", "other ms",
         "comm under compute", "span ms"),
        [(p.phase, p.occurrences or "-", p.kernels, _ms(p.comm_us), _ms(p.compute_us),
          _ms(p.other_us), _pct(p.comm_overlapped), _ms(p.span_us) if p.occurrences else "-")
         for p in report.phases])
    return "\n".join(lines) + "\n"


def _range(lo: int | None, hi: int | None) -> str:
    if lo is None or hi is None:
        return "-"
    return str(lo) if lo == hi else f"{lo}-{hi}"


def to_json(report: Report) -> dict[str, Any]:
    """The report as plain JSON-ready data."""
    return dataclasses.asdict(report)


_COLORS = {"comm": "#d62728", "compute": "#1f77b4", "other": "#9e9e9e"}


def plot_timeline(device_trace: DeviceTrace, report: Report, path: str | Path) -> Any:
    """Writes a PNG: one row per stream (comm/compute/other coloured), phases on top; returns
    the matplotlib Figure."""
    # A Figure of its own, not pyplot: drawing must not switch the caller's matplotlib backend.
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    window = report.window
    streams = [s.stream for s in report.streams]
    lanes = _lanes(report.occurrences)
    n_lanes = max(lanes, default=-1) + 1
    fig = Figure(figsize=(16, 1.2 + 0.55 * len(streams) + 0.35 * max(n_lanes, 1)))
    band, ax = fig.subplots(
        2, 1, sharex=True,
        gridspec_kw={"height_ratios": [max(n_lanes, 1) * 0.6, len(streams) * 1.0]})
    to_ms = lambda t: (t - window.start) / 1e3  # noqa: E731

    palette = colormaps["tab20"]
    names = list(dict.fromkeys(o.phase for o in report.occurrences))
    for occurrence, lane in zip(report.occurrences, lanes, strict=True):
        # The part inside the window, where the label goes (centred on what is drawn).
        x0 = max(to_ms(occurrence.start), 0.0)
        x1 = min(to_ms(occurrence.end), window.duration / 1e3)
        color = palette(names.index(occurrence.phase) % 20)
        band.broken_barh([(x0, max(x1 - x0, 1e-6))], (lane + 0.1, 0.8), facecolors=color,
                         edgecolors="black", linewidth=0.3)
        # A label only where it fits inside its box: a 6.5 pt character takes about 0.004 of
        # the axis' width (a 16 in figure), and half a character of margin on each side.
        if (x1 - x0) > 0.004 * (len(occurrence.phase) + 1) * (window.duration / 1e3):
            band.text((x0 + x1) / 2, lane + 0.5, occurrence.phase, ha="center", va="center",
                      fontsize=6.5, clip_on=True)
    band.set_ylim(n_lanes, 0) if n_lanes else band.set_ylim(1, 0)
    band.set_yticks([])
    band.set_ylabel("phases", rotation=0, ha="right", va="center")
    for side in ("top", "right", "left"):
        band.spines[side].set_visible(False)

    for row, stream in enumerate(streams):
        for kind in ("compute", "other", "comm"):
            spans = _spans([k for k in device_trace.kernels
                            if k.stream == stream and k.kind == kind], window)
            if spans:
                ax.broken_barh([(to_ms(s), (e - s) / 1e3) for s, e in spans], (row + 0.1, 0.8),
                               facecolors=_COLORS[kind], linewidth=0)
    ax.set_yticks([r + 0.5 for r in range(len(streams))], streams)
    ax.set_ylim(len(streams), 0)
    ax.set_xlim(0, window.duration / 1e3)
    ax.set_xlabel("time (ms) from the window start")
    ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in ("comm", "compute", "other")],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    device = report.device.split(";")[0]
    band.set_title(f"{device}: {_pct(report.comm_overlapped)} of communication time under "
                   "compute", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


def _lanes(occurrences: Sequence[Occurrence]) -> list[int]:
    """A lane per occurrence such that occurrences in one lane do not overlap."""
    lane_ends: list[float] = []
    lanes = []
    for o in occurrences:  # sorted by start
        for i, end in enumerate(lane_ends):
            if end <= o.start:
                lane_ends[i] = o.end
                lanes.append(i)
                break
        else:
            lane_ends.append(o.end)
            lanes.append(len(lane_ends) - 1)
    return lanes


# ----------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jax_ep.tools.trace_report",
        description="Communication vs compute in a Chrome trace (PyTorch profiler or "
                    "jax.profiler): per-stream busy time, overlap, SMs of communication "
                    "kernels, phases.")
    parser.add_argument("trace", help="a .json or .json.gz trace, or a directory (the newest "
                                      "trace below it is used)")
    parser.add_argument("--png", metavar="OUT", help="write a timeline PNG")
    parser.add_argument("--json", metavar="OUT", help="write the report as JSON")
    parser.add_argument("--events", choices=EVENT_SELECTIONS, default="auto",
                        help="gpu: GPU kernels; host-xla: XLA ops on host threads (traces "
                             "taken without a GPU); auto: gpu if present (default)")
    parser.add_argument("--gpu", type=int, metavar="N",
                        help="device to analyse (default: the first with kernels)")
    parser.add_argument("--comm", action="append", default=[], metavar="REGEX",
                        help="kernel names that are communication (repeatable)")
    parser.add_argument("--compute", action="append", default=[], metavar="REGEX",
                        help="kernel names that are compute, overriding the built-in "
                             "communication patterns (repeatable)")
    parser.add_argument("--no-builtin", action="store_true",
                        help="use only --comm/--compute, not the built-in families")
    parser.add_argument("--sms", type=int, metavar="N",
                        help="SMs per GPU (default: the trace's deviceProperties)")
    parser.add_argument("--window-from", metavar="PHASE|US",
                        help="window start: a phase/annotation name or microseconds after "
                             "the first kernel")
    parser.add_argument("--window-to", metavar="PHASE|US",
                        help="window end: a phase/annotation name or microseconds after "
                             "the first kernel")
    parser.add_argument("--phases", metavar="REGEX",
                        help="only user annotations matching REGEX are phases")
    parser.add_argument("--phase-depth", type=int, metavar="N",
                        help="keep the first N components of named-scope phases")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        for flag, out in (("--json", args.json), ("--png", args.png)):
            if out is not None and not Path(out).resolve().parent.is_dir():
                raise ValueError(f"{flag} {out}: the folder {Path(out).resolve().parent} "
                                 f"does not exist")
        trace, path = load_trace(args.trace)
        classifier = Classifier(tuple(args.comm), tuple(args.compute), not args.no_builtin)
        device_trace = extract(trace, events=args.events, device=args.gpu,
                               classifier=classifier, phase_pattern=args.phases,
                               phase_depth=args.phase_depth, num_sms=args.sms)
        window = resolve_window(device_trace, trace, args.window_from, args.window_to)
    except ValueError as error:  # a trace that cannot be read: reported like a bad flag
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    source = str(path) + (f" (newest trace below {args.trace})" if Path(args.trace).is_dir()
                          else "")
    report = analyze(device_trace, window, source=source)
    sys.stdout.write(format_report(report))
    skipped = trace.get("skipped", {})
    if skipped:
        reasons = "; ".join(f"{n} with {why}" for why, n in sorted(skipped.items()))
        print(f"\nskipped {sum(skipped.values())} malformed events: {reasons}")
    try:
        if args.json:
            Path(args.json).write_text(json.dumps({**to_json(report),
                                                   "skipped_events": skipped}, indent=1))
        if args.png:
            plot_timeline(device_trace, report, args.png)
            print(f"\ntimeline: {args.png}")
    except OSError as error:  # a file that cannot be written, like a bad flag
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
