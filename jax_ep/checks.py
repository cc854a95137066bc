"""Value checks: expert ids out of range and capacity overflow, without a host round trip.

The ops always count what went wrong in their results (`num_invalid`, `num_dropped`). With
the default policies (`on_invalid="error"`, `on_overflow="error"`) they also record a
`jax.experimental.checkify` check on each rank's count. In an ordinary program such a check
compiles to nothing: no host callback, no collective, nothing that waits for the host inside
a step. Run the step through `checked` (or `checkify.checkify` with `user_checks`) to have
the checks raise: the error travels out of the program as a value, with the message of every
rank that failed, and is raised on the host after the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def invalid_ids(op: str, num_invalid: jax.Array, *, num_experts: int) -> None:
    """Checks that this rank's topk_idx held no id outside [-1, E)."""
    num_invalid = jnp.sum(num_invalid)  # a scalar, whatever shape the backend returns
    checkify.debug_check(
        num_invalid == 0,
        f"{op}: topk_idx holds {{n}} expert id(s) outside [-1, {num_experts}) on this rank. "
        f"Use -1 to mask a choice, fix the router, or pass on_invalid='mask' to treat them as "
        f"-1 and only count them (num_invalid).",
        n=num_invalid,
    )


def overflow(op: str, needed: jax.Array, *, capacity: int, what: str, default: str,
             at_least: bool = False) -> None:
    """Checks that this rank needed at most `capacity` rows (or entries); `default` says what
    the default capacity holds, for the message; `at_least`: `needed` may be a lower bound."""
    needed = jnp.sum(needed)
    bound = "at least " if at_least else ""
    checkify.debug_check(
        needed <= capacity,
        f"{op}: capacity={capacity} is too small: this rank needs {bound}{{needed}} {what}, "
        f"so {bound}{{dropped}} would be dropped. Pass capacity>={{needed}} ({default}), or "
        f"on_overflow='drop' to drop them and read the count in num_dropped.",
        needed=needed,
        dropped=needed - capacity,
    )


def same_routing(op: str, topk_idx: jax.Array, handle_idx: jax.Array, *,
                 num_experts: int) -> None:
    """Checks that `topk_idx` is the routing of the dispatch whose handle holds `handle_idx`
    (its clean routing: invalid ids as -1)."""
    clean = jnp.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx, -1)
    checkify.debug_check(
        jnp.all(clean == handle_idx),
        f"{op}: topk_idx differs from the routing of the dispatch that made the handle (in "
        f"{{n}} choice(s) on this rank). Pass the topk_idx given to that low_latency_dispatch, "
        f"with its handle.",
        n=jnp.sum(clean != handle_idx),
    )


def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (jitted here) with jax_ep's value checks raised: ValueError after the call.

    Use it on a whole step (`jax_ep.checks.checked(train_step)(state, batch)`) in tests and
    debugging runs; the message names every rank whose check failed. Other checkify checks
    of `fn` (`checkify.check`, `checkify.debug_check`) are raised the same way. `fn` runs
    outside any `jax.set_mesh` context, so its `jax.shard_map`s must pass `mesh=`.
    """
    run = jax.jit(checkify.checkify(fn, errors=checkify.user_checks))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # checkify cannot trace shard_map under a context mesh of explicit axes (JAX 0.10,
        # 0.11): run without one, so `fn`'s shard_maps must name their mesh.
        with jax.set_mesh(None):
            try:
                error, out = run(*args, **kwargs)
            except ValueError as e:
                if "context mesh cannot be empty" not in str(e):
                    raise
                raise ValueError(
                    f"jax_ep.checked({getattr(fn, '__name__', 'fn')}): the step runs outside "
                    f"any jax.set_mesh context (checkify cannot trace shard_map under one), so "
                    f"its jax.shard_map calls must name their mesh: pass "
                    f"jax.shard_map(..., mesh=mesh)."
                ) from e
        # On the host first: reading the error of a sharded program indexes its per-shard
        # arrays, which explicitly sharded arrays refuse.
        message = jax.tree.map(np.asarray, error).get()
        if message:
            raise ValueError(message)
        return out

    return wrapper
