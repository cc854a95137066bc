"""NumPy reference implementation of the jax_ep contract (see docs/contract.md).

Every function works on all ranks at once: each per-rank array is stacked on a leading axis
of size R, so rank ``d``'s argument is ``a[d]`` and rank ``d``'s result is ``out[d]``.
The code is written as plain loops over ranks, tokens and top-k choices (the hidden dimension
is vectorized) so that each rule of the contract can be read off directly. Where the contract
says float32, arithmetic is done in float32 in exactly the stated order (one NumPy operation
per IEEE operation, so no fused multiply-adds), and results are bitwise reproducible.

Conventions shared by all functions:

* ``E_local = E // R``; expert ``e`` lives on rank ``e // E_local`` as local expert
  ``e % E_local``.
* An entry of ``topk_idx`` is a *choice* when ``0 <= e < E``; ``-1`` masks the slot and any
  other value is *invalid*: it is routed like ``-1`` and counted in ``num_invalid``.
* The "rank-major rows" of destination rank ``d`` are, in order, the tokens ``(s, t)`` (source
  rank ``s``, then token ``t``) with at least one valid choice living on ``d``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "combine",
    "combine_vjp",
    "dequantize",
    "dispatch",
    "dispatch_layout",
    "dispatch_vjp",
    "low_latency_combine",
    "low_latency_dispatch",
    "quantize",
]

FP8_BLOCK = 128
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4

_F32 = np.float32
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


# --------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Routing:
    """Routing of every (rank, token, choice) slot.

    Attributes:
        R, T, K, E, E_local: sizes.
        valid: bool ``[R, T, K]``, the slot holds a choice in ``[0, E)``.
        dest: int ``[R, T, K]``, the rank the choice lives on (-1 where not valid).
        local: int ``[R, T, K]``, the local expert id on ``dest`` (-1 where not valid).
        num_invalid: int32 ``[R]``, entries that are neither -1 nor in ``[0, E)``.
    """

    R: int
    T: int
    K: int
    E: int
    E_local: int
    valid: np.ndarray
    dest: np.ndarray
    local: np.ndarray
    num_invalid: np.ndarray

    def goes_to(self, s: int, t: int, d: int) -> bool:
        """True when token ``t`` of rank ``s`` has a valid choice living on rank ``d``."""
        return bool(np.any(self.dest[s, t] == d))

    def rank_major_rows(self, d: int) -> list[tuple[int, int]]:
        """All rank-major rows ``(s, t)`` of destination ``d`` (before any capacity)."""
        return [(s, t) for s in range(self.R) for t in range(self.T) if self.goes_to(s, t, d)]

    def row_local_ids(self, s: int, t: int, d: int) -> list[int]:
        """The received ``topk_idx`` row on ``d`` for token ``(s, t)``: local id or -1 per k."""
        return [int(self.local[s, t, k]) if self.dest[s, t, k] == d else -1 for k in range(self.K)]


def _route(topk_idx, num_experts: int) -> _Routing:
    """Validates ``topk_idx`` ``[R, T, K]`` and computes the routing of every slot."""
    idx = np.asarray(topk_idx)
    if idx.ndim != 3:
        raise ValueError(f"topk_idx must have shape [R, T, K], got shape {idx.shape}")
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"topk_idx must be an integer array, got dtype {idx.dtype}")
    R, T, K = idx.shape
    E = int(num_experts)
    if R < 1:
        raise ValueError("topk_idx must hold at least one rank (R >= 1)")
    if E < 1 or E % R != 0:
        raise ValueError(f"num_experts ({E}) must be a positive multiple of the rank count {R}")
    e_local = E // R
    idx = idx.astype(np.int64)
    valid = (idx >= 0) & (idx < E)
    invalid = ~valid & (idx != -1)
    dest = np.where(valid, idx // e_local, -1)
    local = np.where(valid, idx % e_local, -1)
    num_invalid = invalid.reshape(R, -1).sum(axis=1).astype(np.int32)
    return _Routing(R, T, K, E, e_local, valid, dest, local, num_invalid)


def _check_leading(name: str, a: np.ndarray, shape: tuple[int, ...]) -> None:
    """Raises ValueError unless ``a.shape`` starts with ``shape``."""
    if a.shape[: len(shape)] != shape:
        raise ValueError(f"{name} must have leading shape {shape}, got shape {a.shape}")


def _check_shape(name: str, a: np.ndarray, shape: tuple[int, ...]) -> None:
    """Raises ValueError unless ``a.shape == shape``."""
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got shape {a.shape}")


# --------------------------------------------------------------------------------------------
# The received layout (which source slot lands in which received row / entry)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    """One kept received row (rank-major) or entry (expert-major) on a destination rank.

    Attributes:
        s, t: source rank and token.
        row: the rank-major row index on the destination (before any capacity).
        k: the choice (expert-major entries only; None for rank-major rows).
        j: the local expert (expert-major entries only; None for rank-major rows).
    """

    s: int
    t: int
    row: int
    k: int | None = None
    j: int | None = None


@dataclass(frozen=True)
class _Plan:
    """The received layout on every destination rank.

    Attributes:
        routing: the routing it was built from.
        capacity: rows (rank-major) or entries (expert-major) per destination.
        expert_major: which layout.
        rows: per destination, all rank-major rows ``(s, t)`` (uncapped).
        kept: per destination, the kept slots in received order (at most ``capacity``).
        needed: per destination, the slot count before the capacity is applied.
    """

    routing: _Routing
    capacity: int
    expert_major: bool
    rows: list[list[tuple[int, int]]]
    kept: list[list[_Slot]]
    needed: list[int]


def _default_capacity(routing: _Routing, expert_major: bool) -> int:
    if expert_major:
        return routing.R * routing.T * min(routing.K, routing.E_local)
    return routing.R * routing.T


def _plan(topk_idx, num_experts: int, capacity: int | None, expert_major: bool,
          drop_order: str | None = None) -> _Plan:
    """Computes which source slot every received row or entry holds, on every rank.
    `drop_order="source"` (expert-major): the entries kept under the capacity are the first
    in order of source, local expert, token and choice (the layout stays sorted by expert)."""
    routing = _route(topk_idx, num_experts)
    if capacity is None:
        capacity = _default_capacity(routing, expert_major)
    capacity = int(capacity)
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    rows, kept, needed = [], [], []
    for d in range(routing.R):
        d_rows = routing.rank_major_rows(d)
        if expert_major:
            # Row-major enumeration of the entries (j, i, k), then a stable sort by j.
            entries = []
            for i, (s, t) in enumerate(d_rows):
                for k, j in enumerate(routing.row_local_ids(s, t, d)):
                    if j != -1:
                        entries.append(_Slot(s=s, t=t, row=i, k=k, j=j))
            slots = sorted(entries, key=lambda e: e.j)  # Python's sort is stable
            if drop_order == "source":
                first = sorted(entries, key=lambda e: (e.s, e.j))[:capacity]
                keep = {(e.row, e.k) for e in first}
                needed.append(len(slots))
                rows.append(d_rows)
                kept.append([e for e in slots if (e.row, e.k) in keep])
                continue
        else:
            slots = [_Slot(s=s, t=t, row=i) for i, (s, t) in enumerate(d_rows)]
        rows.append(d_rows)
        kept.append(slots[:capacity])
        needed.append(len(slots))
    return _Plan(routing, capacity, bool(expert_major), rows, kept, needed)


def _counts(plan: _Plan) -> dict[str, np.ndarray]:
    """num_tokens, tokens_per_expert, num_dropped and num_invalid of a plan."""
    r = plan.routing
    num_tokens = np.array([len(k) for k in plan.kept], dtype=np.int32)
    num_dropped = np.array(plan.needed, dtype=np.int32) - num_tokens
    per_expert = np.zeros((r.R, r.E_local), dtype=np.int32)
    for d in range(r.R):
        for slot in plan.kept[d]:
            if plan.expert_major:
                per_expert[d, slot.j] += 1
            else:
                for j in r.row_local_ids(slot.s, slot.t, d):
                    if j != -1:
                        per_expert[d, j] += 1
    return {
        "num_tokens": num_tokens,
        "tokens_per_expert": per_expert,
        "num_dropped": num_dropped.astype(np.int32),
        "num_invalid": r.num_invalid.copy(),
    }


# --------------------------------------------------------------------------------------------
# get_dispatch_layout
# --------------------------------------------------------------------------------------------


def dispatch_layout(topk_idx, *, num_experts: int) -> dict[str, np.ndarray]:
    """Reference of ``get_dispatch_layout`` on every rank.

    Args:
        topk_idx: int ``[R, T, K]``.
        num_experts: E, a multiple of R.

    Returns:
        A dict with ``num_tokens_per_rank`` int32 ``[R, R]`` (row = source rank),
        ``num_tokens_per_expert`` int32 ``[R, E]``, ``is_token_in_rank`` bool ``[R, T, R]``
        and ``num_invalid`` int32 ``[R]``.
    """
    r = _route(topk_idx, num_experts)
    in_rank = np.zeros((r.R, r.T, r.R), dtype=bool)
    per_expert = np.zeros((r.R, r.E), dtype=np.int32)
    for s in range(r.R):
        for t in range(r.T):
            for k in range(r.K):
                if r.valid[s, t, k]:
                    in_rank[s, t, r.dest[s, t, k]] = True
                    per_expert[s, r.dest[s, t, k] * r.E_local + r.local[s, t, k]] += 1
    return {
        "num_tokens_per_rank": in_rank.sum(axis=1).astype(np.int32),
        "num_tokens_per_expert": per_expert,
        "is_token_in_rank": in_rank,
        "num_invalid": r.num_invalid.copy(),
    }


# --------------------------------------------------------------------------------------------
# dispatch / combine (normal mode)
# --------------------------------------------------------------------------------------------


def _split_x(x, R: int, T: int):
    """Returns ``(rows, scales)``: the token rows ``[R, T, H]`` and the FP8 scales or None."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError("an FP8 x must be the pair (x_fp8, scales)")
        rows, scales = np.asarray(x[0]), np.asarray(x[1])
        if rows.dtype != _FP8:
            raise ValueError(f"x_fp8 must be float8_e4m3fn, got dtype {rows.dtype}")
        if rows.ndim != 3:
            raise ValueError(f"x_fp8 must have shape [R, T, H], got shape {rows.shape}")
        _check_leading("x_fp8", rows, (R, T))
        H = rows.shape[2]
        if H % FP8_BLOCK != 0:
            raise ValueError(f"H ({H}) must be a multiple of {FP8_BLOCK} for FP8")
        if scales.dtype != np.float32:
            raise ValueError(f"scales must be float32, got dtype {scales.dtype}")
        _check_shape("scales", scales, (R, T, H // FP8_BLOCK))
        return rows, scales
    rows = np.asarray(x)
    if rows.ndim != 3:
        raise ValueError(f"x must have shape [R, T, H], got shape {rows.shape}")
    _check_leading("x", rows, (R, T))
    return rows, None


def dispatch(
    x,
    topk_idx,
    topk_weights,
    *,
    num_experts: int,
    capacity: int | None = None,
    expert_major: bool = False,
    drop_order: str | None = None,
) -> dict[str, np.ndarray]:
    """Reference of ``dispatch`` (normal mode) on every rank.

    Args:
        x: ``[R, T, H]`` of any float dtype, or the FP8 pair ``(x_fp8 [R, T, H]
            float8_e4m3fn, scales [R, T, H/128] float32)``; rows are copied bit for bit.
        topk_idx: int ``[R, T, K]``.
        topk_weights: float ``[R, T, K]`` (used as float32).
        num_experts: E, a multiple of R.
        capacity: received rows (rank-major) or entries (expert-major) per rank; None for
            the default ``R*T`` or ``R*T*min(K, E_local)``.
        expert_major: the expert-major layout instead of the rank-major one.
        drop_order: "source": an expert-major capacity keeps entries in order of source
            rank, then local expert (``dispatch``'s); None: in the layout's order.

    Returns:
        A dict with ``x`` ``[R, cap, H]`` (and ``scales`` ``[R, cap, H/128]`` for FP8),
        ``topk_idx`` int32 and ``topk_weights`` float32 (``[R, cap, K]`` rank-major,
        ``[R, cap]`` expert-major), ``num_tokens`` int32 ``[R]``, ``tokens_per_expert`` int32
        ``[R, E_local]``, ``num_dropped`` int32 ``[R]``, ``num_invalid`` int32 ``[R]``, and
        for the expert-major layout ``group_sizes`` int32 ``[R, E_local]``.
    """
    plan = _plan(topk_idx, num_experts, capacity, expert_major, drop_order)
    r, cap = plan.routing, plan.capacity
    rows, scales = _split_x(x, r.R, r.T)
    weights = np.asarray(topk_weights)
    _check_shape("topk_weights", weights, (r.R, r.T, r.K))
    weights = weights.astype(np.float32)

    H = rows.shape[2]
    out_x = np.zeros((r.R, cap, H), dtype=rows.dtype)
    out_s = None if scales is None else np.zeros((r.R, cap, scales.shape[2]), np.float32)
    slot_shape = (r.R, cap) if expert_major else (r.R, cap, r.K)
    out_idx = np.full(slot_shape, -1, dtype=np.int32)
    out_w = np.zeros(slot_shape, dtype=np.float32)

    for d in range(r.R):
        for i, slot in enumerate(plan.kept[d]):
            out_x[d, i] = rows[slot.s, slot.t]
            if out_s is not None:
                out_s[d, i] = scales[slot.s, slot.t]
            if expert_major:
                out_idx[d, i] = slot.j
                out_w[d, i] = weights[slot.s, slot.t, slot.k]
            else:
                for k, j in enumerate(r.row_local_ids(slot.s, slot.t, d)):
                    if j != -1:
                        out_idx[d, i, k] = j
                        out_w[d, i, k] = weights[slot.s, slot.t, k]

    result = {"x": out_x, "topk_idx": out_idx, "topk_weights": out_w, **_counts(plan)}
    if out_s is not None:
        result["scales"] = out_s
    if expert_major:
        result["group_sizes"] = result["tokens_per_expert"].copy()
    return result


def _check_received(name: str, a: np.ndarray, plan: _Plan) -> None:
    """Checks that ``a`` is ``[R, capacity, ...]``."""
    r = plan.routing
    if a.ndim < 2:
        raise ValueError(f"{name} must have shape [R, capacity, ...], got shape {a.shape}")
    _check_leading(name, a, (r.R, plan.capacity))


def _row_weights(weights, plan: _Plan) -> np.ndarray | None:
    """Validates the optional per-row / per-entry weights ``[R, cap]`` and makes them float32."""
    if weights is None:
        return None
    w = np.asarray(weights)
    _check_shape("weights", w, (plan.routing.R, plan.capacity))
    return w.astype(np.float32)


def _combine_plan(y: np.ndarray, plan: _Plan, weights: np.ndarray | None,
                  wire: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """The combine rule of the contract for a plan; returns ``[R, T, H]`` in ``y.dtype``.
    ``wire`` maps the float32 rows that travel (expert-major partial sums, rank-major
    weighted rows) ``[N, H]`` to what arrives (expert-major default: cast to y.dtype)."""
    r = plan.routing
    H = y.shape[2]

    # contributions[(s, t)] = [(d, float32 row)] with d increasing: the value that home token
    # t of rank s receives back from rank d, before it travels.
    contributions: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}
    for d in range(r.R):
        if plan.expert_major:
            # Per rank-major row: sum of its kept entries in sorted order.
            partial = [np.zeros(H, np.float32) for _ in plan.rows[d]]
            for e, slot in enumerate(plan.kept[d]):
                term = y[d, e].astype(np.float32)
                if weights is not None:
                    term = term * weights[d, e]
                partial[slot.row] = partial[slot.row] + term
            for (s, t), p in zip(plan.rows[d], partial, strict=True):
                contributions.setdefault((s, t), []).append((d, p))
        else:
            for i, slot in enumerate(plan.kept[d]):
                term = y[d, i].astype(np.float32)
                if weights is not None:
                    term = term * weights[d, i]
                contributions.setdefault((slot.s, slot.t), []).append((d, term))
    if wire is None and plan.expert_major:
        def wire(rows):
            return rows.astype(y.dtype).astype(np.float32)
    if wire is not None and contributions:
        keys = [(home, i) for home, terms in contributions.items() for i in range(len(terms))]
        arrived = np.asarray(wire(np.stack([contributions[h][i][1] for h, i in keys])),
                             np.float32)
        for (home, i), row in zip(keys, arrived, strict=True):
            contributions[home][i] = (contributions[home][i][0], row)

    out = np.zeros((r.R, r.T, H), dtype=y.dtype)
    for (s, t), terms in contributions.items():
        acc = np.zeros(H, np.float32)
        for _, term in sorted(terms, key=lambda dt: dt[0]):
            acc = acc + term
        out[s, t] = acc.astype(y.dtype)
    return out


def combine(
    y,
    topk_idx,
    *,
    num_experts: int,
    capacity: int | None = None,
    expert_major: bool = False,
    weights=None,
    drop_order: str | None = None,
    wire: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Reference of ``combine`` on every rank.

    Args:
        y: ``[R, cap, H]``, one row per received row (rank-major) or entry (expert-major).
        topk_idx: the original routing ``[R, T, K]`` that the dispatch used.
        num_experts: E.
        capacity: as given to ``dispatch``.
        expert_major, drop_order: as given to ``dispatch``.
        weights: optional ``[R, cap]`` float32, one weight per received row / entry.
        wire: what travelling does to the float32 rows a rank sends home, ``[N, H] -> [N, H]``
            (a wire format: quantize, then dequantize to float32); default: rank-major rows
            arrive as they are, expert-major partial sums cast to ``y.dtype``.

    Returns:
        ``[R, T, H]`` in ``y.dtype``: per home token, the float32 sum over ranks ``d = 0..R-1``
        in order of its (weighted) row (expert-major: of the per-row partial sums), from 0.0.
    """
    plan = _plan(topk_idx, num_experts, capacity, expert_major, drop_order)
    y = np.asarray(y)
    if y.ndim != 3:
        raise ValueError(f"y must have shape [R, capacity, H], got shape {y.shape}")
    _check_received("y", y, plan)
    return _combine_plan(y, plan, _row_weights(weights, plan), wire)


def dispatch_vjp(
    dx_recv,
    dw_recv,
    topk_idx,
    *,
    num_experts: int,
    capacity: int | None = None,
    expert_major: bool = False,
    drop_order: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Reference of the backward pass of ``dispatch`` (non-FP8 ``x``).

    Args:
        dx_recv: cotangent of the received ``x``, ``[R, cap, H]``.
        dw_recv: cotangent of the received ``topk_weights``, ``[R, cap, K]`` (rank-major) or
            ``[R, cap]`` (expert-major).
        topk_idx: the original routing ``[R, T, K]``.
        num_experts, capacity, expert_major, drop_order: as given to ``dispatch``.

    Returns:
        ``(dx, dtopk_weights)``: ``dx`` ``[R, T, H]`` in ``dx_recv.dtype`` is the unweighted
        combine of ``dx_recv``; ``dtopk_weights`` float32 ``[R, T, K]`` holds, per choice, the
        cotangent of the received weight slot that carried it (0 if masked, invalid or
        dropped).
    """
    plan = _plan(topk_idx, num_experts, capacity, expert_major, drop_order)
    r = plan.routing
    dx_recv = np.asarray(dx_recv)
    if dx_recv.ndim != 3:
        raise ValueError(f"dx_recv must have shape [R, capacity, H], got {dx_recv.shape}")
    _check_received("dx_recv", dx_recv, plan)
    dw_recv = np.asarray(dw_recv)
    w_shape = (r.R, plan.capacity) if expert_major else (r.R, plan.capacity, r.K)
    _check_shape("dw_recv", dw_recv, w_shape)
    dw_recv = dw_recv.astype(np.float32)

    dx = _combine_plan(dx_recv, plan, None)
    dw = np.zeros((r.R, r.T, r.K), dtype=np.float32)
    for d in range(r.R):
        for i, slot in enumerate(plan.kept[d]):
            if expert_major:
                dw[slot.s, slot.t, slot.k] = dw_recv[d, i]
            else:
                for k, j in enumerate(r.row_local_ids(slot.s, slot.t, d)):
                    if j != -1:
                        dw[slot.s, slot.t, k] = dw_recv[d, i, k]
    return dx, dw


def combine_vjp(
    dout,
    y,
    topk_idx,
    *,
    num_experts: int,
    capacity: int | None = None,
    expert_major: bool = False,
    weights=None,
    drop_order: str | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Reference of the backward pass of ``combine``.

    Args:
        dout: cotangent of the combine output, ``[R, T, H]``.
        y: the combine input ``[R, cap, H]``.
        topk_idx: the original routing ``[R, T, K]``.
        num_experts, capacity, expert_major, drop_order: as given to ``dispatch``.
        weights: the optional ``[R, cap]`` weights given to ``combine``.

    Returns:
        ``(dy, dweights)``: ``dy`` ``[R, cap, H]`` in ``dout.dtype``, where kept row / entry
        ``i`` of home token ``t`` gets ``float32(dout[t]) * w[i]`` (``dout[t]`` itself when
        there are no weights) and other rows are zero; ``dweights`` float32 ``[R, cap]`` with
        ``dot(dout[t], y[i])`` per kept row / entry (0 elsewhere), or None without weights.
        The contract leaves the summation order of the dot open: it is computed in float64
        and rounded once to float32.
    """
    plan = _plan(topk_idx, num_experts, capacity, expert_major, drop_order)
    r = plan.routing
    y = np.asarray(y)
    if y.ndim != 3:
        raise ValueError(f"y must have shape [R, capacity, H], got shape {y.shape}")
    _check_received("y", y, plan)
    H = y.shape[2]
    dout = np.asarray(dout)
    _check_shape("dout", dout, (r.R, r.T, H))
    w = _row_weights(weights, plan)

    dy = np.zeros((r.R, plan.capacity, H), dtype=dout.dtype)
    dw = None if w is None else np.zeros((r.R, plan.capacity), dtype=np.float32)
    for d in range(r.R):
        for i, slot in enumerate(plan.kept[d]):
            g = dout[slot.s, slot.t]
            if w is None:
                dy[d, i] = g
            else:
                dy[d, i] = (g.astype(np.float32) * w[d, i]).astype(dout.dtype)
                dot = np.dot(g.astype(np.float64), y[d, i].astype(np.float64))
                dw[d, i] = np.float32(dot)
    return dy, dw


# --------------------------------------------------------------------------------------------
# Low latency
# --------------------------------------------------------------------------------------------


def _low_latency_slots(r: _Routing) -> tuple[dict[tuple[int, int, int], int], np.ndarray]:
    """Slot of every (source rank, token, expert) message, and ``count [R, E_local]``.

    A token that picks an expert several times sends one message to it. For local expert
    ``j`` of rank ``d``, the messages are ordered by source rank, then source token.
    """
    chose = np.zeros((r.R, r.T, r.E), dtype=bool)
    for s in range(r.R):
        for t in range(r.T):
            for k in range(r.K):
                if r.valid[s, t, k]:
                    chose[s, t, r.dest[s, t, k] * r.E_local + r.local[s, t, k]] = True
    slot_of: dict[tuple[int, int, int], int] = {}
    count = np.zeros((r.R, r.E_local), dtype=np.int32)
    for e in range(r.E):
        d, j = divmod(e, r.E_local)
        for s in range(r.R):
            for t in range(r.T):
                if chose[s, t, e]:
                    slot_of[(s, t, e)] = int(count[d, j])
                    count[d, j] += 1
    return slot_of, count


def low_latency_dispatch(x, topk_idx, *, num_experts: int, use_fp8: bool = False) -> dict:
    """Reference of ``low_latency_dispatch`` on every rank.

    Args:
        x: bfloat16 ``[R, T, H]``, H a multiple of 128.
        topk_idx: int ``[R, T, K]``.
        num_experts: E.
        use_fp8: send the rows quantized with :func:`quantize`.

    Returns:
        A dict with ``x`` ``[R, E_local, R*T, H]`` (bfloat16, or float8_e4m3fn plus ``scales``
        float32 ``[R, E_local, R*T, H/128]``), ``count`` int32 ``[R, E_local]`` and
        ``num_invalid`` int32 ``[R]``. Rows past ``count`` are zero (scales too).
    """
    r = _route(topk_idx, num_experts)
    x = np.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"x must have shape [R, T, H], got shape {x.shape}")
    _check_leading("x", x, (r.R, r.T))
    H = x.shape[2]
    if H % FP8_BLOCK != 0:
        raise ValueError(f"H ({H}) must be a multiple of {FP8_BLOCK}")

    if use_fp8:
        rows, row_scales = quantize(x)
    else:
        rows, row_scales = x, None
    slot_of, count = _low_latency_slots(r)
    out_x = np.zeros((r.R, r.E_local, r.R * r.T, H), dtype=rows.dtype)
    out_s = None
    if row_scales is not None:
        out_s = np.zeros((r.R, r.E_local, r.R * r.T, H // FP8_BLOCK), dtype=np.float32)
    for (s, t, e), slot in slot_of.items():
        d, j = divmod(e, r.E_local)
        out_x[d, j, slot] = rows[s, t]
        if out_s is not None:
            out_s[d, j, slot] = row_scales[s, t]
    result = {"x": out_x, "count": count, "num_invalid": r.num_invalid.copy()}
    if out_s is not None:
        result["scales"] = out_s
    return result


def low_latency_combine(y, topk_idx, topk_weights, *, num_experts: int) -> np.ndarray:
    """Reference of ``low_latency_combine`` on every rank.

    Args:
        y: ``[R, E_local, R*T, H]`` (bfloat16), the expert outputs in the dispatch slots.
        topk_idx: the original routing ``[R, T, K]``.
        topk_weights: float ``[R, T, K]`` (used as float32; masked / invalid slots ignored).
        num_experts: E.

    Returns:
        bfloat16 ``[R, T, H]``: per home token, ``sum over valid k in order of
        float32(w[t, k]) * float32(y[slot])`` in float32 from 0.0 (a duplicate choice reads
        the same slot with each of its weights).
    """
    r = _route(topk_idx, num_experts)
    y = np.asarray(y)
    if y.ndim != 4:
        raise ValueError(f"y must have shape [R, E_local, R*T, H], got shape {y.shape}")
    _check_leading("y", y, (r.R, r.E_local, r.R * r.T))
    weights = np.asarray(topk_weights)
    _check_shape("topk_weights", weights, (r.R, r.T, r.K))
    weights = weights.astype(np.float32)
    H = y.shape[3]

    slot_of, _ = _low_latency_slots(r)
    out = np.zeros((r.R, r.T, H), dtype=ml_dtypes.bfloat16)
    for s in range(r.R):
        for t in range(r.T):
            acc = np.zeros(H, np.float32)
            for k in range(r.K):
                if r.valid[s, t, k]:
                    d, j = int(r.dest[s, t, k]), int(r.local[s, t, k])
                    e = d * r.E_local + j
                    acc = acc + weights[s, t, k] * y[d, j, slot_of[(s, t, e)]].astype(_F32)
            out[s, t] = acc.astype(ml_dtypes.bfloat16)
    return out


# --------------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------------


def quantize(x) -> tuple[np.ndarray, np.ndarray]:
    """Per-128-channel float8_e4m3fn quantization, as the contract's ``fp8.quantize``.

    Per block of 128 channels, in float32: ``amax = max(max |x|, 1e-4)``,
    ``scale = amax * float32(1/448)``, ``inv = float32(1 / scale)`` and
    ``x_fp8 = float8_e4m3fn(x * inv)`` (round to nearest even).

    Args:
        x: ``[..., H]`` of any float dtype, ``H % 128 == 0``.

    Returns:
        ``(x_fp8 [..., H] float8_e4m3fn, scales [..., H/128] float32)``.
    """
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] % FP8_BLOCK != 0:
        raise ValueError(
            f"the last dimension of x must be a multiple of {FP8_BLOCK}, got shape {x.shape}"
        )
    H = x.shape[-1]
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], H // FP8_BLOCK, FP8_BLOCK)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.maximum(np.max(np.abs(blocks), axis=-1), _F32(FP8_AMAX_FLOOR))
        inv_fp8_max = _F32(1.0) / _F32(FP8_MAX)  # float32(1/448), correctly rounded
        scale = (amax * inv_fp8_max).astype(np.float32)
        # NaN is the quiet NaN 0x7FC00000: a NaN block's scale, and (the byte 0x7F) every
        # NaN element, whatever the sign of the NaN the arithmetic made (an infinity times
        # its block's inverse scale 0 is a negative NaN on x86).
        scale = np.where(np.isnan(scale), _F32(np.nan), scale)
        inv_scale = (_F32(1.0) / scale).astype(np.float32)
        scaled = (blocks * inv_scale[..., None]).astype(np.float32)
    q = np.where(np.isnan(scaled), _F32(np.nan), scaled).astype(_FP8)
    return q.reshape(x.shape), scale


def dequantize(x_fp8, scales, out_dtype=np.float32) -> np.ndarray:
    """Inverse of :func:`quantize`: ``float32(x_fp8) * scale`` per block, cast to ``out_dtype``.

    Args:
        x_fp8: float8_e4m3fn ``[..., H]``.
        scales: float32 ``[..., H/128]``.
        out_dtype: result dtype (the product is computed in float32).

    Returns:
        ``[..., H]`` in ``out_dtype``.
    """
    q = np.asarray(x_fp8)
    s = np.asarray(scales)
    if q.ndim < 1 or q.shape[-1] % FP8_BLOCK != 0:
        raise ValueError(f"the last dimension of x_fp8 must be a multiple of {FP8_BLOCK}")
    H = q.shape[-1]
    _check_shape("scales", s, (*q.shape[:-1], H // FP8_BLOCK))
    blocks = q.astype(np.float32).reshape(*q.shape[:-1], H // FP8_BLOCK, FP8_BLOCK)
    out = (blocks * s.astype(np.float32)[..., None]).astype(np.float32)
    return out.reshape(q.shape).astype(out_dtype)
