// spmd._native_cuda: the GPU half of spmd's native layer, built only where nvcc is found. It
// hands the CUDA FFI handlers to JAX, lets the Python group layer (spmd.runtime) register GPU
// groups (NCCL and the custom all-reduce's IPC buffers), exports the GPU code tables, and runs
// the simulation mode for tests and benchmarks.
// Importing it touches no GPU: CUDA and NCCL are first used when a group is registered.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <string>
#include <vector>

#include "../cuda/groups.h"
#include "../cuda/handlers.h"
#include "../cuda/nccl.h"
#include "../cuda/selftest.h"
#include "../cuda/timing.h"
#include "args.h"
#include "spmd/common.h"

namespace {

using spmd_python::CodeDict;
using spmd_python::IntList;
using spmd_python::Raise;
using spmd_python::SetNew;

bool BytesList(PyObject* seq, std::vector<std::string>* out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of bytes");
  if (fast == nullptr) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    char* data;
    Py_ssize_t len;
    if (PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(fast, i), &data, &len) != 0) {
      Py_DECREF(fast);
      return false;
    }
    out->emplace_back(data, static_cast<size_t>(len));
  }
  Py_DECREF(fast);
  return true;
}

PyObject* ToBytesList(const std::vector<std::string>& v) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(v.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < v.size(); ++i) {
    PyObject* b = PyBytes_FromStringAndSize(v[i].data(), static_cast<Py_ssize_t>(v[i].size()));
    if (b == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), b);
  }
  return list;
}

PyObject* AbiVersion(PyObject*, PyObject*) { return PyLong_FromLong(SPMD_NATIVE_ABI_VERSION); }

