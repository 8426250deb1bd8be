// The CUDA FFI handlers, for the Python module to hand to jax.ffi.register_ffi_target.
#ifndef SPMD_CUDA_HANDLERS_H_
#define SPMD_CUDA_HANDLERS_H_

namespace spmd {

struct CudaHandlerEntry {
  const char* name;  // the custom-call target name
  void* handler;     // an XLA_FFI_Handler*
};

// Null-terminated.
const CudaHandlerEntry* CudaHandlers();

}  // namespace spmd

#endif  // SPMD_CUDA_HANDLERS_H_
