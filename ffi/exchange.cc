// Parsers of the exchange targets (ffi/exchange.h): shapes, dtypes and the argument structs.
#include "ffi/exchange.h"

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>

namespace jax_ep::ffi {
namespace {

using xffi::AnyBuffer;
using xffi::DataType;

// Sentinel for "any dtype" in the checks below.
constexpr DataType kAnyType = DataType::INVALID;

std::string TypeName(DataType t) {
  switch (t) {
    case DataType::F32: return "float32";
    case DataType::BF16: return "bfloat16";
    case DataType::F16: return "float16";
    case DataType::S32: return "int32";
    case DataType::F8E4M3FN: return "float8_e4m3fn";
    default: return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

// Checks one buffer (an operand or a result) and returns its data pointer.
xffi::Error Check(std::string_view op, std::string_view name, const AnyBuffer& buffer,
                  DataType dtype, std::initializer_list<int64_t> dims, void** data) {
  if (dtype != kAnyType && buffer.element_type() != dtype) {
    return xffi::Error::InvalidArgument(std::string(op) + ": " + std::string(name) + " must be " +
                                        TypeName(dtype) + ", got " +
                                        TypeName(buffer.element_type()));
  }
  JAX_EP_RETURN_IF_ERROR(CheckDims(op, name, buffer, dims));
  *data = buffer.untyped_data();
  return xffi::Error::Success();
}

// Index-checked access to the variadic operands and results.
class Buffers {
 public:
  Buffers(std::string_view op, xffi::RemainingArgs args, xffi::RemainingRets rets)
      : op_(op), args_(args), rets_(rets) {}

  xffi::Error Count(size_t num_args, size_t num_rets) const {
    if (args_.size() == num_args && rets_.size() == num_rets) return xffi::Error::Success();
    return xffi::Error::InvalidArgument(
        std::string(op_) + ": expected " + std::to_string(num_args) + " operands and " +
        std::to_string(num_rets) + " results, got " + std::to_string(args_.size()) + " and " +
        std::to_string(rets_.size()));
  }
  AnyBuffer Arg(size_t i) const { return *args_.get<AnyBuffer>(i); }
  AnyBuffer Ret(size_t i) const { return **rets_.get<AnyBuffer>(i); }

  template <typename T>
  xffi::Error In(size_t i, std::string_view name, DataType dtype,
                 std::initializer_list<int64_t> dims, const T** data) const {
    void* p = nullptr;
    JAX_EP_RETURN_IF_ERROR(Check(op_, name, Arg(i), dtype, dims, &p));
    *data = static_cast<const T*>(p);
    return xffi::Error::Success();
  }
  template <typename T>
  xffi::Error Out(size_t i, std::string_view name, DataType dtype,
                  std::initializer_list<int64_t> dims, T** data) const {
    void* p = nullptr;
    JAX_EP_RETURN_IF_ERROR(Check(op_, name, Ret(i), dtype, dims, &p));
    *data = static_cast<T*>(p);
    return xffi::Error::Success();
  }

 private:
  std::string_view op_;
  xffi::RemainingArgs args_;
  xffi::RemainingRets rets_;
};

xffi::Error Invalid(std::string_view op, const std::string& what) {
  return xffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// The kernels index with 32-bit rows and offsets.
xffi::Error CheckInt32(std::string_view op, std::string_view name, int64_t value) {
  if (value >= 0 && value <= INT32_MAX) return xffi::Error::Success();
  return Invalid(op, std::string(name) + " = " + std::to_string(value) +
                         " is outside [0, 2^31 - 1]");
}

xffi::Error CheckExperts(std::string_view op, int64_t num_experts, int64_t num_ranks) {
  if (num_experts >= 1 && num_experts % num_ranks == 0 && num_experts <= INT32_MAX) {
    return xffi::Error::Success();
  }
  return Invalid(op, "num_experts (" + std::to_string(num_experts) +
                         ") must be a positive multiple of the number of ranks (" +
                         std::to_string(num_ranks) + ")");
}

// The operands stack V ranks: all R of them (virtual ranks) or this rank alone (V = 1).
xffi::Error CheckStack(std::string_view op, int64_t stacked, int64_t num_ranks) {
  if (num_ranks >= 1 && (stacked == num_ranks || stacked == 1)) return xffi::Error::Success();
  return Invalid(op, "the operands stack " + std::to_string(stacked) +
                         " ranks; expected num_ranks (" + std::to_string(num_ranks) +
                         ", virtual ranks) or 1 (one rank per device)");
}

// Whether operands stacking `stacked` ranks of a group of num_ranks are one rank of several
// devices (else every rank of the group: virtual ranks).
bool Between(int64_t stacked, int64_t num_ranks) { return stacked == 1 && num_ranks > 1; }

// Checks the `ranks` operand against the stacked count of the op's operands (the leading
// dimension of args[stacked_operand]); `*between`: this call is one rank of several devices.
xffi::Error ParseRanks(std::string_view op, const AnyBuffer& ranks,
                       const xffi::RemainingArgs& args, size_t stacked_operand,
                       int64_t num_ranks, bool* between, const int32_t** data) {
  const int64_t stacked = args.get<AnyBuffer>(stacked_operand)->dimensions()[0];
  void* p = nullptr;
  JAX_EP_RETURN_IF_ERROR(Check(op, "ranks", ranks, DataType::S32, {stacked}, &p));
  *data = static_cast<const int32_t*>(p);
  *between = Between(stacked, num_ranks);
  return xffi::Error::Success();
}

}  // namespace

// The element type of a row's data in wire format `wire` (low-latency rows, and the rows a
// dispatch's send casts).
static DataType WireDataType(int wire) {
  return wire == kWireBf16 ? DataType::BF16 : wire == kWireNvfp4 ? DataType::U8
                                                                  : DataType::F8E4M3FN;
}

static xffi::Error CheckWire(std::string_view op, int64_t wire) {
  if (wire < 0 || wire >= kNumWires) {
    return Invalid(op, "wire format " + std::to_string(wire) + " is not one of 0.." +
                           std::to_string(kNumWires - 1) + " (cuda/wire.h)");
  }
  return xffi::Error::Success();
}

xffi::Error ParseDispatch(xffi::RemainingArgs args, xffi::RemainingRets rets, int64_t num_ranks,
                          int64_t num_experts, int64_t capacity, int64_t expert_major,
                          int64_t wire, bool dequantize, DispatchArgs* a) {
  const std::string_view op = kPeerOpNames[kPeerDispatch];
  Buffers b(op, args, rets);
  JAX_EP_RETURN_IF_ERROR(b.Count(4, 16));
  const AnyBuffer idx = b.Arg(2);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "topk_idx", idx, 3));
  const int64_t V = idx.dimensions()[0], T = idx.dimensions()[1], K = idx.dimensions()[2];
  const int64_t R = num_ranks;
  JAX_EP_RETURN_IF_ERROR(CheckStack(op, V, R));
  JAX_EP_RETURN_IF_ERROR(CheckExperts(op, num_experts, R));
  JAX_EP_RETURN_IF_ERROR(CheckInt32(op, "capacity", capacity));
  JAX_EP_RETURN_IF_ERROR(CheckInt32(op, "R*T*K", R * T * K));
  const AnyBuffer x = b.Arg(0);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "x", x, 3));
  JAX_EP_RETURN_IF_ERROR(CheckWire(op, wire));
  const int64_t H = x.dimensions()[2];
  const bool casts = wire != kWireBf16;
  if (casts && x.element_type() != DataType::BF16) {
    return Invalid(op, "the send casts bfloat16 rows to wire format " + std::to_string(wire) +
                           "; x is " + TypeName(x.element_type()));
  }
  if (casts && H % wire_block(static_cast<int>(wire)) != 0) {
    return Invalid(op, "wire format " + std::to_string(wire) + " casts blocks of " +
                           std::to_string(wire_block(static_cast<int>(wire))) +
                           " channels; H = " + std::to_string(H) + " is not a multiple");
  }
  if (dequantize && (!casts || !Between(V, R))) {
    return Invalid(op, "dequantize needs a wire format and one rank per device (V = 1 of R > "
                       "1; virtual ranks write the rows as they travel); got wire " +
                           std::to_string(wire) + ", V = " + std::to_string(V) +
                           ", R = " + std::to_string(R));
  }
  const int64_t S = casts ? wire_scale_words(static_cast<int>(wire), H)
                    : b.Arg(1).dimensions().size() == 3 ? b.Arg(1).dimensions()[2] : 0;
  // The received rows' data elements and their type: x's, or the wire format's (bytes), or,
  // dequantized, bfloat16 channels without scales.
  const int64_t D = casts && !dequantize ? wire_data_bytes(static_cast<int>(wire), H) : H;
  const DataType recv_type = dequantize ? DataType::BF16
                             : casts    ? WireDataType(static_cast<int>(wire))
                                        : x.element_type();
  const int64_t E = num_experts, El = E / R, cap = capacity;
  const bool em = expert_major != 0;
  const int64_t rows = em ? R * T : cap;

