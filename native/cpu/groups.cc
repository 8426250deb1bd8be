#include "groups.h"

#include "spmd/registry.h"

namespace spmd {

std::shared_ptr<Group> GroupFind(int64_t id) { return RegistryOf<Group>().Find(id); }

Status GroupCreate(int64_t id, int rank, int size, std::vector<int> world_ranks, double timeout_s,
                   size_t one_shot_max) {
  auto g = std::make_shared<Group>();
  g->id = id;
  g->rank = rank;
  g->size = size;
  g->world_ranks = std::move(world_ranks);
  g->timeout_s = timeout_s;
  g->one_shot_max = one_shot_max;
  if (!RegistryOf<Group>().Add(id, std::move(g))) {
    return Status::Error("group id " + std::to_string(id) + " exists");
  }
  return Status::Ok();
}

Status GroupAttachShm(int64_t id, int which, const std::string& name, bool create, int rank,
                      int size, std::vector<int> world_ranks, size_t chunk,
                      ShmGroup::Staging staging) {
  std::shared_ptr<Group> g = GroupFind(id);
  if (g == nullptr) return Status::Error("no group " + std::to_string(id));
  ShmGroup* shm = nullptr;
  SPMD_RETURN_IF_ERROR(
      ShmGroup::Open(name, create, rank, size, chunk, staging, g->timeout_s,
                     std::move(world_ranks), &shm));
  (which == 0 ? g->shm : g->local).reset(shm);
  return Status::Ok();
}

Status GroupAttachMpi(int64_t id, int which, MpiHandle comm, int rank, int size,
                      std::vector<int> world_ranks) {
  std::shared_ptr<Group> g = GroupFind(id);
  if (g == nullptr) return Status::Error("no group " + std::to_string(id));
  if (!MpiLoaded()) return Status::Error("MPI is not loaded");
  MpiComm& m = which == 0 ? g->mpi : g->leaders;
  m.comm = comm;
  m.rank = rank;
  m.size = size;
  m.timeout_s = g->timeout_s;
  m.world_ranks = std::move(world_ranks);
  if (which == 0) {
    g->has_mpi = true;
  } else {
    g->is_leader = true;
  }
  return Status::Ok();
}

Status GroupShmHop(int64_t id, double* hop_ns) {
  std::shared_ptr<Group> g = GroupFind(id);
  if (g == nullptr) return Status::Error("no group " + std::to_string(id));
  std::lock_guard<std::mutex> lock(g->mu);
  if (!g->shm) return Status::Error("group " + std::to_string(id) + " has no shared memory");
  constexpr uint64_t kHopHash = 0x53504d44484f5021;  // "SPMDHOP!"
  return g->shm->Hop({kHopHash, [](const void*) { return std::string("shm hop probe"); }, nullptr},
                     hop_ns);
}

Status GroupSetBackend(int64_t id, Backend backend) {
  std::shared_ptr<Group> g = GroupFind(id);
  if (g == nullptr) return Status::Error("no group " + std::to_string(id));
  std::lock_guard<std::mutex> lock(g->mu);
  g->backend = backend;
  return Status::Ok();
}

void GroupDestroy(int64_t id) {
  std::shared_ptr<Group> g = RegistryOf<Group>().Remove(id);
  if (g == nullptr) return;
  std::lock_guard<std::mutex> lock(g->mu);  // wait for a collective still running
}

}  // namespace spmd
