"""Loads the compiled extension (jax_ep._ext) and registers its XLA FFI targets with JAX.

Importing this module only imports the extension. Registration waits until an op needs it:
JAX's backends must exist before FFI targets are registered, and importing jax_ep must not
start them.

Names:
  EXT: the extension module, or None when it could not be imported.
  IMPORT_ERROR: why the import failed (None when it succeeded), for error messages.
  register(): registers every FFI target for its platform; idempotent.
  require_extension(op): raises a RuntimeError naming `op` when the extension is missing.
  cuda_kernels_compiled(): whether the extension holds the CUDA kernels.
"""

from __future__ import annotations

import threading

import jax

try:
    from jax_ep import _ext as EXT

    IMPORT_ERROR: str | None = None
except ImportError as error:  # e.g. the package is used from a source tree without the build
    EXT = None
    IMPORT_ERROR = str(error)

_lock = threading.Lock()
_registered = False


def require_extension(op: str) -> None:
    """Raises RuntimeError, naming `op`, when the compiled extension is not available."""
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
    """Registers every FFI target of the extension for its platform, once per process.

    Targets for a platform this jaxlib lacks (CUDA on a CPU-only jaxlib) are accepted and
    never used, which still lets programs be lowered for that platform.

    Raises:
      RuntimeError: when the extension is not available.
    """
    global _registered
    if _registered:
        return
    require_extension("jax_ep")
    with _lock:
        if _registered:
            return
        jax.devices()  # the backends must exist before FFI targets are registered
        for platform, targets in EXT.registrations().items():
            for name, capsule in targets.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform, api_version=1)
        _registered = True


def cuda_kernels_compiled() -> bool:
    """True when the extension was built with the CUDA kernels (whether or not a GPU exists)."""
    return EXT is not None and bool(EXT.cuda_compiled())