  *a = DispatchArgs{};
  a->num_ranks = static_cast<int>(R);
  a->num_tokens = static_cast<int>(T);
  a->top_k = static_cast<int>(K);
  a->num_experts = static_cast<int>(E);
  a->capacity = static_cast<int>(cap);
  a->expert_major = em;
  a->row_bytes = casts ? wire_data_bytes(static_cast<int>(wire), H)
                       : H * static_cast<int64_t>(xffi::ByteWidth(x.element_type()));
  a->scale_cols = S;
  a->wire = static_cast<int>(wire);
  a->hidden = static_cast<int>(H);
  a->dequantize = dequantize;

  JAX_EP_RETURN_IF_ERROR(b.In(0, "x", kAnyType, {V, T, H}, &a->x));
  // A cast's scale words are the send's to write: x then comes without scales.
  JAX_EP_RETURN_IF_ERROR(b.In(1, "scales", DataType::F32, {V, T, casts ? 0 : S}, &a->scales));
  JAX_EP_RETURN_IF_ERROR(b.In(2, "topk_idx", DataType::S32, {V, T, K}, &a->topk_idx));
  JAX_EP_RETURN_IF_ERROR(b.In(3, "topk_weights", DataType::F32, {V, T, K}, &a->topk_weights));

  JAX_EP_RETURN_IF_ERROR(b.Out(0, "recv_x", recv_type, {V, cap, D}, &a->recv_x));
  JAX_EP_RETURN_IF_ERROR(
      b.Out(1, "recv_scales", DataType::F32, {V, cap, dequantize ? 0 : S}, &a->recv_scales));
  if (em) {
    JAX_EP_RETURN_IF_ERROR(b.Out(2, "recv_idx", DataType::S32, {V, cap}, &a->recv_idx));
    JAX_EP_RETURN_IF_ERROR(b.Out(3, "recv_weights", DataType::F32, {V, cap}, &a->recv_weights));
  } else {
    JAX_EP_RETURN_IF_ERROR(b.Out(2, "recv_idx", DataType::S32, {V, cap, K}, &a->recv_idx));
    JAX_EP_RETURN_IF_ERROR(
        b.Out(3, "recv_weights", DataType::F32, {V, cap, K}, &a->recv_weights));
  }
  JAX_EP_RETURN_IF_ERROR(b.Out(4, "num_received", DataType::S32, {V}, &a->num_received));
  JAX_EP_RETURN_IF_ERROR(
      b.Out(5, "tokens_per_expert", DataType::S32, {V, El}, &a->tokens_per_expert));
  JAX_EP_RETURN_IF_ERROR(b.Out(6, "num_dropped", DataType::S32, {V}, &a->num_dropped));
  JAX_EP_RETURN_IF_ERROR(b.Out(7, "num_invalid", DataType::S32, {V}, &a->num_invalid));
  JAX_EP_RETURN_IF_ERROR(b.Out(8, "clean_idx", DataType::S32, {V, T, K}, &a->clean_idx));
  JAX_EP_RETURN_IF_ERROR(b.Out(9, "recv_src", DataType::S32, {V, rows}, &a->recv_src));
  JAX_EP_RETURN_IF_ERROR(b.Out(10, "src_row", DataType::S32, {V, R * T}, &a->src_row));
  const int64_t em_cap = em ? cap : 0, em_rows = em ? R * T : 0;
  JAX_EP_RETURN_IF_ERROR(b.Out(11, "entry_row", DataType::S32, {V, em_cap}, &a->entry_row));
  JAX_EP_RETURN_IF_ERROR(
      b.Out(12, "entry_choice", DataType::S32, {V, em_cap}, &a->entry_choice));
  JAX_EP_RETURN_IF_ERROR(
      b.Out(13, "row_entries", DataType::S32, {V, em_rows, K}, &a->row_entries));
  JAX_EP_RETURN_IF_ERROR(b.Out(14, "num_needed", DataType::S32, {V}, &a->num_needed));
  int32_t* work = nullptr;
  JAX_EP_RETURN_IF_ERROR(b.Out(15, "workspace", DataType::S32,
                               {carve_dispatch_workspace(a, V)}, &work));
  carve_dispatch_workspace(a, V, work);
  return xffi::Error::Success();
}

