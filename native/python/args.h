// Argument helpers shared by the two Python extension modules (module.cc, module_cuda.cc).
#ifndef SPMD_PYTHON_ARGS_H_
#define SPMD_PYTHON_ARGS_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <vector>

#include "spmd/status.h"

namespace spmd_python {

// Sets a RuntimeError carrying the status's message; returns nullptr for the caller to return.
inline PyObject* Raise(const spmd::Status& s) {
  PyErr_SetString(PyExc_RuntimeError, s.message().c_str());
  return nullptr;
}

// A Python sequence of ints into `out`; false with a Python error set otherwise.
inline bool IntList(PyObject* seq, std::vector<int>* out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (fast == nullptr) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    out->push_back(static_cast<int>(v));
  }
  Py_DECREF(fast);
  return true;
}

}  // namespace spmd_python

#endif  // SPMD_PYTHON_ARGS_H_
