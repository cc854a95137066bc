"""Tools around the library, none of them a call in a training step: the account of what each
op moves (`account`, `kernel_model`), the performance model (`perfmodel`), the benchmark
(`bench`), the rate of the kernels' row copy alone (`copy_rate`), traces and their report
(`profile`, `trace_report`), the NumPy reference of the contract (`reference`) and the
installation check (`doctor`).

Each module is imported on first use (`jax_ep.tools.perfmodel`), and the command-line ones run
with `python -m jax_ep.tools.<name>`.
"""

MODULES = ("account", "bench", "copy_rate", "doctor", "kernel_model", "perfmodel", "profile",
           "reference", "trace_report")


def __getattr__(name: str):
    if name in MODULES:
        import importlib

        return importlib.import_module(f"jax_ep.tools.{name}")
    raise AttributeError(f"module 'jax_ep.tools' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *MODULES])


__all__ = list(MODULES)
