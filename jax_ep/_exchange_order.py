"""One order of exchanges: every exchange custom call of a program runs one at a time, in the
program's order, on every rank.

Exchanges meet their peers through flags that count launches (cuda/peer_ops.h, Meet) and
share one symmetric buffer per rank, so two exchanges of one program must never run at once
on a device, nor in different orders on different ranks. XLA is free to do both with
independent side-effecting calls: XLA:CPU runs independent operations concurrently, and a
GPU schedule or a second stream may reorder them. So every exchange carries an ordered
effect (`EXCHANGE`): JAX threads a token through the calls in program order (through jit,
shard_map, custom_vjp, scan, cond and remat) and from one dispatched program to the next,
and each custom call takes the token and returns the next one. XLA orders the calls by that
dependency, the same way on every rank.

The token is a real operand and result of the custom call (`xla::ffi::Token` in the
handlers' bindings, ffi/exchange_cpu.cc and ffi/exchange_cuda.cc), so the order holds on
every XLA backend, including XLA:CPU's concurrent executor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import numpy as np
from jax._src import core, dispatch, effects, ffi, xla_bridge
from jax._src.interpreters import mlir


@dataclasses.dataclass(frozen=True)
class ExchangeEffect(effects.Effect):
    """The ordered effect of every exchange between devices: meeting the peers through one
    buffer per rank."""

    def __str__(self):
        return "jax_ep exchange"


@dataclasses.dataclass(frozen=True)
class LocalEffect(effects.Effect):
    """The effect of an exchange call that meets no peers (virtual ranks, or one rank): kept
    by XLA like every exchange, but not ordered."""

    def __str__(self):
        return "jax_ep local exchange"


EXCHANGE = ExchangeEffect()
LOCAL = LocalEffect()

# Ordered: JAX threads a token through the calls. Shardable: allowed in programs over
# several devices (each device sees its exchanges in program order; the devices agree
# because they run the same program). Both allowed under control flow, custom_vjp and remat
# (a recomputation repeats the same exchanges in the same order on every rank).
effects.ordered_effects.add_type(ExchangeEffect)
effects.shardable_ordered_effects.add_type(ExchangeEffect)
for _kind in (effects.lowerable_effects, effects.control_flow_allowed_effects,
              effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects):
    _kind.add_type(ExchangeEffect)
    _kind.add_type(LocalEffect)


def has_buffer() -> bool:
    """Whether this process has the buffers exchanges between devices meet in; jax_ep.runtime
    puts its is_initialized in its place (this module imports none of jax_ep's)."""
    return False


exchange_p = core.Primitive("jax_ep_exchange")
exchange_p.multiple_results = True
dispatch.simple_impl(exchange_p)


@exchange_p.def_effectful_abstract_eval
def _abstract_eval(*avals, target, result_avals, attributes, aliases, ordered):
    del target, attributes, aliases
    core.standard_vma_rule("jax_ep_exchange", *avals)
    return result_avals, {EXCHANGE if ordered else LOCAL}


def _lowering(ctx: mlir.LoweringRuleContext, ranks, *operands, target, result_avals,
              attributes, aliases, ordered):
    """The custom call with the token after `ranks` and before the results (a fresh one
    when the call is not ordered)."""
    del result_avals
    if ordered:
        _check_initialized(target, ctx.module_context.platforms)
    token = ctx.tokens_in.get(EXCHANGE) if ordered else mlir.create_token()
    token_ctx = dataclasses.replace(
        ctx,
        avals_in=[ctx.avals_in[0], core.abstract_token, *ctx.avals_in[1:]],
        avals_out=[core.abstract_token, *ctx.avals_out])
    lower = ffi.build_ffi_lowering_function(
        target, has_side_effect=True,
        operand_output_aliases={i + 1: o + 1 for i, o in aliases} or None)
    attrs = {k: np.asarray(v, np.int64) if isinstance(v, tuple) else v for k, v in attributes}
    call = lower(token_ctx, ranks, token, *operands, **attrs)
    token, *results = call.results
    if ordered:
        ctx.set_tokens_out(mlir.TokenSet({EXCHANGE: token}))
    return results


mlir.register_lowering(exchange_p, _lowering)


def _check_initialized(target: str, platforms: Sequence[str]) -> None:
    """An exchange between devices compiled to run in this process needs the buffer
    `jax_ep.initialize()` sets up: refused when the program is lowered (its first call),
    where the handler would fail only when it runs, in a result nobody may read. Lowering
    for another platform (a GPU program on a CPU-only machine) needs no buffer."""
    here = xla_bridge.canonicalize_platform(xla_bridge.default_backend())
    if here in platforms and not has_buffer():
        op = target.removeprefix("jax_ep_")
        raise RuntimeError(
            f"jax_ep: the cuda backend's {op} between devices needs jax_ep.initialize() "
            f"first, before its program is compiled (on CPU devices it sets up host buffers "
            f"standing in for NVSHMEM's); call it once after jax.distributed.initialize() "
            f"(if any) and before the first jitted step, or pass backend='xla'.")


def call(target: str, result_types: Sequence[core.ShapedArray], operands: Sequence,
         attributes: dict[str, np.int64 | tuple[int, ...]], aliases: dict[int, int] | None = None,
         *, ordered: bool) -> list:
    """Exchange custom call `target` (its first operand the ranks); `attributes` are int64
    scalars or tuples (int64 arrays); `aliases` maps operand to result indices. `ordered`
    (between devices): in the program's order of exchanges."""
    operands = core.auto_insert_reshard(*operands)  # one varying-axes type, as ffi_call does
    return exchange_p.bind(*operands, target=target, result_avals=tuple(result_types),
                           attributes=tuple(sorted(attributes.items())),
                           aliases=tuple(sorted((aliases or {}).items())), ordered=ordered)


def failure() -> Exception | None:
    """The error of the last exchanges this thread dispatched, once they finished (None if
    they succeeded or there were none); the token stays."""
    token = dispatch.runtime_tokens.current_tokens.get(EXCHANGE)
    try:
        if token is not None:
            token.block_until_ready()
    except Exception as error:  # the program's failure, returned to be reported
        return error
    return None


def wait_and_forget() -> None:
    """Waits for the exchanges this thread dispatched, then drops the token that orders the
    next program after them (JAX keeps one per thread, `jax.effects_barrier`). A program
    whose exchange failed leaves that token in error, and JAX would fail every later program
    with exchanges with the same error: `jax_ep.initialize()` and `finalize()` call this, so a
    new initialization starts a fresh order."""
    token = dispatch.runtime_tokens.current_tokens.pop(EXCHANGE, None)
    if token is not None:
        with contextlib.suppress(Exception):  # reported by the program whose exchange failed
            token.block_until_ready()
