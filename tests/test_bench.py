"""The main job, python -m jax_ep.tools.bench, runs end to end and reports every op."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jax_ep
from jax_ep import _ffi
from jax_ep.tools.bench import OPS

TIME_UNITS = {"us": 1e-6, "ms": 1e-3}


SMALL = ["--tokens", "16", "--ll-tokens", "8", "--hidden", "128", "--experts", "16",
         "--top-k", "4", "--repeat", "2", "--warmup", "1", "--fp8"]


def _run_bench(tmp_path, *extra):
    """python -m jax_ep.tools.bench on small shapes in a fresh process; (process, JSON record)."""
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(jax_ep.__file__).parents[1]), *filter(None, [env.get("PYTHONPATH")])]
    )
    command = [sys.executable, "-m", "jax_ep.tools.bench", *SMALL, *extra, "--json", str(out)]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_bench_virtual_ranks_times_both_backends(tmp_path):
    """--virtual: all R ranks on one device; the kernels (CPU handlers here) and xla."""
    proc, record = _run_bench(tmp_path, "--virtual", "--ranks", "4")
    assert "with 4 virtual ranks" in proc.stdout
    assert record["device"]["virtual_ranks"] is True
    rows = {(r["op"], r["backend"]): r for r in record["rows"]}
    assert set(rows) == {(op, b) for op in OPS for b in ("xla", "cuda")}
    for key, row in rows.items():
        assert row["status"] == "ok", (key, row)
        # The same op moves the same bytes whichever backend runs it.
        assert row["bytes_per_rank"] == rows[(key[0], "xla")]["bytes_per_rank"], key


def test_bench_runs_every_op(tmp_path):
    # A fresh process: none of this process's device settings (conftest.py) carry over, and
    # it imports the jax_ep under test.
    proc, record = _run_bench(tmp_path)
    assert f"[1/{len(OPS) * len(jax_ep.backends.BACKENDS)}]" in proc.stderr  # progress

    # The table: every op on the xla backend, with a positive time.
    times = {}
    for line in proc.stdout.splitlines():
        words = line.split()
        if len(words) >= 4 and words[0] in OPS and words[1] == "xla":
            times[words[0]] = float(words[2]) * TIME_UNITS[words[3]]
    assert sorted(times) == sorted(OPS), proc.stdout
    assert all(t > 0 for t in times.values()), proc.stdout
    # The cuda backend runs between the CPU devices too: the benchmark initializes its host
    # peers. Rows not timed (no extension built) are explained above the table.
    if _ffi.EXT is not None:
        assert all(r["status"] == "ok" for r in record["rows"]), proc.stdout
        assert "CPU emulation" in proc.stdout, proc.stdout
    else:
        above, _, below = proc.stdout.partition("Not timed (n/a or error in the table below):")
        assert below and OPS[0] not in above.split("rerun:")[-1], proc.stdout
    assert proc.stdout.lstrip().startswith("jax_ep.tools.bench on"), proc.stdout[:200]

    # The JSON: the same rows, with times and bytes moved.
    assert record["copy_bandwidth_Bps"] > 0
    xla_rows = {r["op"]: r for r in record["rows"] if r["backend"] == "xla"}
    assert sorted(xla_rows) == sorted(OPS)
    for op, row in xla_rows.items():
        assert row["status"] == "ok", row
        assert row["time"]["median"] > 0 and len(row["time"]["all"]) == 2, row
        assert row["bytes_per_rank"] > 0 and row["gbps"] > 0 and row["floor_s"] > 0, row
        assert row["vs_xla"] == 1.0, op
    assert {(r["op"], r["backend"]) for r in record["rows"]} == {
        (op, backend) for op in OPS for backend in jax_ep.backends.BACKENDS
    }
    # On CPU the model column is this machine's floor, and the output says so.
    assert record["model_hardware"] == "this machine, all ranks"
    assert any(n.startswith("model on CPU: a floor, not a forecast") for n in record["notes"])


def test_bench_explains_a_round_trip_faster_than_its_dispatch():
    """The note on ll_round_trip < ll_dispatch appears exactly for the backends where it
    happened, with the size of the receive buffer dispatch returns."""
    from jax_ep.tools import perfmodel
    from jax_ep.tools.bench import suite
    from jax_ep.tools.bench.__main__ import readings

    setup = suite.Setup(ranks=8, tokens=16, ll_tokens=32, hidden=2048, top_k=8, experts=256,
                        routing="uniform", dtype="bfloat16", seed=0)

    def row(op, backend, seconds):
        return {"op": op, "backend": backend, "status": "ok", "time": {"median": seconds}}

    rows = [row("ll_dispatch", "xla", 0.087), row("ll_round_trip", "xla", 0.003),
            row("ll_dispatch", "cuda", 0.001), row("ll_round_trip", "cuda", 0.002)]
    notes = readings(rows, setup, perfmodel.H800, on_cpu=False, virtual=True)
    assert len(notes) == 1 and notes[0].startswith("ll_round_trip < ll_dispatch (xla)")
    assert "(268 MB over the ranks here" in notes[0]  # 256 x 8 x 32 x 2048 x 2 bytes


def test_bench_prints_the_performance_model(tmp_path):
    """Each modelled row carries jax_ep.tools.perfmodel's prediction for the chosen hardware."""
    from jax_ep.tools import perfmodel

    proc, record = _run_bench(tmp_path, "--model", "H800", "--ops", "dispatch", "ll_combine",
                              "--backends", "xla")
    assert record["model_hardware"] == "H800" and "--model H800" in record["command"]
    assert "model: jax_ep.tools.perfmodel's prediction for H800" in " ".join(proc.stdout.split())
    rows = {r["op"]: r for r in record["rows"]}
    config = perfmodel.Config(num_tokens=16, hidden=128, num_topk=4, num_experts=16,
                              num_ranks=8, fp8_dispatch=True)
    want = perfmodel.predict(config, perfmodel.H800, mode="normal").dispatch_s
    assert rows["dispatch_fp8"]["model_s"] == want
    ll = perfmodel.predict(dataclasses.replace(config, num_tokens=8, fp8_dispatch=False),
                           perfmodel.H800, mode="low_latency")
    assert rows["ll_combine"]["model_s"] == ll.combine_s
    assert "layout" not in rows  # not asked for; and the model has no layout row
    assert not any(n.startswith("model on CPU") for n in record["notes"])  # a GPU's model


