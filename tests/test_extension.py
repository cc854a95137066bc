"""The compiled extension jax_ep._ext, called directly (below the ops layer).

Covers: the module imports without a GPU and describes its build; registrations; the NVSHMEM
unique id (CUDA builds); the CPU handler of "jax_ep_dispatch_layout" against the NumPy
reference (masks, invalid ids, skew, sizes that are not powers of two, empty inputs), eagerly
and under jit; the handler's argument checks; and the lowering of the call for CUDA on this
CPU-only jaxlib (target name and attributes).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ep import _ffi
from jax_ep.tools import reference

TARGET = "jax_ep_dispatch_layout"
FIELDS = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "num_invalid")


def _ext():
    assert _ffi.EXT is not None, f"jax_ep._ext does not import: {_ffi.IMPORT_ERROR}"
    return _ffi.EXT


def _layout_call(num_tokens, num_experts, num_ranks, *, shapes=None):
    """The raw ffi_call of the layout target; `shapes` overrides result shapes (bad inputs)."""
    shapes = shapes or {}
    results = (
        jax.ShapeDtypeStruct(shapes.get("num_tokens_per_rank", (num_ranks,)), jnp.int32),
        jax.ShapeDtypeStruct(shapes.get("num_tokens_per_expert", (num_experts,)), jnp.int32),
        jax.ShapeDtypeStruct(shapes.get("is_token_in_rank", (num_tokens, num_ranks)), jnp.bool_),
        jax.ShapeDtypeStruct(shapes.get("num_invalid", ()), jnp.int32),
    )
    call = jax.ffi.ffi_call(TARGET, results)

    def layout(topk_idx):
        return call(topk_idx, num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks))

    return layout


def _run(topk_idx, num_experts, num_ranks, *, jit=False, shapes=None):
    _ffi.register()
    topk_idx = jnp.asarray(topk_idx, jnp.int32)
    layout = _layout_call(topk_idx.shape[0], num_experts, num_ranks, shapes=shapes)
    if jit:
        layout = jax.jit(layout)
    return [np.asarray(a) for a in jax.block_until_ready(layout(topk_idx))]


def _check_against_reference(stacked, num_experts, *, jit=False):
    """Runs the handler on each rank's routing stacked[r] and compares with the reference."""
    num_ranks = stacked.shape[0]
    want = reference.dispatch_layout(stacked, num_experts=num_experts)
    for rank in range(num_ranks):
        got = _run(stacked[rank], num_experts, num_ranks, jit=jit)
        for field, value in zip(FIELDS, got, strict=True):
            np.testing.assert_array_equal(
                value, want[field][rank], err_msg=f"{field} of rank {rank}"
            )
            assert value.dtype == want[field].dtype, field


def _routing(rng, num_ranks, num_tokens, top_k, num_experts, *, kind):
    """Random routing [R, T, K] of one kind: distinct experts per token ("uniform"), repeated
    experts ("duplicates"), everything on expert 0 ("skew"), or a mix of valid choices, -1
    masks and invalid ids such as E, -5 and large values ("dirty")."""
    shape = (num_ranks, num_tokens, top_k)
    if kind == "uniform":
        keys = rng.random((num_ranks, num_tokens, num_experts))
        return np.argsort(keys, axis=-1)[..., :top_k].astype(np.int32)
    if kind == "duplicates":
        return rng.integers(0, num_experts, shape, dtype=np.int32)
    if kind == "skew":
        return np.zeros(shape, np.int32)
    choices = np.array([-1, -5, num_experts, num_experts + 3, 2**31 - 1, -(2**31)], np.int32)
    idx = rng.integers(0, num_experts, shape, dtype=np.int32)
    dirty = rng.random(shape) < 0.3
    return np.where(dirty, rng.choice(choices, shape), idx).astype(np.int32)


# --- the module -------------------------------------------------------------------------------


def test_module_imports_and_describes_its_build():
    ext = _ext()
    info = ext.build_info()
    assert info["ffi_api_version"] == "0.3"  # the oldest supported jaxlib's FFI API
    assert info["cuda"] == ext.cuda_compiled() == _ffi.cuda_kernels_compiled()
    if info["cuda"]:
        assert info["cuda_arch"].startswith("sm_")
        assert re.fullmatch(r"3\.\d+\.\d+", info["nvshmem_version"]), info
    else:
        assert info["cuda_arch"] is None and info["nvshmem_version"] is None


