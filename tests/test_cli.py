"""Every command line speaks one way: `--help` exits 0; a usage error (a bad flag, sizes the
ops reject, a file that cannot be read) prints the usage and `PROG: error: MESSAGE` to stderr
and exits 2, before any work, without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (command, its prog, flags of a usage error, a word the error names)
COMMANDS = [
    (["-m", "jax_ep.tools.bench"], "python -m jax_ep.tools.bench", ["--repeat", "0"],
     "--repeat"),
    (["-m", "jax_ep.tools.perfmodel"], "python -m jax_ep.tools.perfmodel", ["--ep", "0"],
     "num_ranks"),
    (["-m", "jax_ep.tools.account"], "python -m jax_ep.tools.account", ["--ranks", "3"],
     "--ranks 3"),
    (["-m", "jax_ep.tools.trace_report"], "python -m jax_ep.tools.trace_report", ["missing.json"],
     "does not exist"),
    (["-m", "jax_ep.pipeline.simulate"], "python -m jax_ep.pipeline.simulate", [],
     "--table"),
    (["-m", "jax_ep.pipeline.plot"], "python -m jax_ep.pipeline.plot", ["no/such/folder"],
     "no such folder"),
    (["examples/train_moe.py"], "train_moe.py", ["--fp8"], "multiple of 128"),
    (["examples/decode_overlap.py"], "decode_overlap.py", ["--tokens", "7"], "--tokens 7"),
    (["examples/prefill_overlap.py"], "prefill_overlap.py", ["--tokens", "7"], "--tokens 7"),
    (["examples/train_dualpipe.py"], "train_dualpipe.py", ["--tokens", "6"], "--tokens 6"),
    (["examples/checkpoint.py"], "checkpoint.py", ["restore", "--dir", "missing"],
     "holds no checkpoint"),
    (["examples/across_nodes.py"], "across_nodes.py", ["--num-processes", "2"],
     "--coordinator"),
]


def _run(command: list[str], *flags: str, cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_EP_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    command = [os.path.join(ROOT, c) if c.startswith("examples/") else c for c in command]
    return subprocess.run([sys.executable, *command, *flags], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command,prog,bad,named", COMMANDS,
                         ids=[" ".join(c[0]) for c in COMMANDS])
def test_help_and_usage_errors(command, prog, bad, named, tmp_path):
    shown = _run(command, "--help", cwd=str(tmp_path))
    assert shown.returncode == 0 and shown.stdout.startswith(f"usage: {prog}"), shown.stderr
    wrong = _run(command, *bad, cwd=str(tmp_path))
    assert wrong.returncode == 2, (wrong.stdout, wrong.stderr)
    last = wrong.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: ") and named in last, wrong.stderr
    assert "Traceback" not in wrong.stderr and "usage:" in wrong.stderr
