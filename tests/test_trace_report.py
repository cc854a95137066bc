"""jax_ep.tools.trace_report on synthetic traces with hand-computed answers, and on real ones.

Covers: interval algebra against a brute-force grid; PyTorch-style traces (busy time per
stream, overlap, SMs, phases through correlation ids, flow events and the autograd-thread
fallback, windows by name and by offset); pattern overrides; gzip and directory input;
JAX-style GPU traces (stream threads, kernel_details grids, tf_op scopes, --gpu); XLA:CPU
host traces (container ops, run ids); a real jax.profiler capture; the CLI with PNG and
JSON output; error messages; and invariants on DeepSeek's train.json when it is present.
"""

import gzip
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep.tools import profile, trace_report
from jax_ep.tools.trace_report import Classifier

TRAIN_JSON = Path(__file__).resolve().parents[2] / "shared/data/profile-data/train.json"
T0 = 1_000_000.0  # the traces' clock starts anywhere; offsets below are from here


def kernel(name, stream, start, dur, corr=None, grid=(1, 1, 1), cat="kernel", device=0):
    args = {"device": device, "stream": stream, "grid": list(grid)}
    if corr is not None:
        args["correlation"] = corr
    return {"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream,
            "ts": T0 + start, "dur": dur, "args": args}


def annotation(name, start, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 100, "tid": tid,
            "ts": T0 + start, "dur": dur}


def launch(corr, start, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100,
            "tid": tid, "ts": T0 + start, "dur": 3, "args": {"correlation": corr}}


def torch_trace():
    """Streams 7 and 23 compute, 27 communication; times in us after T0:

    stream 7:  attn_gemm [0, 100)   mlp_gemm [150, 300)   memcpy [510, 530)
    stream 23: wgrad     [250, 400)
    stream 27: DeepEP dispatch [50, 200) (20 blocks)   NCCL all-reduce [350, 500) (8 blocks)

    Launches on the CPU (thread 1 unless said): attn_gemm at -45 inside attn [-50, -20);
    dispatch at -15 inside dispatch [-20, 0); mlp_gemm at 5 inside mlp [0, 30), linked by a
    flow event only; wgrad at 10 from thread 2, which has no annotation (falls back to mlp,
    open on thread 1); all-reduce at 40, where only step [-100, 1000) is open; the memcpy has
    no launch record.
    """
    flow_id = 777
    events = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python3"}},
        {"ph": "M", "name": "process_labels", "pid": 0, "args": {"labels": "GPU 0"}},
        annotation("step", -100, 1100), annotation("attn", -50, 30),
        annotation("dispatch", -20, 20), annotation("mlp", 0, 30),
        kernel("void attn_gemm<128>(float*)", 7, 0, 100, corr=1, grid=(64, 2, 1)),
        kernel("void dpsk::ep::internode::dispatch<false, 8>(int4*, float*)", 27, 50, 150,
               corr=2, grid=(20, 1, 1)),
        kernel("mlp_gemm", 7, 150, 150, grid=(132, 1, 1)),
        kernel("void wgrad(float*)", 23, 250, 150, corr=4, grid=(112, 1, 1)),
        kernel("ncclDevKernel_AllReduce_Sum_f32(ncclDevKernelArgsStorage<4096ul>)", 27, 350,
               150, corr=5, grid=(4, 2, 1)),
        kernel("Memcpy DtoD (Device -> Device)", 7, 510, 20, cat="gpu_memcpy"),
        launch(1, -45), launch(2, -15), launch(4, 10, tid=2), launch(5, 40),
        {"ph": "s", "id": flow_id, "pid": 100, "tid": 1, "ts": T0 + 5, "cat": "ac2g"},
        {"ph": "f", "id": flow_id, "pid": 0, "tid": 7, "ts": T0 + 150, "cat": "ac2g",
         "bp": "e"},
    ]
    return {"traceEvents": events, "deviceProperties": [{"id": 0, "name": "Test GPU",
                                                          "numSms": 132}]}


