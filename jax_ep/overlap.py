"""Two-micro-batch overlap: one MoE block's stages interleaved over two halves of a batch.

A block is a sequence of stages: `Compute` (attention, routing, the experts, ...) and `Comm`
(dispatch, combine), each a function of the micro-batch's carry (any pytree). `run` splits
the inputs in two and writes both micro-batches into one traced program in an order where
the communication of one micro-batch sits between compute of the other:

    A.attn  A.dispatch.send  B.attn  A.dispatch.recv  B.dispatch.send  A.experts
    B.dispatch.recv  A.combine.send  B.experts  A.combine.recv  B.combine.send  ...

XLA is free to reorder independent operations, so the order is pinned with
`jax.lax.optimization_barrier` over both carries between steps. Two kinds of communication:

- split (decode): `Comm(send=..., recv=...)`, e.g. `low_latency_dispatch_send`/`_recv`. The
  other micro-batch's compute is placed between the send and the receive; at most one
  micro-batch has a message in flight at any time. Each micro-batch's low-latency exchanges
  use their own low-latency region (`micro_batch()`), so a send never waits for the other
  micro-batch's receive.
- whole (prefill): `Comm(send=...)` with no receive, e.g. `dispatch`. The operation and the
  other micro-batch's next compute share one step with no barrier between them, so a backend
  whose collectives run asynchronously (XLA's on GPU) may execute them at the same time. The
  "cuda" backend's kernels do when the op runs on a stream of its own (`stream=COMM_STREAM`);
  give it `num_sms` below the GPU's SMs so the compute keeps SMs to run on.

Every step runs under `jax.named_scope("mb<i>/<stage>[.send|.recv]")`, which names its
operations in profiles (see `jax_ep.tools.profile`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

ORDERS = ("overlap", "sequential")

# The GPU stream for communication that runs beside compute: pass `stream=COMM_STREAM` to
# jax_ep's ops in `Comm` stages (as `jax_ep.nn.MoE(overlap=True)` does) and their kernels run
# on it, so the other micro-batch's compute need not wait for them.
COMM_STREAM = 1

_MICRO_BATCH = contextvars.ContextVar("jax_ep_micro_batch", default=0)


def micro_batch() -> int:
    """The micro-batch whose step `run` is tracing (0 outside `run`)."""
    return _MICRO_BATCH.get()


@contextlib.contextmanager
def _tracing(micro_batch: int):
    token = _MICRO_BATCH.set(micro_batch)
    try:
        yield
    finally:
        _MICRO_BATCH.reset(token)


@dataclasses.dataclass(frozen=True)
class Compute:
    """A compute stage: `fn(carry) -> carry`."""

    name: str
    fn: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Comm:
    """A communication stage: `send(carry) -> pending`, then `recv(pending) -> carry`.

    Without `recv` the stage is one operation (`send` returns the new carry) that may run
    concurrently with the other micro-batch's next compute.
    """

    name: str
    send: Callable[[Any], Any]
    recv: Callable[[Any], Any] | None = None


Stage = Compute | Comm


@dataclasses.dataclass(frozen=True)
class Step:
    """One operation of the program: `micro_batch` runs `stage`'s `part`."""

    micro_batch: int
    stage: Stage
    part: Literal["compute", "send", "recv"]

    @property
    def label(self) -> str:
        split = self.part != "compute" and self.stage.recv is not None
        suffix = f".{self.part}" if split else ""
        return f"mb{self.micro_batch}/{self.stage.name}{suffix}"

    @property
    def fn(self) -> Callable[[Any], Any]:
        if self.part == "compute":
            return self.stage.fn
        return self.stage.send if self.part == "send" else self.stage.recv

    @property
    def joins_next(self) -> bool:
        """A whole communication shares its step with the next operation (no barrier)."""
        return self.part == "send" and self.stage.recv is None


def _steps_of(block: Sequence[Stage], micro_batch: int) -> list[Step]:
    steps = []
    for stage in block:
        if isinstance(stage, Compute):
            steps.append(Step(micro_batch, stage, "compute"))
        else:
            steps.append(Step(micro_batch, stage, "send"))
            if stage.recv is not None:
                steps.append(Step(micro_batch, stage, "recv"))
    return steps


