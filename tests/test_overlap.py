"""jax_ep.overlap (two-micro-batch schedules) and jax_ep.tools.profile (labelled traces)."""

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import overlap
from jax_ep.nn import MoE, RouterConfig
from jax_ep.overlap import Comm, Compute
from jax_ep.tools import profile

identity = lambda c: c  # noqa: E731


def split_block(n_comm: int) -> list:
    """Compute, split Comm, Compute, ... with n_comm communications."""
    block = [Compute("c0", identity)]
    for i in range(n_comm):
        block += [Comm(f"m{i}", identity, identity), Compute(f"c{i + 1}", identity)]
    return block


def test_overlap_order_of_a_decode_block():
    block = [Compute("attn", identity), Comm("dispatch", identity, identity),
             Compute("experts", identity), Comm("combine", identity, identity)]
    labels = [s.label for s in overlap.schedule(block)]
    assert labels == [
        "mb0/attn", "mb0/dispatch.send", "mb1/attn", "mb0/dispatch.recv",
        "mb1/dispatch.send", "mb0/experts", "mb1/dispatch.recv", "mb0/combine.send",
        "mb1/experts", "mb0/combine.recv", "mb1/combine.send", "mb1/combine.recv",
    ]
    sequential = [s.label for s in overlap.schedule(block, "sequential")]
    assert sequential == [label for label in sequential if label.startswith("mb0")] + [
        label for label in sequential if label.startswith("mb1")]
    prefill = [Compute("route", identity), Comm("dispatch", identity),
               Compute("experts", identity), Comm("combine", identity)]
    assert overlap.describe(overlap.schedule(prefill)) == (
        "mb0/route | mb0/dispatch mb1/route | mb1/dispatch mb0/experts | "
        "mb0/combine mb1/experts | mb1/combine")


def random_block(rng) -> list:
    block = []
    for i in range(rng.integers(1, 8)):
        kind = rng.integers(3)
        block.append(Compute(f"s{i}", identity) if kind == 0 else
                     Comm(f"s{i}", identity, identity if kind == 1 else None))
    return block


@pytest.mark.parametrize("seed", range(20))
def test_schedule_invariants(seed):
    rng = np.random.default_rng(seed)
    block = random_block(rng) if seed % 2 else split_block(int(rng.integers(1, 5)))
    program = overlap.schedule(block)
    chains = overlap.schedule(block, "sequential")
    for mb in (0, 1):  # each micro-batch's steps, in its own order, exactly once
        assert [s.label for s in program if s.micro_batch == mb] == [
            s.label for s in chains if s.micro_batch == mb]
    in_flight = set()
    for step in program:
        if step.part == "send" and step.stage.recv is not None:
            assert not in_flight, "two split messages in flight"
            in_flight.add(step.micro_batch)
        elif step.part == "recv":
            in_flight.discard(step.micro_batch)
    assert not in_flight
    if seed % 2 == 0:  # alternating block: every message has the other's compute under it
        for i, step in enumerate(program):
            if step.part != "send":
                continue
            other = 1 - step.micro_batch
            end = next(j for j in range(i, len(program)) if program[j].part == "recv"
                       and program[j].micro_batch == step.micro_batch)
            remaining = [s for s in program[i:] if s.micro_batch == other
                         and s.part == "compute"]
            window = [s for s in program[i:end] if s.micro_batch == other
                      and s.part == "compute"]
            assert window or not remaining, (step.label, overlap.describe(program))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="block is empty"):
        overlap.schedule([])
    with pytest.raises(TypeError, match="Compute or a Comm"):
        overlap.schedule([identity])
    with pytest.raises(ValueError, match="two stages are named 'a'"):
        overlap.schedule([Compute("a", identity), Comm("a", identity)])
    with pytest.raises(ValueError, match="order must be one of"):
        overlap.schedule([Compute("a", identity)], "interleaved")
    with pytest.raises(ValueError, match="even size along axis 0"):
        overlap.run([Compute("a", identity)], {"x": jnp.zeros((5, 2))})


