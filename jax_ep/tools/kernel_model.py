"""Device time of the cuda backend's kernels on an H100, predicted from the account.

Each op (its kernels on one stream, jax_ep.tools.account):

    t = launches x LAUNCH_S + bytes / (rate x fill),  fill = min(1, row_warps / WARPS_TARGET)

bytes: the row data its kernels read and write; row_warps: the warps of work in its least
parallel launch that moves rows (a launch with fewer than 4 warps per SM cannot keep enough
copies in flight to use HBM's bandwidth; the account's target).

Calibrated on the one profile of our kernels on an H100, at commit 973005d
(docs/gpu/2026-11-23-nvidia-h100-80gb-hbm3-973005d.md: 8 virtual ranks, normal mode T 4096,
low latency T 128, H 7168, top-8 of 256 experts, uniform routing). Those kernels differ from
today's, so each is described here by what it moved (`profiled_kernels`): the same copies and
sums as today's account counts, plus the padding and empty slots they zeroed then. LAUNCH_S
is the profile's smallest kernel. Two rates come out of it: the row-moving kernels' (copies
and sums, geometric mean) is the model's rate; the zeroing kernels wrote at about the copy
floor, which the table prints beside the prediction. The error of each profiled kernel
against the model is printed with it; the count kernels move no rows and are bound by their
few warps' serial work, which the model does not see.

Run `python -m jax_ep.tools.perfmodel --ours`. The next GPU report compares these predictions with
the measured per-kernel times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jax_ep.fp8 import BLOCK
from jax_ep.tools import account

# The profiled shapes (973005d's tools/gpu_large_case.py).
R, T, LL_T, H, K, E = 8, 4096, 128, 7168, 8, 256
PROFILE = "docs/gpu/2026-11-23-nvidia-h100-80gb-hbm3-973005d.md"
LAUNCH_S = 2.1e-6  # the profile's smallest kernel (DispatchBases: one thread per counter)
COPY_FLOOR_BPS = 3.0e12  # HBM3 copy rate (read + write) measured on the same kind of H100


@dataclasses.dataclass(frozen=True)
class Profiled:
    """A kernel of 973005d: what it moved per call and its measured device time."""

    kernel: str
    launches: int
    bytes: int
    row_warps: int | None
    measured_s: float
    zeroing: bool = False  # it only wrote zeros (padding, empty slots)


def profiled_kernels(seed: int = 0) -> list[Profiled]:
    """973005d's kernels at the profiled shapes: per call, launches, bytes of row data moved
    (written from those kernels: the sends read each token once and write each delivery, the
    finishes zeroed every row past the count, the expert-major combine wrote a partial row for
    every rank-major row, the low-latency combine copied each choice's row home before the
    weighted sum) and the profile's time (ms, per call)."""
    rng = np.random.default_rng(seed)
    idx = account.uniform_routing(rng, R, T, K, E)
    ll = account.uniform_routing(rng, R, LL_T, K, E)
    row, row8 = 2 * H, H + H // BLOCK * account.SCALE_BYTES
    rows = int(account.kept_rows(idx, E, R * T).sum())  # rank-major deliveries
    entries = int((idx >= 0).sum())  # every choice is an expert-major entry
    capacity, em_capacity = R * T, R * T * min(K, E // R)
    messages = int(account.messages(ll, E).sum())
    choices = int((ll >= 0).sum())
    slots = E * R * LL_T  # every rank's [E/R, R*T] slots
    tokens, ll_tokens = R * T, R * LL_T
    ms = 1e-3
    return [
        Profiled("DispatchSend", 1, tokens * row + rows * row, tokens, 2.165 * ms),
        Profiled("DispatchFinish", 1, (R * capacity - rows) * row, R * capacity, 0.419 * ms,
                 True),
        Profiled("DispatchSend (fp8)", 1, tokens * row8 + rows * row8, tokens, 0.816 * ms),
        Profiled("DispatchFinish (fp8)", 1, (R * capacity - rows) * row8, R * capacity,
                 0.232 * ms, True),
        Profiled("CombineToken", 1, rows * row + tokens * row, tokens, 3.234 * ms),
        Profiled("DispatchSend (expert-major)", 1, tokens * row + entries * row, tokens,
                 3.225 * ms),
        Profiled("DispatchFinish (expert-major)", 1, (R * em_capacity - entries) * row,
                 R * em_capacity, 8.544 * ms, True),
        Profiled("CombineReduceEntries", 1, entries * row + R * R * T * row, R * R * T,
                 6.824 * ms),
        Profiled("CombineToken (expert-major)", 1, rows * row + tokens * row, tokens,
                 2.348 * ms),
        Profiled("DispatchCount", 1, 0, None, 0.350 * ms),
        Profiled("LowLatencyCount", 1, 0, None, 0.0131 * ms),
        Profiled("LowLatencySend", 1, ll_tokens * row + messages * row, ll_tokens, 0.0948 * ms),
        Profiled("LowLatencyFinish", 1, (slots - messages) * row, slots, 1.133 * ms, True),
        Profiled("LowLatencySend (fp8)", 1, ll_tokens * row + messages * row8, ll_tokens,
                 1.197 * ms),
        Profiled("LowLatencyFinish (fp8)", 1, (slots - messages) * row8, slots, 0.590 * ms,
                 True),
        Profiled("LowLatencyCombineSend", 1, 2 * choices * row, ll_tokens, 0.1375 * ms),
        Profiled("LowLatencyCombineToken", 1, choices * row + ll_tokens * row, ll_tokens,
                 0.251 * ms),
    ]


def _rate(kernel: Profiled) -> float:
    return kernel.bytes / (kernel.measured_s - kernel.launches * LAUNCH_S)


def calibrate(kernels: Sequence[Profiled]) -> tuple[float, float]:
    """(the copies' and sums' rate, the zeroing kernels' rate), bytes per second: medians
    over the profiled kernels of each kind (one outlier, 973005d's FP8 low-latency send at a
    twentieth of the others' rate, does not move a median)."""
    moving = [_rate(k) for k in kernels if k.bytes and not k.zeroing]
    return float(np.median(moving)), float(np.median([_rate(k) for k in kernels if k.zeroing]))


def predict_s(launches: int, nbytes: int, row_warps: int | None, rate: float) -> float:
    """The model's device time of launches moving nbytes at `rate` (see the module)."""
    fill = 1.0 if row_warps is None else min(1.0, row_warps / account.WARPS_TARGET)
    return launches * LAUNCH_S + (nbytes / (rate * fill) if nbytes else 0.0)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def _errors(kernels: Sequence[Profiled], rate: float, zero_rate: float) -> list[float]:
    """The model's relative error on each profiled kernel (zeroing ones at their rate)."""
    return [predict_s(k.launches, k.bytes, k.row_warps, zero_rate if k.zeroing else rate)
            / k.measured_s - 1 for k in kernels]


def calibration_table(kernels: Sequence[Profiled], rate: float, zero_rate: float) -> str:
    lines = ["| kernel (973005d) | GB moved | measured us | model us | error |",
             "|---|---:|---:|---:|---:|"]
    for k, error in zip(kernels, _errors(kernels, rate, zero_rate), strict=True):
        model = k.measured_s * (1 + error)
        lines.append(f"| {k.kernel} | {k.bytes / 1e9:.3f} | {_us(k.measured_s)} | "
                     f"{_us(model)} | {error:+.0%} |")
    return "\n".join(lines)


def prediction_table(accounts: Sequence[account.Account], rate: float) -> str:
    lines = ["| op | launches | GB moved | warps moving rows | predicted us | floor us |",
             "|---|---:|---:|---:|---:|---:|"]
    for a in accounts:
        if a.launches == 0:
            continue
        predicted = predict_s(a.launches, a.bytes, a.row_warps, rate)
        floor = a.launches * LAUNCH_S + a.bytes / COPY_FLOOR_BPS
        warps = "-" if a.row_warps is None else f"{a.row_warps:,}"
        lines.append(f"| {a.op} | {a.launches} | {a.bytes / 1e9:.3f} | {warps} | "
                     f"{_us(predicted)} | {_us(floor)} |")
    return "\n".join(lines)


def todays_accounts(num_ranks: int = R, seed: int = 0) -> list[account.Account]:
    """Today's ops at the profiled shapes (jax_ep.tools.account)."""
    return account.deepseek_accounts(num_ranks=num_ranks, seed=seed, tokens=T, ll_tokens=LL_T,
                                     hidden=H, top_k=K, num_experts=E)


def predictions(seed: int = 0) -> str:
    """The table of today's ops at the profiled shapes, R virtual ranks (the GPU report
    prints it beside the measured times)."""
    rate, _ = calibrate(profiled_kernels(seed))
    return prediction_table(todays_accounts(seed=seed), rate)


def report(seed: int = 0) -> str:
    """The calibration and today's predictions, as printed by `perfmodel --ours`."""
    kernels = profiled_kernels(seed)
    rate, zero_rate = calibrate(kernels)
    errors = [abs(e) for k, e in zip(kernels, _errors(kernels, rate, zero_rate), strict=True)
              if k.bytes and not k.zeroing]
    ll_one = [a for a in todays_accounts(num_ranks=1, seed=seed)
              if a.op.startswith("ll_") and "fp8" not in a.op]
    round_trip = sum(predict_s(a.launches, a.bytes, a.row_warps, rate) for a in ll_one)
    parts = [
        f"Our kernels on an H100: t = launches x {LAUNCH_S * 1e6:.1f} us + bytes / (rate x "
        f"fill), fill = min(1, warps moving rows / {account.WARPS_TARGET}).",
        "",
        f"Calibration on {PROFILE} (R {R} virtual ranks; T {T}, low latency T {LL_T}; H {H}; "
        f"top-{K} of {E}): the copies and sums ran at {rate / 1e12:.2f} TB/s (the model's "
        f"rate; median error {np.median(errors):.0%} over them), the zeroing kernels at "
        f"{zero_rate / 1e12:.2f} TB/s (today's kernels zero nothing). The count kernels move "
        "no rows: their time is their few warps' serial work, which the model does not see.",
        "",
        calibration_table(kernels, rate, zero_rate),
        "",
        f"Today's kernels at the same shapes, R {R} virtual ranks on one H100 (floor: the "
        f"bytes at the {COPY_FLOOR_BPS / 1e12:.1f} TB/s copy rate):",
        "",
        prediction_table(todays_accounts(seed=seed), rate),
        "",
        f"Low latency at R 1 (one GPU, T {LL_T}, bfloat16): a round trip of "
        f"{_us(round_trip)} us predicted, against a goal of 25 us.",
        "",
        prediction_table(ll_one, rate),
    ]
    return "\n".join(parts)
