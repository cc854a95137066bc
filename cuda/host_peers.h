// Host peers: the exchange between the CPU devices of one process, the ops of
// cuda/peer_ops.h on a host stand-in for NVSHMEM, so that CI runs the code the GPUs run
// between each other (one rank per device, first_rank = that rank, the buffer carving and
// the flags the launches meet at) without a GPU.
//
// A group of R ranks has one symmetric buffer per rank in host memory, all the same size
// (jax_ep.initialize() on CPU sets it). HostPeers turns an address in this rank's buffer into
// the same offset in a peer's buffer, as nvshmem_ptr does; with puts ($JAX_EP_PEER_ACCESS=put)
// HostPutPeers copies into it only as an NVSHMEM put does, from this rank's buffer; split
// into nodes ($JAX_EP_RANKS_PER_NODE), HostPeers reaches only the ranks of this rank's node,
// as between GPUs of several nodes. Each rank runs its ops on its own thread (XLA:CPU runs the devices of a program concurrently), so the ranks of a group meet
// as the GPUs do (cuda/peer_ops.h, Meet): per-peer signals at the start of each buffer, set
// with release by the unit of a launch that finishes last and awaited with acquire, every
// wait bounded (Wait: peers starting an op get $JAX_EP_START_TIMEOUT_S, peers inside it
// $JAX_EP_TIMEOUT_S). A timeout is remembered, and every later op of that rank reports it.
//
// A group is keyed by its devices (cuda/ep_group.h), so the EP groups of a mesh (data x ep)
// and programs on other devices never share buffers or flags; calls without a group table
// (a 1-D EP mesh traced without a concrete mesh) share one group per R.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cuda/ep_group.h"
#include "cuda/host_launch.h"
#include "cuda/peer_ops.h"

namespace jax_ep::host {

// Sets up host peers with `bytes_per_rank` of symmetric buffer per rank, the last
// `low_latency_bytes` of it for the low-latency regions (groups are created on first use),
// reached with stores or, with `puts`, with puts only (HostPutPeers) and, with
// ranks_per_node > 0, split into nodes of that many consecutive ranks, node-aware (stores
// within a node); an error message, or empty on success.
std::string initialize(size_t bytes_per_rank, size_t low_latency_bytes, bool puts = false,
                       int ranks_per_node = 0);
// Frees every group; no op of any group may be running.
void finalize();
// The buffer size of initialize(), or 0 when not initialized.
size_t buffer_bytes();

// Op `op` (PeerOp) of cuda/peer_ops.h for EP rank `rank` of args.num_ranks in its group of
// `groups` (none: the ranks of one group per R), with the phases run on `grid`. Args is one of
// JAX_EP_FOR_EACH_OP_ARGS.
template <typename Args>
PeerError run(int op, const Args& args, int rank, const HostGrid& grid,
              const GroupTable& groups = {});

// Replays, the CPU's stand-in for CUDA graphs: record() takes the call run() would make and
// keeps the launches it issues, with their arguments, without running them (as XLA records a
// command-buffer-compatible call by capturing the handler's launches); replay() runs them
// again, none of the op's host code with them. A recording is bound to the addresses of
// `args` (rerecord to change them) and replays in order with the rank's other exchanges, as a
// graph on the stream would. What changes from call to call lives where the launches run
// (cuda/peer_ops.h, Meet), so each replay gives what a fresh call would. record()'s error:
// the call would fail before launching (a wrong group, a call larger than the buffer).
class Recording;
template <typename Args>
PeerError record(int op, const Args& args, int rank, const HostGrid& grid,
                 const GroupTable& groups, std::shared_ptr<const Recording>* out);
PeerError replay(const Recording& recording);
// Whether `recording` can replay: no jax_ep.finalize() since it was recorded.
bool current(const Recording& recording);

}  // namespace jax_ep::host
