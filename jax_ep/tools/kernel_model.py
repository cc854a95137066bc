"""Device time of the cuda backend's kernels per GPU model, calibrated on the newest GPU report
of each model (docs/gpu/*.json).

Each op (its kernels on one stream, jax_ep.tools.account):

    t = launches x launch_s + bytes / (rate x fill),  fill = min(1, row_warps / WARPS_TARGET)

bytes: the row data its kernels read and write; row_warps: the warps of work in its least
parallel launch that moves rows (a launch with fewer than 4 warps per SM cannot keep enough
copies in flight to use HBM's bandwidth; the account's target).

A report's large case (tools/gpu_large_case.py: 8 virtual ranks, normal mode T 4096, low latency
T 128, H 7168, top-8 of 256 experts, uniform routing) profiles every kernel. Per GPU model
(H100 and H200 apart) the newest report gives:
- launch_s: its smallest kernel (a launch's fixed cost);
- rate: the median over what it measured of the bytes moved per second past the launches;
- the error of the model on each measured op (or kernel), printed beside the measurement.
What each measured item moved comes from today's account at the same shapes, op by op (the
kernels of an op summed; the case's own XLA work, such as its zero padding, left out), except for
commit 973005d, whose kernels still zeroed padding and empty slots: they are described kernel by
kernel (`LEGACY`), and the kernels that only wrote zeros give a rate of their own.
The floor beside a prediction is the bytes at the model's HBM copy rate (`COPY_FLOORS`).

Run `python -m jax_ep.tools.perfmodel --ours`. tests/test_kernel_model.py checks that every
committed report calibrates.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jax_ep.fp8 import BLOCK
from jax_ep.tools import account

# The large case's shapes (tools/gpu_large_case.py).
R, T, LL_T, H, K, E = 8, 4096, 128, 7168, 8, 256
REPORTS = Path(__file__).resolve().parents[2] / "docs" / "gpu"
# HBM copy rate (read + write) per GPU model, and where it comes from.
COPY_FLOORS = {
    "H100": (3.0e12, "measured with an XLA copy on an H100 80GB HBM3"),
    "H200": (4.26e12, "published measurements of an H200's copy rate; ours is still to come"),
}

# The large case's calls of each op per call of the case (tools/gpu_large_case.py: two
# combines, plain and weighted).
CASE_OPS = {
    "dispatch+combine": {"dispatch": 1, "combine": 2},
    "dispatch+combine expert-major": {"dispatch (expert-major)": 1, "combine (expert-major)": 2},
    "dispatch fp8": {"dispatch (fp8)": 1},
    "low-latency round trip": {"ll_dispatch_send": 1, "ll_dispatch_recv": 1,
                               "ll_combine_send": 1, "ll_combine_recv": 1},
    "low-latency round trip fp8": {"ll_dispatch_send (fp8)": 1, "ll_dispatch_recv (fp8)": 1,
                                   "ll_combine_send": 1, "ll_combine_recv": 1},
}
# The op (its name in the account, before any " (variant)") each kernel of virtual ranks runs for.
KERNEL_OPS = {
    "DispatchCount": "dispatch", "DispatchSend": "dispatch", "DispatchFinish": "dispatch",
    "CombineToken": "combine", "CombineTokenEntries": "combine", "DispatchRows": "dispatch_rows",
    "LowLatencyCount": "ll_dispatch_send", "LowLatencySend": "ll_dispatch_send",
    "LowLatencyFinish": "ll_dispatch_recv", "LowLatencyCombineSend": "ll_combine_send",
    "LowLatencyCombineToken": "ll_combine_recv",
    # 973005d's (its report is calibrated kernel by kernel, LEGACY; these place its kernels
    # in the GPU report's answers per op)
    "DispatchBases": "dispatch", "CombineReduceEntries": "combine",
}
_KERNEL = re.compile(r"per_\w+_kernel<jax_ep::(?:cuda::)?(\w+)")
_MODEL = re.compile(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b")


def gpu_model(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100': the part of a device's name its constants go by."""
    match = _MODEL.search(device)
    return match.group(1) if match else device


