"""The model of our kernels' device time (jax_ep.tools.kernel_model, `perfmodel --ours`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jax_ep.tools import account, kernel_model, perfmodel

REPORTS = Path(__file__).parent.parent / "docs" / "gpu"
H100_REPORT = REPORTS / "2026-11-23-nvidia-h100-80gb-hbm3-973005d.json"
H200_REPORT = REPORTS / "2026-11-27-nvidia-h200-ca296ed.json"


def test_gpu_models_from_device_names():
    assert kernel_model.gpu_model("NVIDIA H100 80GB HBM3") == "H100"
    assert kernel_model.gpu_model("NVIDIA H200") == "H200"
    assert kernel_model.gpu_model("NVIDIA GB200") == "GB200"
    assert kernel_model.gpu_model("cpu") == "cpu"


def test_every_committed_report_calibrates():
    """CI reads the committed reports: each model from its newest, with every one of jax_ep's
    kernels in it assigned to an op (a new kernel name fails here, naming itself)."""
    found = kernel_model.reports(REPORTS)
    assert {r.path.name for r in found} >= {H100_REPORT.name, H200_REPORT.name}
    newest = kernel_model.newest(found)
    assert newest["H100"].path == H100_REPORT and newest["H200"].path == H200_REPORT
    for report in found:
        model = kernel_model.calibrate(report)
        assert 1e11 < model.rate < 1e13, report.path.name
        assert len(model.errors()) == len(model.measured)
    assert set(kernel_model.models(REPORTS)) >= {"H100", "H200"}


def test_an_op_is_its_kernels_per_call():
    """H200 at ca296ed: the dispatch is its count, send and finish; the combine ran twice per
    call of the case, so one combine is half its kernel's time; the bytes are the account's."""
    (report,) = [r for r in kernel_model.reports(REPORTS) if r.path == H200_REPORT]
    by_op = {m.name: m for m in kernel_model.measured_ops(report)}
    rows = {kernel_model.kernel_name(r["kernel"]): r
            for r in report.kernels["dispatch+combine"]}
    sent = sum(rows[k]["ms_per_call"] for k in ("DispatchCount", "DispatchSend", "DispatchFinish"))
    assert by_op["dispatch"].measured_s == pytest.approx(sent * 1e-3)
    assert by_op["dispatch"].launches == 3
    combined = rows["CombineToken"]["ms_per_call"] * 1e-3
    assert by_op["combine"].measured_s == pytest.approx(combined / 2)
    ops = kernel_model.accounts()
    assert by_op["combine (expert-major)"].bytes == ops["combine (expert-major)"].bytes
    # Every one of jax_ep's kernels is in exactly one op: the ops' times add up to theirs.
    ours = sum(r["ms_per_call"] for rows in report.kernels.values() for r in rows
               if kernel_model.kernel_name(r["kernel"])) * 1e-3
    calls = {op: n for ops_of in kernel_model.CASE_OPS.values() for op, n in ops_of.items()}
    counted = sum(m.measured_s * calls[m.name] for m in by_op.values())
    twice = by_op["ll_combine_recv"].measured_s  # two cases ran it; it counts once
    assert counted + twice == pytest.approx(ours, rel=1e-3)


def _write(directory: Path, source: Path, name: str, **fields) -> None:
    record = json.loads(source.read_text())
    record.update(fields)
    (directory / name).write_text(json.dumps(record))


def test_the_newest_report_of_a_model_wins(tmp_path):
    """A newer H100 report replaces 973005d's kernel-by-kernel descriptions with the account's
    ops; the H200's stays."""
    shutil.copy(H100_REPORT, tmp_path)
    shutil.copy(H200_REPORT, tmp_path)
    _write(tmp_path, H200_REPORT, "2026-12-01-nvidia-h100-abc1234.json",
           device="NVIDIA H100 80GB HBM3", date="2026-12-01", commit="abc1234")
    models = kernel_model.models(tmp_path)
    assert models["H100"].report.commit == "abc1234"
    assert models["H100"].zero_rate is None
    assert [m.name for m in models["H100"].measured] == [
        m.name for m in models["H200"].measured]
    assert kernel_model.model_for("NVIDIA H100 PCIe", tmp_path).report.commit == "abc1234"
    # A GPU without a report of its own gets the newest report's model.
    assert kernel_model.model_for("NVIDIA B200", tmp_path).report.commit == "abc1234"


