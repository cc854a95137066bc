"""Defaults measured per GPU model, which `jax_ep.runtime` uses where the caller sets nothing.

`TABLE` maps a GPU's name, as `jax.Device.device_kind` spells it (e.g. "NVIDIA H200"), to the
settings `tools/gpu_tune.py` found fastest on it. The tool prints the entry to paste here
(docs/gpu/README.md); an entry is committed with the GPU report that measured it, and no
entry is written by hand. A GPU that is not in the table, and every CPU device, gets the
built-in defaults (`runtime.Channels()`, `jax_ep.DEFAULT_NUM_SMS`).

An entry:

    "NVIDIA H200": {
        "measured": "what measured it (tool, report, shapes, times)",
        # The buffer's rings (jax_ep.runtime.Channels); None: dispatch and combine in phases.
        "channels": {"channels": 40, "chunk_tokens": 4, "ring_chunks": 3, "warps": 0},
        # The num_sms of jax_ep.dispatch and jax_ep.combine.
        "num_sms": {"dispatch": 20, "combine": 20},
    },

Precedence, highest first. The rings: `$JAX_EP_CHANNELS` (which has always overridden the
config's), a `BufferConfig.channels` the caller gives (`Channels()` and None included), this
table, `Channels()`. The num_sms of dispatch and combine: a `num_sms=` the caller gives (20
and None included), this table, `jax_ep.DEFAULT_NUM_SMS`. `runtime.defaults()` says which
applies and where each came from; `python -m jax_ep.tools.doctor` prints it. On CPU devices
the table never applies: the host peers run every warp on a thread, and a GPU's settings
would not fit them.
"""

from __future__ import annotations

TABLE: dict[str, dict] = {
    # No GPU has been measured into the table yet: tools/gpu_tune.py prints each entry.
}


class Default(int):
    """An int default the caller left as it was: the ops replace it with the tuned table's
    value for their GPU, and keep it where the table has none. An int the caller passes, even
    an equal one, is theirs and is never replaced."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


# SMs each normal-mode kernel launch takes by default: the budget DeepEP's normal kernels use on
# a 132-SM H800, leaving the rest to the computation they overlap with. Left as it is, the ops
# take the tuned table's value for their GPU instead (runtime.default_num_sms).
DEFAULT_NUM_SMS = Default(20)
