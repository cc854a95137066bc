"""Writes the report of tools/gpu_check.sh: one markdown file and one JSON file.

Run: python tools/gpu_report.py OUT_DIR [REPORT_DIR]
Reads OUT_DIR/steps.tsv and the steps' logs and results, and writes
REPORT_DIR/<date>-<device>-<commit>.{md,json} (default REPORT_DIR: docs/gpu), and copies of
both into OUT_DIR.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The committed reports the model is calibrated on (the installed jax_ep has no docs/).
REPORTS = os.path.join(ROOT, "docs", "gpu")


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip()


def steps(out_dir: str) -> list[dict]:
    """The steps recorded so far; a line cut short by a run stopped while writing it is left
    out."""
    rows = []
    for line in read(os.path.join(out_dir, "steps.tsv")).splitlines():
        fields = line.split("\t")
        if len(fields) != 3 or not all(f.lstrip("-").isdigit() for f in fields[1:]):
            continue
        name, rc, seconds = fields
        log = read(os.path.join(out_dir, f"{name}.log"))
        rows.append({"step": name, "exit": int(rc), "seconds": int(seconds),
                     "tail": log.splitlines()[-15:], "skipped": skipped(log)})
    return rows


def skipped(log: str) -> str | None:
    """The line where a step says it skipped its work and why (no MPS, too few GPUs), which
    its exit status 0 does not tell."""
    found = re.search(r"^.*\bskipped: .*$", log, re.M)
    return found.group(0).strip() if found else None


SANITIZERS = ("memcheck", "synccheck", "initcheck", "racecheck")


def load(path: str):
    """A step's JSON result, or None when it is missing or cut short (a stopped step)."""
    try:
        return json.loads(read(path)) if os.path.exists(path) else None
    except json.JSONDecodeError:
        return None


def gpu_name() -> str:
    """The GPU's name from nvidia-smi (when the env step did not run)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown device"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown device"


def sanitizer(log: str) -> str | None:
    # racecheck writes "RACECHECK SUMMARY: ... hazards", the other tools "ERROR SUMMARY".
    found = re.findall(r"=========\s*(?:ERROR|RACECHECK) SUMMARY:.*", log)
    return found[-1].strip("= ") if found else None


def ptxas_table(log: str) -> list[str]:
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("file ")), None)
    return lines[start:] if start is not None else []


def bench(path: str) -> dict | None:
    record = load(path)
    if record is None:
        return None
    keys = ("op", "backend", "status", "gbps", "of_floor", "vs_xla", "device_s",
            "of_floor_device")
    rows = [{k: r.get(k) for k in keys} | {"median_s": r.get("time", {}).get("median"),
                                          "kernels": (r.get("kernels") or [])[:3]}
            for r in record["rows"]]
    return {"command": record["command"], "device": record["device"],
            "copy_bandwidth_Bps": record["copy_bandwidth_Bps"],
            "device_time": record.get("device_time"), "rows": rows}


def tune(path: str) -> dict | None:
    """The sweep's summary (tools/gpu_tune.py): per set of processes the fastest streamed
    settings per op against the phased ops, and what did not run right."""
    record = load(path)
    if record is None or "skipped" in record:
        return record
    def describe(p: dict) -> str:
        return (f"{p['op']} {p['mode']} {p['channels']},{p['chunk_tokens']},{p['ring_chunks']},"
                f"{p['warps']} num_sms {p['num_sms']}: {p['status']} {p['error'][:200]}").strip()

    sets = []
    for run in record.get("sets", []):
        points = run["points"]
        skipped = [p for p in points if p["status"].startswith("skipped")]
        bad = [p for p in points if p["status"] != "ok" and p not in skipped]
        sets.append({"ranks": run["ranks"], "how": run["how"], "best": run["best"],
                     "points": len(points), "ok": len(points) - len(skipped) - len(bad),
                     "skipped": len(skipped), "bad": [describe(p) for p in bad]})
    return {"device": record.get("device"), "meaningful": record["meaningful"],
            "shape": record["shape"], "calls": record["calls"], "sets": sets,
            "table_entry": record.get("table_entry")}


def tune_lines(t: dict) -> list[str]:
    if "skipped" in t:
        return ["", f"Sweep of the streamed ops (`tools/gpu_tune.py`): skipped: {t['skipped']}"]
    shape = t["shape"]
    out = ["", f"Sweep of the streamed ops (`tools/gpu_tune.py`, T {shape['tokens']}, H "
               f"{shape['hidden']}, top-{shape['top_k']} of {shape['experts']}, "
               f"{shape['dtype']}; median per call of {t['calls']} calls in one program): the "
               "fastest streamed settings per op against the fastest phased"
               + ("" if t["meaningful"] else " (times not meaningful here)") + ":", "",
           "| ranks | op | channels,chunk_tokens,ring_chunks,warps | num_sms | streams | us | "
           "GB/s | phased us | streamed/phased |", "|---|---|---|---|---|---|---|---|---|"]
    for run in t["sets"]:
        for op, b in run["best"].items():
            plan = b.get("plan") or {}
            phased = f"{b['phased_s'] * 1e6:.1f}" if b["phased_s"] else "-"
            ratio = f"{b['streamed_over_phased']:.2f}" if b["streamed_over_phased"] else "-"
            out.append(f"| {run['ranks']} | {op} | {b['channels']},{b['chunk_tokens']},"
                       f"{b['ring_chunks']},{b['warps']} | {b['num_sms']} | "
                       f"{plan.get('channels', '?')} x {plan.get('warps', '?')} | "
                       f"{b['median_s'] * 1e6:.1f} | {b['gbps']:.1f} | {phased} | {ratio} |")
    out.append("")
    for run in t["sets"]:
        out.append(f"- {run['ranks']} ranks ({run['how']}): {run['ok']} of {run['points']} "
                   f"points ran and match the first bit for bit, {run['skipped']} skipped")
        out += [f"  - {bad}" for bad in run["bad"]]
    if t.get("table_entry"):
        out += ["", "The entry for `jax_ep/tuned.py`'s table (commit it with this report):", "",
                "```python", t["table_entry"].rstrip(), "```"]
    return out


def copy_rate_lines(c: dict) -> list[str]:
    """The table of `python -m jax_ep.tools.copy_rate` (the row copy alone, per warps and
    loads in flight), from its JSON."""
    out = ["", f"Copy rate of the row copy alone (`{c.get('command', 'jax_ep.tools.copy_rate')}`"
               f", {c['bytes'] / 1e6:g} MB in rows of {c['row_bytes']} bytes; XLA's copy "
               f"{c['xla_copy_Bps'] / 1e9:.0f} GB/s)"
               + ("" if c.get("meaningful", True) else " (times not meaningful here)") + ":", "",
           "| warps | words in flight | GB/s | of XLA copy | identical |", "|---|---|---|---|---|"]
    for r in c["rows"]:
        warps = r["warps"] if r["warps"] != "all" else f"all ({r['warps_run'] or 'every SM'})"
        out.append(f"| {warps} | {r['words_in_flight']} | {r['gbps']:.1f} | {r['of_xla']:.2f} | "
                   f"{'yes' if r['identical'] else 'NO'} |")
    return out


def report_name(report: dict) -> str:
    """The report's file name, without .md or .json: <date>-<device>-<commit>."""
    slug = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
    return f"{report['date']}-{slug}-{report['commit']}"


