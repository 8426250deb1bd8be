// The groups the CPU collectives run on. The Python group layer (spmd.runtime) registers a group
// once under an integer id (spmd/registry.h), attaches what it can use (its shared-memory
// segment, its MPI communicator, and for a group spanning nodes the node-local segments and the
// node leaders' communicator), then chooses its transport; compiled programs carry the id as an
// FFI attribute and look the group up on every call.
#ifndef SPMD_CPU_GROUPS_H_
#define SPMD_CPU_GROUPS_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "mpi.h"
#include "shm.h"
#include "spmd/signature.h"
#include "spmd/status.h"
#include "transport.h"

namespace spmd {

struct Group {
  int64_t id = 0;
  int rank = 0, size = 1;
  std::vector<int> world_ranks;
  double timeout_s = 300;
  size_t one_shot_max = 64 * 1024;
  std::unique_ptr<ShmGroup> shm;    // every rank of the group, when all share one node
  bool has_mpi = false;
  MpiComm mpi;                      // every rank of the group
  std::unique_ptr<ShmGroup> local;  // hierarchical: the group's ranks on this node
  bool is_leader = false;
  MpiComm leaders;                  // hierarchical: local rank 0 of each node
  bool has_rail = false;
  MpiComm rail;                     // hierarchical, nodes of equal size: this local index's ranks
  std::vector<int> node_of;         // hierarchical: each group rank's node (GroupSetNodes)
  // The transport the group's collectives use, built on the parts above (declared after them,
  // so that it goes first); null until Python chooses one. Point-to-point calls use `mpi`.
  std::unique_ptr<Transport> transport;
  TransportKind transport_kind = TransportKind::kShm;
  std::mutex mu;  // one collective at a time per group and process
  // Calls made on the group by this process (under mu), as the flight recorder numbers them.
  uint64_t calls = 0;      // collectives
  uint64_t p2p_calls = 0;  // point-to-point

  int world_rank() const { return world_ranks[rank]; }
};

Status GroupCreate(int64_t id, int rank, int size, std::vector<int> world_ranks, double timeout_s,
                   size_t one_shot_max);
// which: 0 = the whole group, 1 = the node-local part (hierarchical).
Status GroupAttachShm(int64_t id, int which, const std::string& name, bool create, int rank,
                      int size, std::vector<int> world_ranks, size_t chunk,
                      ShmGroup::Staging staging);
// which: 0 = the whole group, 1 = the node leaders, 2 = this rank's rail (one rank of each node,
// the same local index; its rank is the node's number).
Status GroupAttachMpi(int64_t id, int which, MpiHandle comm, int rank, int size,
                      std::vector<int> world_ranks);
// Where the group's ranks sit, for the hierarchical transport: node_of[r] is group rank r's node,
// the nodes numbered in the order of their first rank.
Status GroupSetNodes(int64_t id, std::vector<int> node_of);
// The group's shared-memory staging probe (ShmGroup::Hop); every rank of the group calls it.
Status GroupShmHop(int64_t id, double* hop_ns);
// Chooses the group's transport; an error if what it needs is not attached to the group.
Status GroupSetTransport(int64_t id, TransportKind kind);
// The group's ranks compare `described` (a call written out in full) on the group's transport:
// a barrier whose signature is the text's hash. Ok for an id with no group here (a group of one).
Status GroupCheckSignature(int64_t id, const std::string& described);
// The sequence check of a call compared in full only on its first run (ShmGroup::Sequence), on
// the group's shared memory, or for a group spanning nodes among its ranks on this node; Ok
// for a group of one or without shared memory.
Status GroupSequence(int64_t id, uint64_t hash, std::string_view described);
// ShmGroup::SequenceReset of the group's shared memory, if it has one.
void GroupSequenceReset(int64_t id);
// The functions the GPU handlers call here (spmd/signature.h).
const GpuHooks* HooksForGpu();
// The group's shared-memory segment (the world group's: every rank of the job on this machine)
// becomes the wait board (board.h).
Status GroupBoardUse(int64_t id);
void GroupDestroy(int64_t id);
// nullptr if no group has this id (not registered, or destroyed by spmd.finalize).
std::shared_ptr<Group> GroupFind(int64_t id);

}  // namespace spmd

#endif  // SPMD_CPU_GROUPS_H_
