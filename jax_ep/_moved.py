"""The old import paths of the modules that moved under `jax_ep.tools`.

`jax_ep.account`, `jax_ep.bench.suite`, `python -m jax_ep.perfmodel`, ... still work, with a
DeprecationWarning that names the new path. An old name is the very module object of the new
one (not a second copy), so its state and classes are shared. `jax_ep/__init__.py` installs
the finder; nothing else uses this module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings

from jax_ep.tools import MODULES

# The tools that lived at the top level before the move (every one but those added since).
MOVED = tuple(m for m in MODULES if m != "copy_rate")

_PACKAGE_INIT = os.path.join(os.path.dirname(__file__), "__init__.py")


def new_name(old: str) -> str | None:
    """`jax_ep.<moved>[.<sub>...]` -> `jax_ep.tools.<moved>[...]`; None for any other name."""
    parts = old.split(".")
    if len(parts) < 2 or parts[0] != "jax_ep" or parts[1] not in MOVED:
        return None
    return ".".join(["jax_ep", "tools", *parts[1:]])


def _warn(message: str, category: type[Warning] = DeprecationWarning) -> None:
    # Points at the line that named the old module: past this module, jax_ep's `__getattr__`
    # and importlib. `warnings` counts levels without importlib's bootstrap frames.
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and _ours(frame.f_code.co_filename):
        frame = frame.f_back
        name = frame.f_code.co_filename
        level += not ("importlib" in name and "_bootstrap" in name)
    warnings.warn(message, category, stacklevel=level)


def _ours(filename: str) -> bool:
    return filename in (__file__, _PACKAGE_INIT) or "importlib" in filename


class _Aliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name, loads it as the module at the new one."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        return importlib.util.spec_from_loader(
            fullname, self, origin=real.origin,
            is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        new = new_name(spec.name)
        _warn(f"{spec.name} moved to {new}; import it from there (the old name will be removed)")
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system sets the alias's spec next
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # the new name's spec, back in place

    def get_code(self, fullname):
        """For `python -m <old name>`: the new module's code, run as __main__. Said as a
        FutureWarning, which Python shows by default: the reader is at a shell."""
        new = new_name(fullname)
        old, now = (name.removesuffix(".__main__") for name in (fullname, new))
        _warn(f"python -m {old} is now python -m {now} (the old name will be removed)",
              FutureWarning)
        return importlib.util.find_spec(new).loader.get_code(new)


def install() -> None:
    """Puts the finder first, once (before the path finder, which would load a second copy of
    a moved package's submodules through the old package's `__path__`)."""
    if not any(isinstance(finder, _Aliases) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Aliases())