def markdown(report: dict) -> str:
    out = [f"# GPU check, {report['date']}", "",
           f"- device: {report['device']}", f"- commit: {report['commit']}",
           f"- environment: {' / '.join(report['environment'])}", "",
           "| step | exit | seconds |", "|---|---|---|"]
    out += [f"| {s['step']} | {s['exit']} | {s['seconds']} |" for s in report["steps"]]
    if report.get("large") or report.get("tune") or report.get("bench_ep1"):
        import gpu_summary  # beside this file; needs jax_ep (the answers' model and account)

        out += gpu_summary.answers(report, REPORTS, before=report_name(report) + ".json")
    skips = [s for s in report["steps"] if s.get("skipped")]
    if skips:
        out += ["", "Passed without doing their work (exit 0, and said why):", ""]
        out += [f"- `{s['step']}`: {s['skipped']}" for s in skips]
    kernels = report.get("kernels")
    if kernels is not None:
        failed = [k for k in kernels if k["status"] != "ok"]
        out += ["", f"Kernel cases (tools/gpu_kernels.py): {len(kernels) - len(failed)} passed, "
                    f"{len(failed)} failed of {len(kernels)}."]
        for k in failed:
            out += ["", f"- `{k['test']} {json.dumps(k['args'], sort_keys=True)}` (retried "
                        f"alone: {k['retry'][:200]})", "", "```", k["error"], "```"]
    large = report.get("large")
    if large:
        out += ["", f"Large case (tools/gpu_large_case.py, seed {large['seed']}), GPU against "
                    "the CPU handlers:", ""]
        for name, r in large["cases"].items():
            verdict = "identical" if r["identical"] else "DIFFERENT: " + "; ".join(
                r["differences"])
            out.append(f"- {name}: {r['bytes_compared'] / 1e9:.2f} GB, {verdict}")
        for name, rows in (large.get("kernels") or {}).items():
            out += ["", f"Per-kernel device time, {name} (per call):", "",
                    "| ms | launches | kernel |", "|---|---|---|"]
            out += [f"| {r['ms_per_call']:.3f} | {r['launches_per_call']:g} | "
                    f"`{r['kernel'][:100]}` |" for r in rows[:12]]
        if large.get("kernels"):
            from jax_ep.tools import kernel_model  # the report needs jax_ep only for this table

            out += ["", "What `python -m jax_ep.tools.perfmodel --ours` predicted for these ops at "
                        "these shapes (per op and call; compare with the kernels above):", "",
                    kernel_model.predictions(report["device"], REPORTS,
                                             before=report_name(report) + ".json")]
    for tool in SANITIZERS:
        if report.get(tool):
            out.append(f"- compute-sanitizer {tool}: {report[tool]}")
    if report["ptxas"]:
        out += ["", "Kernel resources (tools/check_ptxas.py):", "", "```", *report["ptxas"], "```"]
    if report.get("copy_rate"):
        out += copy_rate_lines(report["copy_rate"])
    for name in ("bench_ep1", "bench_virtual"):
        b = report.get(name)
        if not b:
            continue
        out += ["", f"Benchmark `{b['command']}` (copy bandwidth "
                    f"{b['copy_bandwidth_Bps'] / 1e9:.0f} GB/s):", "",
                "| op | backend | median | device | GB/s | of floor | of floor (device) | vs xla |",
                "|---|---|---|---|---|---|---|---|"]
        for r in b["rows"]:
            if r["status"] != "ok":
                out.append(f"| {r['op']} | {r['backend']} | {r['status']} | | | | | |")
                continue
            vs = f"{r['vs_xla']:.2f}" if r["vs_xla"] is not None else "-"
            # Reports from before the device time, or runs without it, have none.
            device = f"{r['device_s'] * 1e6:.1f} us" if r.get("device_s") else "-"
            of_device = (f"{r['of_floor_device']:.2f}" if r.get("of_floor_device") is not None
                         else "-")
            out.append(f"| {r['op']} | {r['backend']} | {r['median_s'] * 1e6:.1f} us | "
                       f"{device} | {r['gbps']:.1f} | {r['of_floor']:.2f} | {of_device} | "
                       f"{vs} |")
        device_time = b.get("device_time") or {}
        if device_time.get("meaning"):
            out += ["", device_time["meaning"]]
    graph = report.get("graph")
    if graph:
        out += ["", f"Low-latency decode loop under command buffers (`tools/gpu_graph_case.py`, "
                    f"{graph['steps']} steps): {graph['us_per_step_off']:.1f} us per step "
                    f"with command buffers off, {graph['us_per_step_on']:.1f} us on "
                    f"({graph['speedup']:.2f}x; bench row `ll_roundtrip_graph`)"]
    if report.get("tune"):
        out += tune_lines(report["tune"])
    failed = [s for s in report["steps"] if s["exit"] != 0]
    for s in failed:
        out += ["", f"Step `{s['step']}` failed; the end of its log:", "", "```", *s["tail"], "```"]
    return "\n".join(out) + "\n"


