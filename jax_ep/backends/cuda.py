"""The custom-call backend: XLA FFI targets implemented by our extension.

On a GPU the targets run the CUDA kernels in cuda/; on CPU the same targets have CPU
handlers (ffi/), so the custom-call path is exercised without a GPU. Result types are built
from the operand's type (`jax.typeof(x).update(...)`) so that they carry shard_map's
varying-axis typing and custom_vjp backward passes type-check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _ffi
from jax_ep.structs import DispatchLayout

NAME = "cuda"


def _result(like: jax.Array, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.typeof(like).update(shape=shape, dtype=jnp.dtype(dtype))


def get_dispatch_layout(
    topk_idx: jax.Array, *, num_experts: int, num_ranks: int
) -> DispatchLayout:
    _ffi.register()
    num_tokens = topk_idx.shape[0]
    outs = jax.ffi.ffi_call(
        "jax_ep_dispatch_layout",
        (
            _result(topk_idx, (num_ranks,), jnp.int32),
            _result(topk_idx, (num_experts,), jnp.int32),
            _result(topk_idx, (num_tokens, num_ranks), jnp.bool_),
            _result(topk_idx, (), jnp.int32),
        ),
        vmap_method="sequential",  # each batch element is an independent layout
    )(topk_idx, num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks))
    return DispatchLayout(*outs)
