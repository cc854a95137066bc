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