xffi::Error ParseCombine(xffi::RemainingArgs args, xffi::RemainingRets rets, int64_t num_ranks,
                         int64_t expert_major, int64_t wire, RowType* type,
                         CombineArgs<float>* a) {
  const std::string_view op = kPeerOpNames[kPeerCombine];
  Buffers b(op, args, rets);
  JAX_EP_RETURN_IF_ERROR(b.Count(4, 1));
  const AnyBuffer y = b.Arg(0);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "y", y, 3));
  switch (y.element_type()) {
    case DataType::F32: *type = RowType::kF32; break;
    case DataType::BF16: *type = RowType::kBF16; break;
    case DataType::F16: *type = RowType::kF16; break;
    default:
      return Invalid(op, "y must be float32, bfloat16 or float16, got " +
                             TypeName(y.element_type()) + "; cast it, or use backend='xla'");
  }
  const int64_t V = y.dimensions()[0], cap = y.dimensions()[1], H = y.dimensions()[2];
  const int64_t R = num_ranks;
  JAX_EP_RETURN_IF_ERROR(CheckStack(op, V, R));
  const AnyBuffer entries = b.Arg(3);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "row_entries", entries, 3));
  const int64_t K = entries.dimensions()[2];
  const AnyBuffer src_row = b.Arg(2);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "src_row", src_row, 2));
  if (src_row.dimensions()[1] % R != 0) return Invalid(op, "src_row must be [V, R*T]");
  const int64_t T = src_row.dimensions()[1] / R;
  const bool em = expert_major != 0;
  const int64_t W = b.Arg(1).dimensions().size() == 2 ? b.Arg(1).dimensions()[1] : -2;
  if (W != 0 && W != cap) return Invalid(op, "weights must be [V, capacity] or [V, 0]");
  JAX_EP_RETURN_IF_ERROR(CheckInt32(op, "R*T*K", R * T * K));
  JAX_EP_RETURN_IF_ERROR(CheckInt32(op, "capacity", cap));
  JAX_EP_RETURN_IF_ERROR(CheckWire(op, wire));
  if (wire != kWireBf16) {
    const std::string format = "wire format " + std::to_string(wire);
    if (*type != RowType::kBF16) {
      return Invalid(op, "the stages cast bfloat16 rows to a " + format + "; y is " +
                             TypeName(y.element_type()) + " (cast it, or quantize in XLA)");
    }
    if (H % wire_block(static_cast<int>(wire)) != 0) {
      return Invalid(op, format + " casts blocks of " +
                             std::to_string(wire_block(static_cast<int>(wire))) +
                             " channels; H = " + std::to_string(H) + " is not a multiple");
    }
    if (!Between(V, R)) {
      return Invalid(op, "a " + format + " needs one rank per device (V = 1 of R > 1; virtual "
                         "ranks sum the rows where they are, nothing travels); got V = " +
                             std::to_string(V) + ", R = " + std::to_string(R));
    }
  }

  *a = CombineArgs<float>{};
  a->wire = static_cast<int>(wire);
  a->num_ranks = static_cast<int>(R);
  a->num_tokens = static_cast<int>(T);
  a->top_k = static_cast<int>(K);
  a->hidden = static_cast<int>(H);
  a->capacity = static_cast<int>(cap);
  a->expert_major = em;
  const DataType dtype = y.element_type();
  JAX_EP_RETURN_IF_ERROR(b.In(0, "y", dtype, {V, cap, H}, &a->y));
  JAX_EP_RETURN_IF_ERROR(b.In(1, "weights", DataType::F32, {V, W}, &a->weights));
  if (W == 0) a->weights = nullptr;
  JAX_EP_RETURN_IF_ERROR(b.In(2, "src_row", DataType::S32, {V, R * T}, &a->src_row));
  JAX_EP_RETURN_IF_ERROR(
      b.In(3, "row_entries", DataType::S32, {V, em ? R * T : 0, K}, &a->row_entries));
  JAX_EP_RETURN_IF_ERROR(b.Out(0, "out", dtype, {V, T, H}, &a->out));
  return xffi::Error::Success();
}

