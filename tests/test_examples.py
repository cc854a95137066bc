"""The examples run as a user would run them and report correct results."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(name: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_quickstart_matches_dense_moe():
    out = _run_example("quickstart.py")
    error = float(re.search(r"max \|expert-parallel - dense\| = (\S+)", out).group(1))
    assert error < 1e-4, out
