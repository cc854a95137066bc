"""Errors that depend on values: expert ids out of range and capacity overflow.

XLA has no "assert" instruction, so a value check is a host callback that raises. The counts
are summed over the EP axis first, so every rank (and every process) raises the same error
and no process runs ahead into the next collective while another has stopped. The raised
exception reaches the caller as a ``JaxRuntimeError`` whose message contains ours.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import io_callback


def _raise_invalid(op: str, num_experts: int, total: np.ndarray) -> None:
    if int(total) > 0:
        raise ValueError(
            f"{op}: topk_idx holds {int(total)} expert id(s) outside [-1, {num_experts}) "
            f"(summed over the EP axis). Use -1 to mask a choice, fix the router, or pass "
            f"on_invalid='mask' to treat them as -1 and only count them (num_invalid)."
        )


def _raise_overflow(op: str, capacity: int, what: str, worst: np.ndarray) -> None:
    if int(worst) > capacity:
        raise ValueError(
            f"{op}: capacity={capacity} is too small: a rank received {int(worst)} {what}, "
            f"so {int(worst) - capacity} would be dropped. Pass capacity>={int(worst)} (the "
            f"default never overflows), or on_overflow='drop' to drop them and read the "
            f"count in num_dropped."
        )


def check_invalid(op: str, num_invalid: jax.Array, *, num_experts: int, axis_name: str) -> None:
    """Raises at run time when any rank's topk_idx held ids outside [-1, E)."""
    total = jax.lax.psum(num_invalid, axis_name)
    io_callback(lambda n: _raise_invalid(op, num_experts, n), None, total, ordered=False)


def check_overflow(
    op: str, needed: jax.Array, *, capacity: int, what: str, axis_name: str
) -> None:
    """Raises at run time when any rank needed more than `capacity` rows (or entries)."""
    # stop_gradient: counts carry no tangent, and pmax has no differentiation rule.
    worst = jax.lax.pmax(jax.lax.stop_gradient(needed), axis_name)
    io_callback(lambda n: _raise_overflow(op, capacity, what, n), None, worst, ordered=False)
