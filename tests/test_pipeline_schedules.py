"""Pipeline schedules and their simulator (jax_ep.pipeline): op lists written out by hand for
the smallest cases, completeness and message pairing of every schedule, the simulated
timelines against the dependency rules re-derived here, hand-computed timings, the bubble,
activation and parameter columns of DualPipe's table for PP in {2, 4, 6, 8, 16} under fixed
and fresh random costs, errors for bad arguments and broken schedules, and the pictures."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jax_ep.pipeline import (
    Op,
    Schedule,
    dualpipe,
    dualpipev,
    make_schedule,
    one_f_one_b,
    validate,
    zb1p,
)
from jax_ep.pipeline.simulate import (
    Costs,
    Simulation,
    bubble_table,
    expected_activations,
    expected_bubble,
    expected_parameters,
    main,
    min_micro_batches,
    simulate,
    table_ranks,
)

NAMES = ("1f1b", "zb1p", "dualpipe", "dualpipev")
PPS = (2, 4, 6, 8, 16)


def F(m: int, s: int, d: int = 0) -> Op:
    return Op("F", m, s, d)


def BW(m: int, s: int, d: int = 0) -> Op:
    return Op("BW", m, s, d)


def FB(forward: Op, backward: Op) -> Op:
    return dataclasses.replace(forward, kind="FB", backward=backward)


def compute(schedule: Schedule, rank: int) -> list[Op]:
    return list(schedule.compute_ops(rank))


def cases() -> list[tuple[str, int, int]]:
    """(name, ranks, micro-batches): the fewest micro-batches each takes, and more."""
    out = []
    for name in NAMES:
        for ranks in (1, 2, 3, 4, 5, 8):
            if name == "dualpipe" and ranks % 2:
                continue
            low = min_micro_batches(name, ranks)
            for extra in (0, 1, 2, 7):
                m = low + extra
                if name == "dualpipe" and m % 2:
                    m += 1
                out.append((name, ranks, m))
    return sorted(set(out))


# ---------------------------------------------------------------------------------------------
# Op lists by hand


def test_1f1b_two_ranks_by_hand():
    s = one_f_one_b(2, 2)
    assert s.ops[0] == (
        F(0, 0),
        Op("SEND_F", 0, 0, peer=1),
        F(1, 0),
        Op("SEND_F", 1, 0, peer=1),
        Op("RECV_B", 0, 1, peer=1),
        BW(0, 0),
        Op("RECV_B", 1, 1, peer=1),
        BW(1, 0),
    )
    assert s.ops[1] == (
        Op("RECV_F", 0, 0, peer=0),
        F(0, 1),
        BW(0, 1),
        Op("SEND_B", 0, 1, peer=0),
        Op("RECV_F", 1, 0, peer=0),
        F(1, 1),
        BW(1, 1),
        Op("SEND_B", 1, 1, peer=0),
    )


def test_zb1p_holds_back_one_weight_per_rank_index():
    s = zb1p(3, 4)
    B, W = (lambda m, s: Op("B", m, s)), (lambda m, s: Op("W", m, s))
    assert compute(s, 0) == [
        F(0, 0),
        F(1, 0),
        F(2, 0),
        B(0, 0),
        W(0, 0),
        F(3, 0),
        B(1, 0),
        W(1, 0),
        B(2, 0),
        W(2, 0),
        B(3, 0),
        W(3, 0),
    ]
    assert compute(s, 2) == [
        F(0, 2),
        B(0, 2),
        F(1, 2),
        B(1, 2),
        F(2, 2),
        B(2, 2),
        W(0, 2),
        F(3, 2),
        B(3, 2),
        W(1, 2),
        W(2, 2),
        W(3, 2),
    ]


def test_dualpipev_one_rank_by_hand():
    # Steps 2, 4 (the middle rank's first pair apart), 6 (second half split) and 8.
    s = dualpipev(1, 2)
    assert s.ops == (
        (
            F(0, 0),
            F(0, 1),
            F(1, 0),
            BW(0, 1),
            FB(F(1, 1), BW(0, 0)),
            BW(1, 1),
            Op("B", 1, 0),
            Op("W", 1, 0),
        ),
    )
    assert s.num_stages == 2 and s.chunks(0) == ((0, 0), (0, 1))


def test_dualpipe_two_ranks_by_hand():
    s = dualpipe(2, 4)
    assert compute(s, 0) == [
        F(0, 0),
        F(2, 1, 1),
        F(1, 0),
        BW(2, 1, 1),
        FB(F(3, 1, 1), BW(0, 0)),
        BW(3, 1, 1),
        Op("B", 1, 0),
        Op("W", 1, 0),
    ]
    assert compute(s, 1) == [
        F(2, 0, 1),
        F(0, 1),
        F(3, 0, 1),
        BW(0, 1),
        FB(F(1, 1), BW(2, 0, 1)),
        BW(1, 1),
        Op("B", 3, 0, 1),
        Op("W", 3, 0, 1),
    ]
    assert s.chunks(0) == ((0, 0), (1, 1)) and s.chunks(1) == ((0, 1), (1, 0))


@pytest.mark.parametrize("ranks", [2, 4, 6, 8])
def test_dualpipe_ranks_mirror_each_other(ranks):
    """Rank r runs rank P-1-r's program with the directions swapped."""
    s = dualpipe(ranks, 3 * ranks)
    half = s.num_micro_batches // 2

    def flip(op: Op) -> Op:
        return dataclasses.replace(
            op,
            micro_batch=(op.micro_batch + half) % (2 * half),
            direction=1 - op.direction,
            backward=flip(op.backward) if op.backward else None,
        )

    for r in range(ranks):
        assert [flip(op) for op in compute(s, r)] == compute(s, ranks - 1 - r)


