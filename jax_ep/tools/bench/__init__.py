"""Benchmarks of jax_ep's ops: `python -m jax_ep.tools.bench` (see `__main__.py` here).

Modules: `suite` (the timed programs, one per op), `timing` (timers, copy bandwidth),
`virtual_cases` (the same ops through
`jax_ep.virtual`), `routings` (routing generators shared with the tests), `wire` (the bytes
each transport sends per op). The op names live here, free of jax,
so the command line can be checked before any device is touched.
"""

# Every op the benchmark times, in table order.
OPS = (
    "layout",
    "dispatch",
    "dispatch_fp8",
    "combine",
    "dispatch+combine",
    "ll_dispatch",
    "ll_dispatch_fp8",
    "ll_combine",
    "ll_round_trip",
)
# The FP8 variant of each op that has one (run with --fp8).
FP8_VARIANTS = {"dispatch": "dispatch_fp8", "ll_dispatch": "ll_dispatch_fp8"}
