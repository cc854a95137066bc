// FFI targets of the dispatch and combine ops; the bodies are in cuda/exchange.h. Operands and
// results stack V ranks on their leading axis: V = R with virtual ranks (all R ranks of the
// group in one call), V = 1 between devices (one rank per device, peers through NVSHMEM on GPUs, through host
// peers on CPU devices). Shapes below write R for that leading axis. Every target takes the attribute
// num_ranks (R) and, before the operands listed below, `ranks` s32 [R]: the EP rank of each
// stacked rank (0..R-1 with virtual ranks; the EP axis index between devices), then a token;
// its first result is the next token (the one order of exchanges, jax_ep/_exchange_order.py).
//
// The targets are named by kPeerOpNames (cuda/peer_ops.h). Each takes its operands and
// results as variadic lists (the order is documented at the parser below and mirrored by
// jax_ep/_exchange_ffi.py) and a few int64 attributes. The parsers check every shape and dtype
// and fill the argument struct of the bodies; the CPU handlers (exchange_cpu.cc) then run the
// op on the CPU, the CUDA handlers (exchange_cuda.cc) as kernels (cuda/kernels.h).
#pragma once

#include <cstdint>
#include <string_view>
#include <variant>

#include "cuda/ep_group.h"
#include "cuda/exchange.h"
#include "cuda/peer_ops.h"
#include "ffi/ffi_helpers.h"