def test_an_unknown_kernel_is_named(tmp_path):
    record = json.loads(H200_REPORT.read_text())
    record["large"]["kernels"]["dispatch fp8"].append(
        {"kernel": "void jax_ep::cuda::per_warp_kernel<jax_ep::DispatchTeleport>(...)",
         "launches_per_call": 1.0, "ms_per_call": 0.1})
    (tmp_path / "r.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="DispatchTeleport.*KERNEL_OPS"):
        kernel_model.models(tmp_path)
    with pytest.raises(FileNotFoundError, match="no GPU reports"):
        kernel_model.reports(tmp_path / "missing")


def test_legacy_times_are_the_reports():
    """973005d's kernels: each one's time is the profile's, per launch."""
    report = kernel_model.newest(kernel_model.reports(REPORTS))["H100"]
    kernels = json.loads(H100_REPORT.read_text())["large"]["kernels"]
    measured = kernel_model.measured_legacy(report)
    assert [m.name for m in measured] == [entry[0] for entry in kernel_model.LEGACY]
    for m, (_, case, kernel, *_rest) in zip(measured, kernel_model.LEGACY, strict=True):
        (row,) = [r for r in kernels[case] if f"{kernel}<" in r["kernel"]
                  or f"{kernel}>" in r["kernel"]]
        per_launch = row["ms_per_call"] / row["launches_per_call"] * 1e-3
        assert m.measured_s == pytest.approx(per_launch, rel=3e-3), m.name
    by_name = {m.name: m for m in measured}
    R, T, H = kernel_model.R, kernel_model.T, kernel_model.H
    # The report: rank-major dispatch moved 2 x 2.49 GB, its rows read and written.
    rows = by_name["DispatchSend"].bytes - R * T * 2 * H
    assert rows == pytest.approx(2.49e9, rel=0.01)
    assert by_name["CombineToken"].bytes == rows + R * T * 2 * H


def test_legacy_calibration_and_errors():
    model = kernel_model.models(REPORTS)["H100"]
    assert model.launch_s == pytest.approx(2.1e-6, rel=0.05)  # DispatchBases, not a memcpy
    moving = [m for m in model.measured if m.bytes and not m.zeroing]
    rates = sorted(m.bytes / (m.measured_s - model.launch_s) for m in moving)
    assert rates[0] < model.rate < rates[-1]
    assert model.rate < model.zero_rate <= kernel_model.COPY_FLOORS["H100"][0] * 1.1
    errors = [e for m, e in zip(model.measured, model.errors(), strict=True)
              if m.bytes and not m.zeroing]
    assert np.median(np.abs(errors)) < 0.3


def test_a_launch_that_cannot_fill_the_gpu_is_slower():
    launch = 2e-6
    full = kernel_model.predict_s(1, 10**8, account.WARPS_TARGET, 1e12, launch)
    assert full == pytest.approx(launch + 1e-4)
    assert kernel_model.predict_s(1, 10**8, account.WARPS_TARGET // 4, 1e12, launch) == \
        pytest.approx(launch + 4e-4)
    assert kernel_model.predict_s(3, 0, None, 1e12, launch) == pytest.approx(3 * launch)


def test_perfmodel_ours_prints_every_model(capsys):
    perfmodel.main(["--ours", "--reports", str(REPORTS)])  # CI installs jax_ep without docs/
    out = capsys.readouterr().out
    assert "## H100" in out and "## H200" in out
    for name, *_ in kernel_model.LEGACY:
        assert f"| {name} |" in out
    for op in ("dispatch", "combine (expert-major)", "ll_dispatch_send", "ll_combine_recv"):
        assert f"| {op} |" in out
    assert out.count("goal of 25 us") == 2
    with pytest.raises(SystemExit):
        perfmodel.main(["--ours", "--reports", "/nonexistent"])
