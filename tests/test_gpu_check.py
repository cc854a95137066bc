"""tools/gpu_check.sh and its report, exercised on this machine (no GPU): the steps that can
run here run, the others are recorded as failed, and the report names every step."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_report(out, reports):
    """Runs tools/gpu_report.py on a check's output folder; the folder of its reports."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_report.py"),
                           str(out), str(reports)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return reports


def test_report_from_a_partial_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.tsv").write_text("env\t0\t1\nbuild\t0\t90\nmemcheck\t1\t12\n")
    (out / "env.log").write_text("NVIDIA H100 80GB HBM3, 580.0, 81559 MiB\ncuda 13.0\n")
    (out / "memcheck.log").write_text("========= ERROR SUMMARY: 2 errors\n")
    (out / "racecheck.log").write_text(
        "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    (out / "ptxas.log").write_text("file kernel hot regs\nexchange.cu k yes 40\ncheck_ptxas: ok\n")
    (out / "kernels.json").write_text(json.dumps([
        {"test": "a", "args": {}, "status": "ok"},
        {"test": "b", "args": {"case": [2, 3]}, "status": "failed", "error": "boom",
         "retry": "ok"},
        {"test": "c", "args": {}, "status": "ok"}]))
    reports = write_report(out, tmp_path / "reports")
    (md,) = reports.glob("*-nvidia-h100-80gb-hbm3-*.md")
    text = md.read_text()
    assert "| memcheck | 1 | 12 |" in text and "ERROR SUMMARY: 2 errors" in text
    assert "racecheck: RACECHECK SUMMARY: 0 hazards displayed" in text
    assert "2 passed, 1 failed of 3" in text and "boom" in text
    record = json.loads(md.with_suffix(".json").read_text())
    assert record["device"] == "NVIDIA H100 80GB HBM3"
    assert [s["step"] for s in record["steps"]] == ["env", "build", "memcheck"]
    assert (out / md.name).exists()


def test_the_report_sets_the_kernel_model_beside_the_profile(tmp_path):
    """The large case's per-kernel times come with what `perfmodel --ours` predicted."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.tsv").write_text("large\t0\t130\n")
    profile = os.path.join(ROOT, "docs", "gpu", "2026-11-23-nvidia-h100-80gb-hbm3-973005d.json")
    with open(profile) as f:
        (out / "large.json").write_text(json.dumps(json.load(f)["large"]))
    reports = write_report(out, tmp_path / "reports")
    (md,) = reports.glob("*.md")
    text = md.read_text()
    assert "Per-kernel device time, dispatch+combine (per call)" in text
    assert "perfmodel --ours` predicted" in text
    # The answers per op, this run's device times against the floor (tools/gpu_summary.py).
    assert re.search(r"\| dispatch \(R 8 virtual\) \| 2,\d{3}\.\d \|", text), text
    assert re.search(r"\| combine \(expert-major\) \| 1 \| 4\.2\d\d \|", text)


def test_script_records_steps_it_cannot_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "JAX_EP_GPU_REPORT_DIR": str(tmp_path / "reports")}
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), str(out), "env"],
                          capture_output=True, text=True, timeout=120, env=env)
    steps = (out / "steps.tsv").read_text().split("\n")
    assert steps[0].startswith("env\t"), steps
    # Without a GPU nvidia-smi is missing, so the env step fails and so does the script.
    if shutil.which("nvidia-smi") is None:
        assert proc.returncode != 0
    assert list(out.glob("*.md")) and list((tmp_path / "reports").glob("*.json")), proc.stdout


def test_the_smoke_check_rehearses_on_cpu_devices():
    """tools/gpu_multiprocess_smoke.py --local runs its check over the devices of one process:
    between GPUs through CUDA peer access, here between 8 CPU devices through host peers, on a
    (data 2, ep 4) mesh, each shard against the reference of its EP group; then a refused
    low-latency send, reported by every rank, and the group again after a new
    initialization."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools",
                                                        "gpu_multiprocess_smoke.py"),
                           "--local", "--data", "2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"smoke in one process with 8 devices \(cpu, store, 2 EP groups; a refused "
                     r"send reported in [\d.]+ s\): ok", proc.stdout), proc.stdout


