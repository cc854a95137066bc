"""Loads the compiled extension (jax_ep._ext) and registers its XLA FFI targets with JAX.

Importing this module only imports the extension: the one beside it, or, when jax_ep is
imported from a source tree without a build, the one of the installed jax-ep distribution.
Registration waits until an op needs it: JAX's backends must exist before FFI targets are
registered, and importing jax_ep must not start them.

Names:
  EXT: the extension module, or None when it could not be imported.
  IMPORT_ERROR: why the import failed (None when it succeeded), for error messages.
  register(): registers every FFI target for its platform; idempotent.
  require_extension(op): raises a RuntimeError naming `op` when the extension is missing.
  cuda_kernels_compiled(): whether the extension holds the CUDA kernels.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import threading
from types import ModuleType

import jax


def _installed_extension() -> str | None:
    """The compiled extension of the installed jax-ep distribution, if there is one elsewhere.

    Running from the repository root after `pip install .` imports this source tree, which
    has no build; the extension that install built is the one to use.
    """
    try:
        dist = importlib.metadata.distribution("jax-ep")
    except importlib.metadata.PackageNotFoundError:
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    for file in dist.files or ():
        path = os.path.abspath(str(dist.locate_file(file)))
        if (file.name.startswith("_ext.") and file.name.endswith((".so", ".pyd"))
                and os.path.dirname(path) != here and os.path.exists(path)):
            return path
    return None


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        from jax_ep import _ext

        return _ext, None
    except ImportError as error:
        local_error = str(error)
    path = _installed_extension()
    if path is None:
        return None, local_error
    spec = importlib.util.spec_from_file_location("jax_ep._ext", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        return None, f"{local_error}; the installed {path} does not load either: {error}"
    sys.modules["jax_ep._ext"] = module
    return module, None


EXT, IMPORT_ERROR = _load()

_lock = threading.Lock()
_registered = False


def require_extension(op: str) -> None:
    """Raises RuntimeError, naming `op`, when the compiled extension is not available."""
    if EXT is None:
        import jax_ep

        raise RuntimeError(
            f"{op}: jax_ep's compiled extension is not available ({IMPORT_ERROR}). jax_ep was "
            f"imported from {jax_ep.__path__[0]}, and no installed jax-ep holds one: build it "
            f"with `pip install .` (or `pip install -e .`), or use backend='xla'."
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


def build_info() -> dict:
    """What this installation of jax_ep was built with: {'extension': whether the compiled
    extension loaded, 'ffi_api_version', 'cuda' (whether it holds the CUDA kernels),
    'cuda_arch' (the GPU architectures built, e.g. 'sm_80,sm_90,sm_100,sm_120'),
    'nvshmem_version'}; the last four are None without the extension."""
    if EXT is None:
        return {"extension": False, "ffi_api_version": None, "cuda": None, "cuda_arch": None,
                "nvshmem_version": None}
    return {"extension": True, **EXT.build_info()}


def architectures(info: dict) -> list[str]:
    """The architectures of a build_info(): ["sm_80", "sm_90", ...] (and "compute_XX")."""
    return [a for a in (info.get("cuda_arch") or "").split(",") if a]


def runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether code built for `arch` runs on a GPU of compute `capability`: machine code for
    an "a" architecture ("sm_90a") on exactly its GPU, for a plain one ("sm_80") on its GPU
    and later ones of the same major version; PTX ("compute_90") on its GPU and every later
    one (compiled when loaded)."""
    digits = arch.split("_", 1)[1]
    exact = digits.endswith("a")
    number = int(digits.rstrip("a"))
    major, minor = number // 10, number % 10
    if arch.startswith("compute_"):
        return capability >= (major, minor)
    if exact:
        return capability == (major, minor)
    return capability[0] == major and capability[1] >= minor


def cuda_kernels_compiled() -> bool:
    """True when the extension was built with the CUDA kernels (whether or not a GPU exists)."""
    return EXT is not None and bool(EXT.cuda_compiled())
