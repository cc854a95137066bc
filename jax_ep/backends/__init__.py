"""Backend registry: which implementation runs an op.

- "xla": pure JAX over XLA collectives; runs on any platform (the CPU default).
- "cuda": our XLA FFI custom calls. On GPUs they run the CUDA kernels; on CPU the same
  targets have CPU handlers, which is how CI exercises the custom-call path.
- "auto": $JAX_EP_BACKEND if set, else "cuda" once `jax_ep.initialize()` has run, else "xla".

A named backend never falls back to another: asking for one that cannot run raises an error
that says why.

What a backend provides is `Backend` (jax_ep/backends/interface.py): the ops call its
functions directly (`backends.get(name).dispatch(...)`). The ops' `num_sms`, `stream` and
low-latency `buffer` reach every function as one `Placement` (jax_ep.placement); XLA places
its own collectives, so the "xla" backend ignores it.
"""

from __future__ import annotations

import os

from jax_ep.backends.interface import Backend
from jax_ep.placement import ANYWHERE, Placement  # noqa: F401 (their old home)

BACKENDS = ("xla", "cuda")
ENV_VAR = "JAX_EP_BACKEND"


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


def get(backend: str = "auto") -> Backend:
    """The backend that `backend` stands for (after resolving "auto"): a module implementing
    `Backend` (jax_ep/backends/interface.py), whose functions the ops call."""
    if resolve(backend) == "cuda":
        from jax_ep.backends import cuda

        return cuda
    from jax_ep.backends import xla

    return xla
