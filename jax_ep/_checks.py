"""Argument checks shared by every op, so that all errors are worded the same way.

Static problems (shapes, dtypes, static arguments, axis names) raise ``ValueError`` or
``TypeError`` at trace time, naming the op, the argument, what was expected, what was received
and how to fix it. Problems that depend on values (expert ids out of range, capacity exceeded)
can only be seen at run time; see ``jax_ep.checks``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.placement import Placement

OVERFLOW_POLICIES = ("error", "drop")
INVALID_POLICIES = ("error", "mask")
MAX_TOP_K = 32  # the kernels keep a token's choices in registers


def describe(x: Any) -> str:
    """`float32 [128, 8]`-style description of an array-like value."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{jnp.dtype(x.dtype).name} {list(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:80]


def check_array(
    op: str,
    name: str,
    x: Any,
    *,
    ndim: int | None = None,
    dtypes: tuple[Any, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    expect: str = "",
    fix: str = "",
) -> None:
    """Raises a TypeError/ValueError naming `op` and `name` unless `x` matches.

    `shape` entries that are None are not checked. `expect` is the DESIGN notation of the
    argument (e.g. "int32 [T, K]") and `fix` a hint appended to the message.
    """
    hint = f" {fix}" if fix else ""
    want = f" must be {expect}" if expect else " has the wrong type"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name}{want}; got {describe(x)}.{hint}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{op}: {name}{want}; got {describe(x)} (rank {x.ndim}).{hint}")
    if dtypes is not None and jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dtypes]:
        raise TypeError(f"{op}: {name}{want}; got {describe(x)}.{hint}")
    if shape is not None:
        for got, want_dim in zip(x.shape, shape, strict=True):
            if want_dim is not None and got != want_dim:
                raise ValueError(f"{op}: {name}{want}; got {describe(x)}.{hint}")


def check_float(op: str, name: str, x: Any, *, ndim: int, expect: str) -> None:
    """`x` must be a floating-point array of rank `ndim` (not FP8: FP8 travels as a pair)."""
    check_array(op, name, x, ndim=ndim, expect=expect)
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize < 2:
        raise TypeError(
            f"{op}: {name} must be {expect} with a floating dtype of 16 bits or more; got "
            f"{describe(x)}. Pass FP8 data as the pair (x_fp8, scales) from jax_ep.fp8.quantize."
        )


def is_finite_number(value: Any) -> bool:
    """A real number (Python or NumPy, not a bool) that is finite."""
    return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and math.isfinite(value))


def check_choice(op: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {list(choices)}; got {value!r}.")


def check_positive_int(op: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"{op}: {name} must be a positive Python int (a static value); got {value!r}."
        )


def placement(op: str, num_sms: Any, stream: Any, buffer: Any = 0) -> Placement:
    """The checked Placement of an op's `num_sms` (the SMs each kernel launch may take, None:
    every SM), `stream` (a GPU stream of its own, None: XLA's compute stream) and `buffer`
    (the low-latency region, 0 or 1)."""
    def is_int(value: Any) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    if num_sms is not None and not (is_int(num_sms) and num_sms >= 1):
        raise ValueError(
            f"{op}: num_sms must be a positive int (the SMs each of its kernel launches may "
            f"take) or None (every SM); got {num_sms!r}."
        )
    if stream is not None and not (is_int(stream) and stream >= 0):
        raise ValueError(
            f"{op}: stream must be a non-negative int (GPU stream N, as in "
            f"compute_on('gpu_stream:N')) or None (XLA's compute stream); got {stream!r}."
        )
    if not (is_int(buffer) and buffer in (0, 1)):
        raise ValueError(
            f"{op}: buffer must be 0 or 1 (one of the two low-latency regions); got {buffer!r}."
        )
    return Placement(
        num_sms=None if num_sms is None else int(num_sms),
        stream=None if stream is None else int(stream),
        buffer=int(buffer),
    )


def axis_size(op: str, axis_name: str) -> int:
    """Size of the EP mesh axis; a clear error when the op is not inside shard_map over it."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"{op}: axis_name {axis_name!r} is not a mesh axis in scope. Call {op} per shard "
            f"inside jax.shard_map(..., mesh=mesh) over a mesh that has an axis named "
            f"{axis_name!r}, or pass axis_name= the name of your expert-parallel axis."
        ) from None


def check_num_experts(op: str, num_experts: Any, num_ranks: int, axis_name: str) -> int:
    """E must be a positive int divisible by R; returns E_local."""
    check_positive_int(op, "num_experts", num_experts)
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"{op}: num_experts ({num_experts}) must be a multiple of the size of mesh axis "
            f"{axis_name!r} ({num_ranks}) so that every rank holds the same number of experts."
        )
    return num_experts // num_ranks


def _cast_hint(name: str, x: Any, dtype: Any) -> str:
    """How to fix an array of another dtype (nothing for other problems)."""
    if hasattr(x, "dtype") and jnp.dtype(x.dtype) != jnp.dtype(dtype):
        return f"Cast with {name}.astype(jnp.{jnp.dtype(dtype).name})."
    return ""


def check_topk_idx(op: str, topk_idx: Any) -> tuple[int, int]:
    """topk_idx must be int32 [T, K]; returns (T, K)."""
    check_array(
        op,
        "topk_idx",
        topk_idx,
        ndim=2,
        dtypes=(jnp.int32,),
        expect="int32 [T, K] (expert ids in [-1, num_experts))",
        fix=_cast_hint("topk_idx", topk_idx, jnp.int32),
    )
    return topk_idx.shape


def check_topk_weights(op: str, topk_weights: Any, num_tokens: int, top_k: int) -> jax.Array:
    """topk_weights must be float [T, K] (float32; bfloat16 and float16 are upcast, as
    routers in the model's dtype give them): returns them in float32."""
    check_array(
        op,
        "topk_weights",
        topk_weights,
        ndim=2,
        dtypes=(jnp.float32, jnp.bfloat16, jnp.float16),
        shape=(num_tokens, top_k),
        expect=f"float32 [T, K] = [{num_tokens}, {top_k}] like topk_idx",
        fix=_cast_hint("topk_weights", topk_weights, jnp.float32),
    )
    return topk_weights.astype(jnp.float32)


def check_top_k(op: str, top_k: int, num_experts: int) -> None:
    if top_k < 1 or top_k > min(MAX_TOP_K, num_experts):
        raise ValueError(
            f"{op}: topk_idx has K={top_k} choices per token; K must be between 1 and "
            f"min({MAX_TOP_K}, num_experts={num_experts})."
        )
