// Argument helpers shared by the two Python extension modules (module.cc, module_cuda.cc).
#ifndef SPMD_PYTHON_ARGS_H_
#define SPMD_PYTHON_ARGS_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>
#include <vector>

#include "spmd/status.h"
#include "spmd/tables.h"

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

// {name: code} of a native table; nullptr with a Python error set on failure.
template <size_t N>
PyObject* CodeDict(const spmd::NamedCode (&table)[N]) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  for (const spmd::NamedCode& e : table) {
    PyObject* v = PyLong_FromLongLong(e.code);
    if (v == nullptr || PyDict_SetItemString(d, e.name, v) != 0) {
      Py_XDECREF(v);
      Py_DECREF(d);
      return nullptr;
    }
    Py_DECREF(v);
  }
  return d;
}

// d[key] = value, taking the reference to `value` (which may be nullptr: an error already set).
inline bool SetNew(PyObject* d, const char* key, PyObject* value) {
  if (value == nullptr) return false;
  int rc = PyDict_SetItemString(d, key, value);
  Py_DECREF(value);
  return rc == 0;
}

// A Python list of `v`'s ints; nullptr with a Python error set on failure.
inline PyObject* IntListOf(const std::vector<int>& v) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(v.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < v.size(); ++i) {
    PyObject* x = PyLong_FromLong(v[i]);
    if (x == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), x);
  }
  return list;
}

// list.append(item), taking the reference to `item` (which may be nullptr: an error already
// set).
inline bool AppendNew(PyObject* list, PyObject* item) {
  if (item == nullptr) return false;
  int rc = PyList_Append(list, item);
  Py_DECREF(item);
  return rc == 0;
}

}  // namespace spmd_python

#endif  // SPMD_PYTHON_ARGS_H_