def test_registrations():
    registrations = _ext().registrations()
    assert set(registrations) == {"cpu", "CUDA"}
    assert TARGET in registrations["cpu"]
    if _ffi.cuda_kernels_compiled():
        assert TARGET in registrations["CUDA"]
    else:
        assert registrations["CUDA"] == {}


def test_register_is_idempotent():
    _ffi.register()
    _ffi.register()


@pytest.mark.skipif(not _ffi.cuda_kernels_compiled(), reason="built without CUDA")
def test_nvshmem_unique_id_needs_no_gpu():
    first, second = _ext().nvshmem_unique_id(), _ext().nvshmem_unique_id()
    assert isinstance(first, bytes) and len(first) == 128 and any(first)
    assert first != second  # a fresh id each time


@pytest.mark.skipif(_ffi.cuda_kernels_compiled(), reason="built with CUDA")
def test_nvshmem_unique_id_without_cuda_says_how_to_build():
    with pytest.raises(RuntimeError, match="JAX_EP_CUDA"):
        _ext().nvshmem_unique_id()


# --- the CPU handler against the reference ----------------------------------------------------


def test_handler_small_case_by_hand():
    # E=6 on R=3 ranks (2 experts each); 9 and -4 are invalid, -1 is a mask.
    idx = [[0, 5], [-1, 3], [9, -4], [2, 3]]
    per_rank, per_expert, in_rank, invalid = _run(idx, num_experts=6, num_ranks=3)
    np.testing.assert_array_equal(per_rank, [1, 2, 1])  # token 3 counts once on rank 1
    np.testing.assert_array_equal(per_expert, [1, 0, 1, 2, 0, 1])
    np.testing.assert_array_equal(in_rank, [[1, 0, 1], [0, 1, 0], [0, 0, 0], [0, 1, 0]])
    assert invalid.shape == () and int(invalid) == 2


@pytest.mark.parametrize("kind", ["uniform", "duplicates", "skew", "dirty"])
@pytest.mark.parametrize(
    ("num_ranks", "num_tokens", "top_k", "num_experts"),
    [(1, 5, 2, 3), (3, 37, 5, 12), (4, 64, 8, 32), (5, 29, 3, 35), (8, 13, 6, 24)],
)
def test_handler_matches_reference(kind, num_ranks, num_tokens, top_k, num_experts):
    rng = np.random.default_rng([num_ranks, num_tokens, top_k, num_experts])
    stacked = _routing(rng, num_ranks, num_tokens, top_k, num_experts, kind=kind)
    _check_against_reference(stacked, num_experts)


def test_handler_under_jit_matches_reference():
    rng = np.random.default_rng(7)
    _check_against_reference(_routing(rng, 3, 41, 4, 9, kind="dirty"), 9, jit=True)


@pytest.mark.parametrize(("num_tokens", "top_k"), [(0, 4), (6, 0), (0, 0)])
def test_handler_empty_inputs(num_tokens, top_k):
    per_rank, per_expert, in_rank, invalid = _run(
        np.zeros((num_tokens, top_k), np.int32), num_experts=8, num_ranks=4
    )
    np.testing.assert_array_equal(per_rank, np.zeros(4))
    np.testing.assert_array_equal(per_expert, np.zeros(8))
    assert in_rank.shape == (num_tokens, 4) and not in_rank.any()
    assert int(invalid) == 0


