// NVSHMEM runtime pieces of the CUDA backend: the unique id for bootstrapping, the version
// compiled in, and a kernel that reads the device state. NVSHMEM is device-linked into the
// extension, so all of its kernels share one NVSHMEM device state; that state is set up only by
// an NVSHMEM init called from inside this module.
//
// NOTE: nothing here initializes NVSHMEM: its init terminates the process when it fails (no
// GPU, bad bootstrap), so it runs only from jax_ep.initialize() after Python-side checks.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>

#include "cuda/api.h"

namespace jax_ep::cuda {
namespace {

// The PE of the calling GPU as the device library sees it; checked after initialization.
__global__ void my_pe_kernel(int* pe) { *pe = nvshmem_my_pe(); }

}  // namespace

cudaError_t query_my_pe(int* pe,
                        cudaStream_t stream) {
  my_pe_kernel<<<1, 1, 0, stream>>>(pe);
  return cudaGetLastError();
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
