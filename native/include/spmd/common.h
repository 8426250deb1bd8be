// Shared header of spmd's native layer. Native code knows nothing of Python: the Python modules in
// native/python/ are the only files that include Python.h.
#ifndef SPMD_COMMON_H_
#define SPMD_COMMON_H_

#include "xla/ffi/api/c_api.h"

// Bumped whenever the contract between spmd/ (Python) and the native handlers changes; the Python
// side refuses a native module built for another version instead of calling into it blindly.
#define SPMD_NATIVE_ABI_VERSION 20

#include <cstdint>

#include "spmd/tables.h"

namespace spmd {

// A collective's "group" attribute: the group's id in the low 56 bits and, in the top byte, the
// role of the call in differentiation (GroupRef.role in the Python group layer, spmd.runtime).
// The role joins the signature that ranks compare, so a backward collective never pairs with a
// forward one.
enum Role : int { kRoleForward = 0, kRoleJvp = 1, kRoleBackward = 2 };
inline constexpr NamedCode kRoles[] = {
    {"forward", kRoleForward}, {"jvp", kRoleJvp}, {"backward", kRoleBackward}};
inline constexpr int kRoleShift = 56;
inline int64_t GroupIdOf(int64_t attr) { return attr & ((int64_t{1} << kRoleShift) - 1); }
inline int RoleOf(int64_t attr) { return static_cast<int>((attr >> kRoleShift) & 0xff); }

// Reduction codes of the collectives' "op" attribute.
enum class ReduceOp : int32_t { kSum = 0, kProd = 1, kMax = 2, kMin = 3 };
inline constexpr NamedCode kReduceOps[] = {{"sum", 0}, {"prod", 1}, {"max", 2}, {"min", 3}};

// Every error a handler returns starts with this marker: XLA puts a prefix of its own before the
// text, and the Python side raises what follows the marker as spmd.SpmdError.
inline constexpr char kErrorMarker[] = "spmd.SpmdError: ";

}  // namespace spmd

#endif  // SPMD_COMMON_H_
