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
#include <utility>
#include <vector>

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
  return std::string(what) + ": " + error_text(status);
}

}  // namespace

#ifndef JAX_EP_CUDA_ARCH  // CMakeLists.txt defines it (tools/check_ptxas.py compiles without)
#define JAX_EP_CUDA_ARCH "the architectures of its build"
#endif

std::string error_text(cudaError_t status) {
  std::string text = std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
  if (status != cudaErrorNoKernelImageForDevice) return text;
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  const std::string cc = std::to_string(major) + std::to_string(minor);
  return text + ". This GPU has compute capability " + std::to_string(major) + "." +
         std::to_string(minor) + " and jax_ep was built for " + JAX_EP_CUDA_ARCH +
         ": rebuild for it with pip install -C cmake.define.CMAKE_CUDA_ARCHITECTURES=" + cc +
         "-real . (docs/build.md)";
}

const SymmetricBuffer* symmetric_buffer() { return g_initialized ? &g_buffer : nullptr; }

std::string runtime_initialize(const uint8_t* unique_id, int rank, int num_ranks, int device,
                               size_t buffer_bytes, size_t low_latency_bytes, bool puts,
                               int ranks_per_node, const std::vector<int64_t>& device_of_pe,
                               const std::vector<int>& node_of_pe) {
  if (g_initialized) return "NVSHMEM is already initialized by jax_ep";
  if (device_of_pe.size() != static_cast<size_t>(num_ranks) ||
      node_of_pe.size() != static_cast<size_t>(num_ranks)) {
    return "device_of_pe and node_of_pe must name the GPU and node of each of the " +
           std::to_string(num_ranks) + " PEs";
  }
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
  if (status == cudaSuccess) {
    status = cudaMemcpy(&host_pe, device_pe, sizeof(int), cudaMemcpyDeviceToHost);
  }
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
  g_buffer = SymmetricBuffer{buffer,        buffer_bytes,
                             low_latency_offset(buffer_bytes, low_latency_bytes),
                             rank,          num_ranks,
                             ++g_generation, puts,
                             ranks_per_node, device_of_pe,
                             node_of_pe};
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

namespace {

LocalBuffers g_local{};
bool g_local_initialized = false;

}  // namespace

const LocalBuffers* local_buffers() { return g_local_initialized ? &g_local : nullptr; }

CudaVersions cuda_versions() {
  CudaVersions v;
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  if (cudaRuntimeGetVersion(&v.runtime) != cudaSuccess) v.runtime = 0;
  cudaGetLastError();  // a failed query leaves no error for the next CUDA call
  return v;
}

size_t device_memory_bytes(int ordinal) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, ordinal) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return prop.totalGlobalMem;
}

std::vector<std::vector<bool>> peer_access_matrix() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  std::vector<std::vector<bool>> can(n, std::vector<bool>(n, true));
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      int yes = 0;
      if (a != b) can[a][b] = cudaDeviceCanAccessPeer(&yes, a, b) == cudaSuccess && yes;
    }
  }
  cudaGetLastError();
  return can;
}

std::string local_initialize(const std::vector<int>& ordinals,
                             const std::vector<int64_t>& device_ids, size_t buffer_bytes,
                             size_t low_latency_bytes) {
  if (g_local_initialized) return "the GPUs of this process are already initialized by jax_ep";
  if (ordinals.size() != device_ids.size() || ordinals.size() < 2 ||
      ordinals.size() > static_cast<size_t>(kMaxLocalGpus)) {
    return "between 2 and " + std::to_string(kMaxLocalGpus) + " GPUs, each with its JAX id";
  }
  const std::string layout = check_layout(buffer_bytes, low_latency_bytes);
  if (!layout.empty()) return layout;
  LocalBuffers local{ordinals, device_ids, {}, buffer_bytes,
                     low_latency_offset(buffer_bytes, low_latency_bytes), ++g_generation};
  auto release = [&] {
    for (size_t i = 0; i < local.ptrs.size(); ++i) {
      cudaSetDevice(ordinals[i]);
      cudaFree(local.ptrs[i]);
    }
  };
  for (const int a : ordinals) {
    for (const int b : ordinals) {
      int can = 0;
      if (a != b && (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || !can)) {
        return "CUDA device " + std::to_string(a) + " cannot access the memory of device " +
               std::to_string(b) + " (no NVLink or PCIe peer access between them); run one "
               "process per GPU instead (NVSHMEM)";
      }
    }
  }
  for (size_t i = 0; i < ordinals.size(); ++i) {
    cudaError_t status = cudaSetDevice(ordinals[i]);
    char* ptr = nullptr;
    if (status == cudaSuccess) status = cudaMalloc(&ptr, buffer_bytes);
    if (status == cudaSuccess) local.ptrs.push_back(ptr);
    if (status == cudaSuccess) status = cudaMemset(ptr, 0, buffer_bytes);
    for (const int peer : ordinals) {
      if (status != cudaSuccess || peer == ordinals[i]) continue;
      status = cudaDeviceEnablePeerAccess(peer, 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clears it: enabled by an earlier initialize
        status = cudaSuccess;
      }
    }
    if (status == cudaSuccess) status = cudaDeviceSynchronize();
    if (status != cudaSuccess) {
      release();
      return cuda_failure(("setting up the buffer of CUDA device " +
                           std::to_string(ordinals[i])).c_str(), status);
    }
  }
  g_local = std::move(local);
  g_local_initialized = true;
  return "";
}

std::string local_finalize() {
  if (!g_local_initialized) return "";
  cudaError_t first = cudaSuccess;
  for (size_t i = 0; i < g_local.ptrs.size(); ++i) {
    cudaError_t status = cudaSetDevice(g_local.ordinals[i]);
    if (status == cudaSuccess) status = cudaDeviceSynchronize();
    if (status == cudaSuccess) status = cudaFree(g_local.ptrs[i]);
    if (first == cudaSuccess) first = status;
  }
  g_local_initialized = false;
  g_local = LocalBuffers{};
  return first == cudaSuccess ? "" : cuda_failure("freeing the GPUs' buffers", first);
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
