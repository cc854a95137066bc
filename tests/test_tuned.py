"""The tuned table (jax_ep.tuned): the defaults the runtime takes for a GPU model where the
caller sets none, their precedence (argument, then $JAX_EP_CHANNELS, then the table, then the
built-in defaults), and malformed entries refused by name. A fake GPU name stands for a
measured one; on CPU devices the table never applies unless the test names the GPU."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _ffi, runtime, tuned

FAKE = "Fake GPU 9000"
ENTRY = {"measured": "a test's entry",
         "channels": {"channels": 2, "chunk_tokens": 1, "ring_chunks": 2, "warps": 1},
         "num_sms": {"dispatch": 3, "combine": 5}}


@pytest.fixture
def table(monkeypatch):
    """The table with the fake GPU's entry, the fake GPU the one in use, no $JAX_EP_CHANNELS."""
    monkeypatch.setattr(tuned, "TABLE", {FAKE: dict(ENTRY)})
    monkeypatch.setattr(runtime, "device_kind", lambda: FAKE)
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    return tuned.TABLE


def test_the_table_gives_a_listed_gpu_its_settings(table):
    found = runtime.defaults_for(FAKE)
    assert found.channels == runtime.Channels(2, 1, 2, 1)
    assert found.num_sms == {"dispatch": 3, "combine": 5}
    assert found.channels_from == found.num_sms_from == f"tuned table ({FAKE})"
    assert runtime.defaults() == found
    assert f"{FAKE}: rings 2,1,2,1 [tuned table ({FAKE})]" in found.describe()
    # The ops' num_sms left as it was becomes the table's, per op; one the caller gives stays.
    assert runtime.default_num_sms("jax_ep.dispatch", jax_ep.DEFAULT_NUM_SMS) == 3
    assert runtime.default_num_sms("jax_ep.combine", jax_ep.DEFAULT_NUM_SMS) == 5
    assert runtime.default_num_sms("jax_ep.dispatch", 20) == 20
    assert runtime.default_num_sms("jax_ep.combine", None) is None
    # A phased entry: no rings.
    table[FAKE] = {**ENTRY, "channels": None}
    assert runtime.defaults_for(FAKE).channels is None


def test_an_unlisted_gpu_and_cpu_devices_get_the_built_in_defaults(table):
    for kind in ("NVIDIA Unlisted", None):
        found = runtime.defaults_for(kind)
        assert found.channels == runtime.Channels() and found.num_sms == {
            "dispatch": 20, "combine": 20}
        assert found.channels_from.startswith("built-in")
    assert "NVIDIA Unlisted is not in jax_ep.tuned.TABLE" in \
        runtime.defaults_for("NVIDIA Unlisted").num_sms_from
    assert runtime.defaults_for(None).channels_from == "built-in (CPU devices)"


def test_without_a_gpu_named_this_machine_takes_the_built_in_defaults(monkeypatch):
    """The real lookup on CPU devices: no GPU model, so the table never applies here."""
    monkeypatch.setattr(tuned, "TABLE", {"cpu": dict(ENTRY)})
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    if not runtime.is_initialized():
        assert runtime.device_kind() is None
        assert runtime.defaults().channels == runtime.Channels()
    assert runtime.default_num_sms("jax_ep.dispatch", jax_ep.DEFAULT_NUM_SMS) == 20


def test_the_variable_and_an_explicit_argument_win_over_the_table(table, monkeypatch):
    unset = runtime.BufferConfig()
    assert unset.channels is runtime.BUILT_IN_CHANNELS
    assert runtime._rings_of(unset, FAKE) == (runtime.Channels(2, 1, 2, 1),
                                              f"tuned table ({FAKE})")
    # Channels() given by the caller is theirs, equal to the built-in rings or not.
    for given in (runtime.Channels(), runtime.Channels(4, 2, 2), None):
        config = runtime.BufferConfig(channels=given)
        assert runtime._rings_of(config, FAKE) == (given, "BufferConfig.channels")
    monkeypatch.setenv("JAX_EP_CHANNELS", "3,2,2")
    for config in (unset, runtime.BufferConfig(channels=runtime.Channels(4, 2, 2))):
        assert runtime._rings_of(config, FAKE) == (runtime.Channels(3, 2, 2),
                                                   "$JAX_EP_CHANNELS")
    found = runtime.defaults_for(FAKE)
    assert (found.channels, found.channels_from) == (runtime.Channels(3, 2, 2),
                                                     "$JAX_EP_CHANNELS")
    assert found.num_sms_from == f"tuned table ({FAKE})"  # the variable names rings only
    monkeypatch.setenv("JAX_EP_CHANNELS", "off")
    assert runtime.defaults_for(FAKE).channels is None


