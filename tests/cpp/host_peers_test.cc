// Host peers under ThreadSanitizer: every op of cuda/peer_ops.h between R = 4 ranks, one
// thread per rank, each launch on a GPU-shaped grid run by several threads per rank, each op
// twice in a row (so it also meets the previous call's data in the symmetric buffer; the
// low-latency ops also with two exchanges in flight, one in each low-latency region). The
// results must equal the virtual-rank run of the same phases on one thread, byte for byte,
// and TSan must see no race: the flags the launches meet at alone must order every cross-rank
// access. Then every op again with peers reached by puts only (HostPutPeers: no pointer into
// a peer's buffer), and node-aware, in nodes of 2 ranks (stores only within a node, the
// normal dispatch through relays; streamed, also in nodes of 3 and 1). Then two EP groups of a 2 x 2 mesh side by side (each keyed
// by its devices, cuda/ep_group.h) and the group rules. The last cases check that two
// exchanges issued at once on one rank are refused, and the timeouts: a peer that starts late
// is waited for, one that never comes is reported, to this rank only. Replays (the CPU's CUDA
// graphs, host::record and host::replay): rounds recorded once and replayed 5 times with fresh
// inputs in place, over stores, puts and nodes, phased and streamed, and a second low-latency
// send on a region in flight refused by its own launches.
//
// No Python, no XLA: built by tests/cpp/CMakeLists.txt, run by ctest (.ci/run).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/host_launch.h"
#include "cuda/host_peers.h"
#include "cuda/virtual_ops.h"

namespace jax_ep {
namespace {

int failures = 0;
bool puts_only = false;  // the host peers reach each other by puts (host::initialize)

void expect(bool ok, const std::string& what) {
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "FAILED: %s\n", what.c_str());
}

template <typename T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  expect(got.size() == want.size() &&
             std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0,
         what + ": host peers differ from virtual ranks");
}

// Problem sizes of one round.
struct Shape {
  int R, T, K, E, H, capacity;
  bool expert_major, fp8;
  int wire = 0;  // low-latency wire format (cuda/wire.h); 0: e4m3 with fp8, else bf16
  // Between devices, the dispatch streamed through rings (cuda/channels.h); 0: in phases.
  int channels = 0, chunk_tokens = 0, ring_chunks = 0;
  // Bytes of an element of the normal ops' rows, x and y: 4 (float32), or 2 (bfloat16: with
  // an odd H a row's size is not a multiple of 4, so what a slot holds after it must be
  // padded to stay aligned; the alignment sanitizer checks every access).
  int elem = 4;
  // Streamed, warps per role per channel (Rings::warps); 0: the grid's.
  int warps = 0;
  // The wire format the normal dispatch's send casts x's bfloat16 rows (elem 2) to; 0: none.
  int cast = 0;
  // With a cast, the host peers' finish (receivers) dequantizes the rows into bfloat16
  // results (DispatchArgs::dequantize); virtual ranks keep the rows as they travel.
  bool dequantize = false;
  // The wire format the host peers' combine carries its bfloat16 rows home in (elem 2,
  // rank-major; CombineArgs::wire); 0: none. The virtual ranks' combine of the rows cast and
  // dequantized in float32 is the reference (RoundData::expect_wire_combined).
  int combine_wire = 0;
  // A dispatch row as it travels (x's, or the cast's data bytes and scale words).
  int64_t row_bytes() const { return cast ? wire_data_bytes(cast, H) : int64_t{H} * elem; }
  int64_t scale_cols() const { return cast ? wire_scale_words(cast, H) : fp8 ? H / 128 : 0; }
  // The low-latency ops run where H is a multiple of their 128-channel blocks.
  bool low_latency() const { return H % kFp8Block == 0; }
  int El() const { return E / R; }
  int ll_wire() const { return wire ? wire : fp8 ? kWireE4m3 : kWireBf16; }
  int rows() const { return expert_major ? R * T : capacity; }
  int cols() const { return expert_major ? 1 : K; }
};

// Every per-rank array of one op, stacked [R, ...]: the inputs, and the results of either run.
struct DispatchData {
  std::vector<float> x, scales, weights;
  std::vector<int32_t> idx;
  std::vector<char> recv_x;
  std::vector<float> recv_scales, recv_weights;
  std::vector<int32_t> recv_idx, recv_src, src_row, entry_row, entry_choice, row_entries,
      num_received, tokens_per_expert, num_dropped, num_needed, num_invalid, clean_idx;
  std::vector<std::vector<int32_t>> work;  // the workspace of every rank (0), of rank r (r + 1)
  // Rows along the dispatch's routing (cuda/dispatch_rows.h): kRowWidth floats a token
  // (20-byte rows: the copies go in 4-byte units), and where they arrive.
  static constexpr int kRowWidth = 5;
  std::vector<float> rows_x, rows_out;

  explicit DispatchData(const Shape& s) {
    rows_x.resize(int64_t{s.R} * s.T * kRowWidth);
    rows_out.resize(int64_t{s.R} * s.capacity * kRowWidth);
    const int64_t R = s.R, T = s.T, K = s.K, H = s.H, cap = s.capacity, S = s.scale_cols();
    x.resize(R * T * H);
    scales.resize(R * T * S);
    weights.resize(R * T * K);
    idx.resize(R * T * K);
    recv_x.resize(R * cap * H * 4);
    recv_scales.resize(R * cap * S);
    recv_idx.resize(R * cap * s.cols());
    recv_weights.resize(R * cap * s.cols());
    recv_src.resize(R * s.rows());
    src_row.resize(R * R * T);
    entry_row.resize(s.expert_major ? R * cap : 0);
    entry_choice.resize(s.expert_major ? R * cap : 0);
    row_entries.resize(s.expert_major ? R * R * T * K : 0);
    num_received.resize(R);
    tokens_per_expert.resize(R * s.El());
    num_dropped.resize(R);
    num_needed.resize(R);
    num_invalid.resize(R);
    clean_idx.resize(R * T * K);
    work.resize(R + 1);
  }

