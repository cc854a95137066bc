// Exchange kernels with virtual ranks: the ops of cuda/virtual_ops.h, each phase one kernel
// over all R ranks' items on XLA's stream.
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/phases.cuh"
#include "cuda/virtual_ops.h"

namespace jax_ep::cuda {
namespace {

// The GPU launcher of cuda/virtual_ops.h; launches after a failed one do nothing.
struct VirtualLauncher {
  int ranks;
  cudaStream_t stream;
  cudaError_t status = cudaSuccess;

  template <typename Phase>
  void per_thread(const Phase& phase, int64_t items) {
    if (status == cudaSuccess) status = cuda::per_thread(phase, 0, ranks, items, stream);
  }
  template <typename Phase>
  void per_warp(const Phase& phase, int64_t items) {
    if (status == cudaSuccess) status = cuda::per_warp(phase, 0, ranks, items, stream);
  }
};

}  // namespace

cudaError_t launch_dispatch(const DispatchArgs& a, cudaStream_t stream) {
  VirtualLauncher l{a.num_ranks, stream};
  run_virtual_dispatch(l, a);
  return l.status;
}

template <typename T>
cudaError_t launch_combine(const CombineArgs<T>& a, cudaStream_t stream) {
  VirtualLauncher l{a.num_ranks, stream};
  run_virtual_combine(l, a);
  return l.status;
}

template cudaError_t launch_combine<float>(const CombineArgs<float>&, cudaStream_t);
template cudaError_t launch_combine<Bf16>(const CombineArgs<Bf16>&, cudaStream_t);
template cudaError_t launch_combine<F16>(const CombineArgs<F16>&, cudaStream_t);

cudaError_t launch_ll_dispatch(int op, const LowLatencyArgs& a, cudaStream_t stream) {
  VirtualLauncher l{a.num_ranks, stream};
  run_virtual_ll_dispatch(l, op, a);
  return l.status;
}

cudaError_t launch_ll_combine(const LowLatencyCombineArgs& a, cudaStream_t stream) {
  VirtualLauncher l{a.num_ranks, stream};
  run_virtual_ll_combine(l, a);
  return l.status;
}

}  // namespace jax_ep::cuda
