// The phases of cuda/exchange.h as function objects, for any launcher: the CUDA kernels
// (cuda/phases.cuh) and the CPU's emulated grids (cuda/host_launch.h). A functor holds the
// op's arguments and, for phases that reach other ranks, the Peers view (passed by value:
// kernel arguments on the GPU).
#pragma once

#include <cstdint>

#include "cuda/exchange.h"

namespace jax_ep {

template <typename Peers>
struct DispatchCount {
  DispatchArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t c, int lane, int lanes) const {
    dispatch_count(a, peers, s, static_cast<int>(c), lane, lanes);
  }
};
struct DispatchBases {
  DispatchArgs a;
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t c) const {
    dispatch_bases(a, s, static_cast<int>(c));
  }
};
template <typename Peers>
struct DispatchSend {
  DispatchArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t t, int lane, int lanes) const {
    dispatch_send(a, peers, s, static_cast<int>(t), lane, lanes);
  }
};
template <typename Peers>
struct DispatchFinish {
  DispatchArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t i, int lane, int lanes) const {
    dispatch_finish(a, peers, d, static_cast<int>(i), lane, lanes);
  }
};
template <typename T>
struct CombineStage {
  CombineArgs<T> a;
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t src, int lane, int lanes) const {
    combine_stage(a, d, src, lane, lanes);
  }
};
template <typename T>
struct CombineReduceEntries {
  CombineArgs<T> a;
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t i, int lane, int lanes) const {
    combine_reduce_entries(a, d, static_cast<int>(i), lane, lanes);
  }
};
template <typename T, typename Peers>
struct CombineToken {
  CombineArgs<T> a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t t, int lane, int lanes) const {
    combine_token(a, peers, s, static_cast<int>(t), lane, lanes);
  }
};
template <typename Peers>
struct LowLatencyCount {
  LowLatencyArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t c, int lane, int lanes) const {
    ll_count(a, peers, s, static_cast<int>(c), lane, lanes);
  }
};
template <typename Peers>
struct LowLatencySend {
  LowLatencyArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t t, int lane, int lanes) const {
    ll_send(a, peers, s, static_cast<int>(t), lane, lanes);
  }
};
template <typename Peers>
struct LowLatencyFinish {
  LowLatencyArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t r, int lane, int lanes) const {
    ll_finish(a, peers, d, r, lane, lanes);
  }
};
template <typename Peers>
struct LowLatencyCombineSend {
  LowLatencyCombineArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t src, int lane, int lanes) const {
    ll_combine_send(a, peers, d, src, lane, lanes);
  }
};
struct LowLatencyCombineToken {
  LowLatencyCombineArgs a;
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t t, int lane, int lanes) const {
    ll_combine_token(a, s, static_cast<int>(t), lane, lanes);
  }
};

}  // namespace jax_ep