// tables() -> {name: {name: code}}: the GPU codes, each defined once in native code: algos (the
// allreduce's per-leaf algorithms), codecs (the quantized all-reduce's), custom_dtypes (the
// custom kernels' element types).
PyObject* Tables(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  if (!SetNew(d, "algos", CodeDict(spmd::car::kAlgos)) ||
      !SetNew(d, "codecs", CodeDict(spmd::codec::kCodecs)) ||
      !SetNew(d, "custom_dtypes", CodeDict(spmd::car::kCustomDtypes))) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

// The simulation's dtype, algorithm and codec codes; false with a ValueError set otherwise.
bool SimCodes(int dtype, int algo, int codec_code) {
  std::string bad;
  if (!spmd::HasCode(spmd::car::kCustomDtypes, dtype)) {
    bad = "dtype must be " + spmd::CodeList(spmd::car::kCustomDtypes);
  } else if (algo != -1 && !spmd::HasCode(spmd::car::kAlgos, algo)) {
    bad = "algo must be " + spmd::CodeList(spmd::car::kAlgos);
  } else if (codec_code != 0 && !spmd::HasCode(spmd::codec::kCodecs, codec_code)) {
    bad = "codec must be 0 (none) or " + spmd::CodeList(spmd::codec::kCodecs);
  }
  if (bad.empty()) return true;
  PyErr_SetString(PyExc_ValueError, bad.c_str());
  return false;
}

// cuda_handlers() -> {target name: PyCapsule of its XLA_FFI_Handler}.
PyObject* CudaHandlers(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  for (const spmd::HandlerEntry* e = spmd::CudaHandlers(); e->name != nullptr; ++e) {
    PyObject* cap = PyCapsule_New(e->handler, nullptr, nullptr);
    if (cap == nullptr || PyDict_SetItemString(d, e->name, cap) != 0) {
      Py_XDECREF(cap);
      Py_DECREF(d);
      return nullptr;
    }
    Py_DECREF(cap);
  }
  return d;
}

PyObject* NcclLoad(PyObject*, PyObject* args) {
  const char* lib;
  if (!PyArg_ParseTuple(args, "s", &lib)) return nullptr;
  spmd::Status s = spmd::NcclLoad(lib);
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

PyObject* NcclVersion(PyObject*, PyObject*) {
  return PyUnicode_FromString(spmd::NcclVersion().c_str());
}

PyObject* NcclUniqueId(PyObject*, PyObject*) {
  spmd::NcclUniqueId id;
  spmd::Status s = spmd::NcclGetUniqueId(&id);
  if (!s.ok()) return Raise(s);
  return PyBytes_FromStringAndSize(id.internal, sizeof(id.internal));
}

// device_info() -> (name, pci_bus_id, major, minor, multiprocessors) of the current device.
PyObject* DeviceInfo(PyObject*, PyObject*) {
  std::string name, bus, error;
  int major = 0, minor = 0, sms = 0;
  if (!spmd::sim::DeviceInfo(&name, &bus, &major, &minor, &sms, &error)) {
    return Raise(spmd::Status::Error("no usable CUDA device: " + error));
  }
  return Py_BuildValue("(ssiii)", name.c_str(), bus.c_str(), major, minor, sms);
}

// group_create(id, rank, size, world_ranks, device, timeout_s) -> None
PyObject* GroupCreate(PyObject*, PyObject* args) {
  long long id;
  int rank, size, device;
  double timeout;
  PyObject* ranks;
  if (!PyArg_ParseTuple(args, "LiiOid", &id, &rank, &size, &ranks, &device, &timeout)) {
    return nullptr;
  }
  std::vector<int> r;
  if (!IntList(ranks, &r)) return nullptr;
  spmd::Status s = spmd::CudaGroupCreate(id, rank, size, std::move(r), device, timeout);
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

// nccl_init(id, nccl_unique_id) -> None; blocks until every rank of the group joined.
PyObject* NcclInit(PyObject*, PyObject* args) {
  long long id;
  const char* uid;
  Py_ssize_t uid_len;
  if (!PyArg_ParseTuple(args, "Ly#", &id, &uid, &uid_len)) return nullptr;
  spmd::NcclUniqueId u;
  if (uid_len != static_cast<Py_ssize_t>(sizeof(u.internal))) {
    return Raise(spmd::Status::Error("an NCCL unique id has 128 bytes"));
  }
  std::memcpy(u.internal, uid, sizeof(u.internal));
  spmd::Status s;
  Py_BEGIN_ALLOW_THREADS;
  s = spmd::CudaGroupNcclInit(id, u);
  Py_END_ALLOW_THREADS;
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

PyObject* CarAlloc(PyObject*, PyObject* args) {
  long long id, cap;
  if (!PyArg_ParseTuple(args, "LL", &id, &cap)) return nullptr;
  std::string handle;
  spmd::Status s;
  Py_BEGIN_ALLOW_THREADS;
  s = spmd::CudaGroupCarAlloc(id, static_cast<size_t>(cap), &handle);
  Py_END_ALLOW_THREADS;
  if (!s.ok()) return Raise(s);
  return PyBytes_FromStringAndSize(handle.data(), static_cast<Py_ssize_t>(handle.size()));
}

PyObject* CarOpen(PyObject*, PyObject* args) {
  long long id;
  PyObject* handles;
  if (!PyArg_ParseTuple(args, "LO", &id, &handles)) return nullptr;
  std::vector<std::string> h;
  if (!BytesList(handles, &h)) return nullptr;
  spmd::Status s = spmd::CudaGroupCarOpen(id, h);
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

PyObject* CarWriteCheck(PyObject*, PyObject* args) {
  long long id;
  unsigned int seed;
  if (!PyArg_ParseTuple(args, "LI", &id, &seed)) return nullptr;
  spmd::Status s = spmd::CudaGroupCarWriteCheck(id, seed);
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

// car_read_check(id, seed) -> [world ranks whose pattern did not arrive]
PyObject* CarReadCheck(PyObject*, PyObject* args) {
  long long id;
  unsigned int seed;
  if (!PyArg_ParseTuple(args, "LI", &id, &seed)) return nullptr;
  std::vector<int> bad;
  spmd::Status s = spmd::CudaGroupCarReadCheck(id, seed, &bad);
  if (!s.ok()) return Raise(s);
  PyObject* list = PyList_New(0);
  for (int r : bad) {
    PyObject* v = PyLong_FromLong(r);
    PyList_Append(list, v);
    Py_DECREF(v);
  }
  return list;
}

// set_gpu_hooks(capsule, every_call, sequence_all, timeline) -> None: the CPU module's
// gpu_hooks(), through which the handlers compare and record their calls (groups.h,
// SetGpuHooks); `timeline`: also the GPU's own times of each call (timing.h).
PyObject* SetGpuHooksPy(PyObject*, PyObject* args) {
  PyObject* capsule;
  int every_call, sequence_all, timeline;
  if (!PyArg_ParseTuple(args, "Oppp", &capsule, &every_call, &sequence_all, &timeline)) {
    return nullptr;
  }
  void* p = PyCapsule_GetPointer(capsule, "spmd.GpuHooks");
  if (p == nullptr) return nullptr;
  const auto* hooks = static_cast<const spmd::GpuHooks*>(p);
  spmd::SetGpuHooks(hooks, every_call != 0, sequence_all != 0);
  spmd::GpuTimingSet(hooks, timeline != 0);
  Py_RETURN_NONE;
}

// gpu_timing_flush(wait_s) -> None: the GPU's times of the calls still queued into their
// records, waiting up to wait_s seconds for the GPU to pass them (before the timeline is
// written).
PyObject* GpuTimingFlushPy(PyObject*, PyObject* args) {
  double wait_s;
  if (!PyArg_ParseTuple(args, "d", &wait_s)) return nullptr;
  Py_BEGIN_ALLOW_THREADS;
  spmd::GpuTimingFlush(wait_s);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

PyObject* GroupDestroy(PyObject*, PyObject* args) {
  long long id;
  if (!PyArg_ParseTuple(args, "L", &id)) return nullptr;
  Py_BEGIN_ALLOW_THREADS;
  spmd::CudaGroupDestroy(id);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// sim_allreduce(world, dtype, algo, codec, inputs, iters) -> (outputs, ms)
PyObject* SimAllreduce(PyObject*, PyObject* args) {
  int world, dtype, algo, codec_code, iters;
  PyObject* inputs;
  if (!PyArg_ParseTuple(args, "iiiiOi", &world, &dtype, &algo, &codec_code, &inputs, &iters)) {
    return nullptr;
  }
  if (!SimCodes(dtype, algo, codec_code)) return nullptr;
  std::vector<std::string> in, out;
  if (!BytesList(inputs, &in)) return nullptr;
  double ms = 0;
  spmd::Status s;
  Py_BEGIN_ALLOW_THREADS;
  s = spmd::sim::AllReduce(world, static_cast<spmd::car::DType>(dtype),
                           static_cast<spmd::car::Algo>(algo),
                           static_cast<spmd::codec::Codec>(codec_code), in, iters, &out, &ms);
  Py_END_ALLOW_THREADS;
  if (!s.ok()) return Raise(s);
  PyObject* list = ToBytesList(out);
  if (list == nullptr) return nullptr;
  return Py_BuildValue("(Nd)", list, ms);
}

// sim_allreduce_rmsnorm(world, dtype, mode, rows, hidden, xs, residuals, weight, eps, iters)
//   -> (normed, residual_out, ms)
PyObject* SimAllreduceRmsNorm(PyObject*, PyObject* args) {
  int world, dtype, mode, iters;
  long long rows, hidden;
  PyObject *xs, *residuals;
  const char* weight;
  Py_ssize_t weight_len;
  float eps;
  if (!PyArg_ParseTuple(args, "iiiLLOOy#fi", &world, &dtype, &mode, &rows, &hidden, &xs,
                        &residuals, &weight, &weight_len, &eps, &iters)) {
    return nullptr;
  }
  if (!SimCodes(dtype, -1, 0)) return nullptr;
  std::vector<std::string> x, r, normed, res_out;
  if (!BytesList(xs, &x) || !BytesList(residuals, &r)) return nullptr;
  std::string w(weight, static_cast<size_t>(weight_len));
  double ms = 0;
  spmd::Status s;
  Py_BEGIN_ALLOW_THREADS;
  s = spmd::sim::AllReduceRmsNorm(world, static_cast<spmd::car::DType>(dtype), mode,
                                  static_cast<size_t>(rows), static_cast<size_t>(hidden), x, r, w,
                                  eps, iters, &normed, &res_out, &ms);
  Py_END_ALLOW_THREADS;
  if (!s.ok()) return Raise(s);
  PyObject* a = ToBytesList(normed);
  PyObject* b = a ? ToBytesList(res_out) : nullptr;
  if (b == nullptr) {
    Py_XDECREF(a);
    return nullptr;
  }
  return Py_BuildValue("(NNd)", a, b, ms);
}

PyObject* CopyTime(PyObject*, PyObject* args) {
  long long bytes;
  int iters;
  if (!PyArg_ParseTuple(args, "Li", &bytes, &iters)) return nullptr;
  double ms = 0;
  spmd::Status s;
  Py_BEGIN_ALLOW_THREADS;
  s = spmd::sim::CopyTime(static_cast<size_t>(bytes), iters, &ms);
  Py_END_ALLOW_THREADS;
  if (!s.ok()) return Raise(s);
  return PyFloat_FromDouble(ms);
}

PyMethodDef kMethods[] = {
    {"abi_version", AbiVersion, METH_NOARGS, "ABI version of spmd's native layer."},
    {"tables", Tables, METH_NOARGS, "The GPU code tables, by name."},
    {"cuda_handlers", CudaHandlers, METH_NOARGS, "The CUDA FFI handlers by target name."},
    {"nccl_load", NcclLoad, METH_VARARGS, "Load NCCL from a library path."},
    {"nccl_version", NcclVersion, METH_NOARGS, "Version of the loaded NCCL."},
    {"nccl_unique_id", NcclUniqueId, METH_NOARGS, "A fresh NCCL unique id (128 bytes)."},
    {"device_info", DeviceInfo, METH_NOARGS, "(name, bus id, major, minor, SMs) of the device."},
    {"group_create", GroupCreate, METH_VARARGS, "Register a GPU group."},
    {"nccl_init", NcclInit, METH_VARARGS, "Create the group's NCCL communicator."},
    {"car_alloc", CarAlloc, METH_VARARGS, "Allocate the custom all-reduce buffer; IPC handle."},
    {"car_open", CarOpen, METH_VARARGS, "Map the peers' custom all-reduce buffers."},
    {"car_write_check", CarWriteCheck, METH_VARARGS, "Write the peer-access check pattern."},
    {"car_read_check", CarReadCheck, METH_VARARGS, "Read every peer's pattern; failing ranks."},
    {"set_gpu_hooks", SetGpuHooksPy, METH_VARARGS,
     "Hand over the CPU module's functions that compare and record the calls."},
    {"gpu_timing_flush", GpuTimingFlushPy, METH_VARARGS,
     "Write the GPU's times of the calls still queued into their records."},
    {"group_destroy", GroupDestroy, METH_VARARGS, "Unregister a GPU group."},
    {"sim_allreduce", SimAllreduce, METH_VARARGS, "Custom all-reduce over simulated ranks."},
    {"sim_allreduce_rmsnorm", SimAllreduceRmsNorm, METH_VARARGS,
     "All-reduce + RMSNorm over simulated ranks."},
    {"copy_time", CopyTime, METH_VARARGS, "Mean ms of a device-to-device copy."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_cuda", "spmd's native GPU layer.", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native_cuda() { return PyModule_Create(&kModule); }
