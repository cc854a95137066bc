"""The model of our kernels' device time (jax_ep.tools.kernel_model, `perfmodel --ours`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jax_ep.tools import account, kernel_model, perfmodel

PROFILE_JSON = Path(__file__).parent.parent / kernel_model.PROFILE.replace(".md", ".json")

# Each profiled kernel: the large case that ran it and its name in the trace.
WHERE = {
    "DispatchSend": ("dispatch+combine", "DispatchSend<"),
    "DispatchFinish": ("dispatch+combine", "DispatchFinish<"),
    "DispatchSend (fp8)": ("dispatch fp8", "DispatchSend<"),
    "DispatchFinish (fp8)": ("dispatch fp8", "DispatchFinish<"),
    "CombineToken": ("dispatch+combine", "CombineToken<"),
    "DispatchSend (expert-major)": ("dispatch+combine expert-major", "DispatchSend<"),
    "DispatchFinish (expert-major)": ("dispatch+combine expert-major", "DispatchFinish<"),
    "CombineReduceEntries": ("dispatch+combine expert-major", "CombineReduceEntries<"),
    "CombineToken (expert-major)": ("dispatch+combine expert-major", "CombineToken<"),
    "DispatchCount": ("dispatch+combine", "DispatchCount<"),
    "LowLatencyCount": ("low-latency round trip", "LowLatencyCount<"),
    "LowLatencySend": ("low-latency round trip", "LowLatencySend<"),
    "LowLatencyFinish": ("low-latency round trip", "LowLatencyFinish<"),
    "LowLatencySend (fp8)": ("low-latency round trip fp8", "LowLatencySend<"),
    "LowLatencyFinish (fp8)": ("low-latency round trip fp8", "LowLatencyFinish<"),
    "LowLatencyCombineSend": ("low-latency round trip", "LowLatencyCombineSend<"),
    "LowLatencyCombineToken": ("low-latency round trip", "LowLatencyCombineToken>"),
}


def test_profiled_times_are_the_reports():
    """Each kernel's time is the profile's, per launch (combine ran twice per call there)."""
    kernels = json.loads(PROFILE_JSON.read_text())["large"]["kernels"]
    profiled = kernel_model.profiled_kernels()
    assert sorted(k.kernel for k in profiled) == sorted(WHERE)
    for k in profiled:
        case, name = WHERE[k.kernel]
        (row,) = [r for r in kernels[case] if name in r["kernel"]]
        per_launch = row["ms_per_call"] / row["launches_per_call"] * 1e-3
        assert k.measured_s == pytest.approx(per_launch, rel=3e-3), k.kernel


def test_profiled_bytes_match_the_report_s_summary():
    """The report: rank-major dispatch moved 2 x 2.49 GB, its rows read and written."""
    by_name = {k.kernel: k for k in kernel_model.profiled_kernels()}
    R, T, H = kernel_model.R, kernel_model.T, kernel_model.H
    rows = by_name["DispatchSend"].bytes - R * T * 2 * H
    assert rows == pytest.approx(2.49e9, rel=0.01)
    # The combine read those rows and wrote every token once.
    assert by_name["CombineToken"].bytes == rows + R * T * 2 * H


def test_calibration_and_errors():
    kernels = kernel_model.profiled_kernels()
    rate, zero_rate = kernel_model.calibrate(kernels)
    moving = [k for k in kernels if k.bytes and not k.zeroing]
    rates = sorted(k.bytes / (k.measured_s - kernel_model.LAUNCH_S) for k in moving)
    assert rates[0] < rate < rates[-1]
    assert rate < zero_rate <= kernel_model.COPY_FLOOR_BPS * 1.1  # writes ran near the floor
    errors = kernel_model._errors(moving, rate, zero_rate)
    assert np.median(np.abs(errors)) < 0.3


def test_a_launch_that_cannot_fill_the_gpu_is_slower():
    full = kernel_model.predict_s(1, 10**8, account.WARPS_TARGET, 1e12)
    assert full == pytest.approx(kernel_model.LAUNCH_S + 1e-4)
    assert kernel_model.predict_s(1, 10**8, account.WARPS_TARGET // 4, 1e12) == pytest.approx(
        kernel_model.LAUNCH_S + 4e-4)
    assert kernel_model.predict_s(3, 0, None, 1e12) == pytest.approx(3 * kernel_model.LAUNCH_S)


def test_perfmodel_ours_prints_every_op(capsys):
    perfmodel.main(["--ours"])
    out = capsys.readouterr().out
    for k in kernel_model.profiled_kernels():
        assert f"| {k.kernel} |" in out
    for op in ("dispatch", "combine (expert-major)", "ll_dispatch_send", "ll_combine_recv"):
        assert f"| {op} |" in out
    assert "round trip of" in out and "goal of 25 us" in out