xffi::Error ParseLowLatencyDispatchSend(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                        int64_t num_ranks, int64_t num_experts, int64_t wire,
                                        LowLatencyArgs* a) {
  const std::string_view op = kPeerOpNames[kPeerLlDispatchSend];
  Buffers b(op, args, rets);
  JAX_EP_RETURN_IF_ERROR(b.Count(2, 7));
  const AnyBuffer idx = b.Arg(1);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "topk_idx", idx, 3));
  const int64_t V = idx.dimensions()[0], T = idx.dimensions()[1], K = idx.dimensions()[2];
  const int64_t R = num_ranks;
  JAX_EP_RETURN_IF_ERROR(CheckStack(op, V, R));
  JAX_EP_RETURN_IF_ERROR(CheckExperts(op, num_experts, R));
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "x", b.Arg(0), 3));
  const int64_t H = b.Arg(0).dimensions()[2];
  if (H % kFp8Block != 0) {
    return Invalid(op, "the hidden size (" + std::to_string(H) + ") must be a multiple of 128");
  }
  JAX_EP_RETURN_IF_ERROR(CheckWire(op, wire));
  const int64_t E = num_experts, El = E / R;
  const int64_t D = wire_data_bytes(static_cast<int>(wire), H);
  const int64_t S = wire_scale_words(static_cast<int>(wire), H);
  JAX_EP_RETURN_IF_ERROR(CheckInt32(op, "E/R*R*T", El * R * T));
  JAX_EP_RETURN_IF_ERROR(CheckInt32(op, "R*T*K", R * T * K));

  *a = LowLatencyArgs{};
  a->num_ranks = static_cast<int>(R);
  a->num_tokens = static_cast<int>(T);
  a->top_k = static_cast<int>(K);
  a->num_experts = static_cast<int>(E);
  a->hidden = static_cast<int>(H);
  a->wire = static_cast<int>(wire);
  JAX_EP_RETURN_IF_ERROR(b.In(0, "x", DataType::BF16, {V, T, H}, &a->x));
  JAX_EP_RETURN_IF_ERROR(b.In(1, "topk_idx", DataType::S32, {V, T, K}, &a->topk_idx));
  const int64_t elements = wire == kWireBf16 ? H : D;  // data elements of a row
  JAX_EP_RETURN_IF_ERROR(
      b.Out(0, "recv_x", WireDataType(a->wire), {V, El, R * T, elements}, &a->recv_x));
  JAX_EP_RETURN_IF_ERROR(
      b.Out(1, "recv_scales", DataType::F32, {V, El, R * T, S}, &a->recv_scales));
  JAX_EP_RETURN_IF_ERROR(b.Out(2, "src_row", DataType::S32, {V, R, T, K}, &a->src_row));
  JAX_EP_RETURN_IF_ERROR(b.Out(3, "clean_idx", DataType::S32, {V, T, K}, &a->clean_idx));
  JAX_EP_RETURN_IF_ERROR(b.Out(4, "num_invalid", DataType::S32, {V}, &a->num_invalid));
  // With every rank here the send writes the receive's count (it has no receive call).
  const int64_t counted = Between(V, R) ? 0 : El;
  JAX_EP_RETURN_IF_ERROR(b.Out(5, "count", DataType::S32, {V, counted}, &a->count));
  int32_t* work = nullptr;
  JAX_EP_RETURN_IF_ERROR(
      b.Out(6, "workspace", DataType::S32, {carve_ll_workspace(a, V)}, &work));
  carve_ll_workspace(a, V, work);
  return xffi::Error::Success();
}

