"""Timeline pictures of simulated schedules: one row per rank, one box per compute op.

Boxes are colored by kind (forward, full backward, backward for inputs, backward for
weights); an overlapped ``"FB"`` is drawn as its forward and backward halves inside one black
frame. Each box shows its micro-batch, counted within its direction; the rank's second chunk
(DualPipe's reverse direction, DualPipeV's way back up) is written in white.

``python -m jax_ep.pipeline.plot DIR`` writes the four pictures of docs/pipeline.md to DIR.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from jax_ep.pipeline.schedules import Op, make_schedule
from jax_ep.pipeline.simulate import Costs, Simulation, simulate

__all__ = ["COLORS", "DOC_FIGURES", "main", "plot_timeline"]

COLORS: dict[str, str] = {
    "F": "#f5b041",  # forward
    "BW": "#5cb85c",  # full backward
    "B": "#9bd67e",  # backward for inputs
    "W": "#72b7f2",  # backward for weights
}
_LEGEND = (
    ("F", "forward"),
    ("BW", "backward"),
    ("B", "backward for inputs"),
    ("W", "backward for weights"),
)

# name -> (ranks, micro-batches) of the pictures in docs/, the sizes of DualPipe's figures.
DOC_FIGURES: dict[str, tuple[int, int]] = {
    "1f1b": (8, 20),
    "zb1p": (8, 20),
    "dualpipe": (8, 20),
    "dualpipev": (4, 10),
}


def plot_timeline(
    sim: Simulation, path: str | os.PathLike[str], *, title: str | None = None
) -> None:
    """Draws `sim`'s timeline and saves it to `path` (the format follows the suffix).

    Args:
      sim: a result of `jax_ep.pipeline.simulate.simulate`.
      path: where to write the picture, e.g. ``docs/pipeline_1f1b.png``.
      title: a line above the picture; default: schedule, ranks, micro-batches, bubble.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    schedule, costs = sim.schedule, sim.costs
    per_direction = schedule.num_micro_batches // schedule.num_directions
    width = max(sim.makespan, 1e-9)
    fig_w, fig_h = max(8.0, 0.22 * width + 1.5), 0.4 * schedule.num_ranks + 1.3
    # Fixed margins in inches: tick labels left, axis label and legend below, title above.
    left, bottom, top = 0.8 / fig_w, 0.85 / fig_h, 0.4 / fig_h
    fig = Figure(figsize=(fig_w, fig_h))
    ax = fig.add_axes((left, bottom, 1 - left - 0.1 / fig_w, 1 - bottom - top))

    def label(part: Op) -> tuple[str, str]:
        local = schedule.chunks(schedule.rank_of(part.stage, part.direction)).index(
            (part.direction, part.stage)
        )
        return str(part.micro_batch - part.direction * per_direction), (
            "white" if local else "black"
        )

    def box(part: Op, rank: int, start: float, length: float) -> None:
        ax.add_patch(
            Rectangle(
                (start, rank - 0.45),
                length,
                0.9,
                facecolor=COLORS[part.kind],
                edgecolor="#555555",
                linewidth=0.4,
            )
        )
        text, color = label(part)
        ax.text(start + length / 2, rank, text, ha="center", va="center", color=color, fontsize=7)

    for rank, intervals in enumerate(sim.timeline):
        for iv in intervals:
            length = iv.end - iv.start
            if iv.op.kind != "FB":
                box(iv.op, rank, iv.start, length)
                continue
            forward, backward = iv.op.parts()
            split = length * costs.f / (costs.f + costs.b) if costs.f + costs.b else 0.0
            box(forward, rank, iv.start, split)
            box(backward, rank, iv.start + split, length - split)
            ax.add_patch(
                Rectangle(
                    (iv.start, rank - 0.45),
                    length,
                    0.9,
                    fill=False,
                    edgecolor="black",
                    linewidth=1.2,
                )
            )

    ax.set_xlim(0, width)
    ax.set_ylim(schedule.num_ranks - 0.5, -0.5)
    ax.set_yticks(range(schedule.num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(schedule.num_ranks)], fontsize=8)
    ax.set_xlabel("time", fontsize=8, labelpad=1)
    ax.tick_params(axis="x", labelsize=7)
    kinds = {iv.op.kind for intervals in sim.timeline for iv in intervals}
    shown = kinds | ({"F", "BW"} if "FB" in kinds else set())
    handles = [
        Patch(facecolor=COLORS[k], edgecolor="#555555", label=text)
        for k, text in _LEGEND
        if k in shown
    ]
    if "FB" in kinds:
        handles.append(
            Patch(
                facecolor="white",
                edgecolor="black",
                linewidth=1.2,
                label="overlapped forward & backward",
            )
        )
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    if title is None:
        title = (
            f"{schedule.name}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
            f"{schedule.num_micro_batches} micro-batches; F={costs.f:g} B={costs.b:g} "
            f"W={costs.w:g} F&B={costs.overlapped:g}; bubble {sim.bubble:g}"
        )
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: writes ``pipeline_<name>.png`` for each schedule of `DOC_FIGURES`."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_ep.pipeline.plot", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out_dir", help="folder for the pictures (e.g. docs)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.out_dir):
        parser.error(f"{args.out_dir}: no such folder; create it first.")
    costs = Costs(f=1.0, b=2.0, w=1.0)
    for name, (ranks, micro_batches) in DOC_FIGURES.items():
        sim = simulate(make_schedule(name, ranks, micro_batches), costs)
        path = os.path.join(args.out_dir, f"pipeline_{name}.png")
        plot_timeline(sim, path)
        print(path)


if __name__ == "__main__":
    main()
