// What the flight recorder keeps of one call (native/cpu/recorder.h holds the ring), shared by
// the CPU handlers and the GPU handlers, which record through the CPU module (spmd/signature.h,
// GpuHooks).
#ifndef SPMD_RECORD_H_
#define SPMD_RECORD_H_

#include <cstdint>

#include "spmd/tables.h"

namespace spmd {

// The handlers, as records and errors name them.
enum CallCode : int32_t {
  kAllreduce = 1,
  kAllgather,
  kReduceScatter,
  kBroadcast,
  kAllToAll,
  kSendRecv,
  kBarrier,
  kAllToAllv,
  kMoeDispatch,
  kMoeCombine,
  kAllreduceRmsNorm
};
inline constexpr NamedCode kCallCodes[] = {
    {"allreduce", kAllreduce},       {"allgather", kAllgather},
    {"reduce_scatter", kReduceScatter}, {"broadcast", kBroadcast},
    {"all_to_all", kAllToAll},       {"sendrecv", kSendRecv},
    {"barrier", kBarrier},           {"all_to_allv", kAllToAllv},
    {"moe.dispatch", kMoeDispatch},  {"moe.combine", kMoeCombine},
    {"allreduce_rmsnorm", kAllreduceRmsNorm}};

// One call, 64 bytes; the layout Python reads (spmd.runtime's recorder).
struct Record {
  uint64_t seq;       // this process's call number, from 1
  int64_t group;      // the group's id
  uint64_t call;      // the call's number on its group in this process, from 1
  uint64_t hash;      // the signature the ranks compare
  int64_t start_ns;   // CLOCK_MONOTONIC
  int64_t end_ns;     // 0 while the call runs
  uint64_t bytes;     // the bytes of its inputs (its outputs for recv)
  int32_t code;       // the handler (kCallCodes)
  int8_t state;       // RecordState
  int8_t transport;   // the group's TransportKind; kRecordP2p, kRecordGpu
  int16_t unused;
};
static_assert(sizeof(Record) == 64, "Python reads 64-byte records");

// kEnqueued: a GPU call, from the handler's start to the end of its enqueueing on the stream;
// when the GPU ran it is not tracked.
enum RecordState : int8_t { kRunning = 0, kDone = 1, kFailed = 2, kEnqueued = 3 };
// Record::transport of a point-to-point call over MPI, and of a GPU call.
inline constexpr int8_t kRecordP2p = -1;
inline constexpr int8_t kRecordGpu = -2;

}  // namespace spmd

#endif  // SPMD_RECORD_H_