xffi::Error ParseLowLatencyDispatchRecv(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                        int64_t num_ranks, int64_t num_experts,
                                        LowLatencyArgs* a) {
  const std::string_view op = kPeerOpNames[kPeerLlDispatchRecv];
  Buffers b(op, args, rets);
  JAX_EP_RETURN_IF_ERROR(b.Count(3, 4));
  const AnyBuffer x = b.Arg(0);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "recv_x", x, 4));
  const int64_t V = x.dimensions()[0], El = x.dimensions()[1], D = x.dimensions()[3];
  // The receive moves bytes: a wire format of the rows' sizes (e4m3 and mxfp8 rows have the
  // same) stands for the one they were sent in.
  const AnyBuffer scales = b.Arg(1);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "recv_scales", scales, 4));
  const int64_t H = x.element_type() == DataType::U8 ? 2 * D : D;  // channels of a row
  const int64_t S = scales.dimensions()[3];
  const int wire = x.element_type() == DataType::BF16 ? kWireBf16
                   : x.element_type() == DataType::U8 ? kWireNvfp4
                   : S == wire_scale_words(kWireE4m3, H) ? kWireE4m3 : kWireE4m3Ue8m0;
  if (S != wire_scale_words(wire, H)) {
    return Invalid(op, "recv_scales must hold the other bytes of each row of recv_x, as the "
                       "send returned them");
  }
  const int64_t R = num_ranks;
  JAX_EP_RETURN_IF_ERROR(CheckStack(op, V, R));
  if (!Between(V, R)) {
    return Invalid(op, "with virtual ranks (or one rank) low-latency dispatch has no receive: "
                       "the send's results are the received data");
  }
  if (x.dimensions()[2] % R != 0 || El * R != num_experts) {
    return Invalid(op, "recv_x must be [V, E/R, R*T, H] with E = num_experts");
  }
  const int64_t T = x.dimensions()[2] / R;
  const AnyBuffer src_row = b.Arg(2);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "src_row", src_row, 4));
  const int64_t K = src_row.dimensions()[3];

  *a = LowLatencyArgs{};
  a->num_ranks = static_cast<int>(R);
  a->num_tokens = static_cast<int>(T);
  a->top_k = static_cast<int>(K);
  a->num_experts = static_cast<int>(num_experts);
  a->hidden = static_cast<int>(H);
  a->wire = wire;
  const void* in_x = nullptr;
  const float* in_scales = nullptr;
  const int32_t* in_src_row = nullptr;
  JAX_EP_RETURN_IF_ERROR(b.In(0, "recv_x", WireDataType(a->wire), {V, El, R * T, D}, &in_x));
  JAX_EP_RETURN_IF_ERROR(b.In(1, "recv_scales", DataType::F32, {V, El, R * T, S}, &in_scales));
  JAX_EP_RETURN_IF_ERROR(b.In(2, "src_row", DataType::S32, {V, R, T, K}, &in_src_row));
  JAX_EP_RETURN_IF_ERROR(b.Out(0, "recv_x", x.element_type(), {V, El, R * T, D}, &a->recv_x));
  JAX_EP_RETURN_IF_ERROR(
      b.Out(1, "recv_scales", DataType::F32, {V, El, R * T, S}, &a->recv_scales));
  JAX_EP_RETURN_IF_ERROR(b.Out(2, "src_row", DataType::S32, {V, R, T, K}, &a->src_row));
  JAX_EP_RETURN_IF_ERROR(b.Out(3, "count", DataType::S32, {V, El}, &a->count));
  // The results alias the operands (input_output_aliases); anything else is a wiring error.
  if (a->recv_x != in_x || a->recv_scales != in_scales || a->src_row != in_src_row) {
    return xffi::Error::Internal(std::string(op) + ": recv_x, recv_scales and src_row must "
                                 "alias the operands (input_output_aliases {1: 0, 2: 1, 3: 2})");
  }
  return xffi::Error::Success();
}

