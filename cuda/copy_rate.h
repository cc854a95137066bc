// The copy-rate microbenchmark's body (jax_ep/tools/copy_rate.py): the kernels' row copy
// (copy_row, cuda/primitives.h) alone, so that the rate one warp reaches with a given number
// of loads in flight, which the performance model's rates rest on, is measured apart from any
// op's bookkeeping. `warps` warps copy `bytes` from src to dst as rows of `row_bytes` (the last
// one shorter where the size is not a multiple), each warp a contiguous share of the rows, as
// a phase's warp takes its items. On the GPU each warp is a block of its own, so the warps are
// the SMs the copy occupies (cuda/copy_rate.cu); on the CPU the same body runs on a 32-lane
// grid (ffi/copy_rate.cc). Beside it, the same copy with Hopper's bulk copies (CopyRateBulk).
#pragma once

#include <cstdint>

#include "cuda/primitives.h"

namespace jax_ep {

struct CopyRateArgs {
  const char* src;
  char* dst;
  int64_t bytes;
  int64_t row_bytes;  // at least 1, below 2^31 (copy_row counts a row's words in an int)
  int64_t warps;      // at least 1

  JAX_EP_HOST_DEVICE int64_t rows() const { return (bytes + row_bytes - 1) / row_bytes; }
  // The first row of warp w's share (w == warps: the end): the rows split as evenly as whole
  // rows allow, so that no warp waits on another's extra rows.
  JAX_EP_HOST_DEVICE int64_t first_row(int64_t w) const { return rows() * w / warps; }
};

// Warp w copies its share, each row with kWords loads in flight per lane.
template <int kWords>
struct CopyRate {
  CopyRateArgs a;
  JAX_EP_HOST_DEVICE void operator()(int, int64_t w, int lane, int lanes) const {
    const int64_t end = a.first_row(w + 1);
    for (int64_t row = a.first_row(w); row < end; ++row) {
      const int64_t at = row * a.row_bytes;
      const int64_t rest = a.bytes - at;
      copy_row<kWords>(a.dst + at, a.src + at, rest < a.row_bytes ? rest : a.row_bytes, lane,
                       lanes);
    }
  }
};

// The bulk variant: Hopper's bulk copies (cp.async.bulk, the TMA's unit), global -> shared ->
// global, issued by one lane with kBulkStages chunks of kBulkChunk bytes in flight per warp:
// what a copy reaches without a register per word. A warp's share of rows is one contiguous
// run of bytes, so it is copied as such, its last bytes that do not make 16 (the bulk copies'
// unit) with copy_row. Elsewhere (the CPU, GPUs before sm_90) and where the share does not
// start 16-byte aligned (rows whose size is not a multiple of 16), the plain copy with the
// streams' loads in flight.
constexpr int kBulkChunk = 4096;
constexpr int kBulkStages = 8;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace bulk {

__device__ inline uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The load of `bytes` into shared memory; `bar` completes its phase when they are there.
__device__ inline void load(void* to, const void* from, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(shared_address(bar)), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(shared_address(to)), "l"(from), "r"(bytes), "r"(shared_address(bar)) : "memory");
}

__device__ inline void wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}" ::"r"(shared_address(bar)), "r"(parity) : "memory");
}

// The store of `bytes` from shared memory, as a bulk group of its own.
__device__ inline void store(void* to, const void* from, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               ::"l"(to), "r"(shared_address(from)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from src to dst; one lane.
__device__ inline void copy(char* dst, const char* src, int64_t bytes) {
  __shared__ alignas(128) char stage[kBulkStages][kBulkChunk];
  __shared__ uint64_t bars[kBulkStages];
  for (int s = 0; s < kBulkStages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&bars[s]))
                 : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the inits, to the TMA
  const int64_t chunks = (bytes + kBulkChunk - 1) / kBulkChunk;
  auto size = [&](int64_t i) {
    const int64_t rest = bytes - i * kBulkChunk;
    return static_cast<uint32_t>(rest < kBulkChunk ? rest : kBulkChunk);
  };
  for (int64_t i = 0; i < chunks && i < kBulkStages; ++i) {
    load(stage[i], src + i * kBulkChunk, size(i), &bars[i]);
  }
  for (int64_t i = 0; i < chunks; ++i) {
    const int s = static_cast<int>(i % kBulkStages);
    wait(&bars[s], static_cast<uint32_t>(i / kBulkStages) & 1u);
    store(dst + i * kBulkChunk, stage[s], size(i));
    if (i + kBulkStages < chunks) {
      // The stage is loaded again only once the store has read it.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(stage[s], src + (i + kBulkStages) * kBulkChunk, size(i + kBulkStages), &bars[s]);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // written before the block ends
  for (int s = 0; s < kBulkStages; ++s) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(shared_address(&bars[s]))
                 : "memory");
  }
}

}  // namespace bulk
#endif

struct CopyRateBulk {
  CopyRateArgs a;
  JAX_EP_HOST_DEVICE void operator()(int, int64_t w, int lane, int lanes) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int64_t first = a.first_row(w) * a.row_bytes, last = a.first_row(w + 1) * a.row_bytes;
    const int64_t begin = first < a.bytes ? first : a.bytes, end = last < a.bytes ? last : a.bytes;
    const int64_t whole = (end - begin) / 16 * 16;
    const uintptr_t bits = reinterpret_cast<uintptr_t>(a.src + begin) |
                           reinterpret_cast<uintptr_t>(a.dst + begin);
    if (bits % 16 == 0) {
      if (lane == 0 && whole > 0) bulk::copy(a.dst + begin, a.src + begin, whole);
      __syncwarp();
      copy_row(a.dst + begin + whole, a.src + begin + whole, end - begin - whole, lane, lanes);
      return;
    }
#endif
    CopyRate<kStreamWordsInFlight>{a}(0, w, lane, lanes);
  }
};

// Calls run(body) with the body of words_in_flight: CopyRate<K> for K 4 (the phases'), 8 (the
// streams') or 16, CopyRateBulk for 0 (the bulk copy); false, running nothing, for any other.
template <typename Run>
bool with_copy_rate_body(const CopyRateArgs& a, int64_t words_in_flight, const Run& run) {
  switch (words_in_flight) {
    case 0:
      run(CopyRateBulk{a});
      return true;
    case 4:
      run(CopyRate<4>{a});
      return true;
    case 8:
      run(CopyRate<8>{a});
      return true;
    case 16:
      run(CopyRate<16>{a});
      return true;
    default:
      return false;
  }
}

}  // namespace jax_ep