def run(trace, window_from=None, window_to=None, **options):
    device_trace = trace_report.extract(trace, **options)
    window = trace_report.resolve_window(device_trace, trace, window_from, window_to)
    return device_trace, trace_report.analyze(device_trace, window)


# ------------------------------------------------------------------------ interval algebra


@pytest.mark.parametrize("seed", range(5))
def test_interval_algebra_matches_a_grid(seed):
    rng = np.random.default_rng(seed)

    def random_intervals():
        starts = rng.integers(0, 200, size=rng.integers(0, 12))
        return [(float(s), float(s + rng.integers(0, 40))) for s in starts]

    a, b = random_intervals(), random_intervals()

    def mask(intervals):
        grid = np.zeros(260, bool)
        for s, e in intervals:
            grid[int(s):int(e)] = True
        return grid

    assert trace_report.length(a) == mask(a).sum()
    assert trace_report.length(trace_report.intersect(a, b)) == (mask(a) & mask(b)).sum()
    assert trace_report.length(trace_report.clip(a, 50, 120)) == mask(a)[50:120].sum()
    merged = trace_report.union(a)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(merged, merged[1:], strict=False))


# ------------------------------------------------------------------- PyTorch-style traces


def test_busy_overlap_and_sms_by_hand():
    _, report = run(torch_trace())
    assert report.window.start == T0 and report.window.duration == 530
    streams = {s.stream: s for s in report.streams}
    assert [s.stream for s in report.streams] == ["stream 7", "stream 23", "stream 27"]
    assert (streams["stream 7"].busy_us, streams["stream 7"].compute_us,
            streams["stream 7"].other_us) == (270, 250, 20)
    assert streams["stream 23"].busy_us == 150
    assert streams["stream 27"].comm_us == 300
    # comm [50,200) + [350,500); compute [0,100) + [150,400): overlap 50 + 50 + 50.
    assert report.comm_us == 300 and report.compute_us == 350
    assert report.comm_overlapped_us == 150 and report.comm_overlapped == 0.5
    assert streams["stream 27"].comm_overlapped == 0.5
    assert streams["stream 7"].comm_overlapped is None
    assert report.busy_us == 520  # idle only in [500, 510)
    kernels = {c.family: c for c in report.comm_kernels}
    assert kernels["DeepEP"].name == "dpsk::ep::internode::dispatch"
    assert (kernels["DeepEP"].blocks_max, kernels["DeepEP"].sms_max) == (20, 20)
    assert (kernels["NCCL"].blocks_max, kernels["NCCL"].sms_max) == (8, 8)
    assert report.comm_sms_max == 20
    families = {f.family: f for f in report.families}
    assert families["DeepEP"].sms_mean == 20 and families["NCCL"].busy_us == 150


def test_sm_count_caps_blocks_and_concurrent_comm_adds_up():
    trace = torch_trace()
    # A second DeepEP kernel on another stream, overlapping the first one for [100, 200).
    trace["traceEvents"].append(kernel("void deep_ep::intranode::combine(int*)", 29, 100, 100,
                                       grid=(24, 1, 1)))
    _, report = run(trace, num_sms=16)
    assert report.num_sms == 16
    deep_ep = {c.name: c for c in report.comm_kernels}
    assert deep_ep["dpsk::ep::internode::dispatch"].sms_max == 16
    assert deep_ep["deep_ep::intranode::combine"].sms_max == 16
    assert report.comm_sms_max == 32
    family = {f.family: f for f in report.families}["DeepEP"]
    # busy [50, 200) = 150 us; SM-time 150*16 + 100*16.
    assert family.sms_max == 32 and family.sms_mean == pytest.approx(250 * 16 / 150)


