"""The README's Python code blocks run as pasted, each in a fresh interpreter with nothing
set beforehand (no XLA_FLAGS), as on a new user's CPU-only machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)


def test_the_readme_has_code_blocks():
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs_as_pasted(index, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTHONPATH", "JAX_EP_BACKEND", "JAX_EP_XLA_TRANSPORT")}
    proc = subprocess.run([sys.executable, "-c", python_blocks()[index]], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_dotted_name_in_the_readme_is_an_attribute():
    """`jax_ep.pipeline`, `jax_ep.nn.linen.MoE`, ...: each name the README writes resolves
    from `import jax_ep` alone, attribute by attribute."""
    import jax_ep

    with open(os.path.join(ROOT, "README.md")) as f:
        names = set(re.findall(r"\b(jax_ep(?:\.[A-Za-z_]\w*)+)", f.read()))
    assert {"jax_ep.pipeline", "jax_ep.nn.linen.MoE"} <= names
    for name in sorted(names):
        obj = jax_ep
        for part in name.split(".")[1:]:
            assert hasattr(obj, part), f"{name}: no attribute {part!r}"
            obj = getattr(obj, part)
