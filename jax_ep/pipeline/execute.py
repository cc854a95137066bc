"""Runs a pipeline schedule on a "pp" mesh axis with shard_map and ppermute.

Every rank holds the chunks (stages) the schedule places on it, stacked on a leading axis.
The per-rank op lists are laid out on a common clock (`tick_table`): at each tick every rank
runs at most one compute op of its list (F, B, W, BW, or FB: one chunk's forward overlapped
with another chunk's full backward), then the ranks hand what they produced to their
neighbours with `jax.lax.ppermute` by +1 and by -1 (a hand-over between two chunks of one
rank, DualPipeV's turn, stays local). The clock is a `lax.scan` and the op a `lax.switch` on
this rank's entry of the table, so a step compiles once whatever the number of micro-batches.

Backward recomputes a stage's forward from its saved input (`jax.vjp`): B gives the input
gradient (sent to the previous stage), W the parameter gradient of that B, BW both.

FB is where DualPipe's overlap happens: `overlapped(params_f, x_f, params_b, x_b, dy_b)`
computes one chunk's forward and the other's backward in one place. A model whose stage is
attention, dispatch, experts and combine can interleave the two there (for instance with
`jax_ep.overlap`) so that one's EP communication runs under the other's compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.pipeline.schedules import Op, Schedule

IDLE, F, B, W, BW, FB = range(6)  # op codes of the tick table
_CODES = {"F": F, "B": B, "W": W, "BW": BW, "FB": FB}
NONE, PLUS, MINUS, SELF = range(4)  # where a stage's output goes


def chunk_table(schedule: Schedule) -> np.ndarray:
    """int [R, C]: the stage of each rank's local chunk (its position in `chunks(rank)`)."""
    chunks = [schedule.chunks(r) for r in range(schedule.num_ranks)]
    if len({len(c) for c in chunks}) != 1:
        raise ValueError(
            f"{schedule.name}: every rank must hold as many chunks; got {[len(c) for c in chunks]}."
        )
    return np.array([[s for _, s in c] for c in chunks], np.int32)


def place_stages(schedule: Schedule, stage_params: Any) -> Any:
    """Per-stage parameters (leaves [S, ...]) -> per-rank chunks (leaves [R, C, ...]).

    A stage held by two ranks (DualPipe) is copied to both."""
    index = jnp.asarray(chunk_table(schedule))
    return jax.tree.map(lambda p: jnp.take(jnp.asarray(p), index, axis=0), stage_params)


def stage_grads(schedule: Schedule, rank_grads: Any) -> Any:
    """Per-rank chunk gradients (leaves [R, C, ...], as `pipeline_step` returns them, where
    copies already hold their sum) -> per-stage gradients (leaves [S, ...])."""
    table = chunk_table(schedule)
    first = {}
    for r, c in np.ndindex(table.shape):
        first.setdefault(int(table[r, c]), (r, c))
    ranks, chunks = zip(*(first[s] for s in range(schedule.num_stages)), strict=True)
    return jax.tree.map(lambda g: jnp.asarray(g)[np.array(ranks), np.array(chunks)], rank_grads)


@dataclasses.dataclass(frozen=True)
class TickTable:
    """The schedule on a common clock, per tick and rank: the op code, the micro-batch and
    local chunk of F/B/W/BW (of the forward half for FB), and of the backward half of FB."""

    code: np.ndarray  # int32 [T, R]
    mb: np.ndarray
    chunk: np.ndarray
    b_mb: np.ndarray
    b_chunk: np.ndarray

    @property
    def num_ticks(self) -> int:
        return int(self.code.shape[0])


