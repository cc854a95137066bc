// Exchange kernels with virtual ranks: the ops of cuda/virtual_ops.h, each phase one kernel
// over all R ranks' items on XLA's stream.
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "cuda/api.h"
#include "cuda/kernels.h"
#include "cuda/phases.cuh"
#include "cuda/setup.cuh"
#include "cuda/virtual_ops.h"

namespace jax_ep::cuda {
namespace {

// The GPU launcher of cuda/virtual_ops.h; launches after a failed one do nothing.
struct VirtualLauncher {
  int ranks, num_sms;
  cudaStream_t stream;
  cudaError_t status = cudaSuccess;

  template <typename Phase, typename Tail = NoTail>
  void per_warp(const Phase& phase, int64_t items, const Tail& tail = {}) {
    if (status == cudaSuccess) {
      status = cuda::per_warp(phase, 0, ranks, items, stream, num_sms, tail);
    }
  }
};

}  // namespace

cudaError_t stream_ticket(cudaStream_t stream, unsigned** ticket) {
  static std::mutex mutex;
  static std::unordered_map<cudaStream_t, unsigned*> tickets;  // kept for the process
  std::lock_guard<std::mutex> lock(mutex);
  unsigned*& t = tickets[stream];
  if (t == nullptr) {
    // Once per stream, and never part of a CUDA graph XLA may be capturing (cuda/setup.cuh).
    unsigned* fresh = nullptr;
    Setup setup;
    cudaError_t status = cudaMalloc(&fresh, sizeof(unsigned));
    if (status == cudaSuccess) status = setup.zero(fresh, sizeof(unsigned));
    if (status == cudaSuccess) status = setup.finish();
    if (status != cudaSuccess) {
      tickets.erase(stream);
      return status;
    }
    t = fresh;
  }
  *ticket = t;
  return cudaSuccess;
}

PeerError launch_error(int op, cudaError_t status) {
  if (status == cudaSuccess) return PeerError{};
  return PeerError{std::string("CUDA error in ") + kPeerOpNames[op] + ": " +
                   error_text(status)};
}

template <typename Args>
PeerError run_virtual_ranks(int op, const Args& a, int num_sms, cudaStream_t stream) {
  VirtualLauncher l{a.num_ranks, num_sms, stream};
  run_virtual(l, op, a);
  return launch_error(op, l.status);
}

#define JAX_EP_INSTANTIATE(Args) \
  template PeerError run_virtual_ranks<Args>(int, const Args&, int, cudaStream_t);
JAX_EP_FOR_EACH_OP_ARGS(JAX_EP_INSTANTIATE)
#undef JAX_EP_INSTANTIATE

}  // namespace jax_ep::cuda
