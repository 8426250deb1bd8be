// The GPU group registry; see groups.h.
#include "groups.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "spmd/registry.h"

namespace spmd {
namespace {

Status CudaCheck(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(what + " failed: " + cudaGetErrorString(e));
}

Status Find(int64_t id, std::shared_ptr<CudaGroup>* g) {
  *g = CudaGroupFind(id);
  if (*g == nullptr) return Status::Error("GPU group " + std::to_string(id) + " is not registered");
  return CudaCheck(cudaSetDevice((*g)->device), "cudaSetDevice");
}

void ReleaseCar(CudaGroup& g) {
  for (char* p : g.opened) {
    if (p != nullptr) cudaIpcCloseMemHandle(p);
  }
  g.opened.clear();
  if (g.own != nullptr) cudaFree(g.own);
  g.own = nullptr;
  g.car_ready = false;
  g.peers = car::Peers{};
}

std::atomic<const GpuHooks*> g_hooks{nullptr};
std::atomic<bool> g_check_every_call{false};
std::atomic<bool> g_sequence_all{false};

}  // namespace

void SetGpuHooks(const GpuHooks* hooks, bool every_call, bool sequence_all) {
  g_check_every_call.store(every_call);
  g_sequence_all.store(sequence_all);
  g_hooks.store(hooks);
}

Status CheckCall(CudaGroup& g, int64_t site, std::string_view described, CallCode code,
                 bool captured, uint64_t* hash) {
  *hash = 0;
  const GpuHooks* hooks = g_hooks.load();
  if (hooks == nullptr || described.empty()) return Status::Ok();
  bool first = true;
  {
    std::lock_guard<std::mutex> lock(g.check_mu);
    auto [it, added] = g.site_hashes.try_emplace(site, 0);
    if (added) it->second = HashText(described);
    *hash = it->second;
    first = added;
  }
  if (g.size == 1) return Status::Ok();
  char error[2048] = {0};
  const bool every_call = g_check_every_call.load();
  if (first || every_call) {
    const std::string text(described);
    if (hooks->check(g.id, text.c_str(), error, sizeof(error)) != 0) return Status::Error(error);
    if (every_call) return Status::Ok();  // each call compared before it runs
  }
  // Only calls that every rank runs through this handler on every run count: where XLA may
  // capture the handlers in CUDA graphs, one rank may replay a call that another runs here (a
  // profiler session runs command buffers uncaptured), so only all_to_allv, never captured,
  // counts there.
  if (captured || !(g_sequence_all.load() || code == kAllToAllv)) return Status::Ok();
  if (hooks->sequence(g.id, *hash, described.data(), described.size(), error, sizeof(error)) != 0) {
    return Status::Error(error);
  }
  return Status::Ok();
}

size_t RecordBegin(int64_t group, uint64_t call, uint64_t hash, uint64_t bytes, int32_t code) {
  const GpuHooks* hooks = g_hooks.load();
  if (hooks == nullptr) return SIZE_MAX;
  return hooks->record_begin(group, call, hash, bytes, code, kRecordGpu);
}

void RecordEnd(size_t slot, bool failed) {
  const GpuHooks* hooks = g_hooks.load();
  if (hooks == nullptr || slot == SIZE_MAX) return;
  hooks->record_end(slot, failed ? kFailed : kEnqueued);
}

uint32_t CheckPattern(uint32_t seed, int rank) {
  return (seed * 2654435761u) ^ (0x5bd1e995u * static_cast<uint32_t>(rank + 1));
}

Status CudaGroupCreate(int64_t id, int rank, int size, std::vector<int> world_ranks, int device,
                       double timeout_s) {
  auto g = std::make_shared<CudaGroup>();
  g->id = id;
  g->rank = rank;
  g->size = size;
  g->world_ranks = std::move(world_ranks);
  g->device = device;
  // A non-positive or infinite timeout means none (the kernels' barriers then wait forever).
  g->timeout_ns = (timeout_s > 0 && timeout_s < 1e9) ? static_cast<uint64_t>(timeout_s * 1e9)
                                                      : UINT64_MAX;
  SPMD_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(device), "cudaSetDevice(" +
                                                            std::to_string(device) + ")"));
  SPMD_RETURN_IF_ERROR(CudaCheck(cudaMalloc(&g->scratch, 16), "cudaMalloc"));
  SPMD_RETURN_IF_ERROR(CudaCheck(cudaMemset(g->scratch, 0, 16), "cudaMemset"));
  if (!RegistryOf<CudaGroup>().Add(id, std::move(g))) {
    return Status::Error("GPU group " + std::to_string(id) + " registered twice");
  }
  return Status::Ok();
}

Status CudaGroupNcclInit(int64_t id, const NcclUniqueId& uid) {
  std::shared_ptr<CudaGroup> g;
  SPMD_RETURN_IF_ERROR(Find(id, &g));
  int size, rank;
  {
    std::lock_guard<std::mutex> lock(g->mu);
    if (g->nccl != nullptr) return Status::Ok();
    size = g->size;
    rank = g->rank;
  }
  // Without the group's lock: this blocks until every rank has joined, and a caller that gave
  // up waiting (the Python group layer bounds the wait) must still be able to use and destroy
  // the group meanwhile. The group may be destroyed when NCCL returns.
  NcclComm comm = nullptr;
  SPMD_RETURN_IF_ERROR(NcclCommInitRank(&comm, size, uid, rank));
  std::lock_guard<std::mutex> lock(g->mu);
  if (g->destroyed) {
    NcclCommDestroy(comm);
    return Status::Error("GPU group " + std::to_string(id) +
                         " was destroyed while its NCCL communicator was being created");
  }
  if (g->nccl != nullptr) {
    NcclCommDestroy(comm);
  } else {
    g->nccl = comm;
  }
  return Status::Ok();
}

