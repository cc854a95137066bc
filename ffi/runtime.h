// Python bindings of the NVSHMEM runtime, added to jax_ep._ext by module.cc.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_ep::ffi {

void BindRuntime(nanobind::module_& m);

}  // namespace jax_ep::ffi