def test_phases_from_launches_flows_and_other_threads():
    device_trace, report = run(torch_trace())
    phase = {k.name.split("(")[0]: k.phase for k in device_trace.kernels}
    assert phase == {
        "void attn_gemm<128>": "attn",
        "void dpsk::ep::internode::dispatch<false, 8>": "dispatch",
        "mlp_gemm": "mlp",  # through the flow event
        "void wgrad": "mlp",  # launched from thread 2: the process's open annotation
        "ncclDevKernel_AllReduce_Sum_f32": "step",
        "Memcpy DtoD ": None,
    }
    stats = {p.phase: p for p in report.phases}
    assert stats["mlp"].kernels == 2 and stats["mlp"].compute_us == 250
    assert stats["mlp"].span_us == 250 and stats["mlp"].occurrences == 1
    assert stats["dispatch"].comm_us == 150 and stats["step"].comm_us == 150
    # dispatch [50,200) has compute in [50,100) and [150,200); step [350,500) in [350,400).
    assert stats["dispatch"].comm_overlapped == pytest.approx(100 / 150)
    assert stats["step"].comm_overlapped == pytest.approx(50 / 150)
    assert stats["mlp"].comm_overlapped is None
    assert stats["(no phase)"].other_us == 20 and stats["(no phase)"].occurrences == 0
    assert sum(p.kernels for p in report.phases) == report.kernels == 6
    only = trace_report.extract(torch_trace(), phase_pattern="^(attn|mlp)$")
    assert {k.phase for k in only.kernels} == {"attn", "mlp", None}


def test_gpu_annotations_come_before_launch_annotations():
    trace = torch_trace()
    trace["traceEvents"].append({"ph": "X", "cat": "gpu_user_annotation", "name": "experts",
                                 "pid": 0, "tid": 7, "ts": T0 + 140, "dur": 170})
    device_trace, report = run(trace)
    phase = {k.start - T0: k.phase for k in device_trace.kernels}
    # mlp_gemm (150) on the annotated stream, wgrad (250) on another stream of the GPU.
    assert phase == {0: "attn", 50: "dispatch", 150: "experts", 250: "experts", 350: "step",
                     510: None}
    assert "GPU annotations" in report.phase_source


def test_windows_by_phase_name_and_offset():
    _, report = run(torch_trace(), "dispatch", "mlp")
    assert (report.window.start, report.window.end) == (T0 + 50, T0 + 400)
    # comm [50,200) + [350,400); compute [50,100) + [150,400).
    assert (report.comm_us, report.compute_us, report.comm_overlapped) == (200, 300, 0.75)
    _, report = run(torch_trace(), "100", 300.0)
    assert report.window.duration == 200
    assert (report.comm_us, report.compute_us, report.comm_overlapped) == (100, 150, 0.5)
    with pytest.raises(ValueError, match="window_from: no phase or event named 'nope'"):
        run(torch_trace(), "nope")
    with pytest.raises(ValueError, match="window is empty"):
        run(torch_trace(), "300", "100")


def test_pattern_overrides():
    classifier = Classifier(comm=("Memcpy",), compute=("ncclDev",))
    _, report = run(torch_trace(), classifier=classifier)
    assert {c.family for c in report.comm_kernels} == {"DeepEP", "custom"}
    # comm [50,200) + memcpy [510,530); compute adds the all-reduce [350,500).
    assert report.comm_us == 170 and report.compute_us == 100 + 350
    assert report.comm_overlapped_us == 100
    _, report = run(torch_trace(), classifier=Classifier(builtin=False))
    assert report.comm_us == 0 and report.comm_overlapped is None
    with pytest.raises(ValueError, match="comm pattern '\\(' is not a valid"):
        Classifier(comm=("(",))


@pytest.mark.parametrize(("name", "family"), [
    ("void deep_ep::intranode::dispatch<8, 768>(int4*)", "DeepEP"),
    ("void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*)", "DeepEP"),
    ("void jax_ep::cuda::per_thread_kernel<jax_ep::Dispatch>(int)", "jax_ep"),
    ("jax_ep_ll_dispatch_send", "jax_ep"),
    ("nvshmemi_barrier_all_kernel", "NVSHMEM"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "NCCL"),
    ("all-to-all.3", "XLA collective"),
    ("ragged-all-to-all", "XLA collective"),
    ("all-gather-start.1", "XLA collective"),
    ("collective-permute-done", "XLA collective"),
    ("reduce-scatter.7", "XLA collective"),
    ("step/combine/psum (all-reduce.2)", "XLA collective"),
    ("Memcpy PtoP (Device -> Device)", "peer copy"),
    ("fusion.12", None),
    ("small_all_reduce_gemm", None),
])
def test_builtin_families(name, family):
    kind, found = Classifier().classify(name)
    assert (kind, found) == (("comm", family) if family else ("compute", None))