# ---------------------------------------------------------------------------------------------
# Every schedule: complete, consistent, runnable; timelines obey the dependencies


def check_timeline(sim: Simulation) -> None:
    """Re-derives the dependency rules from the timeline alone."""
    s, comm = sim.schedule, sim.costs.comm
    end: dict[tuple[str, int, int, int], tuple[float, int]] = {}
    for rank, intervals in enumerate(sim.timeline):
        assert [iv.op for iv in intervals] == compute(s, rank)
        for a, b in zip(intervals, intervals[1:], strict=False):
            assert a.end <= b.start + 1e-9
        for iv in intervals:
            assert iv.end - iv.start == pytest.approx(sim.costs.of(iv.op.kind))
            for part in iv.op.parts():
                kind = "I" if part.kind in ("B", "BW") else part.kind
                end[(kind, part.micro_batch, part.stage, part.direction)] = (iv.end, rank)
    for rank, intervals in enumerate(sim.timeline):
        for iv in intervals:
            for part in iv.op.parts():
                m, st, d = part.micro_batch, part.stage, part.direction
                needs = {"F": [("F", m, st - 1, d)] if st else [], "W": [("I", m, st, d)]}.get(
                    part.kind,
                    [("F", m, st, d)] + ([("I", m, st + 1, d)] if st < s.num_stages - 1 else []),
                )
                for key in needs:
                    t, where = end[key]
                    assert t + (comm if where != rank else 0) <= iv.start + 1e-9, (part, key)


@pytest.mark.parametrize(("name", "ranks", "micro_batches"), cases())
def test_schedule_is_complete_and_runs(name, ranks, micro_batches):
    s = make_schedule(name, ranks, micro_batches)
    validate(s)
    assert (s.num_ranks, s.num_micro_batches) == (ranks, micro_batches)
    assert s.num_stages == (2 * ranks if name == "dualpipev" else ranks)
    for comm in (0.0, 0.3):
        check_timeline(simulate(s, Costs(f=1.0, b=2.5, w=0.75, fb=2.8, comm=comm)))


@pytest.mark.parametrize("name", NAMES)
def test_messages_pair_in_order_of_production(name):
    """A send follows the compute op that produced its data; its receive is on the peer."""
    s = make_schedule(name, 4, 16)
    for rank, ops in enumerate(s.ops):
        last: Op | None = None
        for op in ops:
            if not op.kind.startswith(("SEND", "RECV")):
                last = op
            elif op.kind.startswith("SEND"):
                assert last is not None
                assert (op.kind[-1], op.micro_batch, op.stage, op.direction) in {
                    (p.kind[0], p.micro_batch, p.stage, p.direction) for p in last.parts()
                }
                assert (
                    Op("RECV" + op.kind[4:], op.micro_batch, op.stage, op.direction, peer=rank)
                    in s.ops[op.peer]
                )


# ---------------------------------------------------------------------------------------------
# Timings by hand


def test_1f1b_timeline_by_hand():
    sim = simulate(one_f_one_b(2, 2), Costs(f=1, b=2, w=1))
    spans = [[(iv.start, iv.end) for iv in ivs] for ivs in sim.timeline]
    assert spans[0] == [(0, 1), (1, 2), (4, 6), (7, 9)]
    assert spans[1] == [(1, 2), (2, 4), (4, 5), (5, 7)]
    assert (sim.makespan, sim.busy, sim.bubble) == (9, (6, 6), 3)


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_1f1b_one_micro_batch_pays_every_hop_twice(ranks):
    c = Costs(f=1.0, b=2.0, w=0.5, comm=0.25)
    sim = simulate(one_f_one_b(ranks, 1), c)
    assert sim.makespan == pytest.approx(ranks * (c.f + c.b) + 2 * (ranks - 1) * c.comm)


