// What the ranks of a group compare before a collective moves data: a hash of the call (op,
// role, static parameters, dtypes and shapes) and, only when the hashes differ, a description of
// it for the error.
//
// The CPU handlers hash the call themselves and compare on every call, inside the transport's
// first synchronisation. The GPU handlers enqueue work and never wait for the peers, so their
// calls are compared through the CPU module (CheckSignatureFn, below): the GPU module holds a
// pointer to it, handed over by the Python group layer.
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

}  // namespace spmd

#endif  // SPMD_SIGNATURE_H_