def _check_block(block: Sequence[Stage]) -> None:
    if not block:
        raise ValueError("jax_ep.overlap: block is empty; give a sequence of Compute and "
                         "Comm stages.")
    names = set()
    for stage in block:
        if not isinstance(stage, (Compute, Comm)):
            raise TypeError(f"jax_ep.overlap: every stage of block must be a Compute or a "
                            f"Comm; got {type(stage).__name__}.")
        if stage.name in names:
            raise ValueError(f"jax_ep.overlap: two stages are named {stage.name!r}; stage "
                             f"names label the profile and must be unique.")
        names.add(stage.name)


def schedule(block: Sequence[Stage], order: Literal["overlap", "sequential"] = "overlap"
             ) -> list[Step]:
    """The program order of both micro-batches' steps.

    "sequential": all of micro-batch 0, then all of micro-batch 1 (the reference).
    "overlap": turns alternate between the micro-batches; in its turn a micro-batch runs its
    steps up to and including its next send, and just before that send the other
    micro-batch's pending receive completes, so one message is in flight at a time and
    each one has the other micro-batch's compute under it.
    """
    _check_block(block)
    if order not in ORDERS:
        raise ValueError(f"jax_ep.overlap: order must be one of {ORDERS}; got {order!r}.")
    chains = [_steps_of(block, 0), _steps_of(block, 1)]
    if order == "sequential":
        return chains[0] + chains[1]
    program: list[Step] = []
    position = [0, 0]
    pending: list[Step | None] = [None, None]  # the receive each micro-batch still owes

    def take(mb: int) -> None:
        step = chains[mb][position[mb]]
        position[mb] += 1
        program.append(step)
        pending[mb] = None if step.part == "recv" else pending[mb]
        if step.part == "send" and step.stage.recv is not None:
            pending[mb] = step

    mb = 0
    while position[0] < len(chains[0]) or position[1] < len(chains[1]):
        other = 1 - mb
        while position[mb] < len(chains[mb]):
            step = chains[mb][position[mb]]
            if step.part == "send" and pending[other] is not None:
                take(other)  # the other's receive is next in its chain: it only waits
            take(mb)
            if step.part == "send":
                break
        mb = other
    return program


def describe(program: Sequence[Step]) -> str:
    """The program as text: step labels, with " | " where a barrier separates steps."""
    text = ""
    for i, step in enumerate(program):
        text += step.label
        if i + 1 < len(program):
            text += " " if step.joins_next else " | "
    return text


def apply(block: Sequence[Stage], inputs: Any) -> Any:
    """Runs `block` on `inputs` as one batch, stage after stage (no micro-batches)."""
    _check_block(block)
    carry = inputs
    for stage in block:
        with jax.named_scope(stage.name):
            if isinstance(stage, Compute):
                carry = stage.fn(carry)
            else:
                carry = stage.send(carry)
                carry = carry if stage.recv is None else stage.recv(carry)
    return carry


def _split(inputs: Any, axis: int) -> tuple[Any, Any]:
    leaves, treedef = jax.tree.flatten(inputs)
    halves = []
    for a in map(jnp.asarray, leaves):
        if a.ndim <= axis or a.shape[axis] % 2:
            raise ValueError(
                f"jax_ep.overlap: every input must have an even size along axis {axis} to "
                f"split into two micro-batches; got shape {a.shape}. Pad the batch."
            )
        halves.append(jnp.split(a, 2, axis=axis))
    return (treedef.unflatten([h[0] for h in halves]),
            treedef.unflatten([h[1] for h in halves]))


def run(
    block: Sequence[Stage],
    inputs: Any,
    *,
    order: Literal["overlap", "sequential"] = "overlap",
    axis: int = 0,
    merge: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """Runs `block` on two micro-batches (halves of `inputs` along `axis`) in `order`.

    Args:
      block: the stages, applied in sequence to each micro-batch's carry; the first stage
        receives that micro-batch's half of `inputs`.
      inputs: a pytree of arrays, each with an even size along `axis`.
      order: "overlap" (see `schedule`) or "sequential" (the same steps, micro-batch 0 then
        1: the non-overlapped reference, equal bit for bit when the stages are deterministic).
      axis: the batch axis of `inputs`.
      merge: combines the two final carries; default: concatenate every leaf along `axis`.

    Returns:
      `merge(carry_0, carry_1)`.
    """
    program = schedule(block, order)
    carries = list(_split(inputs, axis))
    for i, step in enumerate(program):
        with jax.named_scope(step.label), _tracing(step.micro_batch):
            carries[step.micro_batch] = step.fn(carries[step.micro_batch])
        if not step.joins_next and i + 1 < len(program):
            carries = list(jax.lax.optimization_barrier(tuple(carries)))
    if merge is None:
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=axis), *carries)
    return merge(*carries)
