// The CUDA FFI handlers, for the Python module to hand to jax.ffi.register_ffi_target.
#ifndef SPMD_CUDA_HANDLERS_H_
#define SPMD_CUDA_HANDLERS_H_

#include "spmd/call.h"

namespace spmd {

// Null-terminated.
const HandlerEntry* CudaHandlers();

}  // namespace spmd

#endif  // SPMD_CUDA_HANDLERS_H_