def tick_table(schedule: Schedule) -> TickTable:
    """Places each rank's compute ops, in their order, at the earliest tick their inputs
    allow (an input made at tick t arrives for tick t + 1).

    Raises:
      ValueError: when an op's input is never produced before it (a deadlock).
    """
    stage_of = chunk_table(schedule)
    local = {(r, int(s)): c for r in range(schedule.num_ranks) for c, s in enumerate(stage_of[r])}
    last_stage = schedule.num_stages - 1
    done: dict[tuple[str, int, int], int] = {}  # (F|B|W, micro-batch, stage) -> tick

    def needs(op: Op) -> list[tuple[str, int, int]]:
        m, s = op.micro_batch, op.stage
        if op.kind == "F":
            return [("F", m, s - 1)] if s else []
        if op.kind in ("B", "BW"):
            return [("F", m, s)] + ([("B", m, s + 1)] if s < last_stage else [])
        return [("B", m, s)]

    def key(op: Op) -> tuple[str, int, int]:
        return ("F" if op.kind == "F" else "W" if op.kind == "W" else "B", op.micro_batch, op.stage)

    ops = [schedule.compute_ops(r) for r in range(schedule.num_ranks)]
    position = [0] * schedule.num_ranks
    last = [-1] * schedule.num_ranks
    placed: list[list[tuple[int, Op]]] = [[] for _ in ops]
    progress = True
    while progress:
        progress = False
        for r, rank_ops in enumerate(ops):
            while position[r] < len(rank_ops):
                op = rank_ops[position[r]]
                deps = [d for part in op.parts() for d in needs(part)]
                if any(d not in done for d in deps):
                    break
                tick = max([last[r] + 1] + [done[d] + 1 for d in deps])
                for part in op.parts():
                    done[key(part)] = tick
                placed[r].append((tick, op))
                last[r], position[r], progress = tick, position[r] + 1, True
    for r, rank_ops in enumerate(ops):
        if position[r] < len(rank_ops):
            raise ValueError(
                f"{schedule.name}: rank {r} waits forever at "
                f"{rank_ops[position[r]]}: an input it needs is never produced."
            )
    shape = (max(last) + 1, schedule.num_ranks)
    table = {name: np.zeros(shape, np.int32) for name in ("code", "mb", "chunk", "b_mb", "b_chunk")}
    for r, rank_ops in enumerate(placed):
        for tick, op in rank_ops:
            table["code"][tick, r] = _CODES[op.kind]
            table["mb"][tick, r] = op.micro_batch
            table["chunk"][tick, r] = (
                local[(r, op.stage)] if op.kind != "FB" else local[(r, op.parts()[0].stage)]
            )
            if op.backward is not None:
                table["b_mb"][tick, r] = op.backward.micro_batch
                table["b_chunk"][tick, r] = local[(r, op.backward.stage)]
    return TickTable(**table)


def _routes(schedule: Schedule) -> dict[str, np.ndarray]:
    """Per (rank, local chunk): first/last stage, and where its forward output and its input
    gradient go (direction code and the receiving rank's local chunk)."""
    stage_of = chunk_table(schedule)
    R, C = stage_of.shape
    last_stage = schedule.num_stages - 1
    routes = {
        name: np.zeros((R, C), np.int32)
        for name in ("first", "last", "f_dir", "f_chunk", "b_dir", "b_chunk")
    }
    local = {(r, int(s)): c for r in range(R) for c, s in enumerate(stage_of[r])}
    codes = {0: SELF, 1: PLUS, -1: MINUS}
    for d in range(schedule.num_directions):
        for s in range(schedule.num_stages):
            r = schedule.rank_of(s, d)
            c = local[(r, s)]
            routes["first"][r, c], routes["last"][r, c] = s == 0, s == last_stage
            if s < last_stage:
                nxt = schedule.rank_of(s + 1, d)
                routes["f_dir"][r, c], routes["f_chunk"][r, c] = codes[nxt - r], local[(nxt, s + 1)]
            if s > 0:
                prv = schedule.rank_of(s - 1, d)
                routes["b_dir"][r, c], routes["b_chunk"][r, c] = codes[prv - r], local[(prv, s - 1)]
    return routes


def default_overlapped(stage: Callable) -> Callable:
    """The FB op without interleaving: the forward, then the backward."""

    def overlapped(params_f, x_f, params_b, x_b, dy_b):
        y_f = stage(params_f, x_f)
        _, vjp = jax.vjp(stage, params_b, x_b)
        d_params, d_x = vjp(dy_b)
        return y_f, d_x, d_params

    return overlapped