def test_gzip_and_directory_input(tmp_path):
    trace = torch_trace()
    older = tmp_path / "run" / "old.trace.json"
    older.parent.mkdir()
    older.write_text(json.dumps({"traceEvents": trace["traceEvents"][:4]}))
    os.utime(older, (1, 1))
    newer = tmp_path / "run" / "host.trace.json.gz"
    with gzip.open(newer, "wt") as f:
        json.dump(trace, f)
    loaded, path = trace_report.load_trace(tmp_path)
    assert path == newer and loaded == trace
    assert trace_report.load_trace(newer)[0] == trace


# --------------------------------------------------------------------------- JAX traces


def jax_gpu_trace():
    """Two GPUs; on GPU 0 a compute stream and a collective stream, plus a derived row."""
    def k(pid, tid, name, start, dur, scope, grid="8,1,1"):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": T0 + start, "dur": dur,
                "args": {"correlation_id": str(start), "hlo_op": name.split(" ")[0],
                         "kernel_details": f"regs:32 static_shared:0 dynamic_shared:0 "
                                           f"grid:{grid} block:128,1,1 occ_pct:50",
                         "tf_op": scope}}
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "pid": 2, "tid": 10, "name": "thread_name",
         "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 11, "name": "thread_name",
         "args": {"name": "Stream #20(Collective)"}},
        {"ph": "M", "pid": 2, "tid": 99, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    return {"traceEvents": meta + [
        k(2, 10, "loop_fusion", 0, 40, "jit(step)/mb0/attn/dot_general"),
        k(2, 10, "gemm_fusion", 40, 60, "jit(step)/mb1/attn/dot_general", grid="16,2,1"),
        k(2, 11, "ncclDevKernel_AllToAll", 20, 50, "jit(step)/mb0/dispatch/all_to_all",
          grid="24,1,1"),
        k(2, 11, "jax_ep::cuda::per_thread_kernel<jax_ep::Combine>", 110, 30,
          "jit(step)/mb0/combine/jax_ep.combine/custom_call", grid="200,1,1"),
        # The derived "XLA Ops" row repeats work already on the streams: not a kernel.
        {"ph": "X", "pid": 2, "tid": 99, "name": "all-to-all.1", "ts": T0 + 20, "dur": 50,
         "args": {"hlo_op": "all-to-all.1"}},
        k(3, 10, "loop_fusion", 5, 10, "jit(step)/mb0/attn/dot_general"),
        {}, {"ph": "X", "pid": 1, "tid": 5, "name": "PjitFunction(step)", "ts": T0 - 10,
             "dur": 5},
    ]}


def test_jax_gpu_trace():
    device_trace, report = run(jax_gpu_trace())
    assert device_trace.events == "gpu" and device_trace.devices == (0, 1)
    assert "GPU 0" in report.device and "--gpu" in report.device
    assert [s.stream for s in report.streams] == ["Stream #13(Compute)",
                                                 "Stream #20(Collective)"]
    assert report.kernels == 4 and report.window.duration == 140
    # comm [20,70) + [110,140) = 80; compute [0,100): 50 us under compute.
    assert (report.comm_us, report.compute_us, report.comm_overlapped_us) == (80, 100, 50)
    assert {c.family: c.blocks_max for c in report.comm_kernels} == {"NCCL": 24, "jax_ep": 200}
    assert report.num_sms is None  # no deviceProperties: SMs = blocks
    assert {c.family: c.sms_max for c in report.comm_kernels} == {"NCCL": 24, "jax_ep": 200}
    assert [(p.phase, p.kernels) for p in report.phases] == [
        ("mb0/attn", 1), ("mb0/dispatch", 1), ("mb1/attn", 1), ("mb0/combine/jax_ep.combine", 1)]
    _, capped = run(jax_gpu_trace(), num_sms=132, phase_depth=2)
    assert {c.family: c.sms_max for c in capped.comm_kernels} == {"NCCL": 24, "jax_ep": 132}
    assert "mb0/combine" in {p.phase for p in capped.phases}
    other, second = run(jax_gpu_trace(), device=1)
    assert other.device == 1 and second.kernels == 1 and second.comm_us == 0
    with pytest.raises(ValueError, match="device 5 has no kernels.*\\[0, 1\\]"):
        trace_report.extract(jax_gpu_trace(), device=5)


def test_host_xla_trace_drops_container_ops():
    def op(tid, name, start, dur, scope, run_id, device="0"):
        return {"ph": "X", "pid": 7, "tid": tid, "name": f"{scope} ({name})", "ts": T0 + start,
                "dur": dur, "args": {"hlo_op": name, "device_ordinal": device,
                                     "run_id": run_id, "scope": scope}}
    trace = {"traceEvents": [
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "tid": 1, "name": "thread_name",
         "args": {"name": "tf_XLAPjRtCpuClient/123"}},
        op(1, "while.3", 0, 100, "shard_map/mb0/experts/while", "1"),  # encloses the next two
        op(1, "dot.1", 10, 30, "shard_map/mb0/experts/while/body/dot_general", "1"),
        op(1, "add.2", 50, 20, "shard_map/mb0/experts/while/body/add", "1"),
        op(2, "all-to-all.1", 30, 40, "shard_map/mb1/dispatch/all_to_all", "1"),
        op(1, "dot.1", 200, 30, "shard_map/mb0/experts/while/body/dot_general", "2"),
        op(3, "dot.1", 0, 500, "shard_map/mb0/experts/dot_general", "1", device="1"),
    ]}
    device_trace, report = run(trace)
    assert device_trace.events == "host-xla" and device_trace.devices == (0, 1)
    assert [k.name.split(" (")[1] for k in device_trace.kernels] == [
        "dot.1)", "all-to-all.1)", "add.2)", "dot.1)"]
    assert report.streams[0].stream == "tf_XLAPjRtCpuClient 1"
    # comm [30,70); compute [10,40) + [50,70) + [200,230): 30 us under compute.
    assert (report.comm_us, report.compute_us, report.comm_overlapped_us) == (40, 80, 30)
    phases = {p.phase: p for p in trace_report.analyze(
        trace_report.extract(trace, phase_depth=2), report.window).phases}
    assert phases["mb0/experts"].occurrences == 2  # one per run id
    assert phases["mb0/experts"].span_us == 60 + 30
    with pytest.raises(ValueError, match="no GPU kernels"):
        trace_report.extract(trace, events="gpu")
    # In a host trace's words: operations on threads, not kernels on streams.
    text = trace_report.format_report(report)
    assert "## Threads (busy = time with at least one operation running" in text
    assert "| thread | operations |" in text and "first operation start" in text
    assert not re.search(r"\b(kernels?|streams?)\b", text, re.IGNORECASE), text


