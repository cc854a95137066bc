"""The GPU report's answers per op: device time, fraction of the HBM floor, streamed against
phased between processes, the best swept settings, the model's prediction and its error, and
the targets met or missed.

`answers(report)` reads a report record of tools/gpu_report.py (its large case's per-kernel
times, the benchmarks, the sweep, the copy rate) and returns markdown lines. What a run did not
measure reads "-", never a guess. Targets:
- normal dispatch and combine at 8 virtual ranks: at least 80 % of the HBM floor;
- expert-major dispatch and combine there: at least 60 %;
- the low-latency round trip at one rank: at most 25 us of device time;
- between processes (the MPS rig), streamed at least as fast as phased.
"""

from __future__ import annotations

from pathlib import Path

from jax_ep.tools import kernel_model

# (op in the large case, the floor's fraction it must reach)
FLOOR_TARGETS = (("dispatch", 0.80), ("combine", 0.80), ("dispatch (fp8)", None),
                 ("dispatch (expert-major)", 0.60), ("combine (expert-major)", 0.60),
                 ("ll_dispatch_send", None), ("ll_combine_recv", None))
ROUND_TRIP_TARGET_S = 25e-6


def copy_rate(report: dict) -> tuple[float, str]:
    """The run's HBM copy rate (read + write) and where it comes from: the copy-rate step's
    XLA copy, else the virtual benchmark's (device-timed since the benchmark copies 16 times in
    one program), else the model's constant for the GPU."""
    measured = (report.get("copy_rate") or {}).get("xla_copy_Bps")
    if measured:
        return measured, "this run's XLA copy (copyrate step)"
    bench = report.get("bench_virtual") or {}
    if (bench.get("device_time") or {}).get("enabled") and bench.get("copy_bandwidth_Bps"):
        return bench["copy_bandwidth_Bps"], "this run's benchmark copy"
    floor = kernel_model.COPY_FLOORS.get(kernel_model.gpu_model(report["device"]))
    return (floor[0], floor[1]) if floor else (0.0, "no copy rate")


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.1f}"


def _tuned(report: dict) -> dict[str, list[str]]:
    """Per op, the sweep's streamed/phased ratio and best settings of each set of processes."""
    found: dict[str, list[str]] = {}
    tune = report.get("tune") or {}
    for run in tune.get("sets", []):
        for op, b in run["best"].items():
            ratio = b.get("streamed_over_phased")
            found.setdefault(op, []).append(
                f"{run['ranks']} ranks: {'-' if not ratio else f'{ratio:.2f}'} at "
                f"{b['channels']},{b['chunk_tokens']},{b['ring_chunks']},{b['warps']} "
                f"num_sms {b['num_sms']}")
    return found


def _met(ok: bool | None) -> str:
    return "-" if ok is None else "met" if ok else "**missed**"


def answers(report: dict, reports: Path | str = kernel_model.REPORTS,
            before: str | None = None) -> list[str]:
    """The table of the module's answers for `report`, the model calibrated on `reports`
    (but `before`, the report's own file)."""
    large = (report.get("large") or {}).get("kernels")
    rate, source = copy_rate(report)
    out = ["", "## Per op: what this run answers", "",
           f"HBM floor: the account's bytes at {rate / 1e12:.2f} TB/s ({source}). The model: "
           "`perfmodel --ours` for this GPU from the reports committed before this one. "
           "Streamed/phased: time ratio on the MPS rig (below 1: streamed faster).", "",
           "| op | device us | floor us | of floor | target | model us (error) | "
           "streamed/phased, best settings |", "|---|---:|---:|---:|---|---:|---|"]
    measured = {}
    if large:
        this = kernel_model.Report(Path("this run"), report["device"], report["date"],
                                   str(report["commit"]).split()[0], large)
        measured = {m.name: m for m in kernel_model.measured_ops(this)}
    try:
        model = kernel_model.model_for(report["device"], reports, before=before)
    except FileNotFoundError:
        model = None
    ops = kernel_model.accounts()
    tuned = _tuned(report)
    for op, target in FLOOR_TARGETS:
        m, a = measured.get(op), ops[op]
        floor = a.launches * (model.launch_s if model else 0.0) + a.bytes / rate if rate else None
        of_floor = floor / m.measured_s if m and floor else None
        met = None if target is None or of_floor is None else of_floor >= target
        goal = "-" if target is None else f">= {target:.0%}: {_met(met)}"
        predicted = model.predict_s(a.launches, a.bytes, a.row_warps) if model else None
        error = (f" ({predicted / m.measured_s - 1:+.0%})" if m and predicted else "")
        family = op.split(" (")[0]
        sweep = "; ".join(tuned.get(family, [])) if "(" not in op else ""
        out.append(f"| {op} (R 8 virtual) | {_us(m.measured_s if m else None)} | {_us(floor)} | "
                   f"{'-' if of_floor is None else f'{of_floor:.2f}'} | {goal} | "
                   f"{_us(predicted)}{error} | {sweep or '-'} |")
    row = next((r for r in (report.get("bench_ep1") or {}).get("rows", [])
                if r["op"] == "ll_round_trip" and r["backend"] == "cuda" and r["status"] == "ok"),
               None)
    device = row.get("device_s") if row else None
    met = None if device is None else device <= ROUND_TRIP_TARGET_S
    wall = f"; wall {_us(row['median_s'])}" if row and row.get("median_s") else ""
    out.append(f"| ll round trip (R 1) | {_us(device)}{wall} | - | - | <= 25 us: {_met(met)} | "
               "- | - |")
    streamed = [b.get("streamed_over_phased") for run in (report.get("tune") or {}).get("sets", [])
                for b in run["best"].values() if b.get("streamed_over_phased")]
    met = None if not streamed else max(streamed) <= 1.0
    out += ["", f"- Streamed at least as fast as phased between processes: {_met(met)}"
                + (f" (worst ratio {max(streamed):.2f})" if streamed else " (not measured)")]
    return out
