// spmd._native: the CPU half of spmd's native layer. It hands the XLA FFI handlers to JAX as
// PyCapsules, lets the Python group layer (spmd.runtime) register the groups the handlers run on,
// and exports the tables of codes the two sides share.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../cpu/board.h"
#include "../cpu/groups.h"
#include "../cpu/handlers.h"
#include "../cpu/mpi.h"
#include "../cpu/recorder.h"
#include "../cpu/watch.h"
#include "../cuda/codec.h"
#include "../cuda/custom_ar.h"
#include "args.h"
#include "spmd/common.h"

namespace {

using spmd_python::AppendNew;
using spmd_python::CodeDict;
using spmd_python::IntList;
using spmd_python::IntListOf;
using spmd_python::Raise;
using spmd_python::SetNew;

// abi_version() -> int: SPMD_NATIVE_ABI_VERSION this module was compiled with.
PyObject* AbiVersion(PyObject*, PyObject*) { return PyLong_FromLong(SPMD_NATIVE_ABI_VERSION); }

// xla_ffi_api_version() -> (major, minor) of the XLA FFI C API in the headers used at build time.
PyObject* XlaFfiApiVersion(PyObject*, PyObject*) {
  return Py_BuildValue("(ii)", XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}

// tables() -> {name: table}: the codes the handlers and this module's functions take, each defined
// once in native code (spmd/tables.h): reduce_ops, transports, wires, staging and roles
// ({name: code}), role_shift, error_marker, dtypes (the names of the dtypes the collectives
// take, in the order messages list them), and the GPU chain's algos, codecs and custom_dtypes.
PyObject* Tables(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  PyObject* dtypes = PyTuple_New(static_cast<Py_ssize_t>(std::size(spmd::kDtypes)));
  for (size_t i = 0; dtypes != nullptr && i < std::size(spmd::kDtypes); ++i) {
    PyObject* name = PyUnicode_FromString(spmd::kDtypes[i].name);
    if (name == nullptr) Py_CLEAR(dtypes);
    if (dtypes != nullptr) PyTuple_SET_ITEM(dtypes, static_cast<Py_ssize_t>(i), name);
  }
  bool ok = SetNew(d, "reduce_ops", CodeDict(spmd::kReduceOps)) &&
            SetNew(d, "transports", CodeDict(spmd::kTransportKinds)) &&
            SetNew(d, "wires", CodeDict(spmd::kWires)) &&
            SetNew(d, "staging", CodeDict(spmd::ShmGroup::kStagingModes)) &&
            SetNew(d, "roles", CodeDict(spmd::kRoles)) &&
            SetNew(d, "role_shift", PyLong_FromLong(spmd::kRoleShift)) &&
            SetNew(d, "call_codes", CodeDict(spmd::kCallCodes)) &&
            SetNew(d, "error_marker", PyUnicode_FromString(spmd::kErrorMarker)) &&
            SetNew(d, "dtypes", dtypes) &&
            // The GPU all-reduce chain's codes, here too: Python chooses algorithms without a
            // GPU (and checks quantize= on CPU) where the GPU module is not built.
            SetNew(d, "algos", CodeDict(spmd::car::kAlgos)) &&
            SetNew(d, "codecs", CodeDict(spmd::codec::kCodecs)) &&
            SetNew(d, "custom_dtypes", CodeDict(spmd::car::kCustomDtypes));
  if (!ok) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

// cpu_handlers() -> {target name: PyCapsule of its XLA_FFI_Handler}.
PyObject* CpuHandlers(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  for (const spmd::HandlerEntry* e = spmd::CpuHandlers(); e->name != nullptr; ++e) {
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

// mpi_load(library, (byte, c_bool, int8, uint8, int32, int64, float32, float64,
//                    sum, prod, max, min, land, lor), prefer_large_count, classic_max_count)
//   -> bool: whether the large-count calls were chosen
PyObject* MpiLoad(PyObject*, PyObject* args) {
  const char* lib;
  spmd::MpiConstants c;
  unsigned long long v[14];
  int prefer_large;
  long long max_count;
  if (!PyArg_ParseTuple(args, "s(KKKKKKKKKKKKKK)pL", &lib, &v[0], &v[1], &v[2], &v[3], &v[4],
                        &v[5], &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13],
                        &prefer_large, &max_count)) {
    return nullptr;
  }
  spmd::MpiHandle* fields[] = {&c.byte, &c.c_bool, &c.int8, &c.uint8, &c.int32,
                               &c.int64, &c.float32, &c.float64, &c.sum, &c.prod,
                               &c.max, &c.min, &c.land, &c.lor};
  for (int i = 0; i < 14; ++i) *fields[i] = static_cast<spmd::MpiHandle>(v[i]);
  spmd::Status s = spmd::MpiLoad(lib, c, prefer_large != 0, max_count);
  if (!s.ok()) return Raise(s);
  return PyBool_FromLong(spmd::MpiLargeCount());
}

// mpi_has_large_count(library) -> bool: whether the library has the MPI-4 large-count calls
PyObject* MpiHasLargeCount(PyObject*, PyObject* args) {
  const char* lib;
  if (!PyArg_ParseTuple(args, "s", &lib)) return nullptr;
  bool has = false;
  spmd::Status s = spmd::MpiHasLargeCount(lib, &has);
  if (!s.ok()) return Raise(s);
  return PyBool_FromLong(has);
}

// group_create(id, rank, size, world_ranks, timeout_s, one_shot_max) -> None
PyObject* GroupCreate(PyObject*, PyObject* args) {
  long long id, one_shot_max;
  int rank, size;
  double timeout;
  PyObject* ranks;
  if (!PyArg_ParseTuple(args, "LiiOdL", &id, &rank, &size, &ranks, &timeout, &one_shot_max)) {
    return nullptr;
  }
  std::vector<int> r;
  if (!IntList(ranks, &r)) return nullptr;
  spmd::Status s = spmd::GroupCreate(id, rank, size, std::move(r), timeout,
                                     static_cast<size_t>(one_shot_max));
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

// group_attach_shm(id, which, name, create, rank, size, world_ranks, chunk, staging) -> None
// staging: a ShmGroup::Staging code.
PyObject* GroupAttachShm(PyObject*, PyObject* args) {
  long long id, chunk;
  int which, create, rank, size, staging;
  const char* name;
  PyObject* ranks;
  if (!PyArg_ParseTuple(args, "LispiiOLi", &id, &which, &name, &create, &rank, &size, &ranks,
                        &chunk, &staging)) {
    return nullptr;
  }
  if (!spmd::HasCode(spmd::ShmGroup::kStagingModes, staging)) {
    PyErr_SetString(PyExc_ValueError,
                    ("staging must be " + spmd::CodeList(spmd::ShmGroup::kStagingModes)).c_str());
    return nullptr;
  }
  std::vector<int> r;
  if (!IntList(ranks, &r)) return nullptr;
  spmd::Status s;
  Py_BEGIN_ALLOW_THREADS;
  s = spmd::GroupAttachShm(id, which, name, create != 0, rank, size, std::move(r),
                           static_cast<size_t>(chunk),
                           static_cast<spmd::ShmGroup::Staging>(staging));
  Py_END_ALLOW_THREADS;
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

// group_attach_mpi(id, which, comm_handle, rank, size, world_ranks) -> None
PyObject* GroupAttachMpi(PyObject*, PyObject* args) {
  long long id;
  unsigned long long handle;
  int which, rank, size;
  PyObject* ranks;
  if (!PyArg_ParseTuple(args, "LiKiiO", &id, &which, &handle, &rank, &size, &ranks)) {
    return nullptr;
  }
  std::vector<int> r;
  if (!IntList(ranks, &r)) return nullptr;
  spmd::Status s = spmd::GroupAttachMpi(id, which, static_cast<spmd::MpiHandle>(handle), rank,
                                        size, std::move(r));
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

// group_set_nodes(id, node_of) -> None: each group rank's node, for the hierarchical transport.
PyObject* GroupSetNodes(PyObject*, PyObject* args) {
  long long id;
  PyObject* nodes;
  if (!PyArg_ParseTuple(args, "LO", &id, &nodes)) return nullptr;
  std::vector<int> n;
  if (!IntList(nodes, &n)) return nullptr;
  spmd::Status s = spmd::GroupSetNodes(id, std::move(n));
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

// group_set_transport(id, code) -> None: the group's transport (TransportKind); an error if what
// it needs is not attached to the group.
PyObject* GroupSetTransport(PyObject*, PyObject* args) {
  long long id;
  int code;
  if (!PyArg_ParseTuple(args, "Li", &id, &code)) return nullptr;
  if (!spmd::HasCode(spmd::kTransportKinds, code)) {
    PyErr_SetString(PyExc_ValueError,
                    ("transport must be " + spmd::CodeList(spmd::kTransportKinds)).c_str());
    return nullptr;
  }
  spmd::Status s = spmd::GroupSetTransport(id, static_cast<spmd::TransportKind>(code));
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

// shm_mark_leaving(): this process's ranks of every shared-memory group are leaving (called at
// interpreter exit, so that a peer waiting for them fails at once naming them).
PyObject* ShmMarkLeaving(PyObject*, PyObject*) {
  spmd::ShmGroup::MarkAllLeaving();
  spmd::WatchMarkLeaving();
  spmd::MpiSendProgressStop();  // before mpi4py finalizes MPI
  Py_RETURN_NONE;
}

// mpi_send_progress(on): whether a thread moves the sends waiting for their receivers
// (native/cpu/mpi.h, MpiSendProgress).
PyObject* MpiSendProgressSet(PyObject*, PyObject* args) {
  int on;
  if (!PyArg_ParseTuple(args, "p", &on)) return nullptr;
  spmd::MpiSendProgress(on != 0);
  Py_RETURN_NONE;
}

// watch_listen(host, token) -> port: start the peer watch's server (native/cpu/watch.h).
PyObject* WatchListen(PyObject*, PyObject* args) {
  const char* host;
  const char* secret;
  if (!PyArg_ParseTuple(args, "ss", &host, &secret)) return nullptr;
  int port = 0;
  spmd::Status s = spmd::WatchListen(host, secret, &port);
  if (!s.ok()) return Raise(s);
  return PyLong_FromLong(port);
}

// watch_stop(): stop it.
PyObject* WatchStop(PyObject*, PyObject*) {
  Py_BEGIN_ALLOW_THREADS;
  spmd::WatchStop();
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// mpi_oversubscribed(on): whether this node runs more ranks than cores (native/cpu/mpi.h).
PyObject* MpiOversubscribed(PyObject*, PyObject* args) {
  int on = 0;
  if (!PyArg_ParseTuple(args, "p", &on)) return nullptr;
  spmd::MpiSetOversubscribed(on != 0);
  Py_RETURN_NONE;
}

// mpi_watch_waits() -> [(world_ranks, call, seconds)]: this process's MPI communicators that
// wait in a collective (spmd/runtime/_watch.py), with the collective's number and how long.
PyObject* MpiWatchWaits(PyObject*, PyObject*) {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch()).count();
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (const auto& w : spmd::MpiWatches()) {
    const int64_t since = w->waiting_since_ns.load(std::memory_order_acquire);
    if (since == 0) continue;
    PyObject* ranks = IntListOf(w->world_ranks);
    if (ranks == nullptr ||
        !AppendNew(out, Py_BuildValue("(NKd)", ranks,
                                      static_cast<unsigned long long>(w->started.load()),
                                      static_cast<double>(now - since) * 1e-9))) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

// mpi_watch_verdict(world_ranks, call, gone, late): the peer watch's verdict on collective #call
// of the communicators of those world ranks ("" for none).
PyObject* MpiWatchVerdict(PyObject*, PyObject* args) {
  PyObject* ranks;
  unsigned long long call;
  const char *gone, *late;
  if (!PyArg_ParseTuple(args, "OKss", &ranks, &call, &gone, &late)) return nullptr;
  std::vector<int> r;
  if (!IntList(ranks, &r)) return nullptr;
  for (const auto& w : spmd::MpiWatches()) {
    if (w->world_ranks != r) continue;
    std::lock_guard<std::mutex> lock(w->mu);
    w->verdict_call = call;
    w->gone = gone;
    w->late = late;
    w->has_gone.store(*gone != 0, std::memory_order_release);
  }
  Py_RETURN_NONE;
}

// mpi_watch_failures() -> [(world_ranks, call, error)]: the collectives over MPI this process
// failed and has not yet handed to the peer watch (each once), for the watch to tell the peers.
PyObject* MpiWatchFailures(PyObject*, PyObject*) {
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (const auto& w : spmd::MpiWatches()) {
    const uint64_t failed = w->failed.load(std::memory_order_acquire);
    if (failed == 0) continue;
    std::string error;
    {
      std::lock_guard<std::mutex> lock(w->mu);
      if (w->failure_told) continue;
      w->failure_told = true;
      error = w->failure;
    }
    PyObject* ranks = IntListOf(w->world_ranks);
    if (ranks == nullptr ||
        !AppendNew(out, Py_BuildValue("(NKs#)", ranks, static_cast<unsigned long long>(failed),
                                      error.data(), static_cast<Py_ssize_t>(error.size())))) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

// shm_dumps_stack(on): whether this process prints its Python stack on SIGUSR1 (a peer that
// reports a stall then asks for it).
PyObject* ShmDumpsStack(PyObject*, PyObject* args) {
  int on = 0;
  if (!PyArg_ParseTuple(args, "p", &on)) return nullptr;
  spmd::ShmGroup::SetDumpsStack(on != 0);
  spmd::WatchSetDumpsStack(on != 0);
  Py_RETURN_NONE;
}

// group_shm_hop_ns(id) -> float: the shared-memory staging probe, collective over the group;
// the mean hop time in ns on the group's rank 0, NaN on the others.
PyObject* GroupShmHopNs(PyObject*, PyObject* args) {
  long long id;
  if (!PyArg_ParseTuple(args, "L", &id)) return nullptr;
  double hop_ns = 0;
  spmd::Status s;
  Py_BEGIN_ALLOW_THREADS;
  s = spmd::GroupShmHop(id, &hop_ns);
  Py_END_ALLOW_THREADS;
  if (!s.ok()) return Raise(s);
  return PyFloat_FromDouble(hop_ns);
}

// group_destroy(id) -> None; waits for a collective of the group still running.
// recorder_open(path, capacity) -> None: record this process's calls in a ring of `capacity`
// (0: stop), in the file `path` ("": in memory); see native/cpu/recorder.h.
PyObject* RecorderOpen(PyObject*, PyObject* args) {
  const char* path;
  long long capacity;
  if (!PyArg_ParseTuple(args, "sL", &path, &capacity)) return nullptr;
  if (capacity < 0) {
    PyErr_SetString(PyExc_ValueError, "capacity must be >= 0");
    return nullptr;
  }
  spmd::Status s = spmd::RecorderOpen(path, static_cast<size_t>(capacity));
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

// recorder_snapshot() -> bytes: the ring's header and records (b"" when none is open).
PyObject* RecorderSnapshot(PyObject*, PyObject*) {
  std::string bytes;
  Py_BEGIN_ALLOW_THREADS;
  bytes = spmd::RecorderSnapshot();
  Py_END_ALLOW_THREADS;
  return PyBytes_FromStringAndSize(bytes.data(), static_cast<Py_ssize_t>(bytes.size()));
}

// group_sequence_reset(id) -> None: forgets this rank's calls of the sequence check (for the
// tests: every rank of the group, between two barriers).
PyObject* GroupSequenceReset(PyObject*, PyObject* args) {
  long long id;
  if (!PyArg_ParseTuple(args, "L", &id)) return nullptr;
  spmd::GroupSequenceReset(id);
  Py_RETURN_NONE;
}

// gpu_hooks() -> PyCapsule "spmd.GpuHooks" of the functions through which the GPU handlers
// compare their calls on a group's CPU transport and record them (spmd/signature.h).
PyObject* GpuHooks(PyObject*, PyObject*) {
  const spmd::GpuHooks* hooks = spmd::HooksForGpu();
  return PyCapsule_New(const_cast<spmd::GpuHooks*>(hooks), "spmd.GpuHooks", nullptr);
}

// group_sequence(id, described) -> None: the sequence check of one call as the GPU handlers
// make it (spmd/signature.h, GpuHooks::sequence): its hash is the text's. Raises on a mismatch.
PyObject* GroupSequence(PyObject*, PyObject* args) {
  long long id;
  const char* text;
  Py_ssize_t len;
  if (!PyArg_ParseTuple(args, "Ls#", &id, &text, &len)) return nullptr;
  const std::string_view described(text, static_cast<size_t>(len));
  spmd::Status s = spmd::Status::Ok();
  Py_BEGIN_ALLOW_THREADS;
  s = spmd::GroupSequence(id, spmd::HashText(described), described);
  Py_END_ALLOW_THREADS;
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

PyObject* GroupDestroy(PyObject*, PyObject* args) {
  long long id;
  if (!PyArg_ParseTuple(args, "L", &id)) return nullptr;
  Py_BEGIN_ALLOW_THREADS;
  spmd::GroupDestroy(id);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// A MessageQueue's shared-memory ring (spmd/runtime/_queue.py), at an address of its mapping:
// the slot's sequence number is published with a release store and read with an acquire load,
// a reader's flag set with a release store and the flags read with acquire loads, so that on
// every architecture (aarch64 too) a reader sees a slot's data once it sees its number, and the
// writer reuses a slot only after every reader has finished reading it. Fast calls: the queue
// makes a few per message.
PyObject* MqLoad(PyObject*, PyObject* const* args, Py_ssize_t n) {  // mq_load(address) -> int
  if (n != 1) return PyErr_Format(PyExc_TypeError, "mq_load takes 1 argument");
  const auto* at = reinterpret_cast<const uint64_t*>(PyLong_AsVoidPtr(args[0]));
  if (at == nullptr) return nullptr;
  return PyLong_FromUnsignedLongLong(__atomic_load_n(at, __ATOMIC_ACQUIRE));
}

PyObject* MqStore(PyObject*, PyObject* const* args, Py_ssize_t n) {  // mq_store(address, value)
  if (n != 2) return PyErr_Format(PyExc_TypeError, "mq_store takes 2 arguments");
  auto* at = reinterpret_cast<uint64_t*>(PyLong_AsVoidPtr(args[0]));
  const unsigned long long v = PyLong_AsUnsignedLongLong(args[1]);
  if (at == nullptr || PyErr_Occurred()) return nullptr;
  __atomic_store_n(at, static_cast<uint64_t>(v), __ATOMIC_RELEASE);
  Py_RETURN_NONE;
}

PyObject* MqMark(PyObject*, PyObject* const* args, Py_ssize_t n) {  // mq_mark(address): byte 1
  if (n != 1) return PyErr_Format(PyExc_TypeError, "mq_mark takes 1 argument");
  auto* at = reinterpret_cast<uint8_t*>(PyLong_AsVoidPtr(args[0]));
  if (at == nullptr) return nullptr;
  __atomic_store_n(at, static_cast<uint8_t>(1), __ATOMIC_RELEASE);
  Py_RETURN_NONE;
}

// mq_all_set(address, n) -> bool: whether the n bytes there are all 1 (every reader's flag).
PyObject* MqAllSet(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2) return PyErr_Format(PyExc_TypeError, "mq_all_set takes 2 arguments");
  const auto* at = reinterpret_cast<const uint8_t*>(PyLong_AsVoidPtr(args[0]));
  const Py_ssize_t count = PyLong_AsSsize_t(args[1]);
  if (at == nullptr || PyErr_Occurred()) return nullptr;
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (__atomic_load_n(at + i, __ATOMIC_ACQUIRE) != 1) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// board_use(id): the group's shared-memory segment (the world's) becomes the wait board.
PyObject* BoardUse(PyObject*, PyObject* args) {
  long long id;
  if (!PyArg_ParseTuple(args, "L", &id)) return nullptr;
  spmd::Status s = spmd::GroupBoardUse(id);
  if (!s.ok()) return Raise(s);
  Py_RETURN_NONE;
}

// The waits of Python code (spmd.runtime._wait) on the board, by handle.
std::mutex board_waits_mu;
std::unordered_map<long long, std::unique_ptr<spmd::board::Wait>> board_waits;
long long board_next = 0;

// board_wait(kind, members, n, what) -> handle: a wait starts (board.h).
PyObject* BoardWait(PyObject*, PyObject* args) {
  const char* kind;
  const char* what;
  PyObject* members;
  unsigned long long n;
  if (!PyArg_ParseTuple(args, "sOKs", &kind, &members, &n, &what)) return nullptr;
  std::vector<int> m;
  if (!IntList(members, &m)) return nullptr;
  const uint64_t key = spmd::board::Key(kind, m, n);
  std::lock_guard<std::mutex> lock(board_waits_mu);
  board_waits[++board_next] = std::make_unique<spmd::board::Wait>(key, std::move(m), what);
  return PyLong_FromLongLong(board_next);
}

// board_poll(handle) -> str: "" or the deadlock this wait is part of.
PyObject* BoardPoll(PyObject*, PyObject* args) {
  long long handle;
  if (!PyArg_ParseTuple(args, "L", &handle)) return nullptr;
  std::string dead;
  {
    std::lock_guard<std::mutex> lock(board_waits_mu);
    auto it = board_waits.find(handle);
    if (it != board_waits.end()) dead = it->second->Poll();
  }
  return PyUnicode_FromStringAndSize(dead.data(), static_cast<Py_ssize_t>(dead.size()));
}

// board_end(handle): the wait has ended.
PyObject* BoardEnd(PyObject*, PyObject* args) {
  long long handle;
  if (!PyArg_ParseTuple(args, "L", &handle)) return nullptr;
  std::lock_guard<std::mutex> lock(board_waits_mu);
  board_waits.erase(handle);
  Py_RETURN_NONE;
}

// board_mine() -> str: this process's wait for the peer watch (board::Mine's line).
PyObject* BoardMine(PyObject*, PyObject*) {
  const std::string line = spmd::board::Mine();
  return PyUnicode_FromStringAndSize(line.data(), static_cast<Py_ssize_t>(line.size()));
}

// board_declare(text): the peer watch found a deadlock that includes this process's waits.
PyObject* BoardDeclare(PyObject*, PyObject* args) {
  const char* text;
  if (!PyArg_ParseTuple(args, "s", &text)) return nullptr;
  spmd::board::Declare(text);
  Py_RETURN_NONE;
}

// board_judge([(key, members, what)] by world rank) -> str: the deadlock, or "" (board::Judge).
PyObject* BoardJudge(PyObject*, PyObject* args) {
  PyObject* waits;
  if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &waits)) return nullptr;
  std::vector<spmd::board::Seen> seen;
  std::vector<int> world_ranks;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(waits); ++i) {
    unsigned long long key;
    PyObject* members;
    const char* what;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(waits, i), "KOs", &key, &members, &what)) {
      return nullptr;
    }
    spmd::board::Seen s{key, {}, what};
    if (!IntList(members, &s.members)) return nullptr;
    seen.push_back(std::move(s));
    world_ranks.push_back(static_cast<int>(i));
  }
  const std::string text = spmd::board::Judge(seen, world_ranks);
  return PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
}

// The GPU's quantized all-reduce codecs (native/cuda/codec.h), run on the CPU for the tests.
bool Floats(PyObject* obj, std::vector<float>* out) {
  char* data;
  Py_ssize_t len;
  if (PyBytes_AsStringAndSize(obj, &data, &len) != 0) return false;
  out->resize(static_cast<size_t>(len) / sizeof(float));
  std::memcpy(out->data(), data, out->size() * sizeof(float));
  return true;
}

PyObject* FloatBytes(const std::vector<float>& v) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()),
                                   static_cast<Py_ssize_t>(v.size() * sizeof(float)));
}

bool CodecArg(int code, spmd::codec::Codec* c) {
  if (!spmd::HasCode(spmd::codec::kCodecs, code)) {
    PyErr_SetString(PyExc_ValueError,
                    ("codec code must be " + spmd::CodeList(spmd::codec::kCodecs)).c_str());
    return false;
  }
  *c = static_cast<spmd::codec::Codec>(code);
  return true;
}

// quant_roundtrip(codec, float32 bytes) -> float32 bytes: every block encoded and decoded.
PyObject* QuantRoundtrip(PyObject*, PyObject* args) {
  int code;
  PyObject* data;
  if (!PyArg_ParseTuple(args, "iO", &code, &data)) return nullptr;
  spmd::codec::Codec c;
  std::vector<float> v;
  if (!CodecArg(code, &c) || !Floats(data, &v)) return nullptr;
  std::vector<float> out(v.size());
  uint8_t payload[spmd::codec::kBlock];
  for (size_t at = 0; at < v.size(); at += spmd::codec::kBlock) {
    int n = static_cast<int>(std::min<size_t>(spmd::codec::kBlock, v.size() - at));
    float scale = spmd::codec::EncodeBlock(c, v.data() + at, n, payload);
    for (int i = 0; i < n; ++i) out[at + i] = spmd::codec::DecodeValue(c, payload, scale, i);
  }
  return FloatBytes(out);
}

// quant_allreduce_reference(codec, world, float32 bytes of world * n values, rank-major)
//   -> float32 bytes of n: what the GPU's quantized all-reduce returns on every rank.
PyObject* QuantAllreduceReference(PyObject*, PyObject* args) {
  int code, world;
  PyObject* data;
  if (!PyArg_ParseTuple(args, "iiO", &code, &world, &data)) return nullptr;
  spmd::codec::Codec c;
  std::vector<float> v;
  if (!CodecArg(code, &c) || !Floats(data, &v)) return nullptr;
  if (world < 1 || v.size() % static_cast<size_t>(world) != 0) {
    PyErr_SetString(PyExc_ValueError, "data must hold world equal parts");
    return nullptr;
  }
  size_t n = v.size() / static_cast<size_t>(world);
  std::vector<float> out(n);
  std::vector<const float*> inputs(static_cast<size_t>(world));
  for (size_t at = 0; at < n; at += spmd::codec::kBlock) {
    for (int r = 0; r < world; ++r) inputs[r] = v.data() + static_cast<size_t>(r) * n + at;
    int m = static_cast<int>(std::min<size_t>(spmd::codec::kBlock, n - at));
    spmd::codec::ReduceBlockReference(c, world, inputs.data(), m, out.data() + at);
  }
  return FloatBytes(out);
}

PyMethodDef kMethods[] = {
    {"abi_version", AbiVersion, METH_NOARGS, "ABI version of spmd's native layer."},
    {"xla_ffi_api_version", XlaFfiApiVersion, METH_NOARGS,
     "(major, minor) of the XLA FFI C API the module was compiled against."},
    {"tables", Tables, METH_NOARGS, "The native code tables, by name."},
    {"cpu_handlers", CpuHandlers, METH_NOARGS, "The CPU FFI handlers by target name."},
    {"mpi_load", MpiLoad, METH_VARARGS, "Resolve MPI functions from the library mpi4py loaded."},
    {"mpi_has_large_count", MpiHasLargeCount, METH_VARARGS,
     "Whether an MPI library has the MPI-4 large-count functions."},
    {"mpi_send_progress", MpiSendProgressSet, METH_VARARGS,
     "Say whether a thread moves the sends waiting for their receivers."},
    {"group_create", GroupCreate, METH_VARARGS, "Register a group."},
    {"group_attach_shm", GroupAttachShm, METH_VARARGS, "Map a group's shared-memory segment."},
    {"group_attach_mpi", GroupAttachMpi, METH_VARARGS, "Give a group an MPI communicator."},
    {"group_set_nodes", GroupSetNodes, METH_VARARGS, "Say which node each group rank is on."},
    {"group_set_transport", GroupSetTransport, METH_VARARGS, "Choose how a group moves data."},
    {"group_shm_hop_ns", GroupShmHopNs, METH_VARARGS, "Time the shared-memory staging probe."},
    {"shm_dumps_stack", ShmDumpsStack, METH_VARARGS,
     "Say whether this process prints its Python stack on SIGUSR1."},
    {"watch_listen", WatchListen, METH_VARARGS, "Start the peer watch's server."},
    {"watch_stop", WatchStop, METH_NOARGS, "Stop the peer watch's server."},
    {"mpi_oversubscribed", MpiOversubscribed, METH_VARARGS,
     "Say whether this node runs more ranks than cores."},
    {"mpi_watch_waits", MpiWatchWaits, METH_NOARGS,
     "The MPI communicators waiting in a collective, for the peer watch."},
    {"mpi_watch_verdict", MpiWatchVerdict, METH_VARARGS,
     "The peer watch's verdict on a waiting collective."},
    {"board_mine", BoardMine, METH_NOARGS, "This process's wait, for the peer watch."},
    {"board_declare", BoardDeclare, METH_VARARGS,
     "A deadlock the peer watch found, which this process's waits are part of."},
    {"board_judge", BoardJudge, METH_VARARGS, "The deadlock among the job's waits, or ''."},
    {"mpi_watch_failures", MpiWatchFailures, METH_NOARGS,
     "The collectives over MPI this process failed, for the peer watch to tell (once each)."},
    {"shm_mark_leaving", ShmMarkLeaving, METH_NOARGS,
     "Mark this process's ranks of every shared-memory group as leaving."},
    {"recorder_open", RecorderOpen, METH_VARARGS, "Record this process's calls in a ring."},
    {"recorder_snapshot", RecorderSnapshot, METH_NOARGS, "The recorder's ring as bytes."},
    {"gpu_hooks", GpuHooks, METH_NOARGS,
     "The functions the GPU handlers call in this module (a capsule)."},
    {"group_sequence_reset", GroupSequenceReset, METH_VARARGS,
     "Forget this rank's calls of the sequence check (tests)."},
    {"group_sequence", GroupSequence, METH_VARARGS,
     "The sequence check of one call of a group, as the GPU handlers make it."},
    {"group_destroy", GroupDestroy, METH_VARARGS, "Unregister a group."},
    {"board_use", BoardUse, METH_VARARGS, "Make the world group's segment the wait board."},
    {"mq_load", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(MqLoad)),
     METH_FASTCALL, "Acquire load of a MessageQueue slot's sequence number."},
    {"mq_store", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(MqStore)),
     METH_FASTCALL, "Release store of a MessageQueue slot's sequence number."},
    {"mq_mark", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(MqMark)),
     METH_FASTCALL, "Release store of a MessageQueue reader's flag."},
    {"mq_all_set", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(MqAllSet)),
     METH_FASTCALL, "Whether every reader's flag of a MessageQueue slot is set (acquire)."},
    {"board_wait", BoardWait, METH_VARARGS, "A wait of Python code starts (the wait board)."},
    {"board_poll", BoardPoll, METH_VARARGS, "The deadlock a wait is part of, or ''."},
    {"board_end", BoardEnd, METH_VARARGS, "A wait of Python code ends."},
    {"quant_roundtrip", QuantRoundtrip, METH_VARARGS, "Encode and decode with a GPU codec."},
    {"quant_allreduce_reference", QuantAllreduceReference, METH_VARARGS,
     "The GPU quantized all-reduce's result, computed on the CPU."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", "spmd's native layer.", -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native() { return PyModule_Create(&kModule); }
