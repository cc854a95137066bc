"""Event-driven simulation of a pipeline schedule: timeline, bubbles, memory, parameters.

Every rank runs its op list in order, one compute op at a time. A compute op starts when the
rank is free and its inputs are there: a forward needs the previous stage's forward of the
same micro-batch, an input backward needs the chunk's own forward and the next stage's input
backward, a ``"W"`` needs its ``"B"``. Inputs from another rank arrive through a receive,
``comm`` after the matching send (sends never block); a receive whose send has not happened
yet blocks its rank. If every unfinished rank is blocked, the schedule deadlocks and
`simulate` raises.

Quantities (docs/pipeline.md has the derivations):

- ``makespan``: when the last op ends (the step starts at 0 on every rank).
- ``busy[r]``: the sum of rank r's compute-op costs; ``idle[r] = makespan - busy[r]`` is its
  bubble.
- ``bubble``: ``max(idle)``, the bubble of the rank that waits most. This is the quantity of
  the bubble table in DualPipe's documentation (in 1F1B and ZB1P all ranks wait equally).
- ``peak_activations[r]``: the most chunk activations rank r holds at once, in units of one
  stage's activations for one micro-batch. A chunk's activation is live from the start of
  its forward until the end of its weight gradient (``"W"``, or the full backward that
  includes it); in an ``"FB"`` the forward's activation is allocated before the backward
  releases its own, so both count.
- ``parameters[r]``: the number of stage chunks whose parameters rank r holds.

Run ``python -m jax_ep.pipeline.simulate --table`` for the bubble table of docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence

from jax_ep.pipeline.schedules import COMPUTE_KINDS, Op, Schedule, make_schedule

__all__ = [
    "Costs",
    "Interval",
    "Simulation",
    "bubble_table",
    "expected_activations",
    "expected_bubble",
    "expected_parameters",
    "main",
    "min_micro_batches",
    "simulate",
    "table_ranks",
]


@dataclasses.dataclass(frozen=True)
class Costs:
    """Execution times of one chunk's ops, in any unit.

    Attributes:
      f: forward (F).
      b: full backward, input and weight gradients together (B in DualPipe's table); a
        backward for inputs only costs ``b - w``.
      w: backward for weights (W).
      fb: a forward and a full backward overlapped (F&B); None means ``f + b`` (no overlap).
      comm: time from a send to the matching receive's data being usable.
    """

    f: float = 1.0
    b: float = 2.0
    w: float = 1.0
    fb: float | None = None
    comm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "comm"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Costs: {name} must be a finite number >= 0; got {value!r}.")
        if self.w > self.b:
            raise ValueError(
                f"Costs: w must be at most b (W is the weight part of the full "
                f"backward); got w={self.w}, b={self.b}."
            )
        if self.fb is not None and not (math.isfinite(self.fb) and self.fb >= 0):
            raise ValueError(f"Costs: fb must be a finite number >= 0 or None; got {self.fb!r}.")

    @property
    def overlapped(self) -> float:
        """The cost of an ``"FB"``."""
        return self.f + self.b if self.fb is None else self.fb

    def of(self, kind: str) -> float:
        """The cost of a compute op of `kind`."""
        costs = {
            "F": self.f,
            "B": self.b - self.w,
            "W": self.w,
            "BW": self.b,
            "FB": self.overlapped,
        }
        if kind not in costs:
            raise ValueError(f"Costs.of: kind must be one of {sorted(costs)}; got {kind!r}.")
        return costs[kind]


@dataclasses.dataclass(frozen=True)
class Interval:
    """A compute op placed on the timeline."""

    op: Op
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The result of `simulate` (see the module docstring for the definitions).

    Attributes:
      schedule: the schedule simulated.
      costs: the costs used.
      timeline: ``timeline[rank]`` is that rank's compute ops with start and end times.
      makespan: when the last op ends.
      busy: per rank, the time spent computing.
      peak_activations: per rank, the most chunk activations held at once.
      parameters: per rank, the stage chunks of parameters held.
    """

    schedule: Schedule
    costs: Costs
    timeline: tuple[tuple[Interval, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    parameters: tuple[int, ...]

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank, the time not spent computing before the step ends."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble(self) -> float:
        """The bubble of the rank that waits most (the table's bubble)."""
        return max(self.idle)


# Keys of the data a rank can hold: ("F" | "B", micro_batch, stage, direction), the forward
# output of a chunk or the input gradient from its backward.
_Key = tuple[str, int, int, int]


def _needs(part: Op, num_stages: int) -> list[_Key]:
    m, s, d = part.micro_batch, part.stage, part.direction
    if part.kind == "F":
        return [("F", m, s - 1, d)] if s > 0 else []
    if part.kind in ("B", "BW"):
        own = [("F", m, s, d)]
        return own + ([("B", m, s + 1, d)] if s < num_stages - 1 else [])
    return [("B", m, s, d)]  # "W"


def _peak_activations(ops: Sequence[Op]) -> int:
    live = peak = 0
    for op in ops:
        for part in op.parts():
            if part.kind == "F":
                live += 1
                peak = max(peak, live)
            elif part.kind in ("W", "BW"):
                live -= 1
    return peak


def simulate(schedule: Schedule, costs: Costs | None = None) -> Simulation:
    """Runs `schedule` with `costs` (default `Costs()`) and measures it.

    Raises:
      ValueError: an op's input is neither computed earlier on its rank nor received there,
        a send precedes the op that produces its data, or the ranks deadlock.
    """
    costs = Costs() if costs is None else costs
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    clock = [0.0] * num_ranks
    position = [0] * num_ranks
    have: list[dict[_Key, float]] = [{} for _ in range(num_ranks)]  # data -> time usable
    sent: dict[tuple[_Key, int, int], float] = {}  # (data, from, to) -> time sent
    timeline: list[list[Interval]] = [[] for _ in range(num_ranks)]

    def run(rank: int, op: Op) -> bool:
        """Runs `op` on `rank` if it can run now; False if it waits for a send."""
        if op.kind in COMPUTE_KINDS:
            ready = clock[rank]
            for part in op.parts():
                for key in _needs(part, num_stages):
                    if key not in have[rank]:
                        raise ValueError(
                            f"{schedule.name}: rank {rank} runs {op}, which needs {key}, "
                            f"neither computed earlier on rank {rank} nor received there."
                        )
                    ready = max(ready, have[rank][key])
            end = ready + costs.of(op.kind)
            for part in op.parts():
                if part.kind in ("F", "B", "BW"):
                    have[rank][(part.kind[0], part.micro_batch, part.stage, part.direction)] = end
            timeline[rank].append(Interval(op, ready, end))
            clock[rank] = end
            return True
        assert op.peer is not None
        key = (op.kind[-1], op.micro_batch, op.stage, op.direction)
        if op.kind.startswith("SEND"):
            if key not in have[rank]:
                raise ValueError(
                    f"{schedule.name}: rank {rank} runs {op} before the op that produces its data."
                )
            sent[(key, rank, op.peer)] = have[rank][key]
            return True
        if (key, op.peer, rank) not in sent:
            return False
        have[rank][key] = sent[(key, op.peer, rank)] + costs.comm
        return True

    while True:
        progress = False
        for rank in range(num_ranks):
            ops = schedule.ops[rank]
            while position[rank] < len(ops) and run(rank, ops[position[rank]]):
                position[rank] += 1
                progress = True
        if all(position[r] == len(schedule.ops[r]) for r in range(num_ranks)):
            break
        if not progress:
            waiting = {
                r: str(schedule.ops[r][position[r]])
                for r in range(num_ranks)
                if position[r] < len(schedule.ops[r])
            }
            raise ValueError(f"{schedule.name}: the ranks deadlock; each waits at {waiting}.")

    busy = tuple(sum(costs.of(iv.op.kind) for iv in ivs) for ivs in timeline)
    return Simulation(
        schedule=schedule,
        costs=costs,
        timeline=tuple(tuple(ivs) for ivs in timeline),
        makespan=max(clock),
        busy=busy,
        peak_activations=tuple(_peak_activations(ops) for ops in schedule.ops),
        parameters=tuple(len(schedule.chunks(r)) for r in range(num_ranks)),
    )


# ---------------------------------------------------------------------------------------------
# DualPipe's table


def table_ranks(name: str, pp: int) -> int:
    """Devices that run `pp` stages: `pp` for all but DualPipeV, `pp / 2` for DualPipeV."""
    return pp // 2 if name == "dualpipev" else pp


def min_micro_batches(name: str, num_ranks: int) -> int:
    """The fewest micro-batches the schedule takes on `num_ranks` ranks."""
    return {"1f1b": 1, "zb1p": 1, "dualpipe": 2 * num_ranks, "dualpipev": 2 * num_ranks}[name]


def expected_bubble(name: str, pp: int, costs: Costs) -> float:
    """The bubble of DualPipe's table for `pp` stages (F&B is ``costs.overlapped``)."""
    f, b, w, fb = costs.f, costs.b, costs.w, costs.overlapped
    return {
        "1f1b": (pp - 1) * (f + b),
        "zb1p": (pp - 1) * (f + b - 2 * w),
        "dualpipe": (pp / 2 - 1) * (fb + b - 3 * w),
        "dualpipev": (pp / 2 - 1) * (fb + b - 3 * w),
    }[name]


def expected_activations(name: str, pp: int) -> int:
    """Peak activations per device in DualPipe's table, in stage-chunk units."""
    return pp + 1 if name in ("dualpipe", "dualpipev") else pp


def expected_parameters(name: str) -> int:
    """Parameters per device in DualPipe's table, in stage-chunk units (1x or 2x)."""
    return 2 if name in ("dualpipe", "dualpipev") else 1


def bubble_table(pps: Sequence[int], costs: Costs, micro_batches_per_stage: int = 2) -> str:
    """A markdown table: per schedule and PP, the simulated bubble, the table's formula,
    peak activations and parameters per device.

    Each run uses ``micro_batches_per_stage * PP`` micro-batches.
    """
    lines = [
        f"Costs: F={costs.f:g}, B={costs.b:g}, W={costs.w:g}, F&B={costs.overlapped:g}, "
        f"comm={costs.comm:g}; {micro_batches_per_stage} x PP micro-batches.",
        "",
        "| schedule | PP | devices | bubble (simulated) | bubble (formula) | "
        "activations / device | parameters / device |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("1f1b", "zb1p", "dualpipe", "dualpipev"):
        for pp in pps:
            ranks = table_ranks(name, pp)
            sim = simulate(make_schedule(name, ranks, micro_batches_per_stage * pp), costs)
            lines.append(
                f"| {name} | {pp} | {ranks} | {sim.bubble:g} | "
                f"{expected_bubble(name, pp, costs):g} | {max(sim.peak_activations)} | "
                f"{max(sim.parameters)}x |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: ``--table`` prints `bubble_table` for the given costs."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_ep.pipeline.simulate", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--table", action="store_true", help="print the bubble table")
    parser.add_argument(
        "--pp", type=int, nargs="+", default=[2, 4, 6, 8, 16], help="numbers of stages"
    )
    parser.add_argument("--f", type=float, default=1.0)
    parser.add_argument("--b", type=float, default=2.0)
    parser.add_argument("--w", type=float, default=1.0)
    parser.add_argument("--fb", type=float, default=None, help="F&B; default F + B")
    parser.add_argument("--comm", type=float, default=0.0)
    parser.add_argument("--micro-batches-per-stage", type=int, default=2)
    args = parser.parse_args(argv)
    if not args.table:
        parser.error("nothing to do; pass --table")
    try:
        costs = Costs(args.f, args.b, args.w, args.fb, args.comm)
        print(bubble_table(args.pp, costs, args.micro_batches_per_stage))
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
