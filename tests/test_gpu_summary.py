"""tools/gpu_summary.py: the GPU report's answers per op, from a report's own numbers."""

from __future__ import annotations

import copy
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_summary  # noqa: E402

REPORTS = os.path.join(ROOT, "docs", "gpu")  # CI's installed jax_ep has no docs/
H200 = os.path.join(REPORTS, "2026-11-27-nvidia-h200-ca296ed.json")


@pytest.fixture
def report() -> dict:
    with open(H200) as f:
        return json.load(f)


def _row(lines: list[str], op: str) -> list[str]:
    (line,) = [x for x in lines if x.startswith(f"| {op} ")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_committed_h200_run_misses_its_floor_targets(report):
    """ca296ed on the H200: dispatch 1.10 ms for 2.96 GB, 0.63 of a 4.26 TB/s floor."""
    lines = gpu_summary.answers(report, REPORTS)
    op, device, floor, of_floor, target, model, sweep = _row(lines, "dispatch (R 8 virtual)")
    assert device == "1,103.7"
    assert float(of_floor) == pytest.approx(float(floor.replace(",", "")) / 1103.7, abs=0.01)
    assert 0.55 < float(of_floor) < 0.7 and "missed" in target
    assert re.fullmatch(r"[\d,.]+ \([+-]\d+%\)", model) and sweep == "-"
    assert "missed" in _row(lines, "combine (expert-major) (R 8 virtual)")[4]
    # The report predates device time in the benchmark: the round trip has wall time only.
    round_trip = _row(lines, "ll round trip (R 1)")
    assert round_trip[1] == "-; wall 395.8" and round_trip[4] == "<= 25 us: -"
    assert "phased between processes: - (not measured)" in lines[-1]


def test_measured_rates_sweeps_and_device_times_are_used(report):
    """A faster copy rate moves the floor; the sweep's ratios and settings and the round
    trip's device time decide their targets."""
    faster = copy.deepcopy(report)
    faster["copy_rate"] = {"xla_copy_Bps": 2 * 4.26e12}
    faster["bench_ep1"]["rows"] = [dict(r, device_s=20e-6) if r["op"] == "ll_round_trip" else r
                                   for r in faster["bench_ep1"]["rows"]]
    best = {"channels": 40, "chunk_tokens": 4, "ring_chunks": 3, "warps": 0, "num_sms": 20}
    faster["tune"] = {"sets": [
        {"ranks": 4, "best": {"dispatch": {**best, "streamed_over_phased": 0.8},
                              "combine": {**best, "streamed_over_phased": 1.1}}}]}
    lines = gpu_summary.answers(faster, REPORTS)
    assert "this run's XLA copy" in "\n".join(lines)
    slow, fast = _row(gpu_summary.answers(report, REPORTS), "dispatch (R 8 virtual)"), \
        _row(lines, "dispatch (R 8 virtual)")
    assert float(fast[3]) == pytest.approx(float(slow[3]) / 2, abs=0.02)
    assert _row(lines, "dispatch (R 8 virtual)")[6] == "4 ranks: 0.80 at 40,4,3,0 num_sms 20"
    assert _row(lines, "ll round trip (R 1)")[4] == "<= 25 us: met"
    assert "phased between processes: **missed** (worst ratio 1.10)" in lines[-1]
