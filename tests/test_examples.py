"""The examples run as a user would run them and report correct results."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(name: str, *args: str) -> str:
    # The examples run as a user runs them: their own flags, the default backend (no
    # JAX_EP_BACKEND=cuda, which between CPU devices would need jax_ep.initialize()).
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTHONPATH", "JAX_EP_BACKEND")}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_quickstart_matches_dense_moe():
    out = _run_example("quickstart.py")
    error = float(re.search(r"max \|expert-parallel - dense\| = (\S+)", out).group(1))
    assert error < 1e-4, out


def test_train_moe_runs_and_learns(tmp_path):
    """A short run: the loss falls and the progress lines carry the numbers a user needs."""
    out = _run_example("train_moe.py", "--steps", "12", "--log-every", "4", "--corpus-mb", "1",
                       "--layers", "1", "--png", "")
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[-1] < losses[0], out
    assert "tokens/s" in out and "expert load max/mean" in out and "unigram entropy" in out


def test_decode_overlap_is_exact(tmp_path):
    out = _run_example("decode_overlap.py", "--ranks", "4", "--tokens", "22", "--repeat", "2",
                       "--profile", str(tmp_path))
    assert "overlapped == sequential bit for bit: True" in out, out
    error = float(re.search(r"dense float64 reference\| = (\S+)", out).group(1))
    assert error < 0.1, out  # bfloat16 output of magnitude ~4
    assert (tmp_path / "trace.json").exists()


def test_prefill_overlap_matches_one_batch():
    out = _run_example("prefill_overlap.py", "--tokens", "128", "--repeat", "2")
    assert "same expert load and drops: True" in out, out
    assert float(re.search(r"max \|overlap - one batch\| = (\S+);", out).group(1)) < 1e-5


def test_train_dualpipe_matches_sequential_and_learns():
    out = _run_example("train_dualpipe.py", "--steps", "12", "--log-every", "6")
    assert "pipeline losses == sequential model losses bit for bit: True" in out, out
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
