// The nanobind module jax_ep._ext: FFI handler registrations and build information only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cstdint>
#include <string>

#include "ffi/layout.h"
#include "xla/ffi/api/c_api.h"

#ifdef JAX_EP_WITH_CUDA
#include "cuda/api.h"
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// {platform: {target name: handler capsule}}, for jax.ffi.register_ffi_target.
nb::dict Registrations() {
  nb::dict cpu;
  cpu["jax_ep_dispatch_layout"] = Capsule(JaxEpLayoutCpu);
  nb::dict cuda;
#ifdef JAX_EP_WITH_CUDA
  cuda["jax_ep_dispatch_layout"] = Capsule(JaxEpLayoutCuda);
#endif
  nb::dict out;
  out["cpu"] = cpu;
  out["CUDA"] = cuda;
  return out;
}

bool CudaCompiled() {
#ifdef JAX_EP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

nb::bytes NvshmemUniqueId() {
#ifdef JAX_EP_WITH_CUDA
  std::array<uint8_t, 128> id{};
  const int status = jax_ep::cuda::nvshmem_unique_id(&id);
  if (status != 0) {
    throw std::runtime_error("nvshmemx_get_uniqueid failed with status " +
                             std::to_string(status));
  }
  return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
#else
  throw std::runtime_error(
      "jax_ep was built without CUDA, so NVSHMEM is not available; rebuild with nvcc on PATH "
      "(pip install -C cmake.define.JAX_EP_CUDA=ON .)");
#endif
}

nb::dict BuildInfo() {
  nb::dict info;
  info["ffi_api_version"] =
      std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["cuda"] = CudaCompiled();
#ifdef JAX_EP_WITH_CUDA
  info["cuda_arch"] = std::string("sm_") + JAX_EP_CUDA_ARCH;
  info["nvshmem_version"] = std::to_string(jax_ep::cuda::nvshmem_version_major()) + "." +
                            std::to_string(jax_ep::cuda::nvshmem_version_minor()) + "." +
                            std::to_string(jax_ep::cuda::nvshmem_version_patch());
#endif
  return info;
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "jax_ep's XLA FFI handlers (CPU always, CUDA when built with it).";
  m.def("registrations", &Registrations, "{platform: {FFI target name: handler capsule}}");
  m.def("cuda_compiled", &CudaCompiled, "Whether the CUDA kernels were compiled in.");
  m.def("nvshmem_unique_id", &NvshmemUniqueId,
        "A fresh 128-byte NVSHMEM unique id (needs no GPU).");
  m.def("build_info", &BuildInfo, "FFI API version, CUDA architecture and NVSHMEM version.");
}
