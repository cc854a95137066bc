"""The main job, python -m jax_ep.bench, runs end to end and reports every op."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jax_ep.bench.suite import OPS


def test_bench_runs_every_op(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(
        [sys.executable, "-m", "jax_ep.bench", "--tokens", "16", "--ll-tokens", "8",
         "--hidden", "128", "--experts", "16", "--top-k", "4", "--repeat", "2", "--warmup",
         "1", "--fp8", "--routing", "masked", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    for op in OPS:
        assert any(line.split()[:2] == [op, "xla"] for line in table.splitlines()), table
    assert "[1/9]" in proc.stderr  # progress while running
    record = json.loads(out.read_text())
    xla_rows = [r for r in record["rows"] if r["backend"] == "xla"]
    assert sorted(r["op"] for r in xla_rows) == sorted(OPS)
    assert all(r["time"]["median"] > 0 and r["bytes_per_rank"] > 0 for r in xla_rows)
    assert record["copy_bandwidth_Bps"] > 0