def test_bench_reports_wire_bytes_and_transport(tmp_path, monkeypatch):
    """The ragged transport (its CPU model here): named in the header, the rows and the rerun
    command; the wire table gives each transport's bytes against the routed minimum."""
    monkeypatch.setenv("JAX_EP_XLA_TRANSPORT", "ragged")
    proc, record = _run_bench(tmp_path, "--ops", "dispatch", "ll_combine", "--backends", "xla")
    assert "xla backend's transport: ragged" in proc.stdout
    assert "JAX_EP_XLA_TRANSPORT=ragged python -m jax_ep.tools.bench" in record["command"]
    assert {r["transport"] for r in record["rows"]} == {"ragged"}
    assert "bytes sent to other ranks, per rank" in proc.stdout
    wire = record["wire_bytes_per_rank"]
    assert {"dispatch", "ll_combine"} <= set(wire)  # (--fp8 adds dispatch_fp8)
    for op, w in wire.items():
        assert 0 < w["minimum"] <= w["cuda"] and w["minimum"] <= w["ragged"], (op, w)
        assert w["ragged"] < w["all_gather"], (op, w)
    assert wire["ll_combine"]["ragged"] == wire["ll_combine"]["minimum"]


def test_bench_refuses_unwritable_json_and_oversized_runs_up_front(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(jax_ep.__file__).parents[1]), *filter(None, [env.get("PYTHONPATH")])]
    )

    def run(*flags):
        return subprocess.run([sys.executable, "-m", "jax_ep.tools.bench", *flags], env=env,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)

    proc = run("--json", str(tmp_path / "missing" / "x.json"))
    assert proc.returncode == 2 and "jax_ep.tools.bench" not in proc.stdout  # nothing timed
    json_path = tmp_path / "missing" / "x.json"
    assert f"python -m jax_ep.tools.bench: error: --json {json_path}: the folder" in proc.stderr
    proc = run("--tokens", "100000000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "python -m jax_ep.tools.bench: error: --ranks" in proc.stderr
    assert "--tokens 100000000" in proc.stderr and "GiB" in proc.stderr
    assert "lower them" in proc.stderr


def test_the_floor_of_a_copy_at_the_measured_rate_is_reached_not_beaten():
    """The floor (a GPU's 'of floor' read 1.4-1.65, faster than the floor, when one short
    copy was timed by wall clock). An accelerator's rate comes from one program of many
    copies, each a pass of its own (XLA fuses none of them), timed together: with an
    H200's numbers (4.26 TB/s; 50 us to launch and wait for a program, more than measured)
    the launch is under 1 % of what is timed, so a copy of other bytes at the true rate sits
    at the floor (of floor within 1 % of 1), where one copy of 256 MB read 1.3 and more."""
    import re

    import jax
    import numpy as np

    from jax_ep.tools.bench import __main__ as bench
    from jax_ep.tools.bench import timing

    hlo = timing.copy_program(5).lower(np.ones(1024, np.float32)).compile().as_text()
    assert len(re.findall(r"\badd\(", hlo)) == 5  # five passes, none fused away
    assert timing.device_copy_rate(jax.devices()[0], 1 << 20, 3, 2) > 0  # runs anywhere

    rate, launch = 4.26e12, 50e-6  # bytes/s read + write; seconds per program
    copies_s = timing.COPIES * 2 * timing.COPY_BYTES / rate
    measured = timing.COPIES * 2 * timing.COPY_BYTES / (launch + copies_s)
    assert 0.99 * rate <= measured <= rate
    moved = 3 << 30  # a copy that reads and writes 3 GiB per rank, at the true rate
    row = {"op": "dispatch", "backend": "cuda", "status": "ok", "bytes_per_rank": moved,
           "time": {"median": 2 * moved / rate}}
    bench.add_ratios([row], measured, 1)
    assert 1.0 <= row["of_floor"] <= 1.01  # above 1 by the launch's share, at most
    lone = 2 * (256 << 20) / (launch + 2 * (256 << 20) / rate)  # one a + 1 of 256 MB, as before
    bench.add_ratios([row], lone, 1)
    assert row["of_floor"] > 1.3  # the report's 1.40-1.65


def test_a_copy_at_the_copy_rate_reads_the_floor_by_device_time():
    """A GPU row whose kernel copies B bytes at the rate the copy floor was measured with:
    by device time (the kernel's own, from its trace) it reads 1 within 1 %, by wall time
    (its launch and the host's wait added) far less. The floor's rate is H200-like, measured
    as copy_bandwidth does (16 copies of 1 GiB in one program, 50 us to launch and wait)."""
    from jax_ep.tools import profile
    from jax_ep.tools.bench import __main__ as bench
    from jax_ep.tools.bench import timing

    rate, launch = 4.26e12, 50e-6
    copies_s = timing.COPIES * 2 * timing.COPY_BYTES / rate
    measured = timing.COPIES * 2 * timing.COPY_BYTES / (launch + copies_s)
    moved, calls = 256 << 20, 5
    copy_us = 2 * moved / rate * 1e6
    period = copy_us + launch * 1e6  # one call after the other: a launch, then the kernel
    trace = {"traceEvents": [
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "tid": 3, "name": "thread_name",
         "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        *({"ph": "X", "pid": 7, "tid": 3, "name": "loop_add_fusion", "ts": i * period + 50.0,
           "dur": copy_us, "args": {"correlation_id": str(i)}} for i in range(calls)),
        *({"ph": "X", "pid": 1, "tid": 2, "name": "PjitFunction(copy)", "ts": i * period,
           "dur": period} for i in range(calls)),
    ]}
    device = profile.device_time(trace, calls, "gpu")
    row = {"op": "dispatch", "backend": "cuda", "status": "ok", "bytes_per_rank": moved,
           "time": {"median": period / 1e6}, "device_s": device.seconds(one_memory=False)}
    bench.add_ratios([row], measured, 1)
    assert row["device_s"] == pytest.approx(copy_us / 1e6, rel=1e-9)
    assert 1.0 <= row["of_floor_device"] <= 1.01, row  # above 1 by the launch's share
    assert row["of_floor"] < 0.75, row  # 126 us of copy in a 176 us call


