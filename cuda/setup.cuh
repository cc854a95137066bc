// One-time setup of device state (allocations, zeroed counters, tables) by a handler that XLA
// may be capturing into a CUDA graph (a command buffer: ffi/exchange_cuda.cc). Such setup must
// not be recorded, or every replay would redo it, and in the capture mode XLA's capturing
// thread runs under, allocating and synchronizing are refused. A Setup relaxes the thread's
// capture mode while it lives and runs its fills and copies on a stream of its own, waited for
// before the setup ends; with no capture under way it is plain setup on a side stream.
#pragma once

#include <cuda_runtime_api.h>

namespace jax_ep::cuda {

class Setup {
 public:
  Setup() {
    cudaThreadExchangeStreamCaptureMode(&mode_);
    status_ = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  }
  ~Setup() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    cudaThreadExchangeStreamCaptureMode(&mode_);  // back to the caller's mode
  }
  Setup(const Setup&) = delete;
  Setup& operator=(const Setup&) = delete;

  // Zeroes `bytes` at `p` (device memory); the first error of the setup so far.
  cudaError_t zero(void* p, size_t bytes) {
    if (status_ == cudaSuccess) status_ = cudaMemsetAsync(p, 0, bytes, stream_);
    return status_;
  }
  cudaError_t copy_to_device(void* dst, const void* src, size_t bytes) {
    if (status_ == cudaSuccess) {
      status_ = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_);
    }
    return status_;
  }
  // Waits for the fills and copies: they are done before any later launch.
  cudaError_t finish() {
    if (status_ == cudaSuccess) status_ = cudaStreamSynchronize(stream_);
    return status_;
  }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  cudaStream_t stream_ = nullptr;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace jax_ep::cuda