def kernel_name(trace_name: str) -> str | None:
    """jax_ep's name of a profiled kernel (`DispatchSend`), or None for XLA's own kernels."""
    match = _KERNEL.search(trace_name)
    return match.group(1) if match else None


@dataclasses.dataclass(frozen=True)
class Report:
    """A GPU report's profile: its device, date, commit and the large case's kernels."""

    path: Path
    device: str
    date: str
    commit: str
    kernels: dict  # case -> [{"kernel", "launches_per_call", "ms_per_call"}]

    @property
    def model(self) -> str:
        return gpu_model(self.device)

    @property
    def launch_s(self) -> float:
        """The smallest kernel's time per launch (copies and memsets are not kernels)."""
        return min(row["ms_per_call"] / row["launches_per_call"] * 1e-3
                   for rows in self.kernels.values() for row in rows
                   if not row["kernel"].startswith(("Memcpy", "Memset")))


def reports(directory: Path | str = REPORTS, before: str | None = None) -> list[Report]:
    """Every report under `directory` with a profiled large case, oldest first; with
    `before` (a report's file name), those but that one (a GPU run's own report, whose
    predictions come from the reports before it)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"jax_ep.tools.kernel_model: no GPU reports at {directory}; the model is calibrated "
            "on docs/gpu/*.json of a source checkout (perfmodel --ours --reports DIR).")
    found = []
    for path in sorted(directory.glob("*.json")):
        if path.name == before:
            continue
        record = json.loads(path.read_text())
        kernels = (record.get("large") or {}).get("kernels")
        if kernels:
            found.append(Report(path, record["device"], record["date"],
                                str(record["commit"]).split()[0], kernels))
    return sorted(found, key=lambda r: (r.date, r.path.name))


def newest(found: Sequence[Report]) -> dict[str, Report]:
    """The newest report of each GPU model."""
    return {r.model: r for r in found}  # oldest first, so the last of each model stays


@dataclasses.dataclass(frozen=True)
class Measured:
    """An op (or one of 973005d's kernels) in a report: what it moved and its device time."""

    name: str
    kernels: tuple[str, ...]
    launches: int
    bytes: int
    row_warps: int | None
    measured_s: float
    zeroing: bool = False  # it only wrote zeros (973005d's padding and empty slots)


def accounts(num_ranks: int = R, seed: int = 0) -> dict[str, account.Account]:
    """Today's ops at the large case's shapes (jax_ep.tools.account), by name."""
    return {a.op: a for a in account.deepseek_accounts(
        num_ranks=num_ranks, seed=seed, tokens=T, ll_tokens=LL_T, hidden=H, top_k=K,
        num_experts=E)}


def measured_ops(report: Report, seed: int = 0) -> list[Measured]:
    """The report's ops, each its kernels' time per call of the op and the account's bytes."""
    ops = accounts(seed=seed)
    found: dict[str, Measured] = {}
    for case, rows in report.kernels.items():
        calls = CASE_OPS.get(case)
        if calls is None:
            raise ValueError(f"{report.path.name}: large case {case!r} is not in "
                             "kernel_model.CASE_OPS; say which ops it calls.")
        summed: dict[str, list] = {op: [[], 0.0, 0.0] for op in calls}
        for row in rows:
            name = kernel_name(row["kernel"])
            if name is None:
                continue  # the case's own XLA work
            family = KERNEL_OPS.get(name)
            (op,) = [op for op in calls if op.split(" (")[0] == family] or [None]
            if op is None:
                raise ValueError(f"{report.path.name}: kernel {name} in case {case!r} runs for "
                                 "none of its ops; add it to kernel_model.KERNEL_OPS.")
            summed[op][0].append(name)
            summed[op][1] += row["launches_per_call"]
            summed[op][2] += row["ms_per_call"] * 1e-3
        for op, (names, launches, seconds) in summed.items():
            if not names:
                continue  # no kernel of its own here (virtual ranks' receives)
            a = ops[op]  # an op two cases ran (the low-latency combine) counts once, the first
            found.setdefault(op, Measured(op, tuple(names), round(launches / calls[op]),
                                          a.bytes, a.row_warps, seconds / calls[op]))
    return list(found.values())


# 973005d's kernels: (name, large case, kernel, bytes it moved per launch, warps of its launch,
# whether it only wrote zeros), of the sizes `s` (_legacy_sizes). The sends read each token
# once and wrote each delivery, the finishes zeroed every row past the count, the expert-major
# combine wrote a partial row for every rank-major row, the low-latency combine copied each
# choice's row home before the weighted sum.
LEGACY_COMMIT = "973005d"
_EM = "dispatch+combine expert-major"
_LL, _LL8 = "low-latency round trip", "low-latency round trip fp8"
LEGACY = (
    ("DispatchSend", "dispatch+combine", "DispatchSend",
     lambda s: s.tokens * s.row + s.rows * s.row, lambda s: s.tokens, False),
    ("DispatchFinish", "dispatch+combine", "DispatchFinish",
     lambda s: (R * s.cap - s.rows) * s.row, lambda s: R * s.cap, True),
    ("DispatchSend (fp8)", "dispatch fp8", "DispatchSend",
     lambda s: s.tokens * s.row8 + s.rows * s.row8, lambda s: s.tokens, False),
    ("DispatchFinish (fp8)", "dispatch fp8", "DispatchFinish",
     lambda s: (R * s.cap - s.rows) * s.row8, lambda s: R * s.cap, True),
    ("CombineToken", "dispatch+combine", "CombineToken",
     lambda s: s.rows * s.row + s.tokens * s.row, lambda s: s.tokens, False),
    ("DispatchSend (expert-major)", _EM, "DispatchSend",
     lambda s: s.tokens * s.row + s.entries * s.row, lambda s: s.tokens, False),
    ("DispatchFinish (expert-major)", _EM, "DispatchFinish",
     lambda s: (R * s.em_cap - s.entries) * s.row, lambda s: R * s.em_cap, True),
    ("CombineReduceEntries", _EM, "CombineReduceEntries",
     lambda s: s.entries * s.row + R * R * T * s.row, lambda s: R * R * T, False),
    ("CombineToken (expert-major)", _EM, "CombineToken",
     lambda s: s.rows * s.row + s.tokens * s.row, lambda s: s.tokens, False),
    ("DispatchCount", "dispatch+combine", "DispatchCount", lambda s: 0, lambda s: None, False),
    ("LowLatencyCount", _LL, "LowLatencyCount", lambda s: 0, lambda s: None, False),
    ("LowLatencySend", _LL, "LowLatencySend",
     lambda s: s.ll_tokens * s.row + s.messages * s.row, lambda s: s.ll_tokens, False),
    ("LowLatencyFinish", _LL, "LowLatencyFinish",
     lambda s: (s.slots - s.messages) * s.row, lambda s: s.slots, True),
    ("LowLatencySend (fp8)", _LL8, "LowLatencySend",
     lambda s: s.ll_tokens * s.row + s.messages * s.row8, lambda s: s.ll_tokens, False),
    ("LowLatencyFinish (fp8)", _LL8, "LowLatencyFinish",
     lambda s: (s.slots - s.messages) * s.row8, lambda s: s.slots, True),
    ("LowLatencyCombineSend", _LL, "LowLatencyCombineSend",
     lambda s: 2 * s.choices * s.row, lambda s: s.ll_tokens, False),
    ("LowLatencyCombineToken", _LL, "LowLatencyCombineToken",
     lambda s: s.choices * s.row + s.ll_tokens * s.row, lambda s: s.ll_tokens, False),
)


def _legacy_sizes(seed: int) -> types.SimpleNamespace:
    rng = np.random.default_rng(seed)
    idx = account.uniform_routing(rng, R, T, K, E)
    ll = account.uniform_routing(rng, R, LL_T, K, E)
    return types.SimpleNamespace(
        row=2 * H, row8=H + H // BLOCK * account.SCALE_BYTES,
        rows=int(account.kept_rows(idx, E, R * T).sum()),  # rank-major deliveries
        entries=int((idx >= 0).sum()),  # every choice is an expert-major entry
        cap=R * T, em_cap=R * T * min(K, E // R),
        messages=int(account.messages(ll, E).sum()), choices=int((ll >= 0).sum()),
        slots=E * R * LL_T,  # every rank's [E/R, R*T] slots
        tokens=R * T, ll_tokens=R * LL_T)


def measured_legacy(report: Report, seed: int = 0) -> list[Measured]:
    """973005d's kernels, each per launch (the combines ran twice per call of the case)."""
    sizes = _legacy_sizes(seed)
    found = []
    for name, case, kernel, moved, warps, zeroing in LEGACY:
        (row,) = [r for r in report.kernels[case] if kernel_name(r["kernel"]) == kernel]
        found.append(Measured(name, (kernel,), 1, moved(sizes), warps(sizes),
                              row["ms_per_call"] / row["launches_per_call"] * 1e-3, zeroing))
    return found


def predict_s(launches: int, nbytes: int, row_warps: int | None, rate: float,
              launch_s: float) -> float:
    """The model's device time of launches moving nbytes at `rate` (see the module)."""
    fill = 1.0 if row_warps is None else min(1.0, row_warps / account.WARPS_TARGET)
    return launches * launch_s + (nbytes / (rate * fill) if nbytes else 0.0)


@dataclasses.dataclass(frozen=True)
class Model:
    """The model of one GPU model, calibrated on one report."""

    report: Report
    measured: tuple[Measured, ...]
    rate: float  # bytes per second of the copies and sums
    zero_rate: float | None  # of the kernels that only wrote zeros (973005d)

    @property
    def gpu(self) -> str:
        return self.report.model

    @property
    def launch_s(self) -> float:
        return self.report.launch_s

    @property
    def copy_floor(self) -> tuple[float, str] | None:
        return COPY_FLOORS.get(self.gpu)

    def predict_s(self, launches: int, nbytes: int, row_warps: int | None,
                  zeroing: bool = False) -> float:
        rate = self.zero_rate if zeroing and self.zero_rate else self.rate
        return predict_s(launches, nbytes, row_warps, rate, self.launch_s)

    def errors(self) -> list[float]:
        """The model's relative error on each measured item."""
        return [self.predict_s(m.launches, m.bytes, m.row_warps, m.zeroing) / m.measured_s - 1
                for m in self.measured]


def calibrate(report: Report, seed: int = 0) -> Model:
    """The model of the report's GPU: the median rates of what it measured (see the module)."""
    legacy = report.commit.startswith(LEGACY_COMMIT)
    measured = measured_legacy(report, seed) if legacy else measured_ops(report, seed)

    def rates(zeroing: bool) -> list[float]:
        return [m.bytes / (m.measured_s - m.launches * report.launch_s)
                for m in measured if m.bytes and m.zeroing == zeroing]

    zero = rates(True)
    return Model(report, tuple(measured), float(np.median(rates(False))),
                 float(np.median(zero)) if zero else None)


def models(directory: Path | str = REPORTS, seed: int = 0) -> dict[str, Model]:
    """The model of each GPU model, from its newest report."""
    return {gpu: calibrate(r, seed) for gpu, r in sorted(newest(reports(directory)).items())}


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def calibration_table(model: Model) -> str:
    lines = [f"| measured at {model.report.commit} | kernels | GB moved | measured us | "
             "model us | error |", "|---|---|---:|---:|---:|---:|"]
    for m, error in zip(model.measured, model.errors(), strict=True):
        lines.append(f"| {m.name} | {' + '.join(m.kernels) or '-'} | {m.bytes / 1e9:.3f} | "
                     f"{_us(m.measured_s)} | {_us(m.measured_s * (1 + error))} | "
                     f"{error:+.0%} |")
    return "\n".join(lines)


def prediction_table(model: Model, ops: Sequence[account.Account]) -> str:
    floor = model.copy_floor
    lines = ["| op | launches | GB moved | warps moving rows | predicted us | floor us |",
             "|---|---:|---:|---:|---:|---:|"]
    for a in ops:
        if a.launches == 0:
            continue
        predicted = model.predict_s(a.launches, a.bytes, a.row_warps)
        at_floor = "-" if floor is None else _us(a.launches * model.launch_s + a.bytes / floor[0])
        warps = "-" if a.row_warps is None else f"{a.row_warps:,}"
        lines.append(f"| {a.op} | {a.launches} | {a.bytes / 1e9:.3f} | {warps} | "
                     f"{_us(predicted)} | {at_floor} |")
    return "\n".join(lines)


def model_for(device: str, directory: Path | str = REPORTS, seed: int = 0,
              before: str | None = None) -> Model:
    """The model of `device`'s GPU model; the newest report's of any model where it has none
    (`before`: see `reports`)."""
    found = reports(directory, before)
    by_model = newest(found)
    return calibrate(by_model.get(gpu_model(device), found[-1]), seed)


def predictions(device: str = "H100", directory: Path | str = REPORTS, seed: int = 0,
                before: str | None = None) -> str:
    """Today's ops at the large case's shapes on `device` (the GPU report prints it beside the
    measured times; `before`: see `reports`)."""
    model = model_for(device, directory, seed, before)
    return (f"(model of the {model.gpu}, calibrated on {model.report.path.name})\n\n"
            + prediction_table(model, list(accounts(seed=seed).values())))


def describe(model: Model, seed: int = 0) -> str:
    """One GPU model's calibration and predictions."""
    moving = [abs(e) for m, e in zip(model.measured, model.errors(), strict=True)
              if m.bytes and not m.zeroing]
    floor = model.copy_floor
    zeroing = ("" if model.zero_rate is None else
               f" The kernels that only wrote zeros ran at {model.zero_rate / 1e12:.2f} TB/s "
               "(today's kernels zero nothing).")
    ll_one = [a for a in accounts(num_ranks=1, seed=seed).values()
              if a.op.startswith("ll_") and "fp8" not in a.op]
    round_trip = sum(model.predict_s(a.launches, a.bytes, a.row_warps) for a in ll_one)
    return "\n".join([
        f"## {model.gpu}",
        "",
        f"Calibrated on {model.report.path.name} ({model.report.device}, commit "
        f"{model.report.commit}; R {R} virtual ranks, T {T}, low latency T {LL_T}, H {H}, "
        f"top-{K} of {E}): t = launches x {model.launch_s * 1e6:.1f} us + bytes / "
        f"({model.rate / 1e12:.2f} TB/s x fill), with a median error of "
        f"{np.median(moving):.0%} over what moves rows.{zeroing} Kernels that move no rows "
        "(counts) are their few warps' serial work, which the model does not see.",
        "",
        calibration_table(model),
        "",
        f"Today's kernels at the same shapes, R {R} virtual ranks (floor: the bytes at "
        + (f"{floor[0] / 1e12:.2f} TB/s, {floor[1]}):" if floor else "no copy rate known):"),
        "",
        prediction_table(model, list(accounts(seed=seed).values())),
        "",
        f"Low latency at R 1 (one GPU, T {LL_T}, bfloat16): a round trip of "
        f"{_us(round_trip)} us predicted, against a goal of 25 us.",
        "",
        prediction_table(model, ll_one),
    ])


def report(directory: Path | str = REPORTS, seed: int = 0) -> str:
    """Every GPU model's calibration and predictions, as printed by `perfmodel --ours`."""
    head = ("Our kernels' device time per GPU model: t = launches x launch + bytes / (rate x "
            f"fill), fill = min(1, warps moving rows / {account.WARPS_TARGET}); each model "
            "calibrated on its newest report under docs/gpu.")
    return "\n\n".join([head, *(describe(m, seed) for m in models(directory, seed).values())])