  // The arguments of rank `rank` alone (V = 1), or of every rank (rank < 0).
  DispatchArgs args(const Shape& s, int rank) {
    const int64_t v = rank < 0 ? 0 : rank, T = s.T, K = s.K, H = s.H, cap = s.capacity;
    const int64_t S = s.scale_cols();
    DispatchArgs a{};
    a.num_ranks = s.R;
    a.num_tokens = s.T;
    a.top_k = s.K;
    a.num_experts = s.E;
    a.capacity = s.capacity;
    a.expert_major = s.expert_major;
    a.row_bytes = s.row_bytes();
    a.scale_cols = S;
    a.wire = s.cast;
    a.hidden = s.H;
    a.x = reinterpret_cast<const char*>(x.data()) + v * T * H * s.elem;
    a.scales = scales.data() + v * T * S;
    a.topk_idx = idx.data() + v * T * K;
    a.topk_weights = weights.data() + v * T * K;
    a.clean_idx = clean_idx.data() + v * T * K;
    a.num_invalid = num_invalid.data() + v;
    std::vector<int32_t>& w = work[rank + 1];
    const int V = rank < 0 ? s.R : 1;
    w.resize(carve_dispatch_workspace(&a, V));
    carve_dispatch_workspace(&a, V, w.data());
    a.dequantize = s.dequantize && rank >= 0;
    a.recv_x = recv_x.data() + v * cap * a.result_row_bytes();
    a.recv_scales = recv_scales.data() + v * cap * a.result_scale_cols();
    a.recv_idx = recv_idx.data() + v * cap * s.cols();
    a.recv_weights = recv_weights.data() + v * cap * s.cols();
    a.recv_src = recv_src.data() + v * s.rows();
    a.src_row = src_row.data() + v * s.R * T;
    a.entry_row = entry_row.data() + (s.expert_major ? v * cap : 0);
    a.entry_choice = entry_choice.data() + (s.expert_major ? v * cap : 0);
    a.row_entries = row_entries.data() + (s.expert_major ? v * s.R * T * K : 0);
    a.num_received = num_received.data() + v;
    a.tokens_per_expert = tokens_per_expert.data() + v * s.El();
    a.num_dropped = num_dropped.data() + v;
    a.num_needed = num_needed.data() + v;
    if (rank >= 0) a.rings = ring_config(s);
    return a;
  }
  // The rows op along this dispatch's results, for rank `rank` or every rank (rank < 0).
  RowsArgs rows_args(const Shape& s, int rank) {
    const int64_t v = rank < 0 ? 0 : rank;
    RowsArgs a{};
    a.num_ranks = s.R;
    a.num_tokens = s.T;
    a.capacity = s.capacity;
    a.num_rows = s.rows();
    a.row_bytes = kRowWidth * 4;
    a.expert_major = s.expert_major;
    a.x = reinterpret_cast<const char*>(rows_x.data() + v * s.T * kRowWidth);
    a.recv_src = recv_src.data() + v * s.rows();
    a.entry_row = s.expert_major ? entry_row.data() + v * s.capacity : nullptr;
    a.out = reinterpret_cast<char*>(rows_out.data() + v * s.capacity * kRowWidth);
    return a;
  }
  static Rings ring_config(const Shape& s) {
    Rings g;
    g.channels = s.channels;
    g.chunk_tokens = s.chunk_tokens;
    g.ring_chunks = s.ring_chunks;
    g.warps = s.warps;
    return g;
  }
};

// The combine's rows are float32, or bfloat16 (y16, out16) when the shape's elem is 2.
struct CombineData {
  std::vector<float> y, weights, out;
  std::vector<Bf16> y16, out16;
  CombineData(const Shape& s, std::mt19937& gen) {
    const int64_t R = s.R;
    std::normal_distribution<float> normal;
    y.resize(R * s.capacity * s.H);
    weights.resize(R * s.capacity);
    for (float& v : y) v = normal(gen);
    for (float& v : weights) v = normal(gen);
    out.resize(R * s.T * s.H);
    if (s.elem == 2) out16.resize(out.size());
    round_y(s);
  }
  // y16: y rounded to bfloat16 (after y changed).
  void round_y(const Shape& s) {
    if (s.elem != 2) return;
    y16.resize(y.size());
    for (size_t i = 0; i < y.size(); ++i) y16[i] = from_float<Bf16>(y[i]);
  }
  template <typename T>
  CombineArgs<T> args(const Shape& s, DispatchData& d, int rank, const T* y_rows, T* out_rows) {
    const int64_t v = rank < 0 ? 0 : rank, rows = int64_t{s.R} * s.T;
    CombineArgs<T> a{};
    a.num_ranks = s.R;
    a.num_tokens = s.T;
    a.top_k = s.K;
    a.hidden = s.H;
    a.capacity = s.capacity;
    a.expert_major = s.expert_major;
    a.y = y_rows + v * s.capacity * s.H;
    a.weights = weights.data() + v * s.capacity;
    a.src_row = d.src_row.data() + v * rows;
    a.row_entries = s.expert_major ? d.row_entries.data() + v * rows * s.K : nullptr;
    a.out = out_rows + v * s.T * s.H;
    if (rank >= 0) a.rings = DispatchData::ring_config(s);
    if (rank >= 0 && sizeof(T) == 2) a.wire = s.combine_wire;
    return a;
  }
  // f(args) with the combine's arguments in the shape's element type.
  template <typename F>
  auto with_args(const Shape& s, DispatchData& d, int rank, const F& f) {
    if (s.elem == 2) return f(args(s, d, rank, y16.data(), out16.data()));
    return f(args(s, d, rank, y.data(), out.data()));
  }
};

struct LowLatencyData {
  std::vector<Bf16> x, y, staging, out;
  std::vector<float> weights, recv_scales;
  std::vector<int32_t> idx, clean_idx, num_invalid, counts, src_row, count;
  std::vector<std::vector<int32_t>> work;  // as DispatchData's
  std::vector<uint8_t> recv_x;

  LowLatencyData(const Shape& s, const std::vector<int32_t>& routing, std::mt19937& gen) {
    const int64_t R = s.R, T = s.T, K = s.K, H = s.H, slots = int64_t{s.El()} * R * T;
    std::normal_distribution<float> normal;
    x.resize(R * T * H);
    for (Bf16& v : x) v = from_float<Bf16>(normal(gen));
    y.resize(R * slots * H);
    for (Bf16& v : y) v = from_float<Bf16>(normal(gen));
    weights.resize(R * T * K);
    for (float& v : weights) v = normal(gen);
    idx = routing;
    clean_idx.resize(R * T * K);
    num_invalid.resize(R);
    counts.resize(R * s.E);
    work.resize(R + 1);
    recv_x.resize(R * slots * H * 2);
    recv_scales.resize(R * slots * wire_scale_words(s.ll_wire(), H));
    src_row.resize(R * R * T * K);
    count.resize(R * s.El());
    staging.resize(R * T * K * H);
    out.resize(R * T * H);
  }
  LowLatencyArgs dispatch_args(const Shape& s, int rank) {
    const int64_t v = rank < 0 ? 0 : rank, T = s.T, K = s.K, H = s.H;
    const int64_t slots = int64_t{s.El()} * s.R * T, row = wire_data_bytes(s.ll_wire(), H);
    LowLatencyArgs a{};
    a.num_ranks = s.R;
    a.num_tokens = s.T;
    a.top_k = s.K;
    a.num_experts = s.E;
    a.hidden = s.H;
    a.wire = s.ll_wire();
    a.x = x.data() + v * T * H;
    a.topk_idx = idx.data() + v * T * K;
    a.clean_idx = clean_idx.data() + v * T * K;
    a.num_invalid = num_invalid.data() + v;
    a.counts = counts.data();
    std::vector<int32_t>& w = work[rank + 1];
    const int V = rank < 0 ? s.R : 1;
    w.resize(carve_ll_workspace(&a, V));
    carve_ll_workspace(&a, V, w.data());
    a.recv_x = recv_x.data() + v * slots * row;
    a.recv_scales = recv_scales.data() + v * slots * wire_scale_words(s.ll_wire(), H);
    a.src_row = src_row.data() + v * s.R * T * K;
    a.count = count.data() + v * s.El();
    return a;
  }
  LowLatencyCombineArgs combine_args(const Shape& s, int rank) {
    const int64_t v = rank < 0 ? 0 : rank, T = s.T, K = s.K, H = s.H;
    const int64_t slots = int64_t{s.El()} * s.R * T;
    LowLatencyCombineArgs a{};
    a.num_ranks = s.R;
    a.num_tokens = s.T;
    a.top_k = s.K;
    a.num_experts = s.E;
    a.hidden = s.H;
    a.y = y.data() + v * slots * H;
    a.src_row = src_row.data() + v * s.R * T * K;
    a.clean_idx = clean_idx.data() + v * T * K;
    a.topk_weights = weights.data() + v * T * K;
    a.staging = staging.data() + v * T * K * H;
    a.out = out.data() + v * T * H;
    return a;
  }
};