def test_real_jax_profiler_capture(tmp_path):
    mesh = jax.make_mesh((8,), ("ep",))

    def body(x):
        with jax.named_scope("dispatch"):
            y = jax.lax.all_to_all(x, "ep", 0, 0, tiled=True)
        with jax.named_scope("experts"):
            return jnp.tanh(y @ y.T)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    x = jax.device_put(jnp.ones((8 * 64, 64)), NamedSharding(mesh, P("ep")))
    captured = profile.capture(step, x, log_dir=tmp_path, steps=2)
    trace, path = trace_report.load_trace(tmp_path)
    assert path == captured.path
    device_trace = trace_report.extract(trace)
    assert device_trace.events == "host-xla" and device_trace.devices == tuple(range(8))
    report = trace_report.analyze(device_trace,
                                  trace_report.resolve_window(device_trace, trace))
    assert "XLA collective" in {c.family for c in report.comm_kernels}
    assert {"dispatch", "experts"} <= {p.phase for p in report.phases}
    assert all(k.kind == "comm" for k in device_trace.kernels if k.phase == "dispatch"
               and "all-to-all" in k.name)


# ----------------------------------------------------------------------------------- CLI


def test_cli_writes_report_png_and_json(tmp_path, capsys):
    source = tmp_path / "trace.json"
    source.write_text(json.dumps(torch_trace()))
    png, out = tmp_path / "timeline.png", tmp_path / "report.json"
    status = trace_report.main([str(source), "--png", str(png), "--json", str(out),
                                "--comm", "Memcpy", "--sms", "10"])
    assert status == 0
    text = capsys.readouterr().out
    assert "GPU 0 (Test GPU, 10 SMs)" in text and "| dpsk::ep::internode::dispatch |" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert data["comm_us"] == 320 and data["comm_sms_max"] == 10
    assert data["window"]["end"] - data["window"]["start"] == 530


