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
#include <string_view>
#include <unordered_set>
#include <vector>

#include "custom_ar.h"
#include "nccl.h"
#include "spmd/signature.h"
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
  // The call sites (CheckCall) whose calls the ranks have compared.
  std::unordered_set<int64_t> checked_sites;
  std::mutex check_mu;
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

// How the GPU handlers compare their calls across the ranks of a group: `fn` is the CPU
// module's comparison (spmd/signature.h); `every_call` compares every call (SPMD_DEBUG=1),
// otherwise only the first run of each call site. Until this is called, nothing is compared.
void SetSignatureCheck(CheckSignatureFn fn, bool every_call);
// Compares this call with the other ranks' if it is due: `described` is the call written out
// (empty: never compared, as for point-to-point calls, which involve two ranks of the group);
// `site` identifies one call of one compiled program (the Python lowering numbers them), so
// that ranks running the same programs compare each call site once, the first time it runs,
// and ranks whose programs differ compare (and fail at) the first call that differs or that only
// one of them runs for the first time. Blocks the host until the group's ranks arrive; the
// stream is not touched.
Status CheckCall(CudaGroup& g, int64_t site, std::string_view described);

}  // namespace spmd

#endif  // SPMD_CUDA_GROUPS_H_