// The inputs of a round: routing with masked (-1), invalid and repeated choices.
void fill_inputs(const Shape& s, DispatchData& d, std::mt19937& gen) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> expert(0, s.E - 1), roll(0, 19);
  for (float& v : d.x) v = normal(gen);
  for (float& v : d.scales) v = normal(gen);
  for (float& v : d.weights) v = normal(gen);
  for (float& v : d.rows_x) v = normal(gen);
  for (int32_t& id : d.idx) {
    const int r = roll(gen);
    id = r == 0 ? -1 : r == 1 ? s.E + 3 : expert(gen);
  }
}

// Runs every op for all ranks: virtual ranks on this thread, or one thread per rank through
// host peers. The ops and their order are those of a training step plus a decoding step.
// With host peers, `groups` (if any) lists the devices of each EP group, and this round runs
// group `group` of it: rank r on device groups[group * R + r].
//
// `replays` > 0: each rank records its calls (host::record, as XLA records them into a CUDA
// graph) instead of running them, then runs the recordings `replays` times, `refill(i)` (on
// one thread, between the ranks' replays) writing fresh inputs in place before replay i and
// `check(i)` after it.
void run_round(const Shape& s, DispatchData& d, CombineData& c, LowLatencyData& ll, bool peers,
               const HostGrid& grid, const std::vector<int64_t>& groups = {}, int group = 0,
               int replays = 0, const std::function<void(int)>& refill = {},
               const std::function<void(int)>& check_replay = {}) {
  if (!peers) {
    HostLauncher l{s.R, grid};
    run_virtual(l, kPeerDispatch, d.args(s, -1));
    run_virtual(l, kPeerDispatchRows, d.rows_args(s, -1));
    c.with_args(s, d, -1, [&](const auto& a) { run_virtual(l, kPeerCombine, a); });
    if (!s.low_latency()) return;
    const LowLatencyArgs la = ll.dispatch_args(s, -1);
    run_virtual(l, kPeerLlDispatchSend, la);  // it delivers: no receive
    LowLatencyCombineArgs lc = ll.combine_args(s, -1);
    lc.staging = nullptr;  // virtual ranks: the receive reads y in place
    run_virtual(l, kPeerLlCombineRecv, lc);
    return;
  }
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(s.R);
  std::vector<std::vector<std::shared_ptr<const host::Recording>>> recordings(s.R);
  for (int r = 0; r < s.R; ++r) {
    ranks.emplace_back([&, r] {
      const GroupTable table{groups.data(), static_cast<int64_t>(groups.size()),
                             groups.empty() ? -1 : groups[group * s.R + r]};
      auto run = [&](int op, const auto& args, int rank, const HostGrid& g) {
        if (replays == 0) return host::run(op, args, rank, g, table);
        std::shared_ptr<const host::Recording> recording;
        const PeerError error = host::record(op, args, rank, g, table, &recording);
        if (recording) recordings[r].push_back(recording);
        return error;
      };
      auto check = [&](const PeerError& e) {
        if (!e.ok() && errors[r].empty()) errors[r] = e.message;
      };
      // Each op twice in a row: the second meets the first's data in the symmetric buffer,
      // with no other op's launches in between.
      for (int i = 0; i < 2; ++i) check(run(kPeerDispatch, d.args(s, r), r, grid));
      // Peers reached by puts cannot be read: jax_ep dispatches again there.
      if (!puts_only) check(run(kPeerDispatchRows, d.rows_args(s, r), r, grid));
      for (int i = 0; i < 2; ++i) {
        check(c.with_args(s, d, r, [&](const auto& a) { return run(kPeerCombine, a, r, grid); }));
      }
      // Low latency: once on one region, then two exchanges in flight, one per region.
      if (!s.low_latency()) return;
      auto ll_dispatch = [&](int buffer) {
        LowLatencyArgs a = ll.dispatch_args(s, r);
        a.buffer = buffer;
        return a;
      };
      auto ll_combine = [&](int buffer) {
        LowLatencyCombineArgs a = ll.combine_args(s, r);
        a.buffer = buffer;
        return a;
      };
      check(run(kPeerLlDispatchSend, ll_dispatch(0), r, grid));
      check(run(kPeerLlDispatchRecv, ll_dispatch(0), r, grid));
      for (int b = 0; b < 2; ++b) check(run(kPeerLlDispatchSend, ll_dispatch(b), r, grid));
      for (int b = 0; b < 2; ++b) check(run(kPeerLlDispatchRecv, ll_dispatch(b), r, grid));
      check(run(kPeerLlCombineSend, ll_combine(1), r, grid));
      check(run(kPeerLlCombineRecv, ll_combine(1), r, grid));
      for (int b = 0; b < 2; ++b) check(run(kPeerLlCombineSend, ll_combine(b), r, grid));
      for (int b = 0; b < 2; ++b) check(run(kPeerLlCombineRecv, ll_combine(b), r, grid));
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int i = 0; i < replays; ++i) {
    refill(i);
    ranks.clear();
    for (int r = 0; r < s.R; ++r) {
      ranks.emplace_back([&, r] {
        for (const auto& recording : recordings[r]) {
          const PeerError e = host::replay(*recording);
          if (!e.ok() && errors[r].empty()) errors[r] = e.message;
        }
      });
    }
    for (std::thread& t : ranks) t.join();
    check_replay(i);
  }
  for (int r = 0; r < s.R; ++r) {
    expect(errors[r].empty(), "rank " + std::to_string(r) + ": " + errors[r]);
  }
}

// The name of a round in messages; `how`: how the host peers were initialized, if not with
// stores.
std::string round_name(const Shape& s, uint32_t seed, const char* how) {
  return " (R " + std::to_string(s.R) + ", T " + std::to_string(s.T) + ", capacity " +
         std::to_string(s.capacity) + (s.expert_major ? ", expert-major" : "") +
         (s.fp8 ? ", fp8" : "") + (s.elem == 2 ? ", bfloat16 rows" : "") + ", wire " +
         std::to_string(s.ll_wire()) +
         (s.channels ? ", rings " + std::to_string(s.channels) + "x" +
                           std::to_string(s.chunk_tokens) + "x" + std::to_string(s.ring_chunks)
                     : "") +
         (s.warps ? ", " + std::to_string(s.warps) + " warps per channel" : "") +
         (s.cast ? ", the send casts to wire " + std::to_string(s.cast) : "") +
         (s.dequantize ? ", the finish dequantizes" : "") +
         how + ", seed " + std::to_string(seed) + ")";
}

// One round's arrays: the host peers' run (`p`) against the virtual ranks' (`v`).
struct RoundData {
  DispatchData dv, dp;
  std::mt19937 gen_c, gen_c2, gen_l, gen_l2;
  CombineData cv, cp;
  LowLatencyData lv, lp;

  RoundData(const Shape& s, uint32_t seed, std::mt19937&& gen)
      : dv(s), dp(s), gen_c(seed + 1), gen_c2(seed + 1), gen_l(seed + 2), gen_l2(seed + 2),
        cv(s, gen_c), cp(s, gen_c2), lv(s, {}, gen_l), lp(s, {}, gen_l2) {
    refill(s, gen);
  }
  // Fresh inputs of every op, written in place (a recording keeps the addresses).
  void refill(const Shape& s, std::mt19937& gen) {
    fill_inputs(s, dv, gen);
    std::normal_distribution<float> normal;
    for (float& v : cv.y) v = normal(gen);
    for (float& v : cv.weights) v = normal(gen);
    cv.round_y(s);
    for (Bf16& v : lv.x) v = from_float<Bf16>(normal(gen));
    for (Bf16& v : lv.y) v = from_float<Bf16>(normal(gen));
    for (float& v : lv.weights) v = normal(gen);
    lv.idx.assign(dv.idx.begin(), dv.idx.end());
    dp.x.assign(dv.x.begin(), dv.x.end());
    dp.scales.assign(dv.scales.begin(), dv.scales.end());
    dp.weights.assign(dv.weights.begin(), dv.weights.end());
    dp.idx.assign(dv.idx.begin(), dv.idx.end());
    dp.rows_x.assign(dv.rows_x.begin(), dv.rows_x.end());
    cp.y.assign(cv.y.begin(), cv.y.end());
    cp.y16.assign(cv.y16.begin(), cv.y16.end());
    cp.weights.assign(cv.weights.begin(), cv.weights.end());
    lp.x.assign(lv.x.begin(), lv.x.end());
    lp.y.assign(lv.y.begin(), lv.y.end());
    lp.weights.assign(lv.weights.begin(), lv.weights.end());
    lp.idx.assign(lv.idx.begin(), lv.idx.end());
  }

  void compare(const Shape& s, const std::string& at) {
    if (s.dequantize) {
      expect_dequantized(s, at);
    } else {
      expect_equal(dp.recv_x, dv.recv_x, "dispatch recv_x" + at);
      expect_equal(dp.recv_scales, dv.recv_scales, "dispatch recv_scales" + at);
    }
    expect_equal(dp.recv_idx, dv.recv_idx, "dispatch recv_idx" + at);
    expect_equal(dp.recv_weights, dv.recv_weights, "dispatch recv_weights" + at);
    expect_equal(dp.recv_src, dv.recv_src, "dispatch recv_src" + at);
    expect_equal(dp.src_row, dv.src_row, "dispatch src_row" + at);
    expect_equal(dp.entry_row, dv.entry_row, "dispatch entry_row" + at);
    expect_equal(dp.entry_choice, dv.entry_choice, "dispatch entry_choice" + at);
    expect_equal(dp.row_entries, dv.row_entries, "dispatch row_entries" + at);
    expect_equal(dp.num_received, dv.num_received, "dispatch num_received" + at);
    expect_equal(dp.tokens_per_expert, dv.tokens_per_expert, "dispatch tokens_per_expert" + at);
    expect_equal(dp.num_dropped, dv.num_dropped, "dispatch num_dropped" + at);
    expect_equal(dp.num_needed, dv.num_needed, "dispatch num_needed" + at);
    expect_equal(dp.num_invalid, dv.num_invalid, "dispatch num_invalid" + at);
    if (!puts_only) expect_equal(dp.rows_out, dv.rows_out, "rows along the dispatch" + at);
    if (s.combine_wire) {
      expect_wire_combined(s, at);
    } else {
      expect_equal(cp.out, cv.out, "combine out" + at);
      expect_equal(cp.out16, cv.out16, "combine out (bfloat16)" + at);
    }
    // The rows of a wire format fill the first part of recv_x.
    const size_t bytes = size_t(s.El()) * s.R * s.T * wire_data_bytes(s.ll_wire(), s.H) * s.R;
    expect(std::memcmp(lp.recv_x.data(), lv.recv_x.data(), bytes) == 0,
           "low-latency recv_x" + at + ": host peers differ from virtual ranks");
    expect_equal(lp.recv_scales, lv.recv_scales, "low-latency recv_scales" + at);
    expect_equal(lp.src_row, lv.src_row, "low-latency src_row" + at);
    expect_equal(lp.count, lv.count, "low-latency count" + at);
    expect_equal(lp.num_invalid, lv.num_invalid, "low-latency num_invalid" + at);
    expect_equal(lp.out, lv.out, "low-latency combine out" + at);
  }
  void expect_dequantized(const Shape& s, const std::string& at);
  void expect_wire_combined(const Shape& s, const std::string& at);
};

// Row i of `rows` (float32 [n, H]): the bfloat16 row y16[i] times weights[i], cast to `wire`
// and dequantized, each part as the host peers' sums dequantize it.
template <int kWire>
void wire_rounded(const Shape& s, const CombineData& c, int64_t i, float* out) {
  std::vector<char> row(wire_row_bytes(kWire, s.H));
  const Bf16* x = c.y16.data() + i * s.H;
  cast_values_as<kWire>(
      [&](int part, float (&v)[kCastChannels]) {
        for (int q = 0; q < kCastChannels; ++q) {
          v[q] = mul_rn(to_float(x[part * kCastChannels + q]), c.weights[i]);
        }
      },
      s.H, row.data(), 0, 1);
  const char* scales = row.data() + wire_data_bytes(kWire, s.H);
  for (int part = 0; part < s.H / kCastChannels; ++part) {
    float v[kCastChannels];
    dequantize_part<kWire>(row.data(), scales, part, global_scale_of<kWire>(scales, s.H), false,
                           v);
    std::memcpy(out + part * kCastChannels, v, sizeof(v));
  }
}

// The host peers' combine in a wire format: the virtual ranks' unweighted float32 combine of
// the rows cast and dequantized (the same rank-order sum), rounded to bfloat16.
void RoundData::expect_wire_combined(const Shape& s, const std::string& at) {
  const int64_t n = int64_t{s.R} * s.capacity;
  std::vector<float> rows(n * s.H), out(int64_t{s.R} * s.T * s.H);
  with_wire(s.combine_wire, [&](auto wire) {
    for (int64_t i = 0; i < n; ++i) wire_rounded<wire.value>(s, cv, i, rows.data() + i * s.H);
  });
  CombineArgs<float> a = cv.args(s, dv, -1, rows.data(), out.data());
  a.weights = nullptr;
  HostLauncher l{s.R, HostGrid{}};
  run_virtual(l, kPeerCombine, a);
  std::vector<Bf16> want(out.size());
  for (size_t i = 0; i < out.size(); ++i) want[i] = from_float<Bf16>(out[i]);
  expect_equal(cp.out16, want, "combine out in wire format " + std::to_string(s.combine_wire) +
                                   at + " (against the virtual ranks' sums of the rows it "
                                   "rounds)");
}

// The host peers' dequantized rows: the virtual ranks' received rows, dequantized (each rank's
// kept rows; the padding is unspecified).
void RoundData::expect_dequantized(const Shape& s, const std::string& at) {
  const int64_t cap = s.capacity, H = s.H, S = s.scale_cols(), bytes = s.row_bytes();
  std::vector<Bf16> want(H);
  for (int d = 0; d < s.R; ++d) {
    for (int64_t i = 0; i < dv.num_received[d]; ++i) {
      const int64_t row = d * cap + i;
      dequantize_row(s.cast, dv.recv_x.data() + row * bytes,
                     reinterpret_cast<const char*>(dv.recv_scales.data() + row * S), s.H,
                     want.data(), 0, 1);
      expect(std::memcmp(dp.recv_x.data() + row * 2 * H, want.data(), 2 * H) == 0,
             "dispatch recv_x" + at + ": rank " + std::to_string(d) + " row " +
                 std::to_string(i) + " is not the virtual ranks' row dequantized");
    }
  }
}

void check_round(const Shape& s, uint32_t seed, const HostGrid& grid, const char* how = "") {
  RoundData d(s, seed, std::mt19937(seed));
  run_round(s, d.dv, d.cv, d.lv, false, HostGrid{});
  run_round(s, d.dp, d.cp, d.lp, true, grid);
  d.compare(s, round_name(s, seed, how));
}

// Every op of a round recorded once per rank, then replayed 5 times with fresh inputs (and
// routings) in place: each replay must give what the virtual ranks give for its inputs. The
// host code of the ops runs only when recording, so state that a call takes from the host
// (arrival counts, the low-latency regions' records) would go stale and fail this.
void check_replays(const Shape& s, uint32_t seed, const HostGrid& grid, const char* how = "") {
  constexpr int kReplays = 5;
  RoundData d(s, seed, std::mt19937(seed));
  std::mt19937 gen(seed + 7);
  auto refill = [&](int) {
    d.refill(s, gen);
    run_round(s, d.dv, d.cv, d.lv, false, HostGrid{});
  };
  auto compare = [&](int i) {
    d.compare(s, round_name(s, seed, how) + ", replay " + std::to_string(i + 1));
  };
  run_round(s, d.dp, d.cp, d.lp, true, grid, {}, 0, kReplays, refill, compare);
}

// Two EP groups of R = 2 at once, on the devices of a 2 x 2 mesh with the EP axis `first` or
// last: each group's buffers and flags are its own (keyed by its devices), so each gives its
// virtual-rank results, and TSan sees no access shared between the groups.
void check_two_groups_at_once(bool ep_first, uint32_t seed) {
  const Shape s{2, 7, 3, 4, 256, 14, false, false};
  const std::vector<int64_t> groups =
      ep_first ? std::vector<int64_t>{0, 2, 1, 3} : std::vector<int64_t>{0, 1, 2, 3};
  std::vector<DispatchData> dv, dp;
  std::vector<CombineData> cv, cp;
  std::vector<LowLatencyData> lv, lp;
  for (auto* v : {&dv, &dp}) v->reserve(2);
  for (auto* v : {&cv, &cp}) v->reserve(2);
  for (auto* v : {&lv, &lp}) v->reserve(2);
  for (int g = 0; g < 2; ++g) {
    dv.emplace_back(s), dp.emplace_back(s);
    std::mt19937 gen(seed + g);
    fill_inputs(s, dv[g], gen);
    dp[g].x = dv[g].x, dp[g].scales = dv[g].scales, dp[g].weights = dv[g].weights;
    dp[g].idx = dv[g].idx;
    std::mt19937 gc(seed + 10 + g), gc2(seed + 10 + g), gl(seed + 20 + g), gl2(seed + 20 + g);
    cv.emplace_back(s, gc), cp.emplace_back(s, gc2);
    lv.emplace_back(s, dv[g].idx, gl), lp.emplace_back(s, dv[g].idx, gl2);
  }
  for (int g = 0; g < 2; ++g) run_round(s, dv[g], cv[g], lv[g], false, HostGrid{});
  std::vector<std::thread> runs;
  for (int g = 0; g < 2; ++g) {
    runs.emplace_back([&, g] {
      run_round(s, dp[g], cp[g], lp[g], true, HostGrid{2, 2, 32, 2}, groups, g);
    });
  }
  for (std::thread& t : runs) t.join();
  for (int g = 0; g < 2; ++g) {
    const std::string at = " (group " + std::to_string(g) + (ep_first ? ", EP axis first" : "") +
                           ", seed " + std::to_string(seed) + ")";
    expect_equal(dp[g].recv_x, dv[g].recv_x, "dispatch recv_x" + at);
    expect_equal(dp[g].src_row, dv[g].src_row, "dispatch src_row" + at);
    expect_equal(cp[g].out, cv[g].out, "combine out" + at);
    expect_equal(lp[g].count, lv[g].count, "low-latency count" + at);
    expect_equal(lp[g].out, lv[g].out, "low-latency combine out" + at);
  }
}

// cuda/ep_group.h: finding a device's group and rank, and a group's node split.
void check_group_rules() {
  const int64_t table[] = {4, 5, 6, 7, 0, 1, 2, 3};
  std::vector<int64_t> row;
  int rank = -1;
  expect(find_group(GroupTable{table, 8, 2}, 4, 2, &row, &rank).empty() && rank == 2 &&
             row == std::vector<int64_t>{0, 1, 2, 3},
         "device 2 is rank 2 of the second group");
  expect(find_group(GroupTable{table, 8, 2}, 4, 1, &row, &rank).find("EP axis index is 1") !=
             std::string::npos,
         "an axis index that is not the device's rank is an error");
  expect(find_group(GroupTable{table, 8, 9}, 4, 0, &row, &rank).find("none of the") !=
             std::string::npos,
         "a device outside the table is an error");
  expect(find_group(GroupTable{table, 6, 2}, 4, 2, &row, &rank).find("not whole groups") !=
             std::string::npos,
         "a table of partial groups is an error");
  std::string error;
  expect(group_ranks_per_node({3, 3, 3}, &error) == 0, "one node");
  expect(group_ranks_per_node({0, 0, 1, 1, 2}, &error) == 2, "nodes of 2, a smaller last");
  expect(group_ranks_per_node({5, 1, 7}, &error) == 1, "one rank per node");
  expect(group_ranks_per_node({0, 1, 0, 1}, &error) == -1 && !error.empty(),
         "ranks out of node order are an error");
  expect(group_ranks_per_node({0, 0, 1, 1, 1}, &error) == -1, "a larger later node is an error");
}

// Run with a start timeout of 2 s and an op timeout of 0.2 s (main). A peer that starts an op
// 0.6 s after the other (a slow compile) is waited for: the waits that may wait for a peer to
// start the op are under the start timeout.
void check_late_peer() {
  Shape s{2, 3, 2, 4, 128, 6, false, false};
  DispatchData d(s);
  std::mt19937 gen(5);
  fill_inputs(s, d, gen);
  PeerError errors[2];
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    errors[1] = host::run(kPeerDispatch, d.args(s, 1), 1, HostGrid{});
  });
  errors[0] = host::run(kPeerDispatch, d.args(s, 0), 0, HostGrid{});
  late.join();
  for (const PeerError& e : errors) expect(e.ok(), "a late peer is waited for: got " + e.message);
}

