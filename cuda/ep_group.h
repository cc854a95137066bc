// The EP group of an exchange between devices: the devices it meets, in EP rank order.
//
// The EP axis may be one axis of a larger mesh (data x ep, or data x fsdp x expert): each
// coordinate of the other axes holds one EP group, the devices along the EP axis there. The
// custom calls of a program carry all of its groups (jax_ep/_ep_groups.py): the attribute
// `ep_groups`, the devices' ids [G, R] row by row. A handler finds its own device's row, and
// its EP rank in it, and exchanges within that row only: host peers key their buffers by the
// row (cuda/host_peers.cc), GPUs map it to NVSHMEM PEs (cuda/peer_exchange.cu). Without the
// attribute (a mesh of the EP axis alone, traced without a concrete mesh) the group is every
// rank in order, as it was before groups existed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

// The groups of one call: `size` device ids, row by row of num_ranks each (empty: unknown,
// one group), and the device that runs the call.
struct GroupTable {
  const int64_t* devices = nullptr;
  int64_t size = 0;
  int64_t device = -1;
};

// An axis index for find_group that the caller checks elsewhere (on the GPU, in the launches).
constexpr int kUncheckedRank = -1;

// "[0, 2, 4, 6]".
inline std::string devices_text(const std::vector<int64_t>& devices) {
  std::string text = "[";
  for (size_t i = 0; i < devices.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(devices[i]);
  }
  return text + "]";
}

// This device's group in `table`: its row of device ids (EP rank order) and its rank, or an
// error (empty when found) naming what does not fit. `axis_index` is the call's EP axis index,
// which must be the rank (kUncheckedRank: not checked here).
inline std::string find_group(const GroupTable& table, int num_ranks, int axis_index,
                              std::vector<int64_t>* row, int* rank) {
  if (num_ranks < 1 || table.size % num_ranks != 0) {
    return "the EP groups list " + std::to_string(table.size) + " devices, not whole groups "
           "of " + std::to_string(num_ranks);
  }
  for (int64_t i = 0; i < table.size; ++i) {
    if (table.devices[i] != table.device) continue;
    const int64_t first = i / num_ranks * num_ranks;
    row->assign(table.devices + first, table.devices + first + num_ranks);
    *rank = static_cast<int>(i - first);
    if (axis_index != kUncheckedRank && *rank != axis_index) {
      return "device " + std::to_string(table.device) + " is EP rank " +
             std::to_string(*rank) + " of its group, but its EP axis index is " +
             std::to_string(axis_index) + " (a program traced for another mesh)";
    }
    return "";
  }
  return "device " + std::to_string(table.device) + " is in none of the program's EP groups "
         "(a program traced for the devices of another mesh)";
}

// The nodes of a group whose rank r runs on node node_of[r]: 0 when every rank is on one
// node; else n when the nodes hold consecutive ranks, n on each (the last may hold fewer),
// which is how the node-aware dispatch splits a group (cuda/peer_ops.h, node_split). -1 with
// `*error` set otherwise.
inline int group_ranks_per_node(const std::vector<int>& node_of, std::string* error) {
  const int R = static_cast<int>(node_of.size());
  int size = 0;  // ranks on the first node
  while (size < R && node_of[size] == node_of[0]) ++size;
  if (size == R) return 0;
  for (int r = 0; r < R; ++r) {
    const bool same = node_of[r] == node_of[r / size * size];
    const bool fresh = r % size != 0 ||
                       std::find(node_of.begin(), node_of.begin() + r, node_of[r]) ==
                           node_of.begin() + r;
    if (!same || !fresh) {
      *error = "the EP group's ranks are not in node order: give each node consecutive EP "
               "ranks, the same number on every node (the last may hold fewer)";
      return -1;
    }
  }
  return size;
}

}  // namespace jax_ep
