// GPU groups: what the CUDA handlers run on. The Python group layer (spmd.runtime) registers each
// group once: an NCCL communicator made from a unique id that travelled through spmd's bootstrap,
// and, for a group on one node, the custom all-reduce's IPC buffers. Compiled programs carry the
// group id.
#ifndef SPMD_CUDA_GROUPS_H_
#define SPMD_CUDA_GROUPS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "custom_ar.h"
#include "nccl.h"
#include "spmd/record.h"
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
  // The call sites (CheckCall) whose calls the ranks have compared in full, with their
  // signatures.
  std::unordered_map<int64_t, uint64_t> site_hashes;
  std::mutex check_mu;
  // Calls made on the group by this process, as the flight recorder numbers them.
  std::atomic<uint64_t> calls{0}, p2p_calls{0};
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

// How the GPU handlers compare and record their calls: `hooks` are the CPU module's
// (spmd/signature.h); `every_call` compares every call in full (SPMD_DEBUG=1), otherwise the
// first run of each call site in full and the calls after it by the sequence check: every call
// with `sequence_all` (the handlers are not registered for CUDA graphs, SPMD_CUDA_GRAPHS=0),
// else only those XLA never captures (all_to_allv). Until this is called, nothing is compared
// or recorded.
void SetGpuHooks(const GpuHooks* hooks, bool every_call, bool sequence_all);
// Compares this call with the other ranks' as due: `described` is the call written out (empty:
// never compared, as for point-to-point calls, which involve two ranks of the group); `site`
// identifies one call of one compiled program (the Python lowering numbers them), so that ranks
// running the same programs compare each call site in full once, the first time it runs (a
// barrier on the host: ranks whose programs differ fail at the first call that differs or that
// only one of them runs for the first time), and the calls after it by the sequence check
// (SetGpuHooks says which), which never waits and finds a difference (calls in another order,
// one call more) at the first call after both ranks made it. `captured`: XLA is capturing the
// call in a CUDA graph, whose replays do not run the handler: compared in full if due, but not
// counted by the sequence check. *hash: the call's signature (0 for an uncompared call). The
// stream is not touched.
Status CheckCall(CudaGroup& g, int64_t site, std::string_view described, CallCode code,
                 bool captured, uint64_t* hash);
// The flight recorder, through the hooks: a GPU call recorded from its start to the end of its
// enqueueing (spmd/record.h, kEnqueued), or as failed.
size_t RecordBegin(int64_t group, uint64_t call, uint64_t hash, uint64_t bytes, int32_t code);
void RecordEnd(size_t slot, bool failed);

}  // namespace spmd

#endif  // SPMD_CUDA_GROUPS_H_
