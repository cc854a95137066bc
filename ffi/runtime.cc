// Python bindings of the CUDA backend's NVSHMEM runtime (initialize / finalize / state).
#include <nanobind/nanobind.h>

#include "ffi/runtime.h"

namespace nb = nanobind;

namespace jax_ep::ffi {

void BindRuntime(nb::module_& m) { (void)m; }

}  // namespace jax_ep::ffi
