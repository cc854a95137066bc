"""The copy-rate microbenchmark (jax_ep/tools/copy_rate.py, FFI target "jax_ep_copy_rate"):
its CPU handler runs the GPU's body (cuda/copy_rate.h) on a 32-lane grid, so every variant of
the row copy it times is checked here byte for byte, at sizes that are not a multiple of a row
or of 16 bytes, with warp counts that split the rows unevenly; bad settings are refused
naming the setting; the command line runs at a tiny size and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import _ffi
from jax_ep.tools import copy_rate as tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = tool.ROW_BYTES


def _copy(x: np.ndarray, **settings) -> np.ndarray:
    return np.asarray(jax.block_until_ready(tool.copy_rate(jnp.asarray(x), **settings)))


def test_the_target_is_registered_for_both_platforms():
    registrations = _ffi.EXT.registrations()
    assert tool.TARGET in registrations["cpu"]
    if _ffi.cuda_kernels_compiled():
        assert tool.TARGET in registrations["CUDA"]


@pytest.mark.parametrize("words", [*tool.WORDS_IN_FLIGHT, tool.BULK])
@pytest.mark.parametrize(("nbytes", "warps", "row_bytes"), [
    (3 * ROW, 1, ROW),          # whole rows, one warp
    (5 * ROW + 7, 3, ROW),      # a short last row of 7 bytes (not a multiple of 16)
    (2 * ROW + 16 * 5, 8, ROW),  # more warps than rows: some copy nothing
    (100_003, 7, 1000),         # rows of 1000 bytes: 8-byte units, and an odd tail
    (4099, 32, 33),             # rows of 33 bytes: byte by byte
    (1, 2, ROW),                # a single byte
])
def test_the_copy_equals_its_input(words, nbytes, warps, row_bytes):
    x = np.random.default_rng().integers(0, 256, nbytes, dtype=np.uint8)  # fresh each run
    _ffi.EXT.meter(reset=True)
    out = _copy(x, warps=warps, words_in_flight=words, row_bytes=row_bytes)
    assert out.dtype == np.uint8 and out.shape == x.shape
    np.testing.assert_array_equal(out, x)
    # Every row copied once: each byte read once and written once.
    metered = _ffi.EXT.meter(reset=True)
    assert (metered["read"], metered["written"]) == (nbytes, nbytes)


def test_any_shape_under_jit():
    x = np.random.default_rng().integers(0, 256, (37, 1001), dtype=np.uint8)
    program = tool.copy_program(3, warps=5, words_in_flight=8, row_bytes=2048)
    np.testing.assert_array_equal(np.asarray(program(jnp.asarray(x))), x)


@pytest.mark.parametrize(("settings", "message"), [
    ({"words_in_flight": 5}, r"words_in_flight must be 4, 8 or 16 \(0: the bulk copy\), got 5"),
    ({"words_in_flight": 32}, r"words_in_flight must be 4, 8 or 16 \(0: the bulk copy\), "
                              "got 32"),
    ({"warps": 0}, r"warps must be in \[1, 2\^31 - 1\], got 0"),
    ({"row_bytes": 0}, r"row_bytes must be in \[1, 2\^31 - 1\], got 0"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    x = np.zeros(100, np.uint8)
    with pytest.raises(Exception, match=rf"{tool.TARGET}: {message}"):
        _copy(x, **{"warps": 2, "words_in_flight": 4, **settings})


def test_x_must_be_bytes():
    with pytest.raises(TypeError, match="x must be uint8, got float32"):
        tool.copy_rate(jnp.zeros(4, jnp.float32), warps=1, words_in_flight=4)


def test_lowers_for_cuda_with_its_attributes():
    _ffi.register()
    lowered = (jax.jit(lambda x: tool.copy_rate(x, warps=16, words_in_flight=8))
               .trace(jax.ShapeDtypeStruct((1000,), jnp.uint8))
               .lower(lowering_platforms=("cuda",)))
    text = lowered.as_text()
    assert f"stablehlo.custom_call @{tool.TARGET}(" in text, text
    for attr in ("warps = 16 : i64", "words_in_flight = 8 : i64", f"row_bytes = {ROW} : i64"):
        assert attr in text, text


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "jax_ep.tools.copy_rate", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_the_command_line_times_every_setting_and_writes_its_json(tmp_path):
    path = tmp_path / "copy_rate.json"
    done = _cli("--bytes", "3e4", "--warps", "1,3,all", "--words", "4,16,bulk", "--copies", "2",
                "--repeat", "1", "--json", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(path.read_text())
    assert record["bytes"] == 30_000 and record["row_bytes"] == ROW
    assert record["meaningful"] is False and "times not meaningful here" in done.stdout
    settings = [(r["warps"], r["words_in_flight"]) for r in record["rows"]]
    assert settings == [(w, k) for w in ("1", "3", "all") for k in (4, 16, "bulk")]
    assert all(r["identical"] and r["gbps"] > 0 and r["of_xla"] > 0 for r in record["rows"])
    assert record["rows"][-1]["warps_run"] == (os.cpu_count() or 1)
    assert "| warps | words in flight | GB/s | of XLA copy | identical |" in done.stdout
    assert "| 3 | 16 |" in done.stdout and "| 3 | bulk |" in done.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--words", "4,5"], "--words: each must be 4, 8, 16 or `bulk`"),
    (["--warps", "8,many"], "--warps: each must be a positive integer or `all`"),
    (["--bytes", "0"], "--bytes must be a positive whole number"),
])
def test_the_command_line_refuses_bad_flags_by_name(args, message):
    done = _cli(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