def test_the_graph_case_rehearses_on_cpu_devices(tmp_path):
    """tools/gpu_graph_case.py's decode loop between 4 CPU devices (host peers): the runs
    with and without command buffers (none on the CPU) agree bit for bit, the program
    compiled ahead of time runs right after a new initialization, and the bench row is
    written, marked not meaningful."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    row = tmp_path / "graph.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_graph_case.py"),
                           "--steps", "3", "--repeats", "2", "--json", str(row)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(row.read_text())
    assert record["name"] == "ll_roundtrip_graph" and record["meaningful"] is False, record
    assert "times not meaningful here" in proc.stdout
    assert "run after a new initialize(): recorded again: the same result" in proc.stdout


def script_steps() -> list[str]:
    with open(os.path.join(ROOT, "tools", "gpu_check.sh")) as f:
        return re.findall(r"^step (\w+) ", f.read(), re.M)


def test_a_dry_run_finds_every_step_runnable(tmp_path):
    """--dry-run runs no step: it checks each one's command and files exist, runs every step
    but `tests` (which runs only when named), and writes the report of that."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--dry-run",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [r[0] for r in rows] == [s for s in script_steps() if s != "tests"]
    assert all(r[1] == "0" for r in rows), rows
    assert "would run: python3 " in (out / "smoke4_groups.log").read_text()
    assert list(out.glob("*.md")), proc.stdout