def decode_case(seed: int, ranks: int = 4, tokens: int = 14, hidden: int = 128,
                experts: int = 8, top_k: int = 3):
    """Routing skewed toward expert 1, with masked (-1) choices; per-expert scales."""
    rng = np.random.default_rng(seed)
    n = ranks * tokens
    idx = np.where(rng.random((n, top_k)) < 0.5, 1, rng.integers(0, experts, (n, top_k)))
    idx[rng.random((n, top_k)) < 0.15] = -1
    if ranks > 1:
        idx[: tokens] = -1  # rank 0 sends nothing
    weights = rng.random((n, top_k)).astype(np.float32)
    x = rng.normal(size=(n, hidden)).astype(np.float32)
    scale = rng.normal(size=(experts,)).astype(np.float32)
    return x, idx.astype(np.int32), weights, scale


def decode_step(order: str, mesh, experts: int, backend: str = "xla"):
    def per_shard(x, idx, weights, scale):  # scale: this rank's experts
        def attention(c):
            return {**c, "h": jnp.tanh(c["x"]).astype(jnp.bfloat16)}

        def dispatch_send(c):
            return {**c, "pending": jax_ep.low_latency_dispatch_send(
                c["h"], c["idx"], num_experts=experts, backend=backend)}

        def dispatch_recv(c):
            received, handle = jax_ep.low_latency_dispatch_recv(c.pop("pending"))
            return {**c, "rows": received.x, "handle": handle}

        def expert_scale(c):
            rows = c.pop("rows").astype(jnp.float32) * scale[:, None, None]
            return {**c, "y": rows.astype(jnp.bfloat16)}

        def combine_send(c):
            return {**c, "pending": jax_ep.low_latency_combine_send(
                c.pop("y"), c["idx"], c["w"], c.pop("handle"), backend=backend)}

        block = [Compute("attention", attention), Comm("dispatch", dispatch_send, dispatch_recv),
                 Compute("experts", expert_scale),
                 Comm("combine", combine_send, lambda c: jax_ep.low_latency_combine_recv(
                     c["pending"]))]
        return overlap.run(block, {"x": x, "idx": idx, "w": weights}, order=order)

    return jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_overlap_equals_sequential_and_reference(seed):
    ranks, experts = 4, 8
    mesh = jax.make_mesh((ranks,), ("ep",), devices=jax.devices()[:ranks])
    x, idx, weights, scale = decode_case(seed, ranks=ranks, experts=experts)
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, idx, weights, scale)]
    got = {order: np.asarray(decode_step(order, mesh, experts)(*args), np.float32)
           for order in overlap.ORDERS}
    np.testing.assert_array_equal(got["overlap"], got["sequential"])
    # float64 reference: the bf16 token times each chosen expert's scale, weighted.
    h = np.asarray(jnp.tanh(jnp.asarray(x)).astype(jnp.bfloat16), np.float64)
    y = np.asarray((jnp.asarray(h, jnp.float32)[:, None, :] * scale[np.maximum(idx, 0)][
        :, :, None]).astype(jnp.bfloat16), np.float64)
    want = np.einsum("tk,tkh->th", np.where(idx >= 0, weights, 0.0), y)
    np.testing.assert_allclose(got["overlap"], want, rtol=1e-2, atol=1e-2)
    assert np.all(got["overlap"][: x.shape[0] // ranks] == 0)  # rank 0's tokens chose nothing


def test_decode_overlap_through_the_custom_calls():
    """One rank: the cuda backend's custom calls (CPU handlers here) in the overlapped order
    give the portable backend's result."""
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    case = decode_case(7, ranks=1, tokens=18, experts=4, top_k=2)
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in case]
    got = {b: np.asarray(decode_step("overlap", mesh, 4, backend=b)(*args), np.float32)
           for b in ("cuda", "xla")}
    assert np.abs(got["xla"]).max() > 0.1
    np.testing.assert_array_equal(got["cuda"], got["xla"])


def test_each_micro_batch_exchanges_on_its_own_low_latency_region():
    """Inside `run` each step sees its micro-batch, so low-latency dispatches there default to
    that region (buffer) and their handles carry it to the combine."""
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    seen = []

    def per_shard(x, idx):
        def send(c):
            pending = jax_ep.low_latency_dispatch_send(c["x"], c["idx"], num_experts=4)
            seen.append((overlap.micro_batch(), pending.placement.buffer))
            return {**c, "pending": pending}

        def recv(c):
            received, handle = jax_ep.low_latency_dispatch_recv(c.pop("pending"))
            seen.append((overlap.micro_batch(), handle.buffer))
            return {**c, "x": received.x[0, : c["x"].shape[0]]}

        return overlap.run([Comm("dispatch", send, recv)], {"x": x, "idx": idx})["x"]

    x, idx = (jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (
        jnp.ones((8, 128), jnp.bfloat16), jnp.zeros((8, 2), jnp.int32)))
    jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, idx)
    assert sorted(seen) == [(0, 0), (0, 0), (1, 1), (1, 1)]
    assert overlap.micro_batch() == 0  # outside run


