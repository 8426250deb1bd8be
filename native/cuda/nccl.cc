// NCCL through dlopen; see nccl.h.
#include "nccl.h"

#include <dlfcn.h>

#include <mutex>

namespace spmd {
namespace {

using Result = int;  // ncclResult_t

struct Fns {
  Result (*GetVersion)(int*);
  Result (*GetUniqueId)(NcclUniqueId*);
  Result (*CommInitRank)(NcclComm*, int, NcclUniqueId, int);
  Result (*CommDestroy)(NcclComm);
  Result (*AllReduce)(const void*, void*, size_t, int, int, NcclComm, NcclStream);
  Result (*AllGather)(const void*, void*, size_t, int, NcclComm, NcclStream);
  Result (*ReduceScatter)(const void*, void*, size_t, int, int, NcclComm, NcclStream);
  Result (*Broadcast)(const void*, void*, size_t, int, int, NcclComm, NcclStream);
  Result (*Reduce)(const void*, void*, size_t, int, int, int, NcclComm, NcclStream);
  Result (*Send)(const void*, size_t, int, int, NcclComm, NcclStream);
  Result (*Recv)(void*, size_t, int, int, NcclComm, NcclStream);
  Result (*GroupStart)();
  Result (*GroupEnd)();
  const char* (*GetErrorString)(Result);
  const char* (*GetLastError)(NcclComm);
};

Fns fns;
std::mutex load_mu;
std::string loaded_from;

template <typename F>
bool Resolve(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

Status Check(Result r, const char* what) {
  if (r == 0) return Status::Ok();
  std::string text = fns.GetErrorString ? fns.GetErrorString(r) : "unknown NCCL error";
  if (fns.GetLastError != nullptr) {
    const char* last = fns.GetLastError(nullptr);
    if (last != nullptr && *last != '\0') text += " (" + std::string(last) + ")";
  }
  return Status::Error(std::string(what) + " failed in NCCL: " + text + " [code " +
                       std::to_string(r) + "]");
}

Status NotLoaded() {
  return Status::Error("NCCL is not loaded (spmd loads it when a GPU group is first used)");
}

}  // namespace

Status NcclLoad(const std::string& library) {
  std::lock_guard<std::mutex> lock(load_mu);
  if (!loaded_from.empty()) {
    if (library == loaded_from) return Status::Ok();
    return Status::Error("NCCL was already loaded from " + loaded_from + ", not reloading it from " +
                         library);
  }
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    return Status::Error("cannot load NCCL from " + library + ": " + (err ? err : "?") +
                         "; install the NCCL wheel (pip install 'spmd[cuda12]' or "
                         "'spmd[cuda13]') or point SPMD_NCCL_LIBRARY at libnccl.so.2");
  }
  Fns f{};
  bool ok = Resolve(lib, "ncclGetVersion", &f.GetVersion) &&
            Resolve(lib, "ncclGetUniqueId", &f.GetUniqueId) &&
            Resolve(lib, "ncclCommInitRank", &f.CommInitRank) &&
            Resolve(lib, "ncclCommDestroy", &f.CommDestroy) &&
            Resolve(lib, "ncclAllReduce", &f.AllReduce) &&
            Resolve(lib, "ncclAllGather", &f.AllGather) &&
            Resolve(lib, "ncclReduceScatter", &f.ReduceScatter) &&
            Resolve(lib, "ncclBroadcast", &f.Broadcast) && Resolve(lib, "ncclReduce", &f.Reduce) &&
            Resolve(lib, "ncclSend", &f.Send) && Resolve(lib, "ncclRecv", &f.Recv) &&
            Resolve(lib, "ncclGroupStart", &f.GroupStart) &&
            Resolve(lib, "ncclGroupEnd", &f.GroupEnd) &&
            Resolve(lib, "ncclGetErrorString", &f.GetErrorString);
  if (!ok) {
    dlclose(lib);
    return Status::Error(library + " lacks NCCL's functions (ncclSend/ncclRecv need NCCL >= 2.7)");
  }
  Resolve(lib, "ncclGetLastError", &f.GetLastError);  // NCCL >= 2.13; optional
  fns = f;
  loaded_from = library;
  return Status::Ok();
}

bool NcclLoaded() {
  std::lock_guard<std::mutex> lock(load_mu);
  return !loaded_from.empty();
}

std::string NcclVersion() {
  if (!NcclLoaded()) return "not loaded";
  int v = 0;
  if (fns.GetVersion(&v) != 0) return "unknown";
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  int major = v / 10000, minor = (v / 100) % 100, patch = v % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

Status NcclGetUniqueId(NcclUniqueId* id) {
  if (!NcclLoaded()) return NotLoaded();
  return Check(fns.GetUniqueId(id), "ncclGetUniqueId");
}

Status NcclCommInitRank(NcclComm* comm, int size, const NcclUniqueId& id, int rank) {
  if (!NcclLoaded()) return NotLoaded();
  return Check(fns.CommInitRank(comm, size, id, rank), "ncclCommInitRank");
}

void NcclCommDestroy(NcclComm comm) {
  if (NcclLoaded() && comm != nullptr) fns.CommDestroy(comm);
}

Status NcclAllReduce(const void* in, void* out, size_t count, NcclType t, NcclOp op,
                     NcclComm comm, NcclStream stream) {
  return Check(fns.AllReduce(in, out, count, t, op, comm, stream), "ncclAllReduce");
}

Status NcclAllGather(const void* in, void* out, size_t count, NcclType t, NcclComm comm,
                     NcclStream stream) {
  return Check(fns.AllGather(in, out, count, t, comm, stream), "ncclAllGather");
}

Status NcclReduceScatter(const void* in, void* out, size_t count, NcclType t, NcclOp op,
                         NcclComm comm, NcclStream stream) {
  return Check(fns.ReduceScatter(in, out, count, t, op, comm, stream), "ncclReduceScatter");
}

Status NcclBroadcast(const void* in, void* out, size_t count, NcclType t, int root,
                     NcclComm comm, NcclStream stream) {
  return Check(fns.Broadcast(in, out, count, t, root, comm, stream), "ncclBroadcast");
}

Status NcclReduce(const void* in, void* out, size_t count, NcclType t, NcclOp op, int root,
                  NcclComm comm, NcclStream stream) {
  return Check(fns.Reduce(in, out, count, t, op, root, comm, stream), "ncclReduce");
}

Status NcclSend(const void* in, size_t count, NcclType t, int peer, NcclComm comm,
                NcclStream stream) {
  return Check(fns.Send(in, count, t, peer, comm, stream), "ncclSend");
}

Status NcclRecv(void* out, size_t count, NcclType t, int peer, NcclComm comm,
                NcclStream stream) {
  return Check(fns.Recv(out, count, t, peer, comm, stream), "ncclRecv");
}

Status NcclGroupStart() {
  if (!NcclLoaded()) return NotLoaded();
  return Check(fns.GroupStart(), "ncclGroupStart");
}

Status NcclGroupEnd() { return Check(fns.GroupEnd(), "ncclGroupEnd"); }

}  // namespace spmd
