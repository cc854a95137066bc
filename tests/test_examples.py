"""The examples run as a user would run them and report correct results."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(name: str, *args: str, **env_vars: str) -> str:
    # The examples run as a user runs them: their own flags, the default backend (no
    # JAX_EP_BACKEND=cuda, which between CPU devices would need jax_ep.initialize()).
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTHONPATH", "JAX_EP_BACKEND", "JAX_EP_PEER_ACCESS",
                        "JAX_EP_RANKS_PER_NODE")}
    env.update(env_vars)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def drawn_backend() -> str:
    """The backend of an example's run: cuda on the cuda path of CI ($JAX_EP_BACKEND=cuda),
    else drawn from the test's seed (both over runs). With `--backend cuda` an example
    initializes the kernels' buffer itself (host peers here)."""
    if os.environ.get("JAX_EP_BACKEND") == "cuda":
        return "cuda"
    return ("xla", "cuda")[np.random.default_rng().integers(2)]


def test_quickstart_matches_dense_moe():
    out = _run_example("quickstart.py")
    error = float(re.search(r"max \|expert-parallel - dense\| = (\S+)", out).group(1))
    assert error < 1e-4, out


def test_train_moe_runs_and_learns(tmp_path):
    """Short runs, without a wire format and with one (drawn), from the same seed: each
    loss falls, the progress lines carry the numbers a user needs, and the table compares
    the runs' held-out losses (a wire format changes them little)."""
    fmt = ("mxfp8", "nvfp4")[np.random.default_rng().integers(2)]
    out = _run_example("train_moe.py", "--steps", "10", "--log-every", "5", "--corpus-mb", "1",
                       "--layers", "1", "--width", "32", "--wire-format", f"none,{fmt}",
                       "--png", str(tmp_path / "loss.png"), "--backend", drawn_backend())
    runs = out.split("--- wire format ")[1:]
    assert [r.split()[0] for r in runs] == ["none", fmt], out
    for run in runs:
        losses = [float(v) for v in re.findall(r"step +\d+  loss (\d+\.\d+)", run)]
        assert losses[-1] < losses[0], run
    assert "tokens/s" in out and "expert load max/mean" in out and "unigram entropy" in out
    table = dict(re.findall(rf"^ +(none|{fmt}) +10 +\S+ +(\S+) ", out, re.M))
    assert abs(float(table[fmt]) / float(table["none"]) - 1) < 0.02, out
    assert (tmp_path / "loss.png").exists()


def test_decode_overlap_is_exact(tmp_path):
    out = _run_example("decode_overlap.py", "--ranks", "4", "--tokens", "22", "--repeat", "2",
                       "--profile", str(tmp_path), "--backend", drawn_backend())
    assert "overlapped == sequential bit for bit: True" in out, out
    error = float(re.search(r"dense float64 reference\| = (\S+)", out).group(1))
    assert error < 0.1, out  # bfloat16 output of magnitude ~4
    assert (tmp_path / "trace.json").exists()


def test_prefill_overlap_matches_one_batch():
    out = _run_example("prefill_overlap.py", "--tokens", "128", "--repeat", "2",
                       "--backend", drawn_backend())
    assert "same expert load and drops: True" in out, out
    assert float(re.search(r"max \|overlap - one batch\| = (\S+);", out).group(1)) < 1e-5


def test_train_dualpipe_matches_sequential_and_learns():
    out = _run_example("train_dualpipe.py", "--steps", "12", "--log-every", "6")
    assert "pipeline losses == sequential model losses bit for bit: True" in out, out
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out


def test_checkpoint_resumes_on_another_data_parallel_size(tmp_path):
    """Saved on data 2 x ep 4, restored in a fresh process on data 1 x ep 4: the first loss
    after the restore is the loss the saved run would have reported next, and training goes on."""
    folder = str(tmp_path / "ckpt")
    saved = _run_example("checkpoint.py", "save", "--dir", folder, "--data", "2", "--ep", "4",
                         "--steps", "4")
    next_loss = float(re.search(r"next loss (\d+\.\d+)", saved).group(1))
    restored = _run_example("checkpoint.py", "restore", "--dir", folder, "--data", "1",
                            "--ep", "4", "--steps", "3")
    assert "restored step 4" in restored, restored
    losses = [float(v) for v in re.findall(r"step +\d+ +loss (\d+\.\d+)", restored)]
    assert len(losses) == 2, restored  # the first and the last step report
    assert abs(losses[0] - next_loss) < 1e-5, (next_loss, restored)
    assert losses[-1] < losses[0], restored


def test_across_nodes_rehearses_on_cpu_devices_in_nodes():
    """The multi-node example in one process: host peers as two nodes of 3, reached by puts
    between the nodes; the first step equals the reference bit for bit."""
    out = _run_example("across_nodes.py", "--cpu-devices", "6", "--tokens", "13", "--steps",
                       "2", JAX_EP_PEER_ACCESS="put", JAX_EP_RANKS_PER_NODE="3")
    assert ("6 ranks in 1 processes (cpu), peers reached with puts, nodes of 3 (node-aware "
            "dispatch)") in out, out
    assert "first step equals jax_ep.tools.reference bit for bit: True" in out, out
    assert "median step" in out, out


def test_wire_formats_states_its_error_against_bfloat16():
    """One of the two block formats, drawn from the test's seed (each over runs)."""
    fmt, bound = (("mxfp8", 0.05), ("nvfp4", 0.15))[np.random.default_rng().integers(2)]
    out = _run_example("wire_formats.py", "--format", fmt, "--tokens", "24")
    error = float(re.search(r"against bfloat16 dispatch = (\S+)", out).group(1))
    assert 0 < error < bound, out


def test_every_example_s_help_shows_its_defaults_and_runs_nothing():
    """`--help` prints the usage and each option's default, and exits before any work."""
    no_default = ("-h", "--dir", "--coordinator")  # required, or None by design
    for name in sorted(os.listdir(os.path.join(ROOT, "examples"))):
        if not name.endswith(".py"):
            continue
        out = _run_example(name, "--help")
        assert out.startswith("usage:"), (name, out[:200])
        entries = re.split(r"\n  (?=-)", out.split("options:", 1)[1])[1:]
        for entry in entries:
            if not entry.startswith(no_default):
                assert "(default:" in entry, (name, entry)
