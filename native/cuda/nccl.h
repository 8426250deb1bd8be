// NCCL, loaded at run time with dlopen from the library Python points at (the NCCL wheel's, or
// the system's). Nothing links against NCCL at build time, so spmd builds without NCCL's headers
// and a CPU-only install never needs it. The types below are NCCL's stable C ABI.
#ifndef SPMD_CUDA_NCCL_H_
#define SPMD_CUDA_NCCL_H_

#include <cstddef>
#include <string>

#include "spmd/status.h"

namespace spmd {

using NcclComm = struct NcclCommOpaque*;
using NcclStream = void*;  // cudaStream_t

struct NcclUniqueId {
  char internal[128];
};

// ncclDataType_t values.
enum NcclType : int {
  kNcclInt8 = 0,
  kNcclUint8 = 1,
  kNcclInt32 = 2,
  kNcclInt64 = 4,
  kNcclFloat16 = 6,
  kNcclFloat32 = 7,
  kNcclFloat64 = 8,
  kNcclBfloat16 = 9,
};
// ncclRedOp_t values.
enum NcclOp : int { kNcclSum = 0, kNcclProd = 1, kNcclMax = 2, kNcclMin = 3 };

// Resolves NCCL's functions from `library` (a path, or a name for the dynamic loader). Once per
// process; later calls with another library are an error.
Status NcclLoad(const std::string& library);
bool NcclLoaded();
// "2.21.5" style.
std::string NcclVersion();

Status NcclGetUniqueId(NcclUniqueId* id);
// Blocks until every rank of the communicator has called it (NCCL's own bootstrap).
Status NcclCommInitRank(NcclComm* comm, int size, const NcclUniqueId& id, int rank);
void NcclCommDestroy(NcclComm comm);

// Enqueue on `stream`; errors are NCCL's synchronous launch errors.
Status NcclAllReduce(const void* in, void* out, size_t count, NcclType t, NcclOp op,
                     NcclComm comm, NcclStream stream);
Status NcclAllGather(const void* in, void* out, size_t count, NcclType t, NcclComm comm,
                     NcclStream stream);
Status NcclReduceScatter(const void* in, void* out, size_t count, NcclType t, NcclOp op,
                         NcclComm comm, NcclStream stream);
Status NcclBroadcast(const void* in, void* out, size_t count, NcclType t, int root,
                     NcclComm comm, NcclStream stream);
Status NcclReduce(const void* in, void* out, size_t count, NcclType t, NcclOp op, int root,
                  NcclComm comm, NcclStream stream);
Status NcclSend(const void* in, size_t count, NcclType t, int peer, NcclComm comm,
                NcclStream stream);
Status NcclRecv(void* out, size_t count, NcclType t, int peer, NcclComm comm,
                NcclStream stream);
Status NcclGroupStart();
Status NcclGroupEnd();

// RAII group: every call between construction and End() is fused by NCCL into one launch.
class NcclGroup {
 public:
  NcclGroup() : status_(NcclGroupStart()) {}
  ~NcclGroup() {
    if (open_) (void)NcclGroupEnd();
  }
  Status End() {
    if (!open_) return status_;
    open_ = false;
    SPMD_RETURN_IF_ERROR(status_);
    return NcclGroupEnd();
  }
  const Status& status() const { return status_; }

 private:
  Status status_;
  bool open_ = true;
};

}  // namespace spmd

#endif  // SPMD_CUDA_NCCL_H_
