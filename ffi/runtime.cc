// Python bindings of the runtimes of the exchange between devices: NVSHMEM (GPUs) and host
// peers (CPU devices); jax_ep/runtime.py drives them.
#include "ffi/runtime.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/host_peers.h"
#ifdef JAX_EP_WITH_CUDA
#include "cuda/api.h"
#endif

namespace nb = nanobind;

namespace jax_ep::ffi {
namespace {

[[noreturn]] void NoCuda() {
  throw std::runtime_error(
      "jax_ep was built without the CUDA kernels, so it has no NVSHMEM runtime; rebuild with "
      "nvcc on PATH (pip install -C cmake.define.JAX_EP_CUDA=ON .) or use backend='xla'");
}

void Initialize(nb::bytes unique_id, int rank, int num_ranks, int device, size_t buffer_bytes) {
#ifdef JAX_EP_WITH_CUDA
  if (unique_id.size() != static_cast<size_t>(cuda::kNvshmemUniqueIdBytes)) {
    throw std::invalid_argument("runtime_initialize: unique_id must be " +
                                std::to_string(cuda::kNvshmemUniqueIdBytes) + " bytes");
  }
  std::string error;
  {
    nb::gil_scoped_release release;  // the bootstrap waits for every other process
    error = cuda::runtime_initialize(reinterpret_cast<const uint8_t*>(unique_id.c_str()), rank,
                                     num_ranks, device, buffer_bytes);
  }
  if (!error.empty()) throw std::runtime_error("jax_ep.initialize: " + error);
#else
  (void)unique_id, (void)rank, (void)num_ranks, (void)device, (void)buffer_bytes;
  NoCuda();
#endif
}

void Finalize() {
#ifdef JAX_EP_WITH_CUDA
  std::string error;
  {
    nb::gil_scoped_release release;
    error = cuda::runtime_finalize();
  }
  if (!error.empty()) throw std::runtime_error("jax_ep.finalize: " + error);
#else
  NoCuda();
#endif
}

nb::object State() {
#ifdef JAX_EP_WITH_CUDA
  const cuda::SymmetricBuffer* buffer = cuda::symmetric_buffer();
  if (buffer == nullptr) return nb::none();
  nb::dict state;
  state["rank"] = buffer->rank;
  state["num_ranks"] = buffer->num_ranks;
  state["buffer_bytes"] = buffer->bytes;
  return state;
#else
  return nb::none();
#endif
}

void HostPeersInitialize(size_t buffer_bytes) {
  const std::string error = host::initialize(buffer_bytes);
  if (!error.empty()) throw std::runtime_error("jax_ep.initialize: " + error);
}

}  // namespace

void BindRuntime(nb::module_& m) {
  m.def("runtime_initialize", &Initialize, nb::arg("unique_id"), nb::arg("rank"),
        nb::arg("num_ranks"), nb::arg("device"), nb::arg("buffer_bytes"),
        "Initializes NVSHMEM with rank 0's unique id and allocates the symmetric buffer "
        "(collective). Raises RuntimeError on failure or without CUDA.");
  m.def("runtime_finalize", &Finalize, "Frees the symmetric buffer and finalizes NVSHMEM.");
  m.def("host_peers_initialize", &HostPeersInitialize, nb::arg("buffer_bytes"),
        "Sets up host peers (the exchange between the CPU devices of this process) with a "
        "buffer of `buffer_bytes` per rank.");
  m.def("host_peers_finalize", &host::finalize,
        "Frees the host peers' buffers (no exchange may be running).");
  m.def("host_peers_buffer_bytes", &host::buffer_bytes,
        "The host peers' buffer bytes per rank, 0 when not initialized.");
  m.def("runtime_state", &State,
        "{'rank', 'num_ranks', 'buffer_bytes'} while initialized, else None.");
}

}  // namespace jax_ep::ffi
