// Shared header of spmd's native layer. Native code knows nothing of Python: the Python module in
// native/python/ is the only file that includes Python.h.
#ifndef SPMD_COMMON_H_
#define SPMD_COMMON_H_

#include "xla/ffi/api/c_api.h"

// Bumped whenever the contract between spmd/ (Python) and the native handlers changes; the Python
// side refuses a native module built for another version instead of calling into it blindly.
#define SPMD_NATIVE_ABI_VERSION 2

#endif  // SPMD_COMMON_H_
