// The registry of groups the collectives run on. Python registers a group once (its ranks, its
// shared-memory segment, its MPI communicator) under an integer id; compiled programs carry the
// id as an FFI attribute and look the group up on every call.
#ifndef SPMD_CPU_GROUPS_H_
#define SPMD_CPU_GROUPS_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mpi.h"
#include "shm.h"
#include "spmd/status.h"

namespace spmd {

// How a group moves data; codes shared with Python (spmd/ops/_groups.py, BACKENDS).
enum class Backend : int32_t { kShm = 0, kMpi = 1, kHier = 2 };

struct Group {
  int64_t id = 0;
  int rank = 0, size = 1;
  std::vector<int> world_ranks;
  double timeout_s = 300;
  size_t one_shot_max = 64 * 1024;
  Backend backend = Backend::kShm;
  std::unique_ptr<ShmGroup> shm;    // every rank of the group, when all share one node
  bool has_mpi = false;
  MpiComm mpi;                      // every rank of the group
  std::unique_ptr<ShmGroup> local;  // hierarchical: the group's ranks on this node
  bool is_leader = false;
  MpiComm leaders;                  // hierarchical: local rank 0 of each node
  std::mutex mu;                    // one collective at a time per group and process
};

Status GroupCreate(int64_t id, int rank, int size, std::vector<int> world_ranks, double timeout_s,
                   size_t one_shot_max);
// which: 0 = the whole group, 1 = the node-local part (hierarchical).
Status GroupAttachShm(int64_t id, int which, const std::string& name, bool create, int rank,
                      int size, std::vector<int> world_ranks, size_t chunk,
                      ShmGroup::Staging staging);
Status GroupAttachMpi(int64_t id, int which, MpiHandle comm, int rank, int size,
                      std::vector<int> world_ranks);
// The group's shared-memory staging probe (ShmGroup::Hop); every rank of the group calls it.
Status GroupShmHop(int64_t id, double* hop_ns);
Status GroupSetBackend(int64_t id, Backend backend);
void GroupDestroy(int64_t id);
// nullptr if no group has this id (not registered, or destroyed by spmd.finalize).
std::shared_ptr<Group> GroupFind(int64_t id);

}  // namespace spmd

#endif  // SPMD_CPU_GROUPS_H_