def main(out_dir: str, report_dir: str) -> int:
    env_log = read(os.path.join(out_dir, "env.log")).splitlines()
    # nvidia-smi's CSV line (a dry run's env log holds none).
    device = env_log[0].split(",")[0].strip() if env_log and "," in env_log[0] else gpu_name()
    # A copy of the tree may carry a stale .git (the last landed commit plus changes): the
    # caller can name the commit it sent.
    commit = os.environ.get("JAX_EP_GPU_COMMIT") or git("rev-parse", "--short", "HEAD") or "unknown"
    if not os.environ.get("JAX_EP_GPU_COMMIT") and git("status", "--porcelain"):
        commit += "-dirty"
    date = datetime.date.today().isoformat()
    report = {
        "date": date, "device": device, "commit": commit, "environment": env_log[:4],
        "steps": steps(out_dir), "kernels": load(os.path.join(out_dir, "kernels.json")),
        "large": load(os.path.join(out_dir, "large.json")),
        **{tool: sanitizer(read(os.path.join(out_dir, f"{tool}.log"))) for tool in SANITIZERS},
        "ptxas": ptxas_table(read(os.path.join(out_dir, "ptxas.log"))),
        "bench_ep1": bench(os.path.join(out_dir, "bench_ep1.json")),
        "bench_virtual": bench(os.path.join(out_dir, "bench_virtual.json")),
        "graph": load(os.path.join(out_dir, "graph.json")),
        "tune": tune(os.path.join(out_dir, "tune.json")),
        "copy_rate": load(os.path.join(out_dir, "copy_rate.json")),
    }
    base = os.path.join(report_dir, report_name(report))
    os.makedirs(os.path.dirname(base), exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    with open(base + ".md", "w") as f:
        f.write(markdown(report))
    for suffix in (".md", ".json"):
        shutil.copy(base + suffix, out_dir)
    print(f"gpu_report: wrote {base}.md and .json")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args[0] if args else "gpu_check_out",
                  args[1] if len(args) > 1 else os.path.join(ROOT, "docs", "gpu")))