def test_bench_device_time_on_cpu(tmp_path):
    """--device-time on, on CPU devices: every row carries its device time (XLA:CPU's
    operations, all virtual devices on one timeline) and its longest operations, each run
    once per call on each of the 8 devices (or per loop iteration), the cuda rows' exchange
    among them; the table shows the column, the footnote says what it is."""
    proc, record = _run_bench(tmp_path, "--device-time", "on", "--ops", "dispatch",
                              "--backends", "xla", "cuda")
    assert record["device_time"]["source"] == "cpu" and record["device_time"]["calls"] == 2
    assert "--device-time on" in record["command"]
    assert "device: device time of one call, from jax.profiler" in " ".join(proc.stdout.split())
    assert "Device time not read" not in proc.stdout
    rows = [r for r in record["rows"] if r["status"] == "ok"]
    assert {r["backend"] for r in rows} >= {"xla"}
    for r in rows:
        assert r["device_s"] > 0, r
        assert r["of_floor_device"] == pytest.approx(r["floor_s"] / r["device_s"]), r
        assert r["kernels"] and len(r["kernels"]) <= 10, r
        for k in r["kernels"]:
            assert k["launches_per_call"] % 8 == 0 and k["ms_per_call"] > 0, (r["op"], k)
        if r["backend"] == "cuda":
            assert any(k["kernel"].startswith("jax_ep_exchange") for k in r["kernels"]), r
    table = {(w[0], w[1]): w for line in proc.stdout.splitlines()
             if len(w := line.split()) > 6 and w[0] in OPS}
    xla = next(r for r in rows if (r["op"], r["backend"]) == ("dispatch", "xla"))
    words = table[("dispatch", "xla")]  # op, backend, time (2 words), device (2 words), ...
    assert float(words[4]) * TIME_UNITS[words[5]] == pytest.approx(xla["device_s"], rel=0.01,
                                                                   abs=1e-7)
