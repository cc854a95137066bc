"""Pipeline-parallel schedules: 1F1B, ZB1P, DualPipe and DualPipeV as per-rank op lists.

A schedule says, for every pipeline rank, the order in which that rank runs its work. Each
entry is an `Op`:

- ``"F"``: the forward of one model chunk (a *stage*) on one micro-batch;
- ``"B"``: the backward for inputs only (the input gradient that the previous stage waits
  for); the weight gradient of the same chunk follows later as a ``"W"``;
- ``"W"``: the backward for weights of an earlier ``"B"``;
- ``"BW"``: the full backward (input and weight gradients in one op);
- ``"FB"``: a forward and a full backward of two different chunks run overlapped (DualPipe's
  "F&B"); the fields describe the forward half and ``backward`` holds the ``"BW"`` half;
- ``"SEND_F"``/``"RECV_F"``: the forward output (activation) of ``(micro_batch, stage)`` to the
  rank of the next stage / from the rank of the previous stage;
- ``"SEND_B"``/``"RECV_B"``: the input gradient produced by the backward of
  ``(micro_batch, stage)`` to the rank of the previous stage / from the rank of the next stage.

A message is named after the computation that produced it, so a ``SEND_F`` and its
``RECV_F`` carry the same ``(micro_batch, stage, direction)``. Sends come right after the op
that produces the data, receives right before the first op that needs it; hand-offs between
two chunks on the same rank (DualPipeV's turn) need no message.

Stages are numbered along a micro-batch's path, ``0 .. num_stages - 1``. DualPipe runs two
pipelines over the same ranks: direction 0 puts stage ``s`` on rank ``s``, direction 1 on rank
``num_ranks - 1 - s``; micro-batches ``0 .. M/2 - 1`` enter at rank 0 (direction 0), the others
at the last rank (direction 1). Every other schedule has one direction.

Dependencies, which `jax_ep.pipeline.simulate` enforces: F of stage s needs F of stage s - 1
(same micro-batch); the input backward (``"B"``, ``"BW"``) of stage s needs the F of stage s
and the input backward of stage s + 1; ``"W"`` needs its ``"B"``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Callable
from typing import Literal

__all__ = [
    "COMPUTE_KINDS",
    "MESSAGE_KINDS",
    "SCHEDULES",
    "Op",
    "OpKind",
    "Schedule",
    "dualpipe",
    "dualpipev",
    "make_schedule",
    "one_f_one_b",
    "validate",
    "zb1p",
]

OpKind = Literal["F", "B", "W", "BW", "FB", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
COMPUTE_KINDS: frozenset[str] = frozenset({"F", "B", "W", "BW", "FB"})
MESSAGE_KINDS: frozenset[str] = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})


@dataclasses.dataclass(frozen=True)
class Op:
    """One entry of a rank's op list (see the module docstring for the kinds).

    Attributes:
      kind: what the rank does.
      micro_batch: the micro-batch (for ``"FB"``: of the forward half).
      stage: the stage along the micro-batch's path (for messages: of the producing op).
      direction: 0, or 1 for DualPipe's reverse pipeline.
      peer: the rank at the other end of a ``SEND_*``/``RECV_*``; None otherwise.
      backward: for ``"FB"``, the ``"BW"`` overlapped with this forward; None otherwise.
    """

    kind: OpKind
    micro_batch: int
    stage: int
    direction: int = 0
    peer: int | None = None
    backward: Op | None = None

    def __post_init__(self) -> None:
        if (self.kind == "FB") != (self.backward is not None):
            raise ValueError(
                f"Op: backward must be given for kind 'FB' and only then; got "
                f"kind {self.kind!r} with backward={self.backward!r}."
            )
        if self.backward is not None and self.backward.kind != "BW":
            raise ValueError(
                f"Op: the backward of an 'FB' must be a full backward (kind 'BW'); got "
                f"{self.backward.kind!r}."
            )
        if (self.kind in MESSAGE_KINDS) != (self.peer is not None):
            raise ValueError(
                f"Op: peer must be given for sends and receives and only then; "
                f"got kind {self.kind!r} with peer={self.peer!r}."
            )

    def parts(self) -> tuple[Op, ...]:
        """The single-chunk computations: ``(F, BW)`` for ``"FB"``, ``(self,)`` otherwise."""
        if self.backward is not None:
            return (dataclasses.replace(self, kind="F", backward=None), self.backward)
        return (self,)

    def __str__(self) -> str:
        if self.backward is not None:
            return f"FB[{self.parts()[0]} + {self.backward}]"
        extra = (", direction=1" if self.direction else "") + (
            f", peer={self.peer}" if self.peer is not None else ""
        )
        return f"{self.kind}(micro_batch={self.micro_batch}, stage={self.stage}{extra})"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Every rank's ordered op list plus where each stage lives.

    Attributes:
      name: "1f1b", "zb1p", "dualpipe" or "dualpipev".
      num_ranks: pipeline ranks (devices).
      num_micro_batches: micro-batches in the step, over both directions.
      num_stages: stages along one micro-batch's path.
      placement: ``placement[direction][stage]`` is the rank that holds that chunk.
      ops: ``ops[rank]`` is that rank's op list, in execution order.
    """

    name: str
    num_ranks: int
    num_micro_batches: int
    num_stages: int
    placement: tuple[tuple[int, ...], ...]
    ops: tuple[tuple[Op, ...], ...]

    @property
    def num_directions(self) -> int:
        return len(self.placement)

    def rank_of(self, stage: int, direction: int = 0) -> int:
        """The rank that holds `stage` of `direction`."""
        return self.placement[direction][stage]

    def direction_of(self, micro_batch: int) -> int:
        """The pipeline a micro-batch runs through (the first half of them enter direction 0)."""
        return micro_batch * self.num_directions // self.num_micro_batches

    def chunks(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The ``(direction, stage)`` chunks whose parameters `rank` holds, in a fixed order.

        The position of a chunk in this tuple is its local index on the rank.
        """
        return tuple(
            (d, s)
            for d, stages in enumerate(self.placement)
            for s, r in enumerate(stages)
            if r == rank
        )

    def compute_ops(self, rank: int) -> tuple[Op, ...]:
        """`rank`'s op list without the messages."""
        return tuple(op for op in self.ops[rank] if op.kind in COMPUTE_KINDS)


def _check_count(name: str, arg: str, value: int, minimum: int, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: {arg} must be an integer >= {minimum}; got {value!r}. {fix}")


# ---------------------------------------------------------------------------------------------
# Building blocks


class _Emitter:
    """Appends compute ops for one rank, counting micro-batches per local chunk ("phase").

    Each phase runs its micro-batches in order, forwards and backwards separately; split
    backwards queue their weight gradients, which ``weight()`` pops oldest first.
    """

    def __init__(
        self, chunk_of: Callable[[int], tuple[int, int]], micro_batch_of: Callable[[int, int], int]
    ) -> None:
        self._chunk_of = chunk_of  # phase -> (direction, stage)
        self._micro_batch_of = micro_batch_of  # (phase, k) -> micro-batch
        self._forwards: Counter[int] = Counter()
        self._backwards: Counter[int] = Counter()
        self._weights: deque[Op] = deque()
        self.ops: list[Op] = []

    def _next(self, kind: OpKind, phase: int, counter: Counter[int]) -> Op:
        direction, stage = self._chunk_of(phase)
        micro_batch = self._micro_batch_of(phase, counter[phase])
        counter[phase] += 1
        return Op(kind, micro_batch, stage, direction)

    def forward(self, phase: int) -> None:
        self.ops.append(self._next("F", phase, self._forwards))

    def backward(self, phase: int, *, split: bool) -> None:
        op = self._next("B" if split else "BW", phase, self._backwards)
        if split:
            self._weights.append(dataclasses.replace(op, kind="W"))
        self.ops.append(op)

    def weight(self) -> None:
        self.ops.append(self._weights.popleft())

    def overlapped(self, forward_phase: int, backward_phase: int) -> None:
        f = self._next("F", forward_phase, self._forwards)
        b = self._next("BW", backward_phase, self._backwards)
        self.ops.append(dataclasses.replace(f, kind="FB", backward=b))


def _with_messages(
    compute: list[list[Op]], placement: tuple[tuple[int, ...], ...], num_stages: int
) -> tuple[tuple[Op, ...], ...]:
    """Adds a receive before each op whose input lives on another rank, a send after each
    op whose output is needed on another rank."""
    ranks = []
    for rank, ops in enumerate(compute):
        out: list[Op] = []
        for op in ops:
            sends = []
            for part in op.parts():
                where = placement[part.direction]
                s = part.stage
                if part.kind == "F":
                    if s > 0 and where[s - 1] != rank:
                        out.append(
                            Op("RECV_F", part.micro_batch, s - 1, part.direction, where[s - 1])
                        )
                    if s < num_stages - 1 and where[s + 1] != rank:
                        sends.append(
                            Op("SEND_F", part.micro_batch, s, part.direction, where[s + 1])
                        )
                elif part.kind in ("B", "BW"):
                    if s < num_stages - 1 and where[s + 1] != rank:
                        out.append(
                            Op("RECV_B", part.micro_batch, s + 1, part.direction, where[s + 1])
                        )
                    if s > 0 and where[s - 1] != rank:
                        sends.append(
                            Op("SEND_B", part.micro_batch, s, part.direction, where[s - 1])
                        )
            out.append(op)
            out.extend(sends)
        ranks.append(tuple(out))
    return tuple(ranks)


# ---------------------------------------------------------------------------------------------
# Single-direction schedules


def one_f_one_b(num_ranks: int, num_micro_batches: int) -> Schedule:
    """1F1B: rank i runs ``num_ranks - 1 - i`` warm-up forwards, then alternates one forward
    and one full backward, then drains the remaining backwards.

    Args:
      num_ranks: pipeline ranks = stages (>= 1).
      num_micro_batches: micro-batches (>= 1).
    """
    _check_count("one_f_one_b", "num_ranks", num_ranks, 1, "Use one rank per stage.")
    _check_count(
        "one_f_one_b",
        "num_micro_batches",
        num_micro_batches,
        1,
        "A step needs at least one micro-batch.",
    )
    compute = []
    for rank in range(num_ranks):
        e = _Emitter(lambda _p, r=rank: (0, r), lambda _p, k: k)
        warm_up = min(num_ranks - 1 - rank, num_micro_batches)
        for _ in range(warm_up):
            e.forward(0)
        for _ in range(num_micro_batches - warm_up):
            e.forward(0)
            e.backward(0, split=False)
        for _ in range(warm_up):
            e.backward(0, split=False)
        compute.append(e.ops)
    return _single_direction("1f1b", num_ranks, num_micro_batches, compute)


def zb1p(num_ranks: int, num_micro_batches: int) -> Schedule:
    """ZB1P (the zero-bubble schedule "ZB-H1"): 1F1B with every backward split into ``"B"``
    and ``"W"``, where rank i holds back its first i weight gradients.

    Rank i runs ``num_ranks - 1 - i`` warm-up forwards, then i rounds of (F, B), then rounds
    of (F, B, W) while forwards remain, then (B, W) rounds, then the i held-back W. Every
    rank keeps at most ``num_ranks`` micro-batches' activations, as 1F1B does, while the
    deferred W fill the cool-down bubble.

    Args:
      num_ranks: pipeline ranks = stages (>= 1).
      num_micro_batches: micro-batches (>= 1).
    """
    _check_count("zb1p", "num_ranks", num_ranks, 1, "Use one rank per stage.")
    _check_count(
        "zb1p", "num_micro_batches", num_micro_batches, 1, "A step needs at least one micro-batch."
    )
    compute = []
    for rank in range(num_ranks):
        e = _Emitter(lambda _p, r=rank: (0, r), lambda _p, k: k)
        warm_up = min(num_ranks - 1 - rank, num_micro_batches)
        held_back = min(rank, num_micro_batches - warm_up)
        for _ in range(warm_up):
            e.forward(0)
        for _ in range(held_back):
            e.forward(0)
            e.backward(0, split=True)
        for _ in range(num_micro_batches - warm_up - held_back):
            e.forward(0)
            e.backward(0, split=True)
            e.weight()
        for _ in range(warm_up):
            e.backward(0, split=True)
            e.weight()
        for _ in range(held_back):
            e.weight()
        compute.append(e.ops)
    return _single_direction("zb1p", num_ranks, num_micro_batches, compute)


def _single_direction(
    name: str, num_ranks: int, num_micro_batches: int, compute: list[list[Op]]
) -> Schedule:
    placement = (tuple(range(num_ranks)),)
    return Schedule(
        name,
        num_ranks,
        num_micro_batches,
        num_ranks,
        placement,
        _with_messages(compute, placement, num_ranks),
    )


# ---------------------------------------------------------------------------------------------
# DualPipe and DualPipeV


def _dual_rank_ops(e: _Emitter, half: int, h: int, per_pipeline: int) -> list[Op]:
    """The eight steps of DualPipe on one rank, in terms of its two local chunks.

    Phase 0 is the chunk whose micro-batches arrive from the rank's near end (its position
    ``h`` counted from that end), phase 1 the chunk fed from the far end. `half` is the
    number of ranks in one half of the pipeline, `per_pipeline` the micro-batches each
    phase runs.
    """
    rest = half - h - 1  # ranks between this one and the middle
    # 1. Warm-up forwards of the near chunk.
    for _ in range(2 * rest):
        e.forward(0)
    # 2. Forwards of both chunks, interleaved.
    for _ in range(h + 1):
        e.forward(0)
        e.forward(1)
    # 3. Backward for inputs (weights right after, while the next input is in flight), forward.
    for _ in range(rest):
        e.backward(1, split=True)
        e.weight()
        e.forward(1)
    # 4. Steady state: overlapped forward and backward pairs. The middle ranks run their
    #    first pair apart so that the forward's output leaves before the backward starts.
    for i in range(per_pipeline - 2 * half + h + 1):
        if i == 0 and h == half - 1:
            e.forward(0)
            e.backward(1, split=False)
        else:
            e.overlapped(0, 1)
        e.overlapped(1, 0)
    # 5. The near chunk's forwards are done: backward, then pair.
    for _ in range(rest):
        e.backward(1, split=False)
        e.overlapped(1, 0)
    # 6. Backwards of both chunks; the second half of them leave their weights for later.
    for i in range(2 * (h + 1)):
        e.backward(1 - i % 2, split=i >= h + 1)
    # 7. Held-back weight gradients between the remaining backwards.
    for _ in range(rest):
        e.weight()
        e.backward(0, split=True)
    # 8. The last weight gradients.
    for _ in range(h + 1):
        e.weight()
    return e.ops


def dualpipe(num_ranks: int, num_micro_batches: int) -> Schedule:
    """DualPipe: two pipelines in opposite directions over the same ranks.

    Rank i holds stage i of direction 0 and stage ``num_ranks - 1 - i`` of direction 1 (two
    copies of every stage's parameters in the system); half of the micro-batches enter at
    each end. After a warm-up, each rank overlaps the forward of one direction with the
    backward of the other.

    Args:
      num_ranks: pipeline ranks = stages per direction, even (>= 2).
      num_micro_batches: micro-batches over both directions, even and >= 2 * num_ranks
        (each direction runs at least num_ranks).
    """
    _check_count("dualpipe", "num_ranks", num_ranks, 2, "DualPipe needs two ranks or more.")
    if num_ranks % 2:
        raise ValueError(
            f"dualpipe: num_ranks must be even (the two directions meet in the middle); got "
            f"{num_ranks}. Use {num_ranks + 1} ranks, or dualpipev for {num_ranks} ranks "
            f"({2 * num_ranks} stages)."
        )
    _check_count(
        "dualpipe",
        "num_micro_batches",
        num_micro_batches,
        2 * num_ranks,
        f"Each direction needs at least num_ranks = {num_ranks} micro-batches.",
    )
    if num_micro_batches % 2:
        raise ValueError(
            f"dualpipe: num_micro_batches must be even (half enter at each end); got "
            f"{num_micro_batches}. Use {num_micro_batches + 1}."
        )
    half, per_direction = num_ranks // 2, num_micro_batches // 2
    compute = []
    for rank in range(num_ranks):
        second_half = rank >= half
        h = min(rank, num_ranks - 1 - rank)

        def chunk_of(
            phase: int, rank: int = rank, second_half: bool = second_half
        ) -> tuple[int, int]:
            direction = phase ^ second_half
            return direction, rank if direction == 0 else num_ranks - 1 - rank

        def micro_batch_of(phase: int, k: int, second_half: bool = second_half) -> int:
            return (phase ^ second_half) * per_direction + k

        compute.append(_dual_rank_ops(_Emitter(chunk_of, micro_batch_of), half, h, per_direction))
    placement = (tuple(range(num_ranks)), tuple(reversed(range(num_ranks))))
    return Schedule(
        "dualpipe",
        num_ranks,
        num_micro_batches,
        num_ranks,
        placement,
        _with_messages(compute, placement, num_ranks),
    )


def dualpipev(num_ranks: int, num_micro_batches: int) -> Schedule:
    """DualPipeV ("cut-in-half"): DualPipe folded onto half the devices.

    ``2 * num_ranks`` stages in one direction, laid out as a V: rank i holds stage i and stage
    ``2 * num_ranks - 1 - i``, so a micro-batch runs down the ranks, turns on the last rank
    (no message) and comes back up; the loss is on rank 0.

    Args:
      num_ranks: pipeline ranks (devices), >= 1; the schedule has 2 * num_ranks stages.
      num_micro_batches: micro-batches, >= 2 * num_ranks (the number of stages).
    """
    _check_count("dualpipev", "num_ranks", num_ranks, 1, "DualPipeV needs one rank or more.")
    _check_count(
        "dualpipev",
        "num_micro_batches",
        num_micro_batches,
        2 * num_ranks,
        f"DualPipeV needs at least as many micro-batches as stages "
        f"(2 * num_ranks = {2 * num_ranks}).",
    )
    num_stages = 2 * num_ranks
    compute = []
    for rank in range(num_ranks):

        def chunk_of(phase: int, rank: int = rank) -> tuple[int, int]:
            return 0, rank if phase == 0 else num_stages - 1 - rank

        compute.append(
            _dual_rank_ops(_Emitter(chunk_of, lambda _p, k: k), num_ranks, rank, num_micro_batches)
        )
    placement = (tuple(list(range(num_ranks)) + list(reversed(range(num_ranks)))),)
    return Schedule(
        "dualpipev",
        num_ranks,
        num_micro_batches,
        num_stages,
        placement,
        _with_messages(compute, placement, num_stages),
    )


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "1f1b": one_f_one_b,
    "zb1p": zb1p,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}


def make_schedule(name: str, num_ranks: int, num_micro_batches: int) -> Schedule:
    """The schedule called `name` (a key of `SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ValueError(f"make_schedule: name must be one of {sorted(SCHEDULES)}; got {name!r}.")
    return SCHEDULES[name](num_ranks, num_micro_batches)


# ---------------------------------------------------------------------------------------------
# Static checks


def validate(schedule: Schedule) -> None:
    """Raises ValueError unless `schedule` is complete and consistent.

    Checks: every compute op runs on the rank that holds its chunk and in its micro-batch's
    direction; every (micro-batch, stage) of a micro-batch's path has exactly one forward,
    one input backward (``"B"`` or a full backward) and one weight gradient (``"W"`` or a full
    backward); each ``"W"`` comes after its ``"B"`` on the same rank; sends and receives pair
    up one to one between the right ranks. Whether the order can run without deadlock is
    checked by `jax_ep.pipeline.simulate.simulate`.
    """
    forwards: Counter[tuple[int, int, int]] = Counter()
    inputs: Counter[tuple[int, int, int]] = Counter()
    weights: Counter[tuple[int, int, int]] = Counter()
    sends: Counter[tuple[str, int, int, int, int, int]] = Counter()
    recvs: Counter[tuple[str, int, int, int, int, int]] = Counter()
    name = schedule.name
    for rank, ops in enumerate(schedule.ops):
        split_done: set[tuple[int, int, int]] = set()
        for op in ops:
            if op.kind in MESSAGE_KINDS:
                assert op.peer is not None
                payload = op.kind[-1]
                if op.kind.startswith("SEND"):
                    sends[(payload, op.micro_batch, op.stage, op.direction, rank, op.peer)] += 1
                else:
                    recvs[(payload, op.micro_batch, op.stage, op.direction, op.peer, rank)] += 1
                continue
            for part in op.parts():
                key = (part.micro_batch, part.stage, part.direction)
                if not 0 <= part.micro_batch < schedule.num_micro_batches:
                    raise ValueError(
                        f"{name}: rank {rank} runs {part} for a micro-batch "
                        f"outside 0..{schedule.num_micro_batches - 1}."
                    )
                if schedule.direction_of(part.micro_batch) != part.direction:
                    raise ValueError(f"{name}: rank {rank} runs {part} in the wrong direction.")
                if schedule.rank_of(part.stage, part.direction) != rank:
                    raise ValueError(
                        f"{name}: rank {rank} runs {part}, whose chunk lives on "
                        f"rank {schedule.rank_of(part.stage, part.direction)}."
                    )
                if part.kind == "F":
                    forwards[key] += 1
                if part.kind in ("B", "BW"):
                    inputs[key] += 1
                if part.kind in ("W", "BW"):
                    weights[key] += 1
                if part.kind == "B":
                    split_done.add(key)
                if part.kind == "W" and key not in split_done:
                    raise ValueError(f"{name}: rank {rank} runs {part} before its B.")
    expected = Counter(
        (m, s, schedule.direction_of(m))
        for m in range(schedule.num_micro_batches)
        for s in range(schedule.num_stages)
    )
    for what, got in (
        ("forward", forwards),
        ("input backward", inputs),
        ("weight gradient", weights),
    ):
        if got != expected:
            wrong = sorted((expected - got) + (got - expected))[:4]
            raise ValueError(
                f"{name}: each (micro-batch, stage, direction) needs exactly one "
                f"{what}; these do not: {wrong}."
            )
    if sends != recvs:
        wrong = sorted((sends - recvs) + (recvs - sends))[:4]
        raise ValueError(f"{name}: sends and receives do not pair up: {wrong}.")