xffi::Error ParseLowLatencyCombineSend(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                       int64_t num_ranks, int64_t num_experts,
                                       LowLatencyCombineArgs* a) {
  const std::string_view op = kPeerOpNames[kPeerLlCombineSend];
  Buffers b(op, args, rets);
  JAX_EP_RETURN_IF_ERROR(b.Count(2, 1));
  const AnyBuffer src_row = b.Arg(1);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "src_row", src_row, 4));
  const int64_t V = src_row.dimensions()[0], T = src_row.dimensions()[2];
  const int64_t K = src_row.dimensions()[3], R = num_ranks;
  JAX_EP_RETURN_IF_ERROR(CheckStack(op, V, R));
  if (!Between(V, R)) {
    return Invalid(op, "with virtual ranks low-latency combine has no send: call " +
                           std::string(kPeerOpNames[kPeerLlCombineRecv]) + " with y");
  }
  JAX_EP_RETURN_IF_ERROR(CheckExperts(op, num_experts, R));
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "y", b.Arg(0), 4));
  const int64_t El = num_experts / R, H = b.Arg(0).dimensions()[3];

  *a = LowLatencyCombineArgs{};
  a->num_ranks = static_cast<int>(R);
  a->num_tokens = static_cast<int>(T);
  a->top_k = static_cast<int>(K);
  a->num_experts = static_cast<int>(num_experts);
  a->hidden = static_cast<int>(H);
  JAX_EP_RETURN_IF_ERROR(b.In(0, "y", DataType::BF16, {V, El, R * T, H}, &a->y));
  JAX_EP_RETURN_IF_ERROR(b.In(1, "src_row", DataType::S32, {V, R, T, K}, &a->src_row));
  JAX_EP_RETURN_IF_ERROR(b.Out(0, "staging", DataType::BF16, {V, T, K, H}, &a->staging));
  return xffi::Error::Success();
}

xffi::Error ParseLowLatencyCombineRecv(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                       int64_t num_ranks, int64_t num_experts,
                                       LowLatencyCombineArgs* a) {
  const std::string_view op = kPeerOpNames[kPeerLlCombineRecv];
  Buffers b(op, args, rets);
  JAX_EP_RETURN_IF_ERROR(b.Count(4, 1));
  const AnyBuffer idx = b.Arg(2);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "clean_idx", idx, 3));
  const int64_t V = idx.dimensions()[0], T = idx.dimensions()[1], K = idx.dimensions()[2];
  const int64_t R = num_ranks;
  JAX_EP_RETURN_IF_ERROR(CheckStack(op, V, R));
  JAX_EP_RETURN_IF_ERROR(CheckExperts(op, num_experts, R));
  const AnyBuffer rows = b.Arg(0);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "rows", rows, 4));
  const int64_t El = num_experts / R, H = rows.dimensions()[3];

  *a = LowLatencyCombineArgs{};
  a->num_ranks = static_cast<int>(R);
  a->num_experts = static_cast<int>(num_experts);
  a->num_tokens = static_cast<int>(T);
  a->top_k = static_cast<int>(K);
  a->hidden = static_cast<int>(H);
  if (Between(V, R)) {
    const Bf16* staging = nullptr;
    JAX_EP_RETURN_IF_ERROR(b.In(0, "staging", DataType::BF16, {V, T, K, H}, &staging));
    a->staging = const_cast<Bf16*>(staging);  // read only in this phase
  } else {
    JAX_EP_RETURN_IF_ERROR(b.In(0, "y", DataType::BF16, {V, El, R * T, H}, &a->y));
  }
  JAX_EP_RETURN_IF_ERROR(b.In(1, "src_row", DataType::S32, {V, R, T, K}, &a->src_row));
  JAX_EP_RETURN_IF_ERROR(b.In(2, "clean_idx", DataType::S32, {V, T, K}, &a->clean_idx));
  JAX_EP_RETURN_IF_ERROR(b.In(3, "topk_weights", DataType::F32, {V, T, K}, &a->topk_weights));
  JAX_EP_RETURN_IF_ERROR(b.Out(0, "out", DataType::BF16, {V, T, H}, &a->out));
  return xffi::Error::Success();
}