Status CudaGroupCarAlloc(int64_t id, size_t cap, std::string* handle) {
  std::shared_ptr<CudaGroup> g;
  SPMD_RETURN_IF_ERROR(Find(id, &g));
  std::lock_guard<std::mutex> lock(g->mu);
  ReleaseCar(*g);
  cap = (cap + 255) / 256 * 256;
  SPMD_RETURN_IF_ERROR(CudaCheck(cudaMalloc(&g->own, car::BufferBytes(cap)),
                                 "allocating the custom all-reduce buffer (cudaMalloc of " +
                                     std::to_string(car::BufferBytes(cap)) + " bytes)"));
  // Flags and epochs start at zero on every rank.
  SPMD_RETURN_IF_ERROR(CudaCheck(cudaMemset(g->own, 0, sizeof(car::Signal)), "cudaMemset"));
  SPMD_RETURN_IF_ERROR(CudaCheck(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  cudaIpcMemHandle_t h;
  SPMD_RETURN_IF_ERROR(CudaCheck(cudaIpcGetMemHandle(&h, g->own), "cudaIpcGetMemHandle"));
  handle->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  g->peers.cap = cap;
  return Status::Ok();
}

Status CudaGroupCarOpen(int64_t id, const std::vector<std::string>& handles) {
  std::shared_ptr<CudaGroup> g;
  SPMD_RETURN_IF_ERROR(Find(id, &g));
  std::lock_guard<std::mutex> lock(g->mu);
  if (g->own == nullptr) return Status::Error("custom all-reduce buffer not allocated");
  if (static_cast<int>(handles.size()) != g->size || g->size > car::kMaxRanks) {
    return Status::Error("expected " + std::to_string(g->size) + " IPC handles (at most " +
                         std::to_string(car::kMaxRanks) + "), got " +
                         std::to_string(handles.size()));
  }
  g->opened.assign(g->size, nullptr);
  g->peers.world = g->size;
  for (int r = 0; r < g->size; ++r) {
    char* base = g->own;
    if (r != g->rank) {
      if (handles[r].size() != sizeof(cudaIpcMemHandle_t)) {
        return Status::Error("IPC handle of rank " + std::to_string(g->world_ranks[r]) +
                             " has " + std::to_string(handles[r].size()) + " bytes");
      }
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handles[r].data(), sizeof(h));
      void* p = nullptr;
      SPMD_RETURN_IF_ERROR(CudaCheck(
          cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
          "mapping the custom all-reduce buffer of rank " + std::to_string(g->world_ranks[r]) +
              " (cudaIpcOpenMemHandle)"));
      base = static_cast<char*>(p);
      g->opened[r] = base;
    }
    g->peers.sig[r] = car::SignalOf(base);
    g->peers.data[r] = car::DataOf(base);
  }
  return Status::Ok();
}

Status CudaGroupCarWriteCheck(int64_t id, uint32_t seed) {
  std::shared_ptr<CudaGroup> g;
  SPMD_RETURN_IF_ERROR(Find(id, &g));
  std::lock_guard<std::mutex> lock(g->mu);
  if (g->own == nullptr) return Status::Error("custom all-reduce buffer not allocated");
  return car::WriteCheck(g->own, CheckPattern(seed, g->rank));
}

Status CudaGroupCarReadCheck(int64_t id, uint32_t seed, std::vector<int>* bad) {
  std::shared_ptr<CudaGroup> g;
  SPMD_RETURN_IF_ERROR(Find(id, &g));
  std::lock_guard<std::mutex> lock(g->mu);
  uint32_t got[car::kMaxRanks] = {0};
  SPMD_RETURN_IF_ERROR(car::ReadChecks(g->peers, got));
  bad->clear();
  for (int r = 0; r < g->size; ++r) {
    if (got[r] != CheckPattern(seed, r)) bad->push_back(g->world_ranks[r]);
  }
  g->car_ready = bad->empty();
  return Status::Ok();
}

void CudaGroupDestroy(int64_t id) {
  std::shared_ptr<CudaGroup> g = RegistryOf<CudaGroup>().Remove(id);
  if (g == nullptr) return;
  // A handler that found the group before it was removed may still hold it: it waits for this
  // lock and then finds no NCCL communicator and no custom all-reduce.
  std::lock_guard<std::mutex> lock(g->mu);
  cudaSetDevice(g->device);
  cudaDeviceSynchronize();  // spmd.finalize(): work still queued must not touch freed buffers
  ReleaseCar(*g);
  NcclCommDestroy(g->nccl);
  g->nccl = nullptr;
  if (g->scratch != nullptr) cudaFree(g->scratch);
  g->scratch = nullptr;
  g->destroyed = true;
}

std::shared_ptr<CudaGroup> CudaGroupFind(int64_t id) { return RegistryOf<CudaGroup>().Find(id); }

}  // namespace spmd