@settings(max_examples=15, deadline=None)
@given(
    num_ranks=st.integers(1, 6),
    experts_per_rank=st.integers(1, 5),
    num_tokens=st.integers(1, 40),
    top_k=st.integers(1, 9),
    kind=st.sampled_from(["duplicates", "skew", "dirty"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_handler_matches_reference_random(
    num_ranks, experts_per_rank, num_tokens, top_k, kind, seed
):
    num_experts = num_ranks * experts_per_rank
    stacked = _routing(
        np.random.default_rng(seed), num_ranks, num_tokens, top_k, num_experts, kind=kind
    )
    _check_against_reference(stacked, num_experts)


# --- the handler's argument checks ------------------------------------------------------------


def test_handler_rejects_experts_not_divisible_by_ranks():
    with pytest.raises(
        Exception,
        match=rf"{TARGET}: num_experts \(5\) must be a positive "
        r"multiple of num_ranks \(2\)",
    ):
        _run(np.zeros((4, 2), np.int32), num_experts=5, num_ranks=2)


def test_handler_rejects_zero_ranks():
    with pytest.raises(Exception, match=rf"{TARGET}: num_ranks must be >= 1, got 0"):
        _run(
            np.zeros((4, 2), np.int32),
            num_experts=4,
            num_ranks=0,
            shapes={"num_tokens_per_rank": (1,), "is_token_in_rank": (4, 1)},
        )


def test_handler_rejects_topk_idx_of_wrong_rank():
    _ffi.register()
    idx = jnp.zeros((2, 4, 2), jnp.int32)
    call = _layout_call(2, 4, 2)
    with pytest.raises(Exception, match=rf"{TARGET}: topk_idx must be rank 2, got rank 3"):
        jax.block_until_ready(call(idx))


@pytest.mark.parametrize(
    ("field", "shape", "message"),
    [
        ("num_tokens_per_rank", (3,), r"num_tokens_per_rank must have shape \[2\], got \[3\]"),
        ("num_tokens_per_expert", (5,), r"num_tokens_per_expert must have shape \[4\], got \[5\]"),
        ("is_token_in_rank", (2, 4), r"is_token_in_rank must have shape \[4, 2\], got \[2, 4\]"),
        ("num_invalid", (1,), r"num_invalid must have shape \[\], got \[1\]"),
    ],
)
def test_handler_rejects_wrong_result_shape(field, shape, message):
    with pytest.raises(Exception, match=rf"{TARGET}: {message}"):
        _run(np.zeros((4, 2), np.int32), num_experts=4, num_ranks=2, shapes={field: shape})


# --- lowering for CUDA on a CPU-only jaxlib ---------------------------------------------------


def test_lowers_for_cuda_with_attributes():
    _ffi.register()  # registering the CUDA target is a no-op here; lowering needs no handler
    layout = _layout_call(37, 12, 3)
    lowered = (
        jax.jit(layout)
        .trace(jax.ShapeDtypeStruct((37, 5), jnp.int32))
        .lower(lowering_platforms=("cuda",))
    )
    stablehlo = lowered.as_text()
    assert f"stablehlo.custom_call @{TARGET}(" in stablehlo, stablehlo
    assert "num_experts = 12 : i64" in stablehlo, stablehlo
    assert "num_ranks = 3 : i64" in stablehlo, stablehlo
    signature = (
        "(tensor<37x5xi32>) -> (tensor<3xi32>, tensor<12xi32>, tensor<37x3xi1>, tensor<i32>)"
    )
    assert signature in stablehlo, stablehlo
    hlo = lowered.as_text(dialect="hlo")
    assert f'custom_call_target="{TARGET}"' in hlo, hlo
    assert "api_version=API_VERSION_TYPED_FFI" in hlo, hlo


def test_source_tree_without_a_build_uses_the_installed_extension(tmp_path):
    """`pip install . && python -m jax_ep.tools.bench` from the repository root imports the source
    tree, which has no extension: the installed one is used, so the cuda rows run."""
    import os
    import shutil
    import subprocess
    import sys

    import jax_ep

    installed = getattr(_ffi.EXT, "__file__", None)
    if installed is None or os.path.dirname(installed) != os.path.dirname(jax_ep.__file__):
        pytest.skip("needs jax-ep installed (not editable) with its extension")
    tree = tmp_path / "jax_ep"
    shutil.copytree(os.path.dirname(jax_ep.__file__), tree,
                    ignore=shutil.ignore_patterns("_ext*", "__pycache__"))
    probe = ("import jax_ep, jax_ep._ffi as f; print(jax_ep.__file__); "
             "print(f.EXT.__file__ if f.EXT else f.IMPORT_ERROR)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    source, extension = out.stdout.split("\n")[:2]
    assert source.startswith(str(tree)), source  # the copy of the tree was imported ...
    assert extension == installed, extension  # ... with the installed extension