def pipeline_step(
    stage: Callable[[Any, jax.Array], jax.Array],
    loss: Callable[[jax.Array, Any], jax.Array],
    schedule: Schedule,
    *,
    axis_name: str = "pp",
    overlapped: Callable | None = None,
) -> Callable:
    """Builds the per-rank training step of `schedule` (call it inside shard_map).

    Args:
      stage: `stage(params, x) -> y`, one stage of the model; y has x's shape and dtype.
      loss: `loss(y, target) -> scalar` on the last stage's output of one micro-batch.
      schedule: a `jax_ep.pipeline` schedule.
      axis_name: the pipeline mesh axis, of size `schedule.num_ranks`.
      overlapped: the FB op, `(params_f, x_f, params_b, x_b, dy_b) -> (y_f, dx_b,
        dparams_b)`; default `default_overlapped(stage)` (forward, then backward).

    Returns:
      `step(params, inputs, targets) -> (losses, grads)`, with per-shard arguments:
      `params` leaves [1, C, ...] (this rank's chunks; `place_stages` builds the global
      [R, C, ...]), `inputs` [M, ...] and `targets` [M, ...] for all micro-batches (the same
      on every rank); `losses` float32 [M], each micro-batch's loss; `grads` like `params`,
      the gradient of the mean loss, summed over the copies of a stage on two ranks.
    """
    table = tick_table(schedule)
    routes = {k: jnp.asarray(v) for k, v in _routes(schedule).items()}
    overlapped = overlapped or default_overlapped(stage)
    R, M = schedule.num_ranks, schedule.num_micro_batches
    tie = _tie_copies(schedule)
    rows = (table.code, table.mb, table.chunk, table.b_mb, table.b_chunk)

    def step(params, inputs, targets):
        if jax.lax.axis_size(axis_name) != R:
            raise ValueError(
                f"pipeline_step: the {axis_name!r} axis has "
                f"{jax.lax.axis_size(axis_name)} ranks; {schedule.name} was "
                f"built for {R}."
            )
        if inputs.shape[0] != M:
            raise ValueError(
                f"pipeline_step: inputs hold {inputs.shape[0]} micro-batches; "
                f"{schedule.name} was built for {M}."
            )
        params = jax.tree.map(lambda p: p[0], params)  # [1, C, ...] -> [C, ...]
        me = jax.lax.axis_index(axis_name)
        chunk_params = lambda c: jax.tree.map(lambda p: p[c], params)  # noqa: E731
        # The buffers differ per rank and hold data that varies over the mesh axes the
        # inputs and parameters vary over (e.g. "ep" too): typed so from the start.
        axes = _varying_axes((params, inputs, targets)) | {axis_name}
        def vary(tree):
            def leaf(a):
                missing = tuple(sorted(axes - _varying_axes(a)))
                return jax.lax.pcast(a, missing, to="varying") if missing else a

            return jax.tree.map(leaf, tree)

        buffers = jnp.zeros((params_chunks(params), M) + inputs.shape[1:], inputs.dtype)
        state = vary(
            {
                "acts": buffers,
                "grads": buffers,
                "losses": jnp.zeros((M,), jnp.float32),
                "dparams": jax.tree.map(jnp.zeros_like, params),
            }
        )
        zero = vary(jnp.int32(0))
        nothing = (vary(jnp.zeros(inputs.shape[1:], inputs.dtype)), zero, zero, zero)
        # A message: (payload, valid, receiving local chunk, micro-batch).

        def add_dparams(state, c, d):
            return {
                **state,
                "dparams": jax.tree.map(lambda a, g: a.at[c].add(g), state["dparams"], d),
            }

        def forward_in(state, m, c):
            x = jnp.where(routes["first"][me, c] == 1, inputs[m], state["acts"][c, m])
            return {**state, "acts": state["acts"].at[c, m].set(x)}, x

        def forward_out(state, y, m, c):
            """At the last stage the loss and its gradient (B starts there later); else a
            message to the next stage."""

            def at_last(state):
                value, dy = jax.value_and_grad(loss)(y, targets[m])
                return {
                    **state,
                    "losses": state["losses"].at[m].set(value),
                    "grads": state["grads"].at[c, m].set(dy / M),
                }

            state = jax.lax.cond(routes["last"][me, c] == 1, at_last, lambda s: s, state)
            return state, (y, 1 - routes["last"][me, c], routes["f_chunk"][me, c], m)

        def backward_out(d_x, m, c):
            return (d_x, 1 - routes["first"][me, c], routes["b_chunk"][me, c], m)

        def saved(state, m, c):
            return state["acts"][c, m], state["grads"][c, m]

        def do_f(state, m, c, bm, bc):
            state, x = forward_in(state, m, c)
            state, f_msg = forward_out(state, stage(chunk_params(c), x), m, c)
            return state, f_msg, c, nothing, c

        def do_b(state, m, c, bm, bc):
            x, dy = saved(state, m, c)
            _, vjp = jax.vjp(lambda x: stage(chunk_params(c), x), x)
            return state, nothing, c, backward_out(vjp(dy)[0], m, c), c

        def do_w(state, m, c, bm, bc):
            x, dy = saved(state, m, c)
            _, vjp = jax.vjp(lambda p: stage(p, x), chunk_params(c))
            return add_dparams(state, c, vjp(dy)[0]), nothing, c, nothing, c

        def do_bw(state, m, c, bm, bc):
            x, dy = saved(state, m, c)
            _, vjp = jax.vjp(stage, chunk_params(c), x)
            d_params, d_x = vjp(dy)
            return add_dparams(state, c, d_params), nothing, c, backward_out(d_x, m, c), c

        def do_fb(state, m, c, bm, bc):
            state, x_f = forward_in(state, m, c)
            x_b, dy_b = saved(state, bm, bc)
            y_f, d_x, d_params = overlapped(chunk_params(c), x_f, chunk_params(bc), x_b, dy_b)
            state, f_msg = forward_out(add_dparams(state, bc, d_params), y_f, m, c)
            return state, f_msg, c, backward_out(d_x, bm, bc), bc

        def idle(state, m, c, bm, bc):
            return state, nothing, zero, nothing, zero

        # Every branch's outputs typed alike (lax.switch requires it).
        branches = [lambda *a, b=b: vary(b(*a)) for b in (idle, do_f, do_b, do_w, do_bw, do_fb)]

        def tick(state, row):
            code, m, c, bm, bc = (column[me] for column in row)
            state, f_msg, f_chunk, b_msg, b_chunk = jax.lax.switch(
                code, branches, state, m, c, bm, bc
            )
            f_dir, b_dir = routes["f_dir"][me, f_chunk], routes["b_dir"][me, b_chunk]

            def going(direction):
                def only(msg, d):
                    return (msg[0], msg[1] * (d == direction), msg[2], msg[3])

                return only(f_msg, f_dir), only(b_msg, b_dir)

            from_left = jax.lax.ppermute(going(PLUS), axis_name, [(i, i + 1) for i in range(R - 1)])
            from_right = jax.lax.ppermute(
                going(MINUS), axis_name, [(i, i - 1) for i in range(1, R)]
            )
            for f_in, b_in in (from_left, from_right, going(SELF)):
                state = _receive(_receive(state, "acts", f_in), "grads", b_in)
            return state, None

        state, _ = jax.lax.scan(tick, state, tuple(jnp.asarray(a) for a in rows))
        losses = jax.lax.psum(state["losses"], axis_name)  # each set on one rank only
        grads = tie(state["dparams"], axis_name)
        return losses, jax.tree.map(lambda g: g[None], grads)

    return step


