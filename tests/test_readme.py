"""The README's Python code blocks run as pasted, each in a fresh interpreter with nothing
set beforehand (no XLA_FLAGS), as on a new user's CPU-only machine; the names the README and
docs/design.md give resolve."""

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


def dotted_names(doc: str) -> set[str]:
    with open(os.path.join(ROOT, doc)) as f:
        return set(re.findall(r"\b(jax_ep(?:\.[A-Za-z_]\w*)+)", f.read()))


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md"])
@pytest.mark.filterwarnings("ignore:.*moved to jax_ep.tools:DeprecationWarning")  # old names
def test_every_dotted_name_in_the_doc_is_an_attribute(doc):
    """`jax_ep.pipeline`, `jax_ep.nn.linen.MoE`, ...: each name the doc writes resolves from
    `import jax_ep` alone, attribute by attribute."""
    import jax_ep

    names = dotted_names(doc)
    assert {"jax_ep.pipeline", "jax_ep.tools.account"} <= names
    for name in sorted(names):
        obj = jax_ep
        for part in name.split(".")[1:]:
            assert hasattr(obj, part), f"{name}: no attribute {part!r}"
            obj = getattr(obj, part)


def test_every_path_in_the_design_exists():
    """docs/design.md's module map and call path name files by their path from the root."""
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        paths = set(re.findall(r"`((?:jax_ep|cuda|ffi|tools|tests|examples)/[\w./-]+)`", f.read()))
    assert "jax_ep/backends/interface.py" in paths and len(paths) > 40
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, missing
