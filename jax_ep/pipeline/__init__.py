"""Pipeline-parallel schedules (1F1B, ZB1P, DualPipe, DualPipeV) and their simulator.

`jax_ep.pipeline.schedules` builds, per pipeline rank, the ordered op list of a training
step (re-exported here); `jax_ep.pipeline.simulate` runs a schedule with given op costs and
measures its bubble, memory and parameters; `jax_ep.pipeline.plot` draws its timeline;
`jax_ep.pipeline.execute` runs it on a "pp" mesh axis (re-exported here). See
docs/pipeline.md.
"""

from jax_ep.pipeline.execute import (
    default_overlapped,
    pipeline_step,
    place_stages,
    stage_grads,
    tick_table,
)
from jax_ep.pipeline.schedules import (
    SCHEDULES,
    Op,
    OpKind,
    Schedule,
    dualpipe,
    dualpipev,
    make_schedule,
    one_f_one_b,
    validate,
    zb1p,
)

__all__ = [
    "SCHEDULES",
    "Op",
    "OpKind",
    "Schedule",
    "dualpipe",
    "default_overlapped",
    "dualpipev",
    "make_schedule",
    "one_f_one_b",
    "pipeline_step",
    "place_stages",
    "stage_grads",
    "tick_table",
    "validate",
    "zb1p",
]