def test_overlap_shortens_dualpipe():
    slow = simulate(dualpipe(4, 8), Costs(f=1, b=2, w=1))
    fast = simulate(dualpipe(4, 8), Costs(f=1, b=2, w=1, fb=2.5))
    pairs = sum(iv.op.kind == "FB" for iv in fast.timeline[0])
    assert fast.busy[0] == pytest.approx(slow.busy[0] - 0.5 * pairs)
    assert fast.makespan < slow.makespan


# ---------------------------------------------------------------------------------------------
# DualPipe's table


# (F, B, W, F&B) with W <= F and B - W = F: the conditions under which all four formulas hold.
TABLE_COSTS = [
    Costs(f=1.0, b=2.0, w=1.0),
    Costs(f=1.0, b=2.0, w=1.0, fb=2.5),
    Costs(f=1.0, b=1.5, w=0.5, fb=2.2),
    Costs(f=2.0, b=3.0, w=1.0, fb=4.0),
    Costs(f=1.0, b=1.25, w=0.25, fb=1.25),
]


@pytest.mark.parametrize("costs", TABLE_COSTS, ids=lambda c: f"{c.f}-{c.b}-{c.w}-{c.overlapped}")
@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("name", NAMES)
def test_table_row(name, pp, costs):
    ranks = table_ranks(name, pp)
    for micro_batches in (max(min_micro_batches(name, ranks), pp), 2 * pp + 2, 3 * pp):
        sim = simulate(make_schedule(name, ranks, micro_batches), costs)
        assert sim.bubble == pytest.approx(expected_bubble(name, pp, costs), abs=1e-9)
        assert max(sim.peak_activations) == expected_activations(name, pp)
        assert set(sim.parameters) == {expected_parameters(name)}
        assert sum(sim.parameters) == {"dualpipe": 2 * pp}.get(name, pp)


def test_table_formulas_by_hand():
    c = Costs(f=1.0, b=1.5, w=0.5, fb=2.2)
    assert expected_bubble("1f1b", 8, c) == pytest.approx(7 * 2.5)
    assert expected_bubble("zb1p", 8, c) == pytest.approx(7 * 1.5)
    assert expected_bubble("dualpipe", 8, c) == pytest.approx(3 * 2.2)
    assert expected_bubble("dualpipev", 8, c) == pytest.approx(3 * 2.2)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_dual_table_rows_random_costs(name):
    """Fresh costs with F = B - W, W <= F and max(F, B) <= F&B <= F + B."""
    rng = np.random.default_rng()
    for _ in range(6):
        f = float(rng.uniform(0.5, 2.0))
        w = float(rng.uniform(0.05, 1.0)) * f
        b = f + w
        c = Costs(f=f, b=b, w=w, fb=float(rng.uniform(b, f + b)))
        for pp in PPS:
            sim = simulate(make_schedule(name, table_ranks(name, pp), 2 * pp), c)
            assert sim.bubble == pytest.approx(expected_bubble(name, pp, c), rel=1e-9, abs=1e-9), c


@pytest.mark.parametrize("name", ["1f1b", "zb1p"])
def test_single_direction_rows_random_costs(name):
    """Fresh costs with W <= F and W <= B - W (the ZB1P condition); 1F1B needs none."""
    rng = np.random.default_rng()
    for _ in range(6):
        f, b_inputs = (float(x) for x in rng.uniform(0.5, 3.0, size=2))
        w = float(rng.uniform(0.0, min(f, b_inputs)))
        c = Costs(f=f, b=b_inputs + w, w=w, fb=float(rng.uniform(0, 10)))
        for pp in PPS:
            m = int(rng.integers(pp, 3 * pp + 1))
            sim = simulate(make_schedule(name, pp, m), c)
            assert sim.bubble == pytest.approx(expected_bubble(name, pp, c), rel=1e-9, abs=1e-9)
            assert len(set(np.round(sim.idle, 9))) == 1  # every rank waits the same


def test_zb1p_formula_needs_w_at_most_f():
    # W > F: the held-back weight gradients no longer fit the gaps they are meant to fill.
    c = Costs(f=1.0, b=2.0, w=1.5)
    assert simulate(zb1p(4, 8), c).bubble > expected_bubble("zb1p", 4, c) + 1


