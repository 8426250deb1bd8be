// What the ranks of a group compare before a collective moves data: a hash of the call (op,
// role, static parameters, dtypes and shapes) and, only when the hashes differ, a description of
// it for the error.
#ifndef SPMD_CPU_SIGNATURE_H_
#define SPMD_CPU_SIGNATURE_H_

#include <cstdint>
#include <string>

namespace spmd {

struct Signature {
  uint64_t hash;
  // Formats the call; only called when ranks disagree, never on the hot path.
  std::string (*describe)(const void* ctx);
  const void* ctx;

  std::string Describe() const { return describe(ctx); }
};

}  // namespace spmd

#endif  // SPMD_CPU_SIGNATURE_H_
