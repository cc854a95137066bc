"""Named scopes on the ops: each op's operations carry its name (`jax_ep.dispatch`, ...) in
the compiled module's metadata, where `jax_ep.tools.profile` finds them to label a trace."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax


def scoped(name: str) -> Callable:
    """Decorator: the function's operations run under `jax.named_scope(name)`."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)

        return inner

    return wrap