xffi::Error ParseDispatchRows(xffi::RemainingArgs args, xffi::RemainingRets rets,
                              int64_t num_ranks, int64_t expert_major, RowsArgs* a) {
  const std::string_view op = kPeerOpNames[kPeerDispatchRows];
  Buffers b(op, args, rets);
  JAX_EP_RETURN_IF_ERROR(b.Count(3, 1));
  const AnyBuffer x = b.Arg(0);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "x", x, 3));
  const AnyBuffer out = b.Ret(0);
  JAX_EP_RETURN_IF_ERROR(CheckRank(op, "out", out, 3));
  const int64_t V = x.dimensions()[0], T = x.dimensions()[1], W = x.dimensions()[2];
  const int64_t R = num_ranks, cap = out.dimensions()[1];
  const bool em = expert_major != 0;
  const int64_t N = em ? R * T : cap;
  JAX_EP_RETURN_IF_ERROR(CheckStack(op, V, R));
  JAX_EP_RETURN_IF_ERROR(CheckInt32(op, "capacity", cap));
  JAX_EP_RETURN_IF_ERROR(CheckInt32(op, "R*T", R * T));

  *a = RowsArgs{};
  a->num_ranks = static_cast<int>(R);
  a->num_tokens = static_cast<int>(T);
  a->capacity = static_cast<int>(cap);
  a->num_rows = N;
  a->row_bytes = W * static_cast<int64_t>(xffi::ByteWidth(x.element_type()));
  a->expert_major = em;
  JAX_EP_RETURN_IF_ERROR(b.In(0, "x", kAnyType, {V, T, W}, &a->x));
  JAX_EP_RETURN_IF_ERROR(b.In(1, "recv_src", DataType::S32, {V, N}, &a->recv_src));
  JAX_EP_RETURN_IF_ERROR(
      b.In(2, "entry_row", DataType::S32, {V, em ? cap : 0}, &a->entry_row));
  if (!em) a->entry_row = nullptr;
  JAX_EP_RETURN_IF_ERROR(b.Out(0, "out", x.element_type(), {V, cap, W}, &a->out));
  return xffi::Error::Success();
}

namespace {

xffi::Error Attr(std::string_view op, const xffi::Dictionary& attrs, std::string_view name,
                 int64_t* value) {
  const xffi::ErrorOr<int64_t> got = attrs.get<int64_t>(name);
  if (!got.has_value()) {
    return Invalid(op, "needs the int64 attribute " + std::string(name));
  }
  *value = *got;
  return xffi::Error::Success();
}

// The optional attribute `buffer`: which of the two low-latency regions a call uses (0 or 1).
xffi::Error LowLatencyBuffer(std::string_view op, const xffi::Dictionary& attrs, int* buffer) {
  if (!attrs.contains("buffer")) return xffi::Error::Success();
  int64_t value = 0;
  JAX_EP_RETURN_IF_ERROR(Attr(op, attrs, "buffer", &value));
  if (value != 0 && value != 1) {
    return Invalid(op, "buffer must be 0 or 1 (one of the two low-latency regions); got " +
                           std::to_string(value));
  }
  *buffer = static_cast<int>(value);
  return xffi::Error::Success();
}

// The optional attributes `channels`, `chunk_tokens` and `ring_chunks` (cuda/channels.h):
// absent or channels 0, the normal dispatch or combine runs in phases; with them, the optional
// `channel_warps` (warps per role per channel; absent or 0, the platform's default).
xffi::Error ParseChannels(std::string_view op, const xffi::Dictionary& attrs, Rings* rings) {
  if (!attrs.contains("channels")) return xffi::Error::Success();
  int64_t values[3] = {0, 0, 0};
  const char* names[] = {"channels", "chunk_tokens", "ring_chunks"};
  for (int i = 0; i < 3; ++i) JAX_EP_RETURN_IF_ERROR(Attr(op, attrs, names[i], &values[i]));
  if (values[0] == 0) return xffi::Error::Success();
  for (int i = 0; i < 3; ++i) {
    if (values[i] < 1 || values[i] > (1 << 20)) {
      return Invalid(op, std::string(names[i]) + " must be in [1, 2^20] with channels; got " +
                             std::to_string(values[i]));
    }
  }
  rings->channels = static_cast<int>(values[0]);
  rings->chunk_tokens = static_cast<int>(values[1]);
  rings->ring_chunks = static_cast<int>(values[2]);
  if (attrs.contains("channel_warps")) {
    int64_t warps = 0;
    JAX_EP_RETURN_IF_ERROR(Attr(op, attrs, "channel_warps", &warps));
    if (warps < 0 || warps > kMaxChannelWarps) {
      return Invalid(op, "channel_warps must be in [0, " + std::to_string(kMaxChannelWarps) +
                             "] (0: the platform's default); got " + std::to_string(warps));
    }
    rings->warps = static_cast<int>(warps);
  }
  return xffi::Error::Success();
}

// The operand whose leading dimension stacks the op's ranks, by PeerOp.
constexpr size_t kStackedOperand[] = {2, 0, 1, 0, 0, 2, 0};

}  // namespace

