"""Backend registry: which implementation runs an op.

- "xla": pure JAX over XLA collectives; runs on any platform (the CPU default).
- "cuda": our XLA FFI custom calls. On GPUs they run the CUDA kernels; on CPU the same
  targets have CPU handlers, which is how CI exercises the custom-call path.
- "auto": $JAX_EP_BACKEND if set, else "cuda" once `jax_ep.initialize()` has run, else "xla".

A named backend never falls back to another: asking for one that cannot run raises an error
that says why.

The ops' `num_sms`, `stream` and low-latency `buffer` reach the "cuda" backend's functions as
one `Placement`; XLA places its own collectives, so the "xla" backend takes none.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

BACKENDS = ("xla", "cuda")
ENV_VAR = "JAX_EP_BACKEND"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the "cuda" backend runs an op's kernels (static and hashable).

    Attributes:
      num_sms: the SMs each kernel launch may take; None: every SM.
      stream: None: XLA's compute stream, in program order with the computation. N: GPU
        stream N (`gpu_stream:N` of `jax.experimental.compute_on`), where the kernels run
        beside the computation that does not depend on them.
      buffer: which of the two low-latency regions of the symmetric buffer a low-latency
        exchange uses (0 or 1); exchanges on different regions may be in flight at once.
    """

    num_sms: int | None = None
    stream: int | None = None
    buffer: int = 0


ANYWHERE = Placement()  # every SM, on XLA's compute stream, low-latency region 0


def resolve(backend: str = "auto") -> str:
    """The backend name that `backend` stands for (observable, so tests can assert it)."""
    if backend == "auto":
        from_env = os.environ.get(ENV_VAR, "").strip().lower()  # as every variable's value
        if from_env:
            if from_env not in BACKENDS:
                raise ValueError(f"${ENV_VAR}={from_env!r} is not one of {list(BACKENDS)}.")
            return from_env
        from jax_ep import runtime

        return "cuda" if runtime.is_initialized() else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {list(BACKENDS)}; got {backend!r}.")
    return backend


def get(backend: str = "auto") -> ModuleType:
    """The module implementing `backend` (after resolving "auto")."""
    name = resolve(backend)
    if name == "cuda":
        from jax_ep.backends import cuda

        return cuda
    from jax_ep.backends import xla

    return xla


def function(backend: str, op: str, name: str, *, placement: Placement | None = None
             ) -> Callable[..., Any]:
    """`name` from the module of `backend`, with `placement` bound where the backend launches
    kernels; a clear error when that backend lacks it."""
    module = get(backend)
    fn = getattr(module, name, None)
    if fn is None:
        raise NotImplementedError(
            f"jax_ep.{op}: backend {module.NAME!r} does not implement {op} yet; "
            f"pass backend='xla' (runs everywhere)."
        )
    if module.NAME == "cuda" and placement is not None:
        return partial(fn, placement=placement)
    return fn