// A wait whose peer never comes times out (the start timeout: the peer never started the
// op), and only this rank's later ops report it.
void check_timeout() {
  Shape s{2, 3, 2, 4, 128, 6, false, false};
  DispatchData d(s);
  std::mt19937 gen(7);
  fill_inputs(s, d, gen);
  const PeerError first = host::run(kPeerDispatch, d.args(s, 0), 0, HostGrid{});
  expect(first.message.find("timed out after 2 s waiting for peer 1 to start it") !=
             std::string::npos,
         "a lone rank times out: got '" + first.message + "'");
  const PeerError again = host::run(kPeerDispatch, d.args(s, 0), 0, HostGrid{});
  expect(again.message.find("an earlier call of jax_ep_dispatch on this rank timed out") !=
             std::string::npos,
         "the timeout is remembered: got '" + again.message + "'");
}

// A ring that never fills: rank 0 streams on 2 channels, rank 1 (a program built for
// another configuration) on 1, every token staying on its own rank. Rank 0's receiver of
// channel 1 waits for rank 1 to close its ring there, and gives up naming where.
void check_ring_timeout() {
  Shape s{2, 5, 2, 4, 128, 10, false, false, 0, 2, 1, 2};
  DispatchData d(s);
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < s.T * s.K; ++i) d.idx[r * s.T * s.K + i] = 2 * r + i % 2;
  }
  PeerError errors[2];
  std::thread one([&] {
    DispatchArgs a = d.args(s, 1);
    a.rings.channels = 1;
    errors[1] = host::run(kPeerDispatch, a, 1, HostGrid{});
  });
  errors[0] = host::run(kPeerDispatch, d.args(s, 0), 0, HostGrid{});
  one.join();
  expect(errors[0].message.find("timed out after 0.2 s on channel 1 waiting for peer 1 to "
                                "fill its ring (0 slots consumed, tail 0, not closed") !=
             std::string::npos,
         "a ring that never fills is reported: got '" + errors[0].message + "'");
  expect(errors[1].ok(), "the other rank's op completes: got '" + errors[1].message + "'");
}

