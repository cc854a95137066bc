// Python bindings of the runtimes of the exchange between devices: NVSHMEM (GPUs) and host
// peers (CPU devices); jax_ep/runtime.py drives them.
#include "ffi/runtime.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/host_launch.h"
#include "cuda/host_peers.h"
#ifdef JAX_EP_WITH_CUDA
#include "cuda/api.h"
#endif

namespace nb = nanobind;

namespace jax_ep::ffi {
namespace {

#ifndef JAX_EP_WITH_CUDA
[[noreturn]] void NoCuda() {
  throw std::runtime_error(
      "jax_ep was built without the CUDA kernels, so it has no NVSHMEM runtime; rebuild with "
      "nvcc on PATH (pip install -C cmake.define.JAX_EP_CUDA=ON .) or use backend='xla'");
}
#endif

void Initialize(nb::bytes unique_id, int rank, int num_ranks, int device, size_t buffer_bytes,
                size_t low_latency_bytes, bool puts, int ranks_per_node,
                const std::vector<int64_t>& device_of_pe, const std::vector<int>& node_of_pe) {
#ifdef JAX_EP_WITH_CUDA
  if (unique_id.size() != static_cast<size_t>(cuda::kNvshmemUniqueIdBytes)) {
    throw std::invalid_argument("runtime_initialize: unique_id must be " +
                                std::to_string(cuda::kNvshmemUniqueIdBytes) + " bytes");
  }
  std::string error;
  {
    nb::gil_scoped_release release;  // the bootstrap waits for every other process
    error = cuda::runtime_initialize(reinterpret_cast<const uint8_t*>(unique_id.c_str()), rank,
                                     num_ranks, device, buffer_bytes, low_latency_bytes,
                                     puts, ranks_per_node, device_of_pe, node_of_pe);
  }
  if (!error.empty()) throw std::runtime_error("jax_ep.initialize: " + error);
#else
  (void)unique_id, (void)rank, (void)num_ranks, (void)device, (void)buffer_bytes;
  (void)low_latency_bytes, (void)puts, (void)ranks_per_node, (void)device_of_pe;
  (void)node_of_pe;
  NoCuda();
#endif
}

void LocalInitialize(const std::vector<int>& ordinals, const std::vector<int64_t>& device_ids,
                     size_t buffer_bytes, size_t low_latency_bytes) {
#ifdef JAX_EP_WITH_CUDA
  std::string error;
  {
    nb::gil_scoped_release release;
    error = cuda::local_initialize(ordinals, device_ids, buffer_bytes, low_latency_bytes);
  }
  if (!error.empty()) throw std::runtime_error("jax_ep.initialize: " + error);
#else
  (void)ordinals, (void)device_ids, (void)buffer_bytes, (void)low_latency_bytes;
  NoCuda();
#endif
}

void LocalFinalize() {
#ifdef JAX_EP_WITH_CUDA
  std::string error;
  {
    nb::gil_scoped_release release;
    error = cuda::local_finalize();
  }
  if (!error.empty()) throw std::runtime_error("jax_ep.finalize: " + error);
#else
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
  state["puts"] = buffer->puts;
  state["ranks_per_node"] = buffer->ranks_per_node;
  return state;
#else
  return nb::none();
#endif
}

void HostPeersInitialize(size_t buffer_bytes, size_t low_latency_bytes, bool puts,
                         int ranks_per_node) {
  const std::string error =
      host::initialize(buffer_bytes, low_latency_bytes, puts, ranks_per_node);
  if (!error.empty()) throw std::runtime_error("jax_ep.initialize: " + error);
}

// {'driver', 'runtime'}: CUDA versions (1000 x major + 10 x minor, 0 where unknown), and
// the GPUs' peer access matrix; None without CUDA.
nb::object CudaVersions() {
#ifdef JAX_EP_WITH_CUDA
  const cuda::CudaVersions v = cuda::cuda_versions();
  nb::dict out;
  out["driver"] = v.driver;
  out["runtime"] = v.runtime;
  return out;
#else
  return nb::none();
#endif
}

nb::object PeerAccessMatrix() {
#ifdef JAX_EP_WITH_CUDA
  nb::list rows;
  for (const std::vector<bool>& row : cuda::peer_access_matrix()) {
    nb::list cells;
    for (const bool can : row) cells.append(can);
    rows.append(cells);
  }
  return rows;
#else
  return nb::none();
#endif
}

nb::object DeviceMemoryBytes(int ordinal) {
#ifdef JAX_EP_WITH_CUDA
  return nb::int_(cuda::device_memory_bytes(ordinal));
#else
  static_cast<void>(ordinal);
  return nb::none();
#endif
}

nb::dict BufferRegions(int num_ranks, int num_tokens, int top_k, int num_experts, int hidden,
                       int dtype_bytes, int64_t capacity, bool expert_major,
                       int low_latency_tokens, bool puts, int ranks_per_node, int channels,
                       int chunk_tokens, int ring_chunks) {
  Rings rings;
  rings.channels = channels;
  rings.chunk_tokens = chunk_tokens;
  rings.ring_chunks = ring_chunks;
  const RegionBytes r = buffer_region_bytes(num_ranks, num_tokens, top_k, num_experts, hidden,
                                            dtype_bytes, capacity, expert_major,
                                            low_latency_tokens, puts, ranks_per_node, rings);
  nb::dict out;
  out["signals"] = r.signals;
  out["normal"] = r.normal;
  out["low_latency"] = r.low_latency;
  out["dispatch"] = r.dispatch;  // of normal: the largest dispatch's bytes, and combine's
  out["combine"] = r.combine;
  return out;
}

}  // namespace

void BindRuntime(nb::module_& m) {
  m.def("runtime_initialize", &Initialize, nb::arg("unique_id"), nb::arg("rank"),
        nb::arg("num_ranks"), nb::arg("device"), nb::arg("buffer_bytes"),
        nb::arg("low_latency_bytes"), nb::arg("puts"), nb::arg("ranks_per_node"),
        nb::arg("device_of_pe"), nb::arg("node_of_pe"),
        "Initializes NVSHMEM with rank 0's unique id and allocates the symmetric buffer, its "
        "last low_latency_bytes for low-latency regions (collective), the peers reached with "
        "stores or, with `puts`, with puts (node-aware with ranks_per_node: stores within a "
        "node); device_of_pe and node_of_pe: each PE's GPU (JAX device id) and node, for the "
        "EP groups of a mesh. Raises RuntimeError on failure or without CUDA.");
  m.def("runtime_finalize", &Finalize, "Frees the symmetric buffer and finalizes NVSHMEM.");
  m.def("local_initialize", &LocalInitialize, nb::arg("ordinals"), nb::arg("device_ids"),
        nb::arg("buffer_bytes"), nb::arg("low_latency_bytes"),
        "The GPUs of this process (CUDA devices `ordinals`, JAX ids `device_ids`): a buffer "
        "on each, its last low_latency_bytes for low-latency regions, reached by the others "
        "through CUDA peer access. Raises RuntimeError on failure (GPUs without peer access) "
        "or without CUDA.");
  m.def("local_finalize", &LocalFinalize, "Frees the buffers of local_initialize.");
  m.def("host_peers_initialize", &HostPeersInitialize, nb::arg("buffer_bytes"),
        nb::arg("low_latency_bytes"), nb::arg("puts") = false, nb::arg("ranks_per_node") = 0,
        "Sets up host peers (the exchange between the CPU devices of this process) with a "
        "buffer of `buffer_bytes` per rank, its last low_latency_bytes for low-latency "
        "regions, reached with stores or, with `puts`, with puts only; with ranks_per_node, "
        "split into nodes of that many ranks (stores within a node, puts between nodes).");
  m.def("buffer_regions", &BufferRegions, nb::arg("num_ranks"), nb::arg("num_tokens"),
        nb::arg("top_k"), nb::arg("num_experts"), nb::arg("hidden"), nb::arg("dtype_bytes"),
        nb::arg("capacity"), nb::arg("expert_major"), nb::arg("low_latency_tokens"),
        nb::arg("puts") = false, nb::arg("ranks_per_node") = 0, nb::arg("channels") = 0,
        nb::arg("chunk_tokens") = 0, nb::arg("ring_chunks") = 0,
        "Bytes of each region of the symmetric buffer for the largest calls of a "
        "configuration, as the ops carve them (cuda/peer_ops.h), and of the normal region "
        "what the largest dispatch and combine use; capacity 0: the default; "
        "puts: with the send areas of peers reached by puts; ranks_per_node: node-aware, "
        "with the relays' slots (0: one node); channels > 0: the dispatch streamed through "
        "rings of chunk_tokens x ring_chunks slots (cuda/channels.h).");
  m.def("rows_stage_fits", &rows_stage_fits, nb::arg("buffer_bytes"),
        nb::arg("low_latency_bytes"), nb::arg("num_tokens"), nb::arg("row_bytes"),
        "Whether jax_ep_dispatch_rows' stage of num_tokens rows of row_bytes fits the "
        "normal-mode region of a buffer of buffer_bytes with low_latency_bytes of "
        "low-latency regions (the check the op makes, cuda/peer_ops.h).");
  m.attr("host_max_units") = kMaxHostUnits;
  m.def("host_peers_finalize", &host::finalize,
        "Frees the host peers' buffers (no exchange may be running).");
  m.def("host_peers_buffer_bytes", &host::buffer_bytes,
        "The host peers' buffer bytes per rank, 0 when not initialized.");
  m.def("cuda_versions", &CudaVersions,
        "{'driver', 'runtime'}: the CUDA driver's version and that of the runtime built in "
        "(1000 x major + 10 x minor, 0 where unknown, as without a driver); None without "
        "CUDA.");
  m.def("peer_access_matrix", &PeerAccessMatrix,
        "[a][b]: whether CUDA device a can access device b's memory (cudaDeviceCanAccessPeer), "
        "over the devices this process sees ([] without a driver); None without CUDA.");
  m.def("device_memory_bytes", &DeviceMemoryBytes, nb::arg("ordinal"),
        "The memory of the GPU of CUDA ordinal `ordinal` in bytes (0 where the query fails); "
        "None without CUDA.");
  m.def("runtime_state", &State,
        "{'rank', 'num_ranks', 'buffer_bytes'} while initialized, else None.");
}

}  // namespace jax_ep::ffi
