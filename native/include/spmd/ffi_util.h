// What the CPU and the GPU FFI handlers share: the handler table entry, a decoded array, and the
// element sizes of the dtypes the collectives take.
#ifndef SPMD_FFI_UTIL_H_
#define SPMD_FFI_UTIL_H_

#include <cstddef>

#include "xla/ffi/api/ffi.h"

namespace spmd {

// One row of a handler table for the Python module to hand to jax.ffi.register_ffi_target.
struct HandlerEntry {
  const char* name;  // the custom-call target name
  void* handler;     // an XLA_FFI_Handler*
};

// One array of a fused call.
struct Leaf {
  char* data;
  size_t bytes;
  xla::ffi::DataType dtype;
  size_t elem;  // bytes per element
};

// Bytes per element of the dtypes spmd's collectives take; 0 for any other.
inline size_t ElemBytes(xla::ffi::DataType d) {
  using xla::ffi::DataType;
  switch (d) {
    case DataType::PRED:
    case DataType::S8:
    case DataType::U8:
      return 1;
    case DataType::F16:
    case DataType::BF16:
      return 2;
    case DataType::S32:
    case DataType::F32:
      return 4;
    case DataType::S64:
    case DataType::F64:
      return 8;
    default:
      return 0;
  }
}

}  // namespace spmd

#endif  // SPMD_FFI_UTIL_H_
