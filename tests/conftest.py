"""Test setup: 8 host CPU devices (before jax is imported), shared fixtures and markers."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import harness  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

# Each example compiles a program, so shrinking a failure would take minutes: report the
# failing example as drawn instead (hypothesis prints it, and its seed to reproduce it).
settings.register_profile(
    "jax_ep", deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate]
)
settings.load_profile("jax_ep")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test that takes more than a few seconds")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert len(jax.devices()) == 8, "tests expect 8 forced host devices"


HOST_PEER_BYTES = 64 << 20  # per rank: more than any test's largest call ...
HOST_PEER_LOW_LATENCY_BYTES = 16 << 20  # ... and low-latency call
# The rings the tests' host peers stream through unless $JAX_EP_CHANNELS names others: 5
# channels of 2 x 2 slots, which wrap in nearly every call, on an eighth of the threads of the
# default Channels() (40 x 4 x 3: tests/test_host_peers.py runs that one too).
TEST_CHANNELS = "5,2,2"


def initialize_host_peers():
    """jax_ep.initialize() of the tests' host peers (their buffer, TEST_CHANNELS)."""
    import jax_ep

    saved = os.environ.get("JAX_EP_CHANNELS")
    os.environ["JAX_EP_CHANNELS"] = saved or TEST_CHANNELS
    try:
        jax_ep.initialize(buffer_bytes=HOST_PEER_BYTES,
                          low_latency_bytes=HOST_PEER_LOW_LATENCY_BYTES)
    finally:
        if saved is None:
            del os.environ["JAX_EP_CHANNELS"]


@pytest.fixture(scope="session", autouse=True)
def _host_peers_for_cuda_backend():
    """With JAX_EP_BACKEND=cuda every op runs the "cuda" backend; on these CPU devices, ops
    between devices exchange through host peers, which jax_ep.initialize() sets up."""
    import jax_ep
    from jax_ep import _ffi

    if os.environ.get("JAX_EP_BACKEND") != "cuda" or _ffi.EXT is None:
        yield
        return
    initialize_host_peers()
    yield
    jax_ep.finalize()


@pytest.fixture(autouse=True)
def _seeded_inputs(request):
    """Every test's unseeded np.random.default_rng() draws from one seed, which a failure
    prints with the command that reruns it on the same inputs."""
    seed = harness.test_seed()
    request.node.user_properties.append(("seed", seed))
    with harness.seeded_default_rng(seed):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seeds = [value for name, value in item.user_properties if name == "seed"]
    if report.failed and seeds:
        report.sections.append(("random inputs", f"seed {seeds[0]}; rerun on the same inputs "
                                f"with: JAX_EP_TEST_SEED={seeds[0]} pytest '{item.nodeid}'"))
    return report
