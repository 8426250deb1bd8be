// GPU groups: what the CUDA handlers run on. The Python group layer (spmd.runtime) registers each
// group once: an NCCL communicator made from a unique id that travelled through spmd's bootstrap,
// and, for a group on one node, the custom all-reduce's IPC buffers. Compiled programs carry the
// group id.
#ifndef SPMD_CUDA_GROUPS_H_
#define SPMD_CUDA_GROUPS_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "custom_ar.h"
#include "nccl.h"
#include "spmd/status.h"

namespace spmd {

struct CudaGroup {
  int64_t id = 0;
  int rank = 0, size = 1;
  std::vector<int> world_ranks;
  int device = 0;
  uint64_t timeout_ns = 0;
  NcclComm nccl = nullptr;
  void* scratch = nullptr;  // 16 bytes of device memory (barrier)
  // Custom all-reduce: this rank's buffer, the peers' as mapped here, and whether it passed the
  // peer-access check.
  char* own = nullptr;
  std::vector<char*> opened;  // by rank; nullptr for this rank
  car::Peers peers{};
  bool car_ready = false;
  bool destroyed = false;  // by CudaGroupDestroy; its resources are released
  std::mutex mu;
  int world_rank() const { return world_ranks[rank]; }
};

Status CudaGroupCreate(int64_t id, int rank, int size, std::vector<int> world_ranks, int device,
                       double timeout_s);
// Creates the group's NCCL communicator; blocks until every rank joined (NCCL's bootstrap).
// A group whose NCCL failed (two ranks on one GPU, say) still serves the custom all-reduce.
Status CudaGroupNcclInit(int64_t id, const NcclUniqueId& uid);
// Allocates this rank's buffer for `cap` bytes per region; returns its IPC handle (64 bytes).
Status CudaGroupCarAlloc(int64_t id, size_t cap, std::string* handle);
// Maps every peer's buffer (handles[r] from rank r).
Status CudaGroupCarOpen(int64_t id, const std::vector<std::string>& handles);
// Peer-access check, in two steps with a bootstrap barrier between them: each rank writes a
// pattern derived from `seed` and its rank, then reads every rank's pattern through the
// mappings; `bad` gets the ranks whose pattern did not arrive. Passing enables the group's
// custom all-reduce.
Status CudaGroupCarWriteCheck(int64_t id, uint32_t seed);
Status CudaGroupCarReadCheck(int64_t id, uint32_t seed, std::vector<int>* bad);
void CudaGroupDestroy(int64_t id);
// nullptr if no group has this id (not registered, or destroyed by spmd.finalize).
std::shared_ptr<CudaGroup> CudaGroupFind(int64_t id);

uint32_t CheckPattern(uint32_t seed, int rank);

}  // namespace spmd

#endif  // SPMD_CUDA_GROUPS_H_