@pytest.mark.parametrize("entry, field", [
    ({**ENTRY, "channels": {**ENTRY["channels"], "channels": 0}}, r"\['channels'\]: "
     r"Channels.channels must be an int"),
    ({**ENTRY, "channels": {"channels": 2, "chunk_tokens": 1}}, r"\['channels'\] must be None"),
    ({**ENTRY, "channels": (2, 1, 2, 1)}, r"\['channels'\] must be None"),
    ({**ENTRY, "num_sms": {"dispatch": 3}}, r"\['num_sms'\] must be a dict"),
    ({**ENTRY, "num_sms": {"dispatch": 0, "combine": 5}}, r"\['num_sms'\] must be a dict"),
    ({**ENTRY, "num_sms": {"dispatch": True, "combine": 5}}, r"\['num_sms'\] must be a dict"),
    ({**ENTRY, "measured": ""}, r"\['measured'\] must say what measured"),
    ({k: v for k, v in ENTRY.items() if k != "measured"}, r"it lacks \['measured'\]"),
    ({**ENTRY, "num_sm": 3}, r"has unknown \['num_sm'\]"),
    ([ENTRY], "must be a dict with"),
])
def test_a_malformed_entry_is_refused_naming_the_gpu_and_field(table, entry, field):
    table[FAKE] = entry
    match = rf"^jax_ep.tuned.TABLE\['{FAKE}'\][^:]*{field}.*tools/gpu_tune.py"
    with pytest.raises(ValueError, match=match):
        runtime.defaults_for(FAKE)
    with pytest.raises(ValueError, match=match):  # and by the ops, as they trace
        runtime.default_num_sms("jax_ep.dispatch", jax_ep.DEFAULT_NUM_SMS)
    runtime.defaults_for("NVIDIA Unlisted")  # another GPU's defaults still resolve


def test_the_default_num_sms_stays_an_int_of_20():
    default = jax_ep.DEFAULT_NUM_SMS
    assert default == 20 and repr(default) == "20" and hash(default) == hash(20)
    assert isinstance(default, tuned.Default) and not isinstance(20, tuned.Default)
    assert type(default + 0) is int


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
def test_initialize_and_the_ops_take_the_tables_settings(table):
    """End to end on the CPU devices' host peers, as if they were the fake GPU: the buffer
    streams through the table's rings, says where they came from, and a dispatch and combine
    left at the default num_sms trace with the table's."""
    if runtime.is_initialized():
        pytest.skip("jax_ep.initialize() has run for the whole session (JAX_EP_BACKEND=cuda)")
    config = runtime.BufferConfig(num_tokens=16, hidden=128, top_k=2, num_experts=8,
                                  dtype_bytes=4, low_latency_tokens=0)
    assert runtime.required_bytes(config) == runtime.required_bytes(
        dataclasses.replace(config, channels=runtime.Channels(2, 1, 2, 1)))
    jax_ep.initialize(config)
    try:
        assert runtime.channels() == runtime.Channels(2, 1, 2, 1)
        assert _ffi.EXT.host_peers_buffer_bytes() == runtime.required_bytes(config)
        assert runtime.defaults().channels_from == f"tuned table ({FAKE})"
        mesh = jax.make_mesh((8,), ("ep",))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((8, 16, 128)).astype(np.float32)
        idx = rng.integers(0, 8, (8, 16, 2)).astype(np.int32)
        w = rng.random((8, 16, 2)).astype(np.float32)

        def program(backend):
            def step(x, idx, w):
                recv, handle = jax_ep.dispatch(x[0], idx[0], w[0], num_experts=8,
                                               backend=backend)
                return jax_ep.combine(recv.x, handle, backend=backend)[None]

            return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

        args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, idx, w)]
        fn = program("cuda")
        text = fn.lower(*args).as_text()
        assert "num_sms = 3" in text and "num_sms = 5" in text, text[:3000]
        assert "num_sms = 20" not in text
        np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(program("xla")(*args)))
    finally:
        jax_ep.finalize()
    assert runtime.defaults().channels == runtime.Channels(2, 1, 2, 1)  # not initialized


def test_the_doctor_says_where_the_defaults_came_from(table):
    from jax_ep.tools import doctor

    def facts(kind):
        devices = (doctor.Device("gpu", kind, (9, 0)),) if kind else (doctor.Device("cpu",
                                                                                    "cpu"),)
        return doctor.Facts(jax_version="0.10.2", jaxlib_version="0.10.2", cuda_plugin=None,
                            build=None, build_error=None, devices=devices, process_count=1,
                            variables={})

    check = doctor._check_defaults(facts(FAKE))
    assert check.status == doctor.OK
    assert check.detail == runtime.defaults_for(FAKE).describe()
    assert f"num_sms dispatch 3, combine 5 [tuned table ({FAKE})]" in check.detail
    assert "[built-in (NVIDIA Unlisted is not in jax_ep.tuned.TABLE)]" in \
        doctor._check_defaults(facts("NVIDIA Unlisted")).detail
    assert "CPU devices: rings 40,4,3,0 [built-in (CPU devices)]" in \
        doctor._check_defaults(facts(None)).detail
    table[FAKE] = {**ENTRY, "num_sms": {"dispatch": 0, "combine": 5}}
    check = doctor._check_defaults(facts(FAKE))
    assert check.status == doctor.FAIL and FAKE in check.detail
    assert f"jax_ep.tuned.TABLE['{FAKE}']['num_sms']" in check.fix
