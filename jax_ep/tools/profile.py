"""Traces of jitted steps, with every operation labelled by its named scope.

`capture(fn, *args, log_dir=...)` compiles `fn`, runs it a few times under `jax.profiler`,
and writes `<log_dir>/trace.json`: the profiler's Chrome trace with each XLA operation's
event renamed `<named scope> (<HLO op>)` and its scope in `args.scope`. The profiler itself
records only HLO names (`fusion.12`); the scopes come from the compiled module's metadata,
where `jax.named_scope` puts them. jax_ep's ops run under scopes named after them
(`jax_ep.dispatch`, `jax_ep.low_latency_combine_send`, ...) and `jax_ep.overlap` adds one
per micro-batch and stage (`mb0/dispatch.send`), so the trace shows who ran when. Open the
file in https://ui.perfetto.dev or chrome://tracing, or summarize it with
`python -m jax_ep.tools.trace_report`.

`device_time(trace, calls)` reads the device's own time out of a raw trace: per device, the
time its kernels (GPU) or XLA operations (CPU) ran, and the same per kernel
(`device_kernel_times`). The benchmark (`python -m jax_ep.tools.bench`) and
tools/gpu_large_case.py use it.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jax_ep.tools import trace_report

# `%fusion.3 = f32[..] fusion(...), ..., metadata={op_name="jit(step)/mb0/attn/dot_general"`
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name="([^"]*)"')
# The outer `jit(name)/` that every op of a jitted function carries says nothing.
_OUTER_JIT = re.compile(r"^jit\([^)]*\)/")


def op_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its named-scope path, from a compiled module's text."""
    scopes = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            scopes[match.group(1)] = _OUTER_JIT.sub("", match.group(2))
    return scopes


@dataclasses.dataclass(frozen=True)
class Trace:
    """Where a capture went.

    Attributes:
      path: the labelled Chrome trace (JSON), for Perfetto, chrome://tracing, trace_report.
      raw_path: the profiler's own trace file it was made from.
      labelled: events that received a scope.
      scopes: the distinct scope paths seen in the trace, in order of first appearance.
    """

    path: Path
    raw_path: Path
    labelled: int
    scopes: tuple[str, ...]


def _newest_trace(log_dir: Path, since: float) -> Path:
    candidates = [p for p in log_dir.glob("plugins/profile/*/*.trace.json.gz")
                  if p.stat().st_mtime >= since]
    if not candidates:
        raise RuntimeError(
            f"jax_ep.tools.profile: the profiler wrote no *.trace.json.gz under {log_dir}/plugins/"
            "profile; is another profiler session active in this process?"
        )
    return max(candidates, key=lambda p: p.stat().st_mtime)


def load_trace(log_dir: str | Path, since: float = 0.0) -> dict[str, Any]:
    """The newest raw trace the profiler wrote under `log_dir` (modified at `since` or later,
    in seconds since the epoch), parsed."""
    with gzip.open(_newest_trace(Path(log_dir), since), "rt") as f:
        return json.load(f)


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """One kernel (GPU) or XLA operation (CPU) of a trace: its launches and their summed
    durations, over every call and device the trace holds."""

    name: str
    launches: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class DeviceTime:
    """What a trace of `calls` calls of one program says about its device time.

    Attributes:
      source: "gpu" (kernels, memory copies and sets on the streams of `/device:GPU:N`
        processes) or "cpu" (the XLA operations XLA:CPU runs on host threads, one event per
        operation and virtual device, with `hlo_op` in its arguments; loops and calls that
        enclose others left out, their operations counted instead).
      devices: the devices with work, by name ("/device:GPU:0", "/host:CPU device 3").
      busy_s: per device, seconds per call during which it ran at least one kernel (the
        union of their intervals: kernels on concurrent streams, or an operation's nested
        events, count once).
      one_memory_s: seconds per call during which any device ran one (all devices' work on
        one timeline: where the devices share the host's cores and memory).
      kernels: per kernel name, longest first: (name, launches per call, ms per call),
        summed over the devices.
    """

    source: str
    devices: tuple[str, ...]
    busy_s: dict[str, float]
    one_memory_s: float
    kernels: list[dict[str, Any]]

    def seconds(self, one_memory: bool) -> float:
        """Device time per call: every device's work on one timeline where the devices
        share one memory (`one_memory`), else the busiest device's."""
        return self.one_memory_s if one_memory else max(self.busy_s.values())