def test_moe_layer_overlap_matches_one_batch_with_gradients():
    mesh = jax.make_mesh((2, 4), ("data", "ep"))
    config = RouterConfig(num_experts=8, top_k=2, score="sigmoid", num_groups=4, top_groups=2)
    x = jax.random.normal(jax.random.key(3), (2, 40, 16))
    mask = jax.random.uniform(jax.random.key(4), (2, 40)) > 0.2
    results = {}
    for flag in (False, True):
        layer = MoE(16, 12, config, mesh=mesh, num_shared_experts=1, backend="xla",
                    overlap=flag, rngs=nnx.Rngs(0))
        with jax.set_mesh(mesh):
            out, stats = nnx.jit(lambda m, x: m(x, mask))(layer, x)
            grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x, mask)[0])),
                                     argnums=(0, 1)))(layer, x)
        results[flag] = (out, stats, grads)
    (out0, stats0, (g_model0, g_x0)), (out1, stats1, (g_model1, g_x1)) = (
        results[False], results[True])
    np.testing.assert_allclose(out1, out0, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(stats1.load, stats0.load)
    assert int(stats1.dropped) == int(stats0.dropped) == 0
    np.testing.assert_allclose(stats1.aux_loss, stats0.aux_loss, rtol=1e-6)
    np.testing.assert_allclose(g_x1, g_x0, rtol=1e-5, atol=1e-6)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(g_model1[name][...], g_model0[name][...], rtol=1e-5,
                                   atol=1e-6, err_msg=name)


def test_op_scopes_reads_hlo_metadata():
    text = (
        "\nENTRY %main (x: f32[4]) -> f32[4] {\n"
        "  %x = f32[4]{0} parameter(0)\n"
        "  %fusion.2 = f32[4]{0} fusion(%x), kind=kLoop, calls=%f, "
        'metadata={op_name="jit(step)/mb0/attn/tanh" stack_frame_id=2}\n'
        "  ROOT %all-to-all.1 = f32[4]{0} all-to-all(%fusion.2), "
        'metadata={op_name="jit(step)/shard_map/mb1/jax_ep.dispatch/all_to_all"}\n'
        "}")
    assert profile.op_scopes(text) == {
        "fusion.2": "mb0/attn/tanh",
        "all-to-all.1": "shard_map/mb1/jax_ep.dispatch/all_to_all",
    }


def test_capture_writes_a_labelled_trace(tmp_path):
    ranks, experts = 4, 8
    mesh = jax.make_mesh((ranks,), ("ep",), devices=jax.devices()[:ranks])
    x, idx, weights, scale = decode_case(5, ranks=ranks, experts=experts)
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, idx, weights, scale)]
    trace = profile.capture(decode_step("overlap", mesh, experts), *args, log_dir=tmp_path,
                            steps=2)
    assert trace.raw_path.suffix == ".gz" and trace.labelled > 0
    events = json.loads(trace.path.read_text())["traceEvents"]
    scopes = {e["args"]["scope"] for e in events if "scope" in e.get("args", {})}
    # (attention's tanh fuses into the send's first fusion, whose scope it then takes)
    for part in ("mb0/dispatch.send", "mb1/dispatch.send", "mb0/combine.recv",
                 "mb1/combine.recv", "jax_ep.low_latency_dispatch_send"):
        assert any(part in s for s in scopes), part
    with gzip.open(trace.raw_path, "rt") as file:
        raw = json.load(file)["traceEvents"]
    assert len(raw) == len(events)  # labelled, not filtered
    with pytest.raises(ValueError, match="steps must be >= 1"):
        profile.capture(lambda a: a, jnp.zeros(2), log_dir=tmp_path, steps=0)
