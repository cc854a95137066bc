"""Runtime of the CUDA backend: NVSHMEM and its symmetric buffers, one GPU per process.

The portable backend needs no initialization. The CUDA backend shares the NVSHMEM unique id
through the `jax.distributed` key-value store and initializes NVSHMEM from inside our
extension. NVSHMEM terminates the process when it cannot initialize, so every precondition
is checked here first and reported as a Python exception.
"""

from __future__ import annotations

import jax

_state: dict[str, object] = {}


def is_initialized() -> bool:
    """True between a successful `initialize()` and `finalize()`."""
    return bool(_state)


def initialize() -> None:
    """Prepares the CUDA backend for this process (one GPU per process).

    Raises:
      RuntimeError: when there is no CUDA GPU, more than one local GPU, or the extension was
        built without CUDA.
    """
    op = "jax_ep.initialize"
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if not gpus:
        raise RuntimeError(
            f"{op}: no CUDA GPU is visible to JAX (local devices: "
            f"{[d.platform for d in jax.local_devices()]}). The CUDA backend needs one GPU per "
            f"process; without a GPU use backend='xla', which needs no initialization."
        )
    if len(gpus) > 1:
        raise RuntimeError(
            f"{op}: this process sees {len(gpus)} GPUs; NVSHMEM allows one GPU per process. "
            f"Start one process per GPU with jax.distributed.initialize(..., "
            f"local_device_ids=[i])."
        )
    from jax_ep import _ffi

    if not _ffi.cuda_kernels_compiled():
        raise RuntimeError(
            f"{op}: jax_ep was built without CUDA kernels. Rebuild with nvcc on PATH: "
            f"pip install -C cmake.define.JAX_EP_CUDA=ON ."
        )
    raise NotImplementedError(
        f"{op}: the NVSHMEM runtime of the CUDA backend is not available in this version; "
        f"use backend='xla'."
    )


def finalize() -> None:
    """Releases what `initialize()` set up; clears JAX's caches first (they hold executables
    that reference the buffers). A no-op when not initialized."""
    if not _state:
        return
    jax.clear_caches()
    _state.clear()