namespace jax_ep::ffi {


// Element type of combine's rows.
enum class RowType { kF32, kBF16, kF16 };

// Operands x [R,T,H], scales f32 [R,T,S], topk_idx s32 [R,T,K], topk_weights f32 [R,T,K].
// Results: recv_x [R,cap,H], recv_scales [R,cap,S], recv_idx s32 and recv_weights f32
// ([R,cap,K] rank-major, [R,cap] expert-major), num_received [R], tokens_per_expert [R,E/R],
// num_dropped [R], num_invalid [R], clean_idx [R,T,K], recv_src [R,rows], src_row [R,R*T],
// entry_row [R,cap'], entry_choice [R,cap'], row_entries [R,rows',K] (cap' = cap and
// rows' = R*T when expert-major, else 0), num_needed [R], workspace s32 [W]
// (W: carve_dispatch_workspace, cuda/exchange.h). Rows of recv_x and recv_scales past the count
// are not written (docs/contract.md, "Padding") unless the handler's attribute zero_padding
// is set; the CPU handlers fill them with NaN bytes first. With `wire` (cuda/wire.h; 0: none)
// the send casts x's bfloat16 rows to that format: scales are then [R,T,0], recv_x the
// format's data ([R,cap,H] float8_e4m3fn, nvfp4 [R,cap,H/2] uint8) and recv_scales
// [R,cap,S] its scale words (jax_ep.quant.to_rows); `dequantize` (one rank per device, not
// virtual ranks): recv_x is instead the rows dequantized to bfloat16 [1,cap,H], recv_scales
// [1,cap,0].
xffi::Error ParseDispatch(xffi::RemainingArgs args, xffi::RemainingRets rets, int64_t num_ranks,
                          int64_t num_experts, int64_t capacity, int64_t expert_major,
                          int64_t wire, bool dequantize, DispatchArgs* out);

// Operands y [R,cap,H] (f32, bf16 or f16), weights f32 [R,cap] or [R,0], src_row s32
// [R,R*T], row_entries s32 [R,R*T,K] (expert-major) or [R,0,K]. Result: out [R,T,H] in y's
// type. `wire` (cuda/wire.h; bfloat16 y, one rank per device): the rows travel home in that
// format (CombineArgs::wire).
xffi::Error ParseCombine(xffi::RemainingArgs args, xffi::RemainingRets rets, int64_t num_ranks,
                         int64_t expert_major, int64_t wire, RowType* type,
                         CombineArgs<float>* out);

// The parsed arguments with the rows' real element type.
template <typename T>
CombineArgs<T> Retype(const CombineArgs<float>& a) {
  CombineArgs<T> out{};
  out.num_ranks = a.num_ranks;
  out.num_tokens = a.num_tokens;
  out.top_k = a.top_k;
  out.hidden = a.hidden;
  out.capacity = a.capacity;
  out.expert_major = a.expert_major;
  out.y = reinterpret_cast<const T*>(a.y);
  out.weights = a.weights;
  out.src_row = a.src_row;
  out.row_entries = a.row_entries;
  out.out = reinterpret_cast<T*>(a.out);
  out.first_rank = a.first_rank;
  out.rings = a.rings;
  out.wire = a.wire;
  return out;
}

// Operands x bf16 [R,T,H], topk_idx s32 [R,T,K]; `wire`, the rows' wire format (cuda/wire.h).
// Results: recv_x [R,E/R,R*T,·] (bf16 [H]; float8_e4m3fn [H] for e4m3, e4m3_ue8m0 and mxfp8;
// u8 [H/2] for nvfp4), recv_scales f32 [R,E/R,R*T,wire_scale_words] (the rows' other bytes,
// jax_ep.quant.to_rows; 0 words for bf16), src_row s32 [R,R,T,K], clean_idx s32 [R,T,K],
// num_invalid s32 [R], count s32 [R,E/R] (the receive's, written by the send with virtual
// ranks; [1,0] between devices), workspace s32 [W] (W: carve_ll_workspace, cuda/exchange.h).
xffi::Error ParseLowLatencyDispatchSend(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                        int64_t num_ranks, int64_t num_experts, int64_t wire,
                                        LowLatencyArgs* out);

// Between devices only (with virtual ranks the send delivers). Operands recv_x, recv_scales,
// src_row as returned by the send (their shapes give the rows' sizes). Results: recv_x,
// recv_scales and src_row (aliasing the operands) and count s32 [1,E/R].
xffi::Error ParseLowLatencyDispatchRecv(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                        int64_t num_ranks, int64_t num_experts,
                                        LowLatencyArgs* out);

// Between devices only (with virtual ranks the receive reads y in place). Operands y bf16
// [1,E/R,R*T,H], src_row s32 [1,R,T,K]. Result: staging bf16 [1,T,K,H].
xffi::Error ParseLowLatencyCombineSend(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                       int64_t num_ranks, int64_t num_experts,
                                       LowLatencyCombineArgs* out);

// Operands rows, src_row s32 [R,R,T,K], clean_idx s32 [R,T,K], topk_weights f32 [R,T,K];
// rows are y bf16 [R,E/R,R*T,H] with virtual ranks, the send's staging bf16 [1,T,K,H]
// between devices. Result: out bf16 [R,T,H].
xffi::Error ParseLowLatencyCombineRecv(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                       int64_t num_ranks, int64_t num_experts,
                                       LowLatencyCombineArgs* out);

// Operands x [R,T,W] (any dtype), recv_src s32 [R,N], entry_row s32 [R,cap] (expert-major)
// or [R,0]; N = cap rank-major, R*T expert-major. Result: out [R,cap,W] in x's type (zeros in
// the slots that hold no row).
xffi::Error ParseDispatchRows(xffi::RemainingArgs args, xffi::RemainingRets rets,
                              int64_t num_ranks, int64_t expert_major, RowsArgs* out);

// One call of an exchange target, parsed.
using OpArgs = std::variant<DispatchArgs, CombineArgs<float>, CombineArgs<Bf16>, CombineArgs<F16>,
                            LowLatencyArgs, LowLatencyCombineArgs, RowsArgs>;
struct Call {
  OpArgs args;
  bool between;          // one rank of several devices (else virtual ranks)
  const int32_t* ranks;  // the ranks operand's data (device memory on GPUs)
  int num_sms = 0;  // launches on at most this many SMs (CPU grid: blocks); 0: no bound
  GroupTable groups;  // between devices: the attribute ep_groups (cuda/ep_group.h), if any
};

// Parses a call of target `op` (PeerOp, cuda/peer_ops.h): its attributes, its ranks operand
// and the operands and results of its parser above. Every target binds the same way on each
// platform (exchange_cpu.cc, exchange_cuda.cc): the ranks operand, the order token in and out,
// the remaining operands and results, and the attributes as a dictionary.
xffi::Error ParseCall(int op, const xffi::AnyBuffer& ranks, xffi::RemainingArgs args,
                      xffi::RemainingRets rets, const xffi::Dictionary& attrs, Call* call);

// X(Name, op) for every exchange target, in PeerOp order. Its handlers (C symbols, wrapped in
// capsules by module.cc) are Name##Cpu (exchange_cpu.cc) and Name##Cuda (exchange_cuda.cc).
#define JAX_EP_FOR_EACH_EXCHANGE_TARGET(X)                                                     \
  X(Dispatch, kPeerDispatch) X(Combine, kPeerCombine)                                          \
  X(LowLatencyDispatchSend, kPeerLlDispatchSend) X(LowLatencyDispatchRecv, kPeerLlDispatchRecv) \
  X(LowLatencyCombineSend, kPeerLlCombineSend) X(LowLatencyCombineRecv, kPeerLlCombineRecv) \
  X(DispatchRows, kPeerDispatchRows)

#define JAX_EP_DECLARE_HANDLERS(Name, op)      \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Name##Cpu);   \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Name##Cuda);
JAX_EP_FOR_EACH_EXCHANGE_TARGET(JAX_EP_DECLARE_HANDLERS)
#undef JAX_EP_DECLARE_HANDLERS

}  // namespace jax_ep::ffi