def test_cli_errors(tmp_path, capsys):
    assert trace_report.main([str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "python -m jax_ep.tools.trace_report: error:" in err and "does not exist" in err
    no_kernels = tmp_path / "cpu_only.json"
    no_kernels.write_text(json.dumps({"traceEvents": [annotation("step", 0, 10),
                                                      launch(1, 2)]}))
    assert trace_report.main([str(no_kernels)]) == 2
    assert "no GPU kernels and no XLA operations" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no \\*.json or \\*.json.gz trace below"):
        trace_report.load_trace(empty)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a \\(gzipped\\) JSON trace"):
        trace_report.load_trace(tmp_path / "bad.json")


# --------------------------------------------------------------------- DeepSeek's trace


@pytest.mark.skipif(not TRAIN_JSON.exists(), reason="profile-data/train.json not present")
def test_deepseek_train_trace_invariants():
    trace, _ = trace_report.load_trace(TRAIN_JSON)
    device_trace, report = run(trace)
    raw = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy",
                                                              "gpu_memset")]
    assert report.kernels == len(raw) and report.num_sms == 132
    # An independent answer: 1-us grids (the trace's times are whole microseconds).
    start = min(e["ts"] for e in raw)
    end = max(e["ts"] + e["dur"] for e in raw)
    comm, compute = np.zeros(end - start, bool), np.zeros(end - start, bool)
    for e in raw:
        if e["cat"] == "kernel":
            grid = comm if "dpsk::ep::" in e["name"] else compute
            grid[e["ts"] - start:e["ts"] + e["dur"] - start] = True
    assert report.comm_us == comm.sum() and report.compute_us == compute.sum()
    assert report.comm_overlapped == pytest.approx((comm & compute).sum() / comm.sum())
    assert {c.family for c in report.comm_kernels} == {"DeepEP"}
    for c in report.comm_kernels:
        grids = {int(np.prod(e["args"]["grid"])) for e in raw if c.name in e["name"]}
        assert (c.blocks_min, c.blocks_max) == (min(grids), max(grids))
        assert c.sms_max == min(max(grids), 132)
    annotations = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {p.phase for p in report.phases} <= annotations
    assert sum(p.kernels for p in report.phases) == report.kernels
    assert all(p.occurrences == 4 for p in report.phases if p.phase.endswith(("(F)", "(B)",
                                                                            "(W)")))


