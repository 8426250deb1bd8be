// What the ranks of a group compare before a collective moves data: a hash of the call (op,
// role, static parameters, dtypes and shapes) and, only when the hashes differ, a description of
// it for the error.
//
// The CPU handlers hash the call themselves and compare on every call, inside the transport's
// first synchronisation. The GPU handlers enqueue work and never wait for the peers, so their
// calls are compared through the CPU module (GpuHooks, below): the GPU module holds pointers
// to its functions, handed over by the Python group layer.
#ifndef SPMD_SIGNATURE_H_
#define SPMD_SIGNATURE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace spmd {

struct Signature {
  uint64_t hash;
  // Formats the call; only called when ranks disagree, never on the hot path.
  std::string (*describe)(const void* ctx);
  const void* ctx;

  std::string Describe() const { return describe(ctx); }
};

// FNV-1a, the hash of the CPU handlers' signatures.
inline constexpr uint64_t kFnvOffset = 1469598103934665603ull;
inline constexpr uint64_t kFnvPrime = 1099511628211ull;

inline uint64_t HashText(std::string_view text) {
  uint64_t h = kFnvOffset;
  for (char c : text) {
    h ^= static_cast<uint8_t>(c);
    h *= kFnvPrime;
  }
  return h;
}

// The ranks of group `group` (an id of the CPU module's registry) compare `described`, a call
// written out in full, through the group's CPU transport: a barrier that carries its hash.
// Returns 0 when every rank passed the same text, or when the CPU module has no such group of
// more than one rank; otherwise 1, with the error (naming each rank's call, or the ranks that did
// not arrive within SPMD_TIMEOUT) in error[0..error_size). Blocks until the group's ranks arrive.
using CheckSignatureFn = int (*)(int64_t group, const char* described, char* error,
                                 size_t error_size);

// What the GPU module calls in the CPU module, handed over once by the Python group layer (a
// capsule of the CPU module's one instance).
struct GpuHooks {
  // The full comparison of one call (above): a barrier.
  CheckSignatureFn check;
  // The sequence check of every call after its first, fully compared run: this rank's next
  // call on group `group` has signature `hash` (`described`, `len` bytes: the call written
  // out). Never waits (the CPU module's ShmGroup::Sequence); 0, or 1 with the error in
  // error[0..error_size) when the calls published so far differ between ranks.
  int (*sequence)(int64_t group, uint64_t hash, const char* described, size_t len, char* error,
                  size_t error_size);
  // The flight recorder (native/cpu/recorder.h): begin returns a slot for end; `state` and
  // `transport` as spmd/record.h says.
  size_t (*record_begin)(int64_t group, uint64_t call, uint64_t hash, uint64_t bytes,
                         int32_t code, int8_t transport);
  void (*record_end)(size_t slot, int8_t state);
  // The GPU's own start and end of the call in `slot` (the timeline's CUDA events, on the
  // monotonic clock): the record is marked done, unless the slot now holds another call than
  // `call` of `group`.
  void (*record_times)(size_t slot, int64_t group, uint64_t call, int64_t start_ns,
                       int64_t end_ns);
};

}  // namespace spmd

#endif  // SPMD_SIGNATURE_H_
