// The CPU FFI handlers, listed for the Python module to hand to jax.ffi.register_ffi_target.
#ifndef SPMD_CPU_HANDLERS_H_
#define SPMD_CPU_HANDLERS_H_

#include "spmd/call.h"

namespace spmd {

// Null-terminated.
const HandlerEntry* CpuHandlers();

}  // namespace spmd

#endif  // SPMD_CPU_HANDLERS_H_