def test_malformed_events_are_skipped_and_counted(tmp_path, capsys):
    """Each bad event is left out and counted by its field; the report comes out of the good
    ones (a negative duration no longer stretches the window), with no traceback."""
    good = [kernel("gemm", 7, 0, 100), kernel("ncclKernel_AllToAll", 27, 50, 100)]
    bad = [
        {k: v for k, v in kernel("no_ts", 7, 0, 5).items() if k != "ts"},
        {**kernel("list_args", 7, 0, 5), "args": [1, 2]},
        {**kernel("nan_ts", 7, 0, 5), "ts": float("nan")},
        {**kernel("string_ts", 7, 0, 5), "ts": "12"},
        {**kernel("nan_dur", 7, 0, 5), "dur": float("nan")},
        kernel("negative_dur", 7, 900, -50),
        {**kernel("string_grid", 7, 0, 5), "args": {"device": 0, "grid": "1x1x1"}},
        {**kernel("string_device", 7, 0, 5), "args": {"device": "0", "grid": [1, 1, 1]}},
        "not an event",
    ]
    path = tmp_path / "bad_events.json"
    path.write_text(json.dumps({"traceEvents": good + bad}))  # NaN is written as NaN
    out_json = tmp_path / "report.json"
    assert trace_report.main([str(path), "--png", str(tmp_path / "t.png"),
                              "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert f"skipped {len(bad)} malformed events" in out
    for why in ("'ts' missing or not a finite number", "'args' is not an object",
                "'dur' not a finite number >= 0", "'args.grid'", "'args.device'",
                "not a JSON object"):
        assert why in out, why
    record = json.loads(out_json.read_text())
    assert sum(record["skipped_events"].values()) == len(bad)
    assert record["window"]["end"] - record["window"]["start"] == 150  # good kernels only


def test_unreadable_traces_name_the_file(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"traceEvents": [{"name": "\xe9"}]}')
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(b"\x1f\x8b\x08\x00 not really gzip")
    for path in (deep, latin, broken):
        assert trace_report.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and "Traceback" not in err, err


def test_cli_refuses_a_window_that_is_not_a_number_and_unwritable_outputs(tmp_path, capsys):
    """A bound of NaN or infinity is an error (it printed a "nan ms" window), and so is an
    output in a folder that does not exist (it was an uncaught FileNotFoundError)."""
    source = tmp_path / "trace.json"
    source.write_text(json.dumps(torch_trace()))
    for flags in (["--window-from=-1e9", "--window-to=nan"], ["--window-from=inf"]):
        assert trace_report.main([str(source), *flags]) == 2
        err = capsys.readouterr().err
        assert "error:" in err and "is not a finite number of microseconds" in err
    for flag in ("--png", "--json"):
        missing = tmp_path / "missing" / "out.x"
        assert trace_report.main([str(source), flag, str(missing)]) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} {missing}: the folder" in err and "does not exist" in err
    assert trace_report.main([str(source), "--window-from=-1e9"]) == 0  # before the first kernel


def test_timeline_labels_fit_inside_their_phases(tmp_path):
    """Every phase label drawn lies inside its box and inside the axis, so none overlaps a
    neighbour or the window's edge; boxes too narrow get none. Adjacent phases of every
    width, one kernel each, the window starting inside the first."""
    rng = np.random.default_rng()
    events, start = [], 0.0
    for i in range(40):
        width = float(rng.choice([60.0, 400.0, 1200.0, 1400.0, 1700.0, 4000.0]))
        events += [annotation(f"phase_{i % 7}({'FBW'[i % 3]})", start, width),
                   launch(i + 1, start + 1), kernel("gemm", 7, start + 2, width - 4, corr=i + 1)]
        start += width
    trace = {"traceEvents": events}
    device_trace = trace_report.extract(trace)
    window = trace_report.resolve_window(device_trace, trace, start="30")
    report = trace_report.analyze(device_trace, window)
    assert len(report.occurrences) > 30
    fig = trace_report.plot_timeline(device_trace, report, tmp_path / "t.png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    band = fig.axes[0]
    boxes = []  # each phase's box in display coordinates: (x0, x1, y0, y1)
    for collection in band.collections:
        for path in collection.get_paths():
            xy = band.transData.transform(path.vertices)
            boxes.append((xy[:, 0].min(), xy[:, 0].max(), xy[:, 1].min(), xy[:, 1].max()))
    labels = [t for t in band.texts if t.get_text()]
    assert labels, "no label drawn at all"
    axis = band.get_window_extent(renderer)
    for text in labels:
        e = text.get_window_extent(renderer)
        assert axis.x0 - 0.5 <= e.x0 and e.x1 <= axis.x1 + 0.5, (text.get_text(), e, axis)
        inside = [b for b in boxes if b[0] - 0.5 <= e.x0 and e.x1 <= b[1] + 0.5
                  and b[2] <= (e.y0 + e.y1) / 2 <= b[3]]
        assert inside, f"label {text.get_text()!r} at {e} sticks out of its phase"
