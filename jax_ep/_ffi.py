"""Loads the compiled extension (jax_ep._ext) and registers its XLA FFI targets with JAX.

Registration waits until it is needed: JAX's backends must exist before FFI targets are
registered, and importing jax_ep must not start them.
"""

from __future__ import annotations

import jax

try:
    from jax_ep import _ext as EXT

    IMPORT_ERROR: str | None = None
except ImportError as error:  # the package is used from a source tree without the build
    EXT = None
    IMPORT_ERROR = str(error)

_registered = False


def require_extension(op: str) -> None:
    """Raises a clear error when the extension is missing."""
    if EXT is None:
        import jax_ep

        raise RuntimeError(
            f"{op}: jax_ep's compiled extension is not available ({IMPORT_ERROR}). jax_ep was "
            f"imported from {jax_ep.__path__[0]}: build it there with `pip install -e .`, or "
            f"install with `pip install .` and run from a directory where the source tree does "
            f"not shadow the installed package (`pytest`, not `python -m pytest`, in the "
            f"repository root); or use backend='xla'."
        )


def register() -> None:
    """Registers every FFI target for its platform, once per process."""
    global _registered
    if _registered:
        return
    require_extension("jax_ep")
    jax.devices()  # the backends must exist before FFI targets are registered
    for platform, targets in EXT.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    _registered = True


def cuda_kernels_compiled() -> bool:
    return EXT is not None and EXT.cuda_compiled()
