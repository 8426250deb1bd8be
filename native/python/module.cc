// spmd._native: the one Python extension module of spmd. It reports what it was built with; the
// XLA FFI handlers (native/cpu, native/cuda) are exported from here as PyCapsules for
// jax.ffi.register_ffi_target.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "spmd/common.h"

namespace {

// abi_version() -> int: SPMD_NATIVE_ABI_VERSION this module was compiled with.
PyObject* AbiVersion(PyObject*, PyObject*) { return PyLong_FromLong(SPMD_NATIVE_ABI_VERSION); }

// xla_ffi_api_version() -> (major, minor) of the XLA FFI C API in the headers used at build time.
PyObject* XlaFfiApiVersion(PyObject*, PyObject*) {
  return Py_BuildValue("(ii)", XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}

PyMethodDef kMethods[] = {
    {"abi_version", AbiVersion, METH_NOARGS, "ABI version of spmd's native layer."},
    {"xla_ffi_api_version", XlaFfiApiVersion, METH_NOARGS,
     "(major, minor) of the XLA FFI C API the module was compiled against."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", "spmd's native layer.", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native() { return PyModule_Create(&kModule); }
