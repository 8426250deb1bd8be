// The flight recorder: the last collectives of this process, each with its group, its number on
// the group, its signature hash, its size and its start and end time, in a ring of fixed size.
// The ring lives in a file mapped shared when the Python layer names one (spmd-run's status
// directory), so that what a rank was doing can be read after it died or was killed; otherwise in
// this process's memory. Recording a call costs two clock reads, an atomic add and a few stores.
#ifndef SPMD_CPU_RECORDER_H_
#define SPMD_CPU_RECORDER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "spmd/record.h"
#include "spmd/status.h"

namespace spmd {

// The file's header, then `capacity` records; record k of the process is at slot (k - 1) % capacity.
struct RecorderHeader {
  uint64_t magic;     // kRecorderMagic
  uint64_t capacity;  // records
  uint64_t count;     // records written so far (the last is count)
  uint64_t pad[5];
};
static_assert(sizeof(RecorderHeader) == 64, "Python reads a 64-byte header");

inline constexpr uint64_t kRecorderMagic = 0x3130434552444d53ull;  // "SMDREC01"

// Starts recording into a ring of `capacity` calls (0: stop), in the file `path` (empty: this
// process's memory). Replaces an earlier ring.
Status RecorderOpen(const std::string& path, size_t capacity);
// Records the start of a call; returns its slot (or SIZE_MAX when nothing is recorded).
size_t RecorderBegin(int64_t group, uint64_t call, uint64_t hash, uint64_t bytes, int32_t code,
                     int8_t transport);
void RecorderEnd(size_t slot, bool failed);
// Ends it in `state` (RecordState).
void RecorderEndIn(size_t slot, int8_t state);
// A GPU call's times as the GPU saw them (spmd/signature.h, GpuHooks::record_times).
void RecorderSetTimes(size_t slot, int64_t group, uint64_t call, int64_t start_ns,
                      int64_t end_ns);
// The header and records as bytes (what the file holds), for Python.
std::string RecorderSnapshot();

}  // namespace spmd

#endif  // SPMD_CPU_RECORDER_H_