def _varying_axes(tree: Any) -> set[str]:
    """The mesh axes any leaf of `tree` varies over (inside shard_map)."""
    axes: set[str] = set()
    for leaf in jax.tree.leaves(tree):
        aval = jax.typeof(leaf)
        vma = getattr(aval, "vma", None)
        axes |= set(vma if vma is not None else aval.manual_axis_type.varying)
    return axes


def params_chunks(params: Any) -> int:
    return jax.tree.leaves(params)[0].shape[0]


def _receive(state: dict, buffer: str, message) -> dict:
    payload, valid, chunk, m = message
    old = state[buffer][chunk, m]
    return {**state, buffer: state[buffer].at[chunk, m].set(jnp.where(valid == 1, payload, old))}


def _tie_copies(schedule: Schedule) -> Callable:
    """Sums the gradients of a stage held by two ranks (DualPipe), on both of them."""
    stage_of = chunk_table(schedule)
    holders: dict[int, list[tuple[int, int]]] = {}
    for r, c in np.ndindex(stage_of.shape):
        holders.setdefault(int(stage_of[r, c]), []).append((r, c))
    moves: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (from chunk, to chunk) -> perm
    for places in holders.values():
        if len(places) == 2:
            for (r, c), (r2, c2) in (places, places[::-1]):
                moves.setdefault((c2, c), []).append((r2, r))

    def tie(grads, axis_name):
        def per_leaf(g):
            total = g
            for (src, dst), perm in moves.items():
                total = total.at[dst].add(jax.lax.ppermute(g[src], axis_name, perm))
            return total

        return jax.tree.map(per_leaf, grads) if moves else grads

    return tie