// Two exchanges issued at once on one rank (as two streams, or a program whose exchanges
// are not ordered, would): whichever comes second is refused at once, naming the cause, and
// the other meets its peer as usual. Rank 1 starts only after the refusal.
void check_two_at_once() {
  Shape s{2, 3, 2, 4, 128, 6, false, false};
  DispatchData first(s), second(s), peer(s);
  std::mt19937 gen(11);
  fill_inputs(s, first, gen);
  second.x = peer.x = first.x, second.idx = peer.idx = first.idx;
  second.weights = peer.weights = first.weights;
  PeerError errors[2];
  std::atomic<int> returned{0};
  auto issue = [&](DispatchData* d, PeerError* error) {
    *error = host::run(kPeerDispatch, d->args(s, 0), 0, HostGrid{});
    returned.fetch_add(1);
  };
  std::thread a(issue, &first, &errors[0]), b(issue, &second, &errors[1]);
  while (returned.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const PeerError at_peer = host::run(kPeerDispatch, peer.args(s, 1), 1, HostGrid{});
  a.join();
  b.join();
  const std::string refused = "rank 0 of this EP group is already running another exchange";
  const int refusals = (errors[0].message.find(refused) != std::string::npos) +
                       (errors[1].message.find(refused) != std::string::npos);
  expect(refusals == 1 && (errors[0].ok() || errors[1].ok()) && at_peer.ok(),
         "two exchanges at once on a rank: one refused, the other done; got '" +
             errors[0].message + "', '" + errors[1].message + "', '" + at_peer.message + "'");
}

// A low-latency dispatch sent twice on one region before its receive, replayed, then a
// phased or streamed dispatch and combine (`streamed`): the second send is refused by its own
// launches, as on a GPU (the rank's status word records it; the send returns), and every
// rank's next call reports it, naming the fix, without running (its results untouched);
// every later call too, until jax_ep.finalize() and jax_ep.initialize(), after which the
// group works again.
void check_in_flight_refused(uint32_t seed, bool streamed) {
  Shape s{2, 5, 2, 4, 128, 10, false, false};
  if (streamed) s.channels = 2, s.chunk_tokens = 1, s.ring_chunks = 2;
  RoundData d(s, seed, std::mt19937(seed));
  struct Outcome {
    PeerError first, second, dispatch, combine;
  };
  std::vector<Outcome> out(s.R);
  const std::vector<char> untouched(d.dp.recv_x.size(), '\x5a');
  d.dp.recv_x = untouched;
  std::vector<std::thread> ranks;
  for (int r = 0; r < s.R; ++r) {
    ranks.emplace_back([&, r] {
      std::shared_ptr<const host::Recording> send;
      const LowLatencyArgs a = d.lp.dispatch_args(s, r);
      out[r].first = host::record(kPeerLlDispatchSend, a, r, HostGrid{}, {}, &send);
      if (!out[r].first.ok()) return;
      out[r].first = host::replay(*send);
      out[r].second = host::replay(*send);
      out[r].dispatch = host::run(kPeerDispatch, d.dp.args(s, r), r, HostGrid{});
      out[r].combine = d.cp.with_args(s, d.dp, r, [&](const auto& c) {
        return host::run(kPeerCombine, c, r, HostGrid{});
      });
    });
  }
  for (std::thread& t : ranks) t.join();
  const std::string refusal =
      "an earlier call of jax_ep_ll_dispatch_send: low-latency buffer 0 still holds an "
      "exchange that was sent and not yet received";
  for (int r = 0; r < s.R; ++r) {
    const Outcome& o = out[r];
    const std::string at = " (rank " + std::to_string(r) + (streamed ? ", streamed)" : ")");
    expect(o.first.ok(), "the first send runs" + at + ": got '" + o.first.message + "'");
    expect(o.second.ok(), "the second send returns, as on a GPU" + at + ": got '" +
                              o.second.message + "'");
    expect(o.dispatch.message.find("jax_ep_dispatch: " + refusal) == 0,
           "the next call reports the refusal" + at + ": got '" + o.dispatch.message + "'");
    expect(o.combine.message.find("jax_ep_combine: " + refusal) == 0,
           "and every later one" + at + ": got '" + o.combine.message + "'");
  }
  expect(d.dp.recv_x == untouched, "a refused call delivers nothing");
  // A new initialization: the group works again.
  host::finalize();
  if (!host::initialize(16 << 20, 4 << 20).empty()) {
    expect(false, "initialize again");
    return;
  }
  check_round(s, seed + 1, HostGrid{}, ", after a refusal");
}

// A call recorded before jax_ep.finalize() holds the freed buffers' addresses: after a new
// initialization its replay is refused, naming the fix, and touches nothing.
void check_stale_replay(uint32_t seed) {
  const Shape s{2, 5, 2, 4, 128, 10, false, false};
  RoundData d(s, seed, std::mt19937(seed));
  std::vector<std::shared_ptr<const host::Recording>> recorded(s.R);
  std::vector<std::thread> ranks;
  for (int r = 0; r < s.R; ++r) {
    ranks.emplace_back([&, r] {
      host::record(kPeerDispatch, d.dp.args(s, r), r, HostGrid{}, {}, &recorded[r]);
    });
  }
  for (std::thread& t : ranks) t.join();
  host::finalize();
  if (!host::initialize(16 << 20, 4 << 20).empty()) {
    expect(false, "initialize again");
    return;
  }
  for (int r = 0; r < s.R; ++r) {
    expect(recorded[r] != nullptr, "rank " + std::to_string(r) + " recorded its dispatch");
    if (recorded[r] == nullptr) continue;
    const PeerError e = host::replay(*recorded[r]);
    expect(e.message.find("jax_ep_dispatch: this call was recorded before jax_ep.finalize()") == 0,
           "a replay after a new initialization is refused: got '" + e.message + "'");
  }
}

// A failure on one rank reaches its peers through its arrival signals (kRankFailed) within a
// poll, not after their timeouts: rank 0 sends twice on region 0 (refused) while rank 1 sends
// on region 1, so only rank 0 fails; then both dispatch. Rank 0 reports its refusal; rank
// 1's dispatch, which waits for rank 0 to start it (a start timeout of 2 s here), stops at
// once naming peer 0.
void check_failure_reaches_peers(uint32_t seed) {
  const Shape s{2, 5, 2, 4, 128, 10, false, false};
  RoundData d(s, seed, std::mt19937(seed));
  PeerError dispatched[2];
  double seconds[2] = {0, 0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < s.R; ++r) {
    ranks.emplace_back([&, r] {
      LowLatencyArgs a = d.lp.dispatch_args(s, r);
      host::run(kPeerLlDispatchSend, a, r, HostGrid{});
      a.buffer = r;  // rank 0: region 0 again (refused); rank 1: region 1
      host::run(kPeerLlDispatchSend, a, r, HostGrid{});
      const auto start = std::chrono::steady_clock::now();
      dispatched[r] = host::run(kPeerDispatch, d.dp.args(s, r), r, HostGrid{});
      seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  }
  for (std::thread& t : ranks) t.join();
  expect(dispatched[0].message.find("low-latency buffer 0 still holds") != std::string::npos,
         "rank 0 reports its refusal: got '" + dispatched[0].message + "'");
  expect(dispatched[1].message.find("jax_ep_dispatch: stopped because EP peer 0 failed") == 0,
         "rank 1 stops, naming peer 0: got '" + dispatched[1].message + "'");
  expect(seconds[1] < 1.0, "rank 1 stops within a poll, not its 2 s timeout: took " +
                               std::to_string(seconds[1]) + " s");
  const PeerError again = host::run(kPeerDispatch, d.dp.args(s, 1), 1, HostGrid{});
  expect(again.message.find("an earlier call of jax_ep_dispatch on this rank stopped because "
                            "EP peer 0 failed") != std::string::npos,
         "and remembers it: got '" + again.message + "'");
}

}  // namespace
}  // namespace jax_ep

int main() {
  using namespace jax_ep;
  const char* seed_text = std::getenv("JAX_EP_TEST_SEED");
  const uint32_t seed = seed_text ? static_cast<uint32_t>(std::strtoul(seed_text, nullptr, 10))
                                  : std::random_device{}();
  std::printf("host peers test: seed %u (rerun with JAX_EP_TEST_SEED=%u)\n", seed, seed);
  if (!host::initialize(16 << 20, 4 << 20).empty()) return 2;
  const HostGrid warps{2, 2, 32, 3};  // 2 blocks of 2 warps of 32 lanes, on 3 threads per rank
  const HostGrid loop{};              // the CPU handlers' default
  const int R = 4;
  const Shape shapes[] = {
      {R, 13, 3, 8, 256, 20, false, false},   // capacity cuts rank-major rows
      {R, 13, 3, 8, 256, 52, false, true},    // every row kept, FP8 scales
      {R, 11, 4, 12, 128, 30, true, false},   // expert-major, entries cut
      {R, 7, 2, 4, 384, 56, true, true},      // expert-major, all kept, FP8
      {R, 300, 6, 8, 128, 700, false, false},  // the count in 5 chunks of 64 tokens
      {R, 200, 5, 12, 128, 1500, true, false}, // expert-major, 4 chunks
      {R, 9, 3, 8, 384, 36, false, false, kWireE4m3Ue8m0},  // low latency: UE8M0 scales, padded
      {R, 9, 3, 8, 256, 36, false, false, kWireMxfp8},      // MXFP8
      {R, 9, 3, 8, 256, 36, false, false, kWireNvfp4},      // NVFP4, a row in one segment
      // bfloat16 rows of 26 bytes (H 13): padded in the packed slots over puts.
      {R, 11, 3, 8, 13, 30, false, false, 0, 0, 0, 0, 2},
      {R, 9, 2, 8, 13, 40, true, false, 0, 0, 0, 0, 2},
      // The send casts bfloat16 rows to a wire format: E4M3 rank-major, NVFP4 expert-major.
      {R, 13, 3, 8, 256, 20, false, false, 0, 0, 0, 0, 2, 0, kWireE4m3},
      {R, 11, 4, 12, 128, 30, true, false, 0, 0, 0, 0, 2, 0, kWireNvfp4},
      // ... and the finish dequantizes them: UE8M0 rank-major, MXFP8 expert-major.
      {R, 13, 3, 8, 384, 20, false, false, 0, 0, 0, 0, 2, 0, kWireE4m3Ue8m0, true},
      {R, 11, 4, 12, 128, 30, true, false, 0, 0, 0, 0, 2, 0, kWireMxfp8, true},
      // The combine's stages cast its weighted rows, its sums dequantize them: NVFP4, E4M3.
      {R, 13, 3, 8, 256, 20, false, false, 0, 0, 0, 0, 2, 0, 0, false, kWireNvfp4},
      {R, 9, 3, 8, 384, 27, false, false, 0, 0, 0, 0, 2, 0, 0, false, kWireE4m3},
  };
  uint32_t round = 0;
  for (const Shape& s : shapes) {
    for (const HostGrid& grid : {warps, loop}) check_round(s, seed + 10 * round++, grid);
  }
  // Replays (the CPU's CUDA graphs): rank-major and expert-major, FP8, in phases.
  for (const Shape& s : {shapes[0], shapes[3], shapes[8]}) {
    check_replays(s, seed + 10 * round++, warps);
  }
  host::finalize();
  // Dispatch and combine streamed through rings a few slots deep, over stores and over puts,
  // so that every ring wraps around many times (T not a multiple of a chunk, capacity cuts).
  const Shape streamed[] = {
      {R, 13, 3, 8, 256, 20, false, false, 0, 2, 1, 2},
      {R, 13, 3, 8, 256, 52, false, true, 0, 3, 2, 2},
      {R, 300, 6, 8, 128, 700, false, false, 0, 2, 3, 2},
      // 12 ranks, top-10: a sender warp writes a token into more rings than one read of its
      // row serves (kFanOut), in two batches.
      {12, 9, 10, 12, 128, 108, false, true, 0, 2, 1, 2},
      // bfloat16 rows of 26 bytes (H 13): each ring slot pads its row to 32 bytes.
      {R, 13, 3, 8, 13, 30, false, false, 0, 2, 1, 2, 2},
      // Warps per channel named (Channels.warps): 3 dispatch senders split 4 destinations and
      // 3 receivers 4 rings unevenly, 3 combine senders 4 homes; at 12 ranks 5 of each.
      {R, 13, 3, 8, 256, 52, false, true, 0, 2, 2, 2, 4, 3},
      {12, 9, 10, 12, 128, 108, false, false, 0, 2, 1, 2, 4, 5},
      // The senders cast bfloat16 rows to MXFP8 (the forwarders pass the cast slots on).
      {R, 13, 3, 8, 256, 52, false, false, 0, 2, 1, 2, 2, 0, kWireMxfp8},
      // ... to NVFP4, and the receivers dequantize them.
      {R, 13, 3, 8, 256, 52, false, false, 0, 2, 1, 2, 2, 0, kWireNvfp4, true},
      // The combine's senders cast its weighted rows to UE8M0 into the ring slots.
      {R, 13, 3, 8, 256, 40, false, false, 0, 2, 1, 2, 2, 0, 0, false, kWireE4m3Ue8m0},
  };
  for (const bool puts : {false, true}) {
    puts_only = puts;
    if (!host::initialize(32 << 20, 16 << 20, puts).empty()) return 2;
    for (const Shape& s : streamed) {
      for (const HostGrid& grid : {warps, loop}) {
        check_round(s, seed + 10 * round++, grid, puts ? ", puts" : "");
      }
    }
    // Streamed, replayed.
    check_replays(streamed[1], seed + 10 * round++, warps, puts ? ", puts" : "");
    host::finalize();
  }
  // Peers reached by puts only.
  puts_only = true;
  if (!host::initialize(32 << 20, 16 << 20, /*puts=*/true).empty()) return 2;
  for (const Shape& s : shapes) check_round(s, seed + 10 * round++, warps, ", puts");
  for (const Shape& s : {shapes[1], shapes[2]}) {
    check_replays(s, seed + 10 * round++, warps, ", puts");
  }
  host::finalize();
  // Node-aware: two nodes of two ranks.
  if (!host::initialize(48 << 20, 16 << 20, /*puts=*/true, /*ranks_per_node=*/2).empty()) {
    return 2;
  }
  for (const Shape& s : shapes) check_round(s, seed + 10 * round++, warps, ", nodes of 2");
  // With rings: the dispatch streamed through the relays (forwarders), the combine over puts.
  for (const Shape& s : streamed) check_round(s, seed + 10 * round++, warps, ", nodes of 2");
  check_replays(shapes[0], seed + 10 * round++, warps, ", nodes of 2");
  check_replays(streamed[0], seed + 10 * round++, warps, ", nodes of 2");
  host::finalize();
  // Nodes of 3 and 1: the last node's relay serves each of the other node's 3 sources.
  if (!host::initialize(48 << 20, 16 << 20, /*puts=*/true, /*ranks_per_node=*/3).empty()) {
    return 2;
  }
  for (const Shape& s : streamed) check_round(s, seed + 10 * round++, warps, ", nodes of 3");
  host::finalize();
  // EP groups of a mesh, side by side.
  puts_only = false;
  if (!host::initialize(16 << 20, 4 << 20).empty()) return 2;
  check_group_rules();
  for (const bool ep_first : {false, true}) check_two_groups_at_once(ep_first, seed + 1000);
  host::finalize();
  // A refused low-latency send: every rank reports it, then a new initialization.
  for (const bool streamed : {false, true}) {
    if (!host::initialize(16 << 20, 4 << 20).empty()) return 2;
    check_in_flight_refused(seed + 10 * round++, streamed);
    host::finalize();
  }
  setenv("JAX_EP_START_TIMEOUT_S", "2", 1);
  setenv("JAX_EP_TIMEOUT_S", "0.2", 1);
  if (!host::initialize(1 << 20, 0).empty()) return 2;
  check_late_peer();
  check_two_at_once();
  check_timeout();
  host::finalize();
  if (!host::initialize(1 << 20, 0).empty()) return 2;
  check_ring_timeout();
  host::finalize();
  if (!host::initialize(16 << 20, 4 << 20).empty()) return 2;
  check_failure_reaches_peers(seed + 10 * round++);
  host::finalize();
  if (!host::initialize(16 << 20, 4 << 20).empty()) return 2;
  check_stale_replay(seed + 10 * round++);
  host::finalize();
  std::printf("host peers test: %s\n", failures ? "FAILED" : "passed");
  return failures ? 1 : 0;
}