def device_events(trace: dict[str, Any], source: str = "auto"
                  ) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """("gpu" or "cpu", device name -> its events): with source "gpu" the GPU's kernels, with
    "cpu" the XLA operations run on the host's threads (see `DeviceTime.source`), with "auto"
    the GPU's where the trace has any, else the CPU's. The host's other events (launches,
    Python, the runtime's own) never count, nor, with "gpu" or "auto", the host annotations
    of the GPU's operations. Empty when nothing matched."""
    if source not in ("auto", "gpu", "cpu"):
        raise ValueError(f"jax_ep.tools.profile: source must be 'auto', 'gpu' or 'cpu'; got "
                         f"{source!r}.")
    raw = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    processes, threads = trace_report.process_names(raw)
    by_device: dict[str, list[dict[str, Any]]] = {}
    if source != "cpu":
        for _, event, _ in trace_report.gpu_events(raw, processes, threads):
            by_device.setdefault(processes.get(event.get("pid"), ""), []).append(event)
        if by_device or source == "gpu":
            return "gpu", by_device
    # A GPU's kernels carry an hlo_op too: only the host's threads run XLA:CPU's operations.
    host = [e for e in raw if "/device:" not in processes.get(e.get("pid"), "")]
    for ordinal, event, _ in trace_report.host_xla_events(host):
        by_device.setdefault(f"/host:CPU device {ordinal}", []).append(event)
    return "cpu", by_device


def _interval(event: dict[str, Any]) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0))


def _kernel_times(by_device: dict[str, list[dict[str, Any]]]) -> list[KernelTime]:
    totals: dict[str, list[float]] = {}
    for events in by_device.values():
        for event in events:
            entry = totals.setdefault(str(event.get("name", "")), [0, 0.0])
            entry[0] += 1
            entry[1] += float(event.get("dur", 0)) / 1e6  # the trace counts microseconds
    return sorted((KernelTime(name, int(n), s) for name, (n, s) in totals.items()),
                  key=lambda k: -k.seconds)


def device_kernel_times(trace: dict[str, Any], source: str = "auto") -> list[KernelTime]:
    """Per kernel name in a raw trace: launches and summed device time over every device,
    longest first (`source` and what counts as a kernel: `device_events`)."""
    return _kernel_times(device_events(trace, source)[1])


def device_time(trace: dict[str, Any], calls: int, source: str = "auto",
                top: int = 10) -> DeviceTime | None:
    """The device time of a trace of `calls` calls of one program (`DeviceTime`; its `top`
    longest kernels), or None when the trace holds no device work of `source` (see
    `device_events`): another platform, or a profiler that recorded none."""
    if calls < 1:
        raise ValueError(f"jax_ep.tools.profile.device_time: calls must be >= 1; got {calls}.")
    source, by_device = device_events(trace, source)
    if not by_device:
        return None
    busy = {name: trace_report.length(map(_interval, events)) / 1e6 / calls
            for name, events in sorted(by_device.items())}
    every = trace_report.length(_interval(e) for events in by_device.values() for e in events)
    kernels = [{"kernel": k.name, "launches_per_call": k.launches / calls,
                "ms_per_call": k.seconds * 1e3 / calls} for k in _kernel_times(by_device)]
    return DeviceTime(source, tuple(busy), busy, every / 1e6 / calls, kernels[:top])


def label_events(trace: dict[str, Any], scopes: dict[str, str]) -> tuple[int, list[str]]:
    """Renames, in place, each event of an HLO op found in `scopes` to `<scope> (<op>)`."""
    labelled, seen = 0, {}
    for event in trace.get("traceEvents", []):
        args = event.get("args") or {}
        op = args.get("hlo_op")
        if event.get("ph") != "X" or op not in scopes or not scopes[op]:
            continue
        scope = scopes[op]
        event["name"] = f"{scope} ({op})"
        args["scope"] = scope
        event["args"] = args
        labelled += 1
        seen.setdefault(scope, None)
    return labelled, list(seen)


def capture(fn: Callable, *args: Any, log_dir: str | Path, steps: int = 3,
            warmup: int = 1) -> Trace:
    """Profiles `steps` calls of `fn(*args)` (after `warmup` untimed ones).

    Args:
      fn: a function of arrays; jitted here unless it already is (`jax.jit` result).
      *args: its arguments.
      log_dir: directory for the profiler's output and `trace.json`.
      steps: profiled calls, each inside `jax.profiler.StepTraceAnnotation("step")`.
      warmup: calls before profiling (the first one compiles).

    Returns:
      A `Trace` (paths and the scopes found).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"jax_ep.tools.profile.capture: steps must be >= 1 and warmup >= 0; got "
                         f"steps={steps}, warmup={warmup}.")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    scopes = op_scopes(jitted.lower(*args).compile().as_text())
    for _ in range(warmup):
        jax.block_until_ready(jitted(*args))
    started = time.time() - 1.0  # file times have a coarse resolution on some systems
    with jax.profiler.trace(str(log_dir)):
        for step in range(steps):
            with jax.profiler.StepTraceAnnotation("step", step_num=step):
                jax.block_until_ready(jitted(*args))
    raw_path = _newest_trace(log_dir, started)
    with gzip.open(raw_path, "rt") as f:
        trace = json.load(f)
    labelled, seen = label_events(trace, scopes)
    path = log_dir / "trace.json"
    path.write_text(json.dumps(trace))
    return Trace(path=path, raw_path=raw_path, labelled=labelled, scopes=tuple(seen))
