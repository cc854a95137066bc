// The nanobind module jax_ep._ext: FFI handler registrations and small informational
// functions only. jax_ep/_ffi.py registers the handlers with JAX.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>

#include "cuda/meter.h"
#include "ffi/copy_rate.h"
#include "ffi/exchange.h"
#include "ffi/layout.h"
#include "ffi/runtime.h"
#include "xla/ffi/api/c_api.h"

#ifdef JAX_EP_WITH_CUDA
#include "cuda/api.h"
#endif

namespace nb = nanobind;

namespace {

using Handler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

nb::capsule Capsule(Handler handler) { return nb::capsule(reinterpret_cast<void*>(handler)); }

// The exchange targets' handlers, in PeerOp order (their names are kPeerOpNames).
namespace ffi = jax_ep::ffi;
#define JAX_EP_CPU_HANDLER(Name, op) ffi::Name##Cpu,
constexpr Handler kExchangeCpu[] = {JAX_EP_FOR_EACH_EXCHANGE_TARGET(JAX_EP_CPU_HANDLER)};
#undef JAX_EP_CPU_HANDLER
#ifdef JAX_EP_WITH_CUDA
#define JAX_EP_CUDA_HANDLER(Name, op) ffi::Name##Cuda,
constexpr Handler kExchangeCuda[] = {JAX_EP_FOR_EACH_EXCHANGE_TARGET(JAX_EP_CUDA_HANDLER)};
#undef JAX_EP_CUDA_HANDLER
static_assert(std::size(kExchangeCuda) == std::size(jax_ep::kPeerOpNames));
#endif
static_assert(std::size(kExchangeCpu) == std::size(jax_ep::kPeerOpNames));

// {platform: {target name: handler capsule}} for jax.ffi.register_ffi_target. The same target
// names on both platforms; the "CUDA" dict is empty when the CUDA kernels were not compiled.
nb::dict Registrations() {
  nb::dict cpu, cuda;
  cpu["jax_ep_dispatch_layout"] = Capsule(ffi::LayoutCpu);
  cpu[ffi::kCopyRateOp] = Capsule(ffi::CopyRateCpu);
  for (size_t op = 0; op < std::size(kExchangeCpu); ++op) {
    cpu[jax_ep::kPeerOpNames[op]] = Capsule(kExchangeCpu[op]);
  }
#ifdef JAX_EP_WITH_CUDA
  cuda["jax_ep_dispatch_layout"] = Capsule(ffi::LayoutCuda);
  cuda[ffi::kCopyRateOp] = Capsule(ffi::CopyRateCuda);
  for (size_t op = 0; op < std::size(kExchangeCuda); ++op) {
    cuda[jax_ep::kPeerOpNames[op]] = Capsule(kExchangeCuda[op]);
  }
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
  uint8_t id[jax_ep::cuda::kNvshmemUniqueIdBytes] = {};
  const int status = jax_ep::cuda::nvshmem_unique_id(id);
  if (status != 0) {
    throw std::runtime_error("jax_ep: nvshmemx_get_uniqueid failed with status " +
                             std::to_string(status));
  }
  return nb::bytes(reinterpret_cast<const char*>(id), sizeof(id));
#else
  throw std::runtime_error(
      "jax_ep: nvshmem_unique_id() needs the CUDA kernels, but this build of jax_ep has none "
      "(it was built without nvcc, or with JAX_EP_CUDA=OFF). Rebuild with nvcc on PATH: "
      "pip install -C cmake.define.JAX_EP_CUDA=ON .");
#endif
}

nb::dict BuildInfo() {
  nb::dict info;
  info["ffi_api_version"] =
      std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["cuda"] = CudaCompiled();
#ifdef JAX_EP_WITH_CUDA
  info["cuda_arch"] = std::string(JAX_EP_CUDA_ARCH);
  info["nvshmem_version"] = std::to_string(jax_ep::cuda::nvshmem_version_major()) + "." +
                            std::to_string(jax_ep::cuda::nvshmem_version_minor()) + "." +
                            std::to_string(jax_ep::cuda::nvshmem_version_patch());
#else
  info["cuda_arch"] = nb::none();
  info["nvshmem_version"] = nb::none();
#endif
  return info;
}

// What the ops run on the CPU did since the last reset (cuda/meter.h).
nb::dict Meter(bool reset) {
  jax_ep::Meter& m = jax_ep::meter();
  nb::dict out;
  out["launches"] = m.launches.load();
  out["barriers"] = m.barriers.load();
  out["read"] = m.read.load();
  out["written"] = m.written.load();
  out["messages"] = m.messages.load();
  out["recordings"] = m.recordings.load();
  out["replays"] = m.replays.load();
  const int64_t smallest = m.smallest.load();
  out["smallest_launch"] =
      smallest == jax_ep::Meter::kNoLaunch ? nb::object(nb::none()) : nb::int_(smallest);
  if (reset) {
    m.launches = 0;
    m.barriers = 0;
    m.read = 0;
    m.written = 0;
    m.messages = 0;
    m.recordings = 0;
    m.replays = 0;
    m.smallest = jax_ep::Meter::kNoLaunch;
  }
  return out;
}

// The kernels' launch parameters that bound how many bytes their copies keep in flight (the
// account's, jax_ep.tools.account, checked against these by its tests).
nb::dict KernelParameters() {
  nb::dict out;
  out["words_in_flight"] = jax_ep::kWordsInFlight;
  out["word_bytes"] = static_cast<int>(sizeof(jax_ep::Word));
  out["phase_warps"] = jax_ep::kBlockWarps;
  out["copy_blocks_per_sm"] = jax_ep::kCopyBlocksPerSm;  // Hopper's (the host's value)
  out["stream_words_in_flight"] = jax_ep::kStreamWordsInFlight;
  out["sum_batch"] = jax_ep::kSumBatch;
  out["stream_blocks_per_sm"] = jax_ep::kStreamBlocksPerSm;
  out["dispatch_channel_warps"] = jax_ep::kGpuDispatchWarps;
  out["combine_channel_senders"] = jax_ep::kGpuCombineSenders;
  out["max_channel_warps"] = jax_ep::kMaxChannelWarps;
  out["forwarders"] = jax_ep::kForwarders;
  out["fan_out"] = jax_ep::kFanOut;
  return out;
}

// Length of the int32 workspace of FFI target `target` for V stacked ranks (cuda/exchange.h).
int64_t Workspace(const std::string& target, int num_ranks, int num_tokens, int top_k,
                  int num_experts, int64_t V) {
  auto sized = [&](auto a) {
    a.num_ranks = num_ranks;
    a.num_tokens = num_tokens;
    a.top_k = top_k;
    a.num_experts = num_experts;
    return a;
  };
  if (target == jax_ep::kPeerOpNames[jax_ep::kPeerDispatch]) {
    jax_ep::DispatchArgs a = sized(jax_ep::DispatchArgs{});
    return jax_ep::carve_dispatch_workspace(&a, V);
  }
  if (target == jax_ep::kPeerOpNames[jax_ep::kPeerLlDispatchSend]) {
    jax_ep::LowLatencyArgs a = sized(jax_ep::LowLatencyArgs{});
    return jax_ep::carve_ll_workspace(&a, V);
  }
  throw std::invalid_argument("workspace: no workspace for target " + target);
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "jax_ep's XLA FFI handlers (CPU always, CUDA when built with it).";
  m.def("registrations",
        &Registrations,
        "{platform: {FFI target name: handler capsule}}; the 'CUDA' dict is empty without CUDA.");
  m.def("cuda_compiled", &CudaCompiled, "Whether the CUDA kernels were compiled in.");
  m.def("nvshmem_unique_id",
        &NvshmemUniqueId,
        "A fresh 128-byte NVSHMEM unique id for rank 0 to share. Needs no GPU and initializes "
        "nothing. Raises RuntimeError when jax_ep was built without CUDA.");
  m.def("build_info",
        &BuildInfo,
        "{'ffi_api_version', 'cuda', 'cuda_arch', 'nvshmem_version'} of this build; cuda_arch "
        "lists the GPU architectures built ('sm_80,sm_90,...': machine code; 'compute_XX': "
        "PTX). The last two are None without CUDA.");
  m.def("kernel_parameters", &KernelParameters,
        "The kernels' launch parameters behind the account's bytes in flight: loads in flight "
        "per lane, bytes per load, warps per block, copy blocks per SM (Hopper), sender warps "
        "per channel on a GPU, forwarders, destinations per read.");
  m.def("meter",
        &Meter,
        nb::arg("reset") = true,
        "{'launches', 'barriers', 'read', 'written', 'messages', 'smallest_launch'}: what the "
        "exchange ops run on the CPU did since the last reset (launches and barriers per "
        "rank's stream, summed over ranks; bytes of row data; puts and value puts, over "
        "puts; the warps of work in the smallest launch, None without one; the calls "
        "recorded and replayed with $JAX_EP_CPU_REPLAY). The cross-check of jax_ep.tools.account.");
  m.def("workspace", &Workspace, nb::arg("target"), nb::arg("num_ranks"),
        nb::arg("num_tokens"), nb::arg("top_k"), nb::arg("num_experts"), nb::arg("stacked"),
        "Length of the int32 workspace result of FFI target `target` (jax_ep_dispatch or "
        "jax_ep_ll_dispatch_send) for `stacked` ranks per call.");
  jax_ep::ffi::BindRuntime(m);
}