xffi::Error ParseCall(int op, const AnyBuffer& ranks, xffi::RemainingArgs args,
                      xffi::RemainingRets rets, const xffi::Dictionary& attrs, Call* call) {
  const std::string_view name = kPeerOpNames[op];
  int64_t R = 0, E = 0;
  JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "num_ranks", &R));
  if (attrs.contains("num_sms")) {
    int64_t num_sms = 0;
    JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "num_sms", &num_sms));
    if (num_sms < 0 || num_sms > std::numeric_limits<int>::max()) {
      return Invalid(name, "num_sms must be in [0, 2^31) (0: no bound); got " +
                               std::to_string(num_sms));
    }
    call->num_sms = static_cast<int>(num_sms);
  }
  if (attrs.contains("ep_groups")) {
    const auto groups = attrs.get<xffi::Span<const int64_t>>("ep_groups");
    if (!groups.has_value()) return Invalid(name, "ep_groups must be an array of int64");
    call->groups.devices = groups->begin();
    call->groups.size = static_cast<int64_t>(groups->size());
  }
  if (op != kPeerCombine && op != kPeerDispatchRows) {
    JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "num_experts", &E));
  }
  switch (op) {
    case kPeerDispatch: {
      int64_t capacity = 0, expert_major = 0, zero_padding = 0, drop_by_source = 0, wire = 0;
      int64_t dequantize = 0;
      JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "capacity", &capacity));
      JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "expert_major", &expert_major));
      JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "zero_padding", &zero_padding));
      JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "drop_by_source", &drop_by_source));
      // Optional: the wire format the send casts x's bfloat16 rows to (0: none).
      if (attrs.contains("wire")) JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "wire", &wire));
      // Optional: with a wire, recv_x the rows dequantized to bfloat16 (0: the format's).
      if (attrs.contains("dequantize")) {
        JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "dequantize", &dequantize));
      }
      DispatchArgs a;
      JAX_EP_RETURN_IF_ERROR(ParseDispatch(args, rets, R, E, capacity, expert_major, wire,
                                           dequantize != 0, &a));
      a.zero_padding = zero_padding != 0;
      a.drop_by_source = drop_by_source != 0 && expert_major != 0;
      JAX_EP_RETURN_IF_ERROR(ParseChannels(name, attrs, &a.rings));
      call->args = a;
      break;
    }
    case kPeerCombine: {
      int64_t expert_major = 0, wire = 0;
      JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "expert_major", &expert_major));
      // Optional: the wire format the stages cast y's bfloat16 rows to (0: none).
      if (attrs.contains("wire")) JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "wire", &wire));
      CombineArgs<float> a;
      RowType type;
      JAX_EP_RETURN_IF_ERROR(ParseCombine(args, rets, R, expert_major, wire, &type, &a));
      JAX_EP_RETURN_IF_ERROR(ParseChannels(name, attrs, &a.rings));
      switch (type) {
        case RowType::kF32: call->args = a; break;
        case RowType::kBF16: call->args = Retype<Bf16>(a); break;
        case RowType::kF16: call->args = Retype<F16>(a); break;
      }
      break;
    }
    case kPeerLlDispatchSend: {
      int64_t wire = 0;
      JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "wire", &wire));
      LowLatencyArgs a;
      JAX_EP_RETURN_IF_ERROR(ParseLowLatencyDispatchSend(args, rets, R, E, wire, &a));
      JAX_EP_RETURN_IF_ERROR(LowLatencyBuffer(name, attrs, &a.buffer));
      call->args = a;
      break;
    }
    case kPeerLlDispatchRecv: {
      LowLatencyArgs a;
      JAX_EP_RETURN_IF_ERROR(ParseLowLatencyDispatchRecv(args, rets, R, E, &a));
      JAX_EP_RETURN_IF_ERROR(LowLatencyBuffer(name, attrs, &a.buffer));
      call->args = a;
      break;
    }
    case kPeerLlCombineSend:
    case kPeerLlCombineRecv: {
      LowLatencyCombineArgs a;
      JAX_EP_RETURN_IF_ERROR(op == kPeerLlCombineSend
                                 ? ParseLowLatencyCombineSend(args, rets, R, E, &a)
                                 : ParseLowLatencyCombineRecv(args, rets, R, E, &a));
      JAX_EP_RETURN_IF_ERROR(LowLatencyBuffer(name, attrs, &a.buffer));
      call->args = a;
      break;
    }
    case kPeerDispatchRows: {
      int64_t expert_major = 0;
      JAX_EP_RETURN_IF_ERROR(Attr(name, attrs, "expert_major", &expert_major));
      RowsArgs a;
      JAX_EP_RETURN_IF_ERROR(ParseDispatchRows(args, rets, R, expert_major, &a));
      call->args = a;
      break;
    }
    default:
      return xffi::Error::Internal("jax_ep: unknown exchange op " + std::to_string(op));
  }
  return ParseRanks(name, ranks, args, kStackedOperand[op], R, &call->between, &call->ranks);
}

}  // namespace jax_ep::ffi
