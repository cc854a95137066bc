// NVSHMEM runtime pieces of the CUDA backend: the unique id for bootstrapping, the version
// compiled in, and a kernel that reads the device state. NVSHMEM is device-linked into the
// extension, so all of its kernels share one NVSHMEM device state; that state is set up only by
// an NVSHMEM init called from inside this module.
//
// NVSHMEM's init terminates the process when it fails (no GPU, bad bootstrap), so
// runtime_initialize runs only from jax_ep.initialize(), after the Python-side checks.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <string>

#include "cuda/api.h"
#include "cuda/common.cuh"
#include "cuda/peer_ops.h"

namespace jax_ep::cuda {
namespace {

// The PE of the calling GPU as the device library sees it; checked after initialization.
__global__ void my_pe_kernel(int* pe) { *pe = nvshmem_my_pe(); }

}  // namespace

cudaError_t query_my_pe(int* pe,
                        cudaStream_t stream) {
  return launch(my_pe_kernel, 1, 1, stream, pe);
}

namespace {

SymmetricBuffer g_buffer{};
bool g_initialized = false;
int g_generation = 0;

std::string cuda_failure(const char* what, cudaError_t status) {
  return std::string(what) + ": " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status);
}

}  // namespace

const SymmetricBuffer* symmetric_buffer() { return g_initialized ? &g_buffer : nullptr; }

std::string runtime_initialize(const uint8_t* unique_id, int rank, int num_ranks, int device,
                               size_t buffer_bytes, size_t low_latency_bytes, bool puts,
                               int ranks_per_node) {
  if (g_initialized) return "NVSHMEM is already initialized by jax_ep";
  const std::string layout = check_layout(buffer_bytes, low_latency_bytes);
  if (!layout.empty()) return layout;
  cudaError_t status = cudaSetDevice(device);
  if (status != cudaSuccess) return cuda_failure("cudaSetDevice", status);
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  std::memcpy(&uid, unique_id, sizeof(uid));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &uid, &attr) != 0) {
    return "nvshmemx_set_attr_uniqueid_args failed";
  }
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) {
    return "nvshmemx_init_attr failed (NVSHMEM_DEBUG=INFO prints why; between nodes NVSHMEM "
           "needs a remote transport that works there, IBGDA or IBRC over InfiniBand or RoCE: "
           "docs/cuda.md, \"Across nodes\")";
  }
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks) {
    return "NVSHMEM numbers this process PE " + std::to_string(nvshmem_my_pe()) + " of " +
           std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(rank) + " of " +
           std::to_string(num_ranks);
  }
  // The device library linked into this module must see the same PE (its own device state).
  int* device_pe = nullptr;
  int host_pe = -1;
  status = cudaMalloc(&device_pe, sizeof(int));
  if (status == cudaSuccess) status = query_my_pe(device_pe, nullptr);
  if (status == cudaSuccess) status = cudaMemcpy(&host_pe, device_pe, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(device_pe);
  if (status != cudaSuccess) return cuda_failure("reading the device PE", status);
  if (host_pe != rank) {
    return "the device library of jax_ep reports PE " + std::to_string(host_pe) +
           ", the host library " + std::to_string(rank);
  }
  void* buffer = nvshmem_malloc(buffer_bytes);
  if (buffer == nullptr) {
    return "nvshmem_malloc of " + std::to_string(buffer_bytes) +
           " bytes failed (raise NVSHMEM_SYMMETRIC_SIZE, or initialize with a smaller "
           "configuration)";
  }
  status = cudaMemset(buffer, 0, buffer_bytes);
  if (status == cudaSuccess) status = cudaDeviceSynchronize();
  if (status != cudaSuccess) return cuda_failure("clearing the symmetric buffer", status);
  nvshmem_barrier_all();  // every rank's buffer is clear before anyone signals into it
  g_buffer = SymmetricBuffer{buffer, buffer_bytes,
                             low_latency_offset(buffer_bytes, low_latency_bytes), rank,
                             num_ranks, ++g_generation, puts, ranks_per_node};
  g_initialized = true;
  return "";
}

std::string runtime_finalize() {
  if (!g_initialized) return "";
  const cudaError_t status = cudaDeviceSynchronize();
  nvshmem_barrier_all();
  nvshmem_free(g_buffer.ptr);
  nvshmem_finalize();
  g_initialized = false;
  g_buffer = SymmetricBuffer{};
  return status == cudaSuccess ? "" : cuda_failure("synchronizing before finalize", status);
}

int nvshmem_unique_id(uint8_t* id) {
  static_assert(sizeof(nvshmemx_uniqueid_t) == kNvshmemUniqueIdBytes,
                "NVSHMEM unique ids are 128 bytes");
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int status = nvshmemx_get_uniqueid(&uid);
  std::memcpy(id, &uid, sizeof(uid));
  return status;
}

int nvshmem_version_major() { return NVSHMEM_VENDOR_MAJOR_VERSION; }
int nvshmem_version_minor() { return NVSHMEM_VENDOR_MINOR_VERSION; }
int nvshmem_version_patch() { return NVSHMEM_VENDOR_PATCH_VERSION; }

}  // namespace jax_ep::cuda
