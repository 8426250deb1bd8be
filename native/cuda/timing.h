// The GPU's own start and end of each recorded GPU call, for the timeline (SPMD_TIMELINE): a pair
// of CUDA events around the call's work on its stream, read once the GPU has passed them and
// written into the call's record (spmd/signature.h, GpuHooks::record_times). Off unless the
// Python layer turns it on; costs two event records per call and a query of the calls before.
#ifndef SPMD_CUDA_TIMING_H_
#define SPMD_CUDA_TIMING_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "spmd/signature.h"

namespace spmd {

void GpuTimingSet(const GpuHooks* hooks, bool on);
bool GpuTimingOn();

// One call's events; `Begin` records the first on `stream` (false: not timed), `End` the second
// and queues the call, after its record was ended (`keep` false: the call failed, no times).
class GpuTimed {
 public:
  bool Begin(cudaStream_t stream, size_t slot, int64_t group, uint64_t call);
  void End(bool keep);

 private:
  cudaStream_t stream_ = nullptr;
  size_t slot_ = 0;
  int64_t group_ = 0;
  uint64_t call_ = 0;
  cudaEvent_t start_ = nullptr, end_ = nullptr;
};

// Writes the times of the queued calls the GPU has passed into their records, waiting up to
// `wait_s` seconds for the GPU to pass them all (a kernel waiting for a peer that is gone would
// never end; such calls keep their enqueueing times).
void GpuTimingFlush(double wait_s);

}  // namespace spmd

#endif  // SPMD_CUDA_TIMING_H_