@pytest.mark.parametrize(("ranks", "micro_batches"), [(4, 4), (4, 2), (6, 20)])
def test_peak_activations_per_rank(ranks, micro_batches):
    """1F1B: rank i holds min(P - i, M); ZB1P: min(P, M) on every rank."""
    a = simulate(one_f_one_b(ranks, micro_batches)).peak_activations
    assert a == tuple(min(ranks - i, micro_batches) for i in range(ranks))
    z = simulate(zb1p(ranks, micro_batches)).peak_activations
    assert z == (min(ranks, micro_batches),) * ranks


def test_bubble_table_command(capsys):
    main(["--table", "--pp", "2", "4", "--f", "1", "--b", "1.5", "--w", "0.5", "--fb", "2.2"])
    rows = [
        line.split("|")[1:-1]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and "schedule" not in line
    ]
    assert len(rows) == 8
    for row in rows:
        assert float(row[3]) == pytest.approx(float(row[4]))
    assert bubble_table([4], Costs()).count("\n| ") == 5


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("build", "args", "match"),
    [
        (dualpipe, (3, 12), "num_ranks must be even"),
        (dualpipe, (4, 6), "num_micro_batches must be an integer >= 8"),
        (dualpipe, (4, 9), "num_micro_batches must be even"),
        (dualpipe, (0, 8), "num_ranks must be an integer >= 2"),
        (dualpipev, (4, 7), r"num_micro_batches must be an integer >= 8.*2 \* num_ranks"),
        (dualpipev, (0, 4), "num_ranks must be an integer >= 1"),
        (one_f_one_b, (4, 0), "num_micro_batches must be an integer >= 1"),
        (zb1p, (0, 4), "num_ranks must be an integer >= 1"),
        (zb1p, (2.0, 4), "num_ranks must be an integer"),
    ],
)
def test_bad_arguments(build, args, match):
    with pytest.raises(ValueError, match=match):
        build(*args)


def test_bad_names_and_costs():
    with pytest.raises(ValueError, match="name must be one of"):
        make_schedule("gpipe", 4, 8)
    with pytest.raises(ValueError, match="w must be at most b"):
        Costs(f=1, b=1, w=2)
    with pytest.raises(ValueError, match="f must be a finite number >= 0"):
        Costs(f=-1)
    with pytest.raises(ValueError, match="peer must be given"):
        Op("SEND_F", 0, 0)
    with pytest.raises(ValueError, match="backward must be given"):
        Op("FB", 0, 0)
    with pytest.raises(ValueError, match="must be a full backward"):
        Op("FB", 0, 0, backward=Op("B", 1, 0))


def with_ops(s: Schedule, rank: int, ops: list[Op]) -> Schedule:
    return dataclasses.replace(s, ops=s.ops[:rank] + (tuple(ops),) + s.ops[rank + 1 :])


def test_broken_schedules_are_caught():
    s = zb1p(3, 4)
    ops = list(s.ops[1])
    dropped = [op for op in ops if op != Op("W", 2, 1)]
    with pytest.raises(ValueError, match="exactly one weight gradient"):
        validate(with_ops(s, 1, dropped))
    w_first = [Op("W", 0, 1)] + [op for op in ops if op != Op("W", 0, 1)]
    with pytest.raises(ValueError, match="before its B"):
        validate(with_ops(s, 1, w_first))
    no_recv = [op for op in ops if op != Op("RECV_F", 0, 0, peer=0)]
    with pytest.raises(ValueError, match="pair up"):
        validate(with_ops(s, 1, no_recv))
    with pytest.raises(ValueError, match="neither computed earlier"):
        simulate(with_ops(s, 1, no_recv))
    wrong_rank = [F(0, 2) if op == F(0, 1) else op for op in ops]
    with pytest.raises(ValueError, match="whose chunk lives on rank 2"):
        validate(with_ops(s, 1, wrong_rank))


def test_deadlock_is_reported():
    s = one_f_one_b(2, 2)
    # Rank 0 waits for a gradient before sending the forward output that produces it.
    ops = [
        Op("RECV_B", 0, 1, peer=1),
        F(0, 0),
        Op("SEND_F", 0, 0, peer=1),
        F(1, 0),
        Op("SEND_F", 1, 0, peer=1),
        BW(0, 0),
        Op("RECV_B", 1, 1, peer=1),
        BW(1, 0),
    ]
    validate(with_ops(s, 0, ops))
    with pytest.raises(ValueError, match="deadlock"):
        simulate(with_ops(s, 0, ops))


# ---------------------------------------------------------------------------------------------
# Pictures


def test_plot_writes_png(tmp_path):
    from jax_ep.pipeline.plot import plot_timeline

    path = tmp_path / "dualpipev.png"
    plot_timeline(simulate(dualpipev(2, 4), Costs(fb=2.5)), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
