"""tools/gpu_tune.py, the sweep of the streamed ops' settings: its rehearsal on CPU devices
(the same code as on a GPU, through the host peers), and the parts that pick and report."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np

from jax_ep import runtime, tuned

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "gpu_tune.py")
spec = importlib.util.spec_from_file_location("gpu_tune", TOOL)
gpu_tune = importlib.util.module_from_spec(spec)
sys.modules["gpu_tune"] = gpu_tune  # its dataclass looks itself up there
spec.loader.exec_module(gpu_tune)


def test_the_sweep_rehearses_on_cpu_devices(tmp_path, monkeypatch):
    """--cpu: a process of R CPU devices per set (R 4 and 2), every point of the tiny grid run,
    checked bit for bit against the first (phased) point, the fastest streamed settings
    per op chosen by median, and the entry for the runtime's table rendered."""
    out = tmp_path / "tune.json"
    proc = subprocess.run([sys.executable, TOOL, "--cpu", "--json", str(out), "--table",
                           str(tmp_path / "entry.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["platform"] == "cpu" and record["meaningful"] is False
    assert "copy-rate microbenchmark" in record["not_done"]
    assert [run["ranks"] for run in record["sets"]] == [4, 2]
    rings = [gpu_tune.parse_rings(r) for r in gpu_tune.CPU_DEFAULTS["rings"]]
    for run in record["sets"]:
        grid = gpu_tune.grid(rings, gpu_tune.CPU_DEFAULTS["num_sms"], run["ranks"])
        labels = [{k: p[k] for k in ("mode", "channels", "chunk_tokens", "ring_chunks",
                                     "warps", "num_sms")} for p in run["points"]]
        assert labels == [point.label() for point in grid for _ in gpu_tune.OPS]
        assert [p["op"] for p in run["points"]] == list(gpu_tune.OPS) * len(grid)
        assert run["points"][0]["mode"] == "phased"
        for p in run["points"]:
            assert p["status"] == "ok" and p["checked_against"] == 0, p
            assert p["median_s"] > 0 and p["rows"] > 0 and len(p["times_s"]) == 2, p
        for op in gpu_tune.OPS:
            streamed = [p for p in run["points"] if p["op"] == op and p["mode"] == "streamed"]
            fastest = min(streamed, key=lambda p: p["median_s"])
            phased = min(p["median_s"] for p in run["points"]
                         if p["op"] == op and p["mode"] == "phased")
            chosen = record["best"]["cpu"][str(run["ranks"])][op]
            assert chosen == run["best"][op]
            assert chosen["median_s"] == fastest["median_s"]
            assert (chosen["channels"], chosen["num_sms"]) == (fastest["channels"],
                                                               fastest["num_sms"])
            assert chosen["streamed_over_phased"] == fastest["median_s"] / phased
            assert f"{op}, {run['ranks']} ranks (CPU devices" in proc.stdout
    assert "points ran and match the first point bit for bit" in proc.stdout
    # The entry for the runtime's table: printed, in the JSON and the --table file, the
    # set of the most ranks' least dispatch + combine time, and read back by the runtime.
    text = record["table_entry"]
    assert text == gpu_tune.render_entry(*gpu_tune.table_entry(record))
    assert text in proc.stdout and "times not meaningful here, not for the table" in proc.stdout
    assert (tmp_path / "entry.py").read_text() == text + "\n"
    assert max(len(line) for line in text.splitlines()) <= 100  # ruff's line length
    parsed = ast.literal_eval("{" + text + "}")
    entry = parsed["cpu"]
    assert list(parsed) == ["cpu"] and "4 ranks" in entry["measured"]
    totals = {}
    for p in record["sets"][0]["points"]:
        shape = None if p["mode"] == "phased" else tuple(p[k] for k in (
            "channels", "chunk_tokens", "ring_chunks", "warps"))
        fastest = totals.setdefault(shape, {})
        fastest[p["op"]] = min(fastest.get(p["op"], (np.inf,)), (p["median_s"], p["num_sms"]))
    shape, chosen = min(totals.items(), key=lambda item: sum(t for t, _ in item[1].values()))
    assert entry["channels"] == (None if shape is None else dict(zip(
        ("channels", "chunk_tokens", "ring_chunks", "warps"), shape, strict=True)))
    assert entry["num_sms"] == {op: chosen[op][1] for op in gpu_tune.OPS}
    monkeypatch.setattr(tuned, "TABLE", parsed)
    settings = runtime.tuned_settings("cpu")
    assert settings.num_sms == entry["num_sms"]
    assert settings.channels == (entry["channels"] and runtime.Channels(**entry["channels"]))


def test_the_entry_takes_one_ring_shape_for_both_ops():
    """The fastest shape of each op differs: the entry takes the shape with the least sum,
    each op at its fastest num_sms there, from the set of the most ranks; phased where the
    phased ops' sum is the least; and it round-trips into the runtime's table."""
    def run(ranks, times):
        points = [{"mode": "phased" if shape is None else "streamed", "op": op,
                   "status": "ok", "median_s": t, "num_sms": sms,
                   **dict(zip(("channels", "chunk_tokens", "ring_chunks", "warps"),
                              shape or (None,) * 4, strict=True))}
                  for (shape, op, sms), t in times.items()]
        return {"ranks": ranks, "device": "NVIDIA Test", "how": "test", "points": points}

    a, b = (40, 4, 3, 0), (64, 4, 3, 0)
    times = {(None, "dispatch", 20): 9, (None, "combine", 20): 9,
             (a, "dispatch", 20): 1, (a, "combine", 20): 6,  # fastest dispatch, sum 7
             (b, "dispatch", 20): 3, (b, "dispatch", 28): 2,  # sum 5, at num_sms 28 and 20
             (b, "combine", 20): 3, (b, "combine", 28): 4}
    record = {"shape": {"tokens": 1, "hidden": 128, "top_k": 1, "experts": 2},
              "sets": [run(2, {(None, "dispatch", 20): 1, (None, "combine", 20): 1}),
                       run(4, times)]}
    kind, entry = gpu_tune.table_entry(record)
    assert kind == "NVIDIA Test" and "4 ranks" in entry["measured"]
    assert entry["channels"] == {"channels": 64, "chunk_tokens": 4, "ring_chunks": 3,
                                 "warps": 0}
    assert entry["num_sms"] == {"dispatch": 28, "combine": 20}
    record["sets"][1] = run(4, {**times, (None, "dispatch", 20): 1, (None, "combine", 20): 1})
    assert gpu_tune.table_entry(record)[1]["channels"] is None
    record["sets"] = [run(4, {(a, "dispatch", 20): 1})]  # no set timed both ops
    assert gpu_tune.table_entry(record) is None
    parsed = ast.literal_eval("{" + gpu_tune.render_entry(kind, entry) + "}")
    assert parsed == {kind: entry}
    try:
        tuned.TABLE[kind] = parsed[kind]
        assert runtime.defaults_for(kind).channels == runtime.Channels(64, 4, 3, 0)
    finally:
        del tuned.TABLE[kind]


def test_without_mps_the_sweep_says_so_and_passes(tmp_path):
    """On a machine where no MPS daemon answers, nothing is timed: the tool says why and
    exits 0, and its JSON says skipped."""
    out = tmp_path / "tune.json"
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no nvidia-cuda-mps-control
    proc = subprocess.run([sys.executable, TOOL, "--json", str(out)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tune: skipped: no MPS (nvidia-cuda-mps-control is not on PATH)" in proc.stdout
    assert json.loads(out.read_text())["skipped"].startswith("no MPS")


def test_differences_are_bitwise():
    """A NaN equals itself bit for bit, -0.0 differs from 0.0, and a result the first point
    did not have is a difference too."""
    nan = np.array([np.nan, 1.0], np.float32)
    want = {(0, ".x"): nan, (1, ".x"): np.array([0.0], np.float32)}
    assert gpu_tune.differences({(0, ".x"): nan.copy(), (1, ".x"): np.zeros(1, np.float32)},
                                want) == []
    got = {(0, ".x"): nan.copy(), (1, ".x"): np.array([-0.0], np.float32),
           (2, ".x"): np.zeros(1, np.float32)}
    assert gpu_tune.differences(got, want) == ["rank 1 .x", "rank 2 .x"]


def line(index, op, mode, median, status="ok", rings=(4, 2, 2, 0)):
    label = {"index": index, "mode": mode, "num_sms": 20,
             **dict(zip(("channels", "chunk_tokens", "ring_chunks", "warps"),
                        rings if mode == "streamed" else (None,) * 4, strict=True))}
    out = {**label, "op": op, "status": status, "times_s": [median] * 3, "rows": 10,
           "checked_against": 0, "differs": ["rank 0 .x"] if status == "wrong" else []}
    if mode == "streamed":
        out["plans"] = {o: {"channels": rings[0], "warps": 1, "per_channel": 3}
                        for o in gpu_tune.OPS}
    return label, out


def test_a_wrong_point_is_never_the_best():
    """The fastest point ran wrong in one process: it is reported, and the best is the
    fastest of those that ran right; a point one process did not report is missing."""
    labels, lines = zip(*(
        line(0, "dispatch", "phased", 4e-3), line(0, "combine", "phased", 5e-3),
        line(1, "dispatch", "streamed", 1e-3, "wrong"), line(1, "combine", "streamed", 2e-3),
        line(2, "dispatch", "streamed", 3e-3, rings=(8, 2, 2, 0)),
        line(2, "combine", "streamed", 4e-3, rings=(8, 2, 2, 0))), strict=True)
    grid = {"device": "NVIDIA H200", "grid": list(labels[::2])}
    second = [dict(p, status="ok", differs=[]) for p in lines[:-1]]  # no combine at point 2
    run = gpu_tune.merge([[grid, *lines], second], ranks=2, hidden=7168)
    status = {(p["index"], p["op"]): p["status"] for p in run["points"]}
    assert status == {(0, "dispatch"): "ok", (0, "combine"): "ok", (1, "dispatch"): "wrong",
                      (1, "combine"): "ok", (2, "dispatch"): "ok", (2, "combine"): "missing"}
    chosen = gpu_tune.best(run["points"])
    assert chosen["dispatch"]["channels"] == 8 and chosen["dispatch"]["median_s"] == 3e-3
    assert chosen["dispatch"]["streamed_over_phased"] == 3e-3 / 4e-3
    assert chosen["combine"]["channels"] == 4
    run["how"] = "test"
    text = "\n".join(gpu_tune.table(run, "dispatch"))
    assert "WRONG: rank 0 .x" in text and "| streamed | 8 | 2 | 2 | 0 | 20 | 8 x 1 |" in text
