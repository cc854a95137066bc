"""The compiled extension: it imports without a GPU, registers its targets, and its handlers
reject inconsistent calls with errors that name the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import _ffi


def test_imports_and_describes_itself():
    assert _ffi.EXT is not None, _ffi.IMPORT_ERROR
    info = _ffi.EXT.build_info()
    assert info["ffi_api_version"] == "0.3"  # the oldest supported jaxlib's FFI API
    assert "jax_ep_dispatch_layout" in _ffi.EXT.registrations()["cpu"]
    if info["cuda"]:
        assert info["cuda_arch"] == "sm_90a"
        assert "jax_ep_dispatch_layout" in _ffi.EXT.registrations()["CUDA"]


@pytest.mark.skipif(not _ffi.cuda_kernels_compiled(), reason="built without CUDA")
def test_nvshmem_unique_id_without_gpu():
    first, second = _ffi.EXT.nvshmem_unique_id(), _ffi.EXT.nvshmem_unique_id()
    assert isinstance(first, bytes) and len(first) == 128 and any(first)
    assert first != second  # a fresh id each time


def _raw_layout(topk_idx, num_experts, num_ranks, rank_shape=None):
    _ffi.register()
    tokens = topk_idx.shape[0]
    results = (
        jax.ShapeDtypeStruct(rank_shape or (num_ranks,), jnp.int32),
        jax.ShapeDtypeStruct((num_experts,), jnp.int32),
        jax.ShapeDtypeStruct((tokens, num_ranks), jnp.bool_),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    return jax.ffi.ffi_call("jax_ep_dispatch_layout", results)(
        topk_idx, num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks)
    )


def test_handler_counts():
    idx = jnp.asarray([[0, 5], [-1, 3], [9, -4]], jnp.int32)  # 9 and -4 are invalid for E=6
    per_rank, per_expert, in_rank, invalid = _raw_layout(idx, num_experts=6, num_ranks=3)
    np.testing.assert_array_equal(per_rank, [1, 1, 1])
    np.testing.assert_array_equal(per_expert, [1, 0, 0, 1, 0, 1])
    np.testing.assert_array_equal(in_rank, [[1, 0, 1], [0, 1, 0], [0, 0, 0]])
    assert int(invalid) == 2


def test_handler_rejects_bad_attributes():
    idx = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(Exception, match=r"num_experts \(5\) must be a positive multiple of "
                                         r"num_ranks \(2\)"):
        jax.block_until_ready(_raw_layout(idx, num_experts=5, num_ranks=2))


def test_handler_rejects_bad_result_shape():
    idx = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(Exception, match=r"num_tokens_per_rank must have shape \[2\], got \[3\]"):
        jax.block_until_ready(_raw_layout(idx, num_experts=4, num_ranks=2, rank_shape=(3,)))