def test_the_docs_list_every_step_of_the_script():
    with open(os.path.join(ROOT, "docs", "gpu", "README.md")) as f:
        rows = [line for line in f if line.startswith("| `")]
    documented = [name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert documented == script_steps()


def test_the_report_of_a_run_stopped_mid_step(tmp_path):
    """A run stopped at a time limit leaves a half-written status line and result: the report
    keeps the steps that finished."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.tsv").write_text("env\t0\t1\nkernels\t0\t12\nlarge\t")
    (out / "kernels.json").write_text('[{"test": "a", "args": {}, "status": "ok"}, {"te')
    (out / "large.log").write_text("")
    reports = write_report(out, tmp_path / "reports")
    (md,) = reports.glob("*.md")
    record = json.loads(md.with_suffix(".json").read_text())
    assert [s["step"] for s in record["steps"]] == ["env", "kernels"]
    assert record["kernels"] is None


def test_the_report_shows_the_sweep_and_the_skipped_steps(tmp_path):
    """The sweep's fastest streamed settings per op with the phased time and their ratio,
    the points that ran wrong, and a step that passed without doing its work (no MPS)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.tsv").write_text("mps\t0\t2\ntune\t1\t170\n")
    (out / "mps.log").write_text("mps: skipped: no MPS (nvidia-cuda-mps-control is not on "
                                 "PATH)\n")

    def point(op, mode, median, status="ok", error=""):
        rings = (40, 4, 3, 0) if mode == "streamed" else (None,) * 4
        return {"op": op, "mode": mode, "num_sms": 20, "status": status, "error": error,
                **dict(zip(("channels", "chunk_tokens", "ring_chunks", "warps"), rings,
                           strict=True)), "median_s": median}

    best = {"channels": 40, "chunk_tokens": 4, "ring_chunks": 3, "warps": 0, "num_sms": 20,
            "median_s": 0.5e-3, "gbps": 420.0, "plan": {"channels": 40, "warps": 4},
            "phased_s": 1e-3, "streamed_over_phased": 0.5}
    (out / "tune.json").write_text(json.dumps({
        "meaningful": True, "calls": 8, "device": "NVIDIA H200",
        "shape": {"tokens": 4096, "hidden": 7168, "top_k": 8, "experts": 256,
                  "dtype": "bfloat16"},
        "sets": [{"ranks": 4, "how": "4 processes on one GPU under MPS", "best":
                  {"dispatch": best},
                  "points": [point("dispatch", "phased", 1e-3),
                             point("dispatch", "streamed", 0.5e-3),
                             point("dispatch", "streamed", 0.1e-3, "wrong", "rank 1 [0].x"),
                             point("combine", "streamed", None, "skipped: over the time "
                                   "budget")]}]}))
    reports = write_report(out, tmp_path / "reports")
    (md,) = reports.glob("*.md")
    text = md.read_text()
    assert "- `mps`: mps: skipped: no MPS (nvidia-cuda-mps-control is not on PATH)" in text
    assert "| 4 | dispatch | 40,4,3,0 | 20 | 40 x 4 | 500.0 | 420.0 | 1000.0 | 0.50 |" in text
    assert "2 of 4 points ran and match the first bit for bit, 1 skipped" in text
    assert "dispatch streamed 40,4,3,0 num_sms 20: wrong rank 1 [0].x" in text
    record = json.loads(md.with_suffix(".json").read_text())
    assert record["tune"]["sets"][0]["best"]["dispatch"]["streamed_over_phased"] == 0.5
    assert [s["skipped"] for s in record["steps"]] == [
        "mps: skipped: no MPS (nvidia-cuda-mps-control is not on PATH)", None]


def test_the_report_shows_the_copy_rate_table(tmp_path):
    """The `copyrate` step's JSON (python -m jax_ep.tools.copy_rate) as a table: per warps and
    loads in flight the rate, its fraction of XLA's copy, and a copy that changed a byte."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.tsv").write_text("copyrate\t1\t14\n")

    def row(warps, run, words, gbps, identical=True):
        return {"warps": warps, "warps_run": run, "words_in_flight": words, "seconds": 1e-3,
                "gbps": gbps, "of_xla": gbps / 4000.0, "identical": identical}

    (out / "copy_rate.json").write_text(json.dumps({
        "command": "python -m jax_ep.tools.copy_rate", "device": "NVIDIA H200",
        "platform": "gpu", "meaningful": True, "bytes": 300_000_000, "row_bytes": 14336,
        "copies": 4, "repeat": 3, "xla_copy_Bps": 4.0e12,
        "rows": [row("8", 8, 4, 40.0), row("8", 8, 16, 120.5), row("all", 132, 8, 3600.0),
                 row("all", 0, 16, 3700.0, identical=False)]}))
    reports = write_report(out, tmp_path / "reports")
    (md,) = reports.glob("*.md")
    text = md.read_text()
    assert ("Copy rate of the row copy alone (`python -m jax_ep.tools.copy_rate`, 300 MB in "
            "rows of 14336 bytes; XLA's copy 4000 GB/s):") in text
    assert "| warps | words in flight | GB/s | of XLA copy | identical |" in text
    assert "| 8 | 16 | 120.5 | 0.03 | yes |" in text
    assert "| all (132) | 8 | 3600.0 | 0.90 | yes |" in text
    assert "| all (every SM) | 16 | 3700.0 | 0.93 | NO |" in text
    record = json.loads(md.with_suffix(".json").read_text())
    assert record["copy_rate"]["rows"][0]["gbps"] == 40.0


def test_the_report_shows_device_time_beside_the_median(tmp_path):
    """A bench row with device time gets it and its 'of floor' in the report's table; a row
    without (an older bench, or --device-time off) reads '-' there; an n/a row stays empty."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.tsv").write_text("bench_ep1\t0\t60\n")
    meaning = "device: device time of one call, from jax.profiler over 5 more calls"
    (out / "bench_ep1.json").write_text(json.dumps({
        "command": "python -m jax_ep.tools.bench --fp8", "device": {"kind": "NVIDIA H200"},
        "copy_bandwidth_Bps": 4.2e12,
        "device_time": {"mode": "auto", "source": "gpu", "calls": 5, "meaning": meaning},
        "rows": [
            {"op": "dispatch", "backend": "cuda", "status": "ok", "gbps": 312.5,
             "of_floor": 0.6512, "vs_xla": 0.25, "time": {"median": 250e-6},
             "device_s": 180.25e-6, "of_floor_device": 0.9044,
             "kernels": [{"kernel": "DispatchSend", "launches_per_call": 1.0,
                          "ms_per_call": 0.15}]},
            {"op": "dispatch", "backend": "xla", "status": "ok", "gbps": 78.1,
             "of_floor": 0.163, "vs_xla": 1.0, "time": {"median": 1e-3}},
            {"op": "combine", "backend": "cuda", "status": "n/a"}]}))
    reports = write_report(out, tmp_path / "reports")
    (md,) = reports.glob("*.md")
    text = md.read_text()
    assert "| op | backend | median | device | GB/s | of floor | of floor (device) | vs xla |" \
        in text
    assert "| dispatch | cuda | 250.0 us | 180.2 us | 312.5 | 0.65 | 0.90 | 0.25 |" in text
    assert "| dispatch | xla | 1000.0 us | - | 78.1 | 0.16 | - | 1.00 |" in text
    assert "| combine | cuda | n/a | | | | | |" in text
    assert meaning in text
    record = json.loads(md.with_suffix(".json").read_text())
    row = record["bench_ep1"]["rows"][0]
    assert row["device_s"] == 180.25e-6 and row["kernels"][0]["kernel"] == "DispatchSend"
