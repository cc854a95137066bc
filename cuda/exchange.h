// Bodies of the exchange kernels, written once for host and device: this header includes
// them, filed by op (below).
//
// Each op is a short sequence of *phases*; a phase is a function of (rank, item) with no
// dependency between items, so any grid can run it, and the next phase starts only after the
// previous one finished on every rank (a kernel boundary on one GPU, a loop on the CPU). The
// CUDA kernels (cuda/exchange.cu) run the items in parallel, the CPU handlers
// (ffi/exchange_cpu.cc) in a loop, so CI checks the exact kernel logic bit for bit against the
// NumPy reference without a GPU. Items move rows with `copy_row(dst, src, bytes, lane, lanes)`:
// a warp on the GPU (32 lanes); on the CPU one lane, or 32 emulated ones (cuda/host_launch.h).
//
// Peers. Every buffer that one rank writes for another is reached through a `Peers` view of
// one of two kinds. A store view (kPuts false) hands out pointers: `peers.at(base, stride,
// rank)` is rank's copy of the buffer; with virtual ranks (all R ranks of the group inside one
// call, inputs and outputs stacked [R, ...]) that is base + rank * stride. A put view (kPuts
// true: peers reached over the network, NVSHMEM's puts) hands out no pointer to a peer: it
// copies from this rank's symmetric buffer into a peer's copy of a buffer (`put`, `put_value`),
// and a phase reads only this rank's own copy (`own`). The bodies write a value to a peer
// through store_to, a row with a put or stores as the view's kind says, and read received
// data through own_copy. Normal combine, which reads the peers' copies with a store view, has
// the receivers return the rows with a put view (combine_return). Every write has exactly one
// writer and every output element that the contract defines is written once, so no buffer
// needs clearing and results do not depend on scheduling. Rows past a count carry no data
// and are not written (docs/contract.md, "Padding").
//
// Ordering rules (docs/contract.md): rank-major rows are ordered by source rank, then token;
// expert-major entries by local expert, then rank-major row, then choice; low-latency slots of
// an expert by source rank, then token. Positions come from counts that every rank publishes
// in a first phase (`counts`, [R][R + E]: tokens of source s for each destination rank, then
// valid choices of s for each expert) and from per-token offsets computed in the same phase.
//
// The bodies, by op (each header's opening comment says what it holds and includes):
//   cuda/primitives.h    peer views, row copies, Fan, Tally, the counts' chunks
//   cuda/cast.h          the sends' casts of bfloat16 rows to the wire formats (cuda/wire.h)
//   cuda/dispatch.h      normal dispatch
//   cuda/sums.h          ordered sums of rows (the combines)
//   cuda/combine.h       normal combine
//   cuda/low_latency.h   low-latency dispatch and combine
// and, beside them, the streamed ops (cuda/dispatch_stream.h, cuda/combine_stream.h) and the
// rows along a dispatch's handle (cuda/dispatch_rows.h).
#pragma once

#include "cuda/combine.h"
#include "cuda/dispatch.h"
#include "cuda/low_latency.h"
#include "cuda/primitives.h"
#include "cuda/sums.h"
