"""python -m jax_ep.tools.copy_rate: the rate of the kernels' row copy alone.

Every op moves its rows with one copy (`copy_row`, cuda/primitives.h): each lane of a warp
keeps a few 16-byte loads in flight (4 in the phased ops, 8 in the streamed ones), and the
performance model's rates rest on what one warp per SM reaches with it. This tool times that
copy with nothing else around it: the FFI target "jax_ep_copy_rate" (cuda/copy_rate.h) copies
an array of bytes as rows of --row-bytes (default 14,336: a bfloat16 row of H 7168) with a
given number of warps, one per block (so one per SM: 8, 16, 32 SMs, or every SM with `all`),
and a given number of loads in flight (4, 8, 16), or with Hopper's bulk copies (`bulk`:
global -> shared -> global by the TMA, one lane issuing them; the plain copy with 8 loads in
flight on older GPUs and on CPU).

Each setting is timed by device time: --copies copies in one jitted program, an optimization
barrier between them so that XLA neither fuses nor drops any, the median of --repeat calls
divided by the copies. The table gives GB/s (bytes read plus bytes written per second) and the
fraction of the rate of XLA's own copy of the same size on the whole GPU
(`jax_ep.tools.bench.timing.copy_bandwidth`). Every setting's result is checked against its
input, byte for byte. --json PATH writes every number.

On CPU the same body runs on a 32-lane grid (the CPU handler), at a small default size: it
checks the tool and the copy, and its times mean nothing for a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jax_ep_copy_rate"
ROW_BYTES = 14336  # a bfloat16 row of H 7168 (DeepSeek-V3's hidden size)
WORDS_IN_FLIGHT = (4, 8, 16)  # the variants built: the phases', the streams', and twice that
BULK = 0  # words_in_flight of the bulk copy (cuda/copy_rate.h, CopyRateBulk)
GPU_BYTES, CPU_BYTES = 300e6, 4e6
WARPS = "8,16,32,all"


def copy_rate(x: jax.Array, *, warps: int, words_in_flight: int,
              row_bytes: int = ROW_BYTES) -> jax.Array:
    """The copy of the uint8 array `x` made by the benchmark's kernel (the CPU handler on CPU).

    Args:
      x: uint8, any shape.
      warps: warps sharing the copy, one per block on a GPU (at least 1; 0 on a GPU: one per
        SM).
      words_in_flight: 16-byte loads each lane keeps in flight: 4, 8 or 16; BULK (0): the
        bulk copy (the handler refuses any other value, naming it).
      row_bytes: the rows the warps share out (each warp a contiguous run of them).

    Returns:
      An array equal to `x`, byte for byte.
    """
    from jax_ep import _ffi

    _ffi.require_extension(TARGET)
    _ffi.register()
    if x.dtype != jnp.uint8:
        raise TypeError(f"{TARGET}: x must be uint8, got {x.dtype}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, jnp.uint8))
    return call(x, warps=np.int64(warps), words_in_flight=np.int64(words_in_flight),
                row_bytes=np.int64(row_bytes))


def all_warps(device: jax.Device) -> int:
    """`all`: one warp per SM of a GPU (0, which the kernel resolves, where JAX does not say
    how many); on CPU one per core."""
    if device.platform == "cpu":
        return os.cpu_count() or 1
    return int(getattr(device, "core_count", 0) or 0)


def copy_program(copies: int, **settings):
    """A jitted program of `copies` copies of its input one after another, each behind an
    optimization barrier, so that XLA runs every one."""

    def program(x: jax.Array) -> jax.Array:
        for _ in range(copies):
            x = jax.lax.optimization_barrier(copy_rate(x, **settings))
        return x

    return jax.jit(program)


def measure(nbytes: int, warps: list[str], words: list[int | str], *, row_bytes: int = ROW_BYTES,
            copies: int = 4, repeat: int = 3, device: jax.Device | None = None) -> dict:
    """Times every (warps, words in flight) setting on `device`; returns the record that
    --json writes: per row the warps (as asked and as run), the words in flight (or "bulk"),
    seconds per copy, GB/s (read plus written), the fraction of XLA's copy rate, and whether
    the copy equals its input."""
    from jax_ep.tools.bench import timing

    device = device or jax.devices()[0]
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.integers(0, 256, nbytes, dtype=np.uint8), device)
    xla_rate = timing.copy_bandwidth(device, nbytes=max(nbytes, 4), copies=copies,
                                     repeat=repeat)
    rows = []
    for label in warps:
        n = all_warps(device) if label == "all" else int(label)
        for k in words:
            program = copy_program(copies, warps=n, words_in_flight=BULK if k == "bulk" else k,
                                   row_bytes=row_bytes)
            t = timing.time_calls(program, (x,), warmup=1, repeat=repeat).median / copies
            identical = bool(jnp.array_equal(program(x), x))
            rate = 2 * nbytes / t if t > 0 else float("inf")
            rows.append({"warps": label, "warps_run": n, "words_in_flight": k, "seconds": t,
                         "gbps": rate / 1e9, "of_xla": rate / xla_rate, "identical": identical})
    return {"device": device.device_kind, "platform": device.platform,
            "meaningful": device.platform != "cpu", "bytes": nbytes, "row_bytes": row_bytes,
            "copies": copies, "repeat": repeat, "xla_copy_Bps": xla_rate, "rows": rows}


def table(record: dict) -> str:
    """The record as a markdown table, one row per setting."""
    out = [f"Copy rate of the row copy alone on {record['device']}: "
           f"{record['bytes'] / 1e6:g} MB in rows of {record['row_bytes']} bytes, "
           f"XLA's copy {record['xla_copy_Bps'] / 1e9:.1f} GB/s"
           + ("" if record["meaningful"] else " (times not meaningful here)"), "",
           "| warps | words in flight | GB/s | of XLA copy | identical |",
           "|---|---|---|---|---|"]
    for r in record["rows"]:
        warps = r["warps"] if r["warps"] != "all" else f"all ({r['warps_run'] or 'every SM'})"
        out.append(f"| {warps} | {r['words_in_flight']} | {r['gbps']:.1f} | "
                   f"{r['of_xla']:.2f} | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(out)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_ep.tools.copy_rate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=float, help=f"bytes copied (default {GPU_BYTES:g} on an "
                   f"accelerator, {CPU_BYTES:g} on CPU)")
    p.add_argument("--warps", default=WARPS,
                   help=f"warps (one per SM) to time, comma-separated, `all`: every SM "
                        f"(default {WARPS})")
    p.add_argument("--words", default="4,8,16,bulk",
                   help="loads in flight per lane to time, comma-separated, each 4, 8, 16 or "
                        "`bulk` (the bulk copy; default 4,8,16,bulk)")
    p.add_argument("--row-bytes", type=int, default=ROW_BYTES,
                   help=f"bytes per row (default {ROW_BYTES})")
    p.add_argument("--copies", type=int, default=4, help="copies per timed program")
    p.add_argument("--repeat", type=int, default=3, help="timed calls; the median is used")
    p.add_argument("--json", metavar="PATH", help="write every number to PATH")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked: every error names its flag."""
    parser = make_parser()
    args = parser.parse_args(argv)
    args.warps = [w.strip() for w in args.warps.split(",") if w.strip()]
    for w in args.warps:
        if w != "all" and not (w.isdigit() and int(w) >= 1):
            parser.error(f"--warps: each must be a positive integer or `all`, got {w!r}")
    words = [k.strip() for k in args.words.split(",") if k.strip()]
    allowed = {str(k): k for k in WORDS_IN_FLIGHT} | {"bulk": "bulk"}
    bad = [k for k in words if k not in allowed]
    if bad or not words:
        parser.error(f"--words: each must be 4, 8, 16 or `bulk`, got {args.words!r}")
    args.words = [allowed[k] for k in words]
    if not args.warps:
        parser.error("--warps: name at least one")
    if args.bytes is not None and (args.bytes < 1 or args.bytes != int(args.bytes)):
        parser.error(f"--bytes must be a positive whole number, got {args.bytes:g}")
    if args.row_bytes < 1 or args.copies < 1 or args.repeat < 1:
        parser.error("--row-bytes, --copies and --repeat must each be at least 1")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    device = jax.devices()[0]
    nbytes = int(args.bytes or (CPU_BYTES if device.platform == "cpu" else GPU_BYTES))
    record = measure(nbytes, args.warps, args.words, row_bytes=args.row_bytes,
                     copies=args.copies, repeat=args.repeat, device=device)
    record["command"] = shlex.join(["python", "-m", "jax_ep.tools.copy_rate", *argv])
    print(table(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    # A copy that changed a byte fails the run: its rate would mean nothing.
    return 0 if all(r["identical"] for r in record["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
