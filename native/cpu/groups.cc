#include "groups.h"

#include <cstdio>
#include <cstring>
#include <exception>

#include "board.h"
#include "messages.h"
#include "recorder.h"
#include "spmd/registry.h"
#include "spmd/tables.h"

namespace spmd {
namespace {

// The transport `kind` on what is attached to `g`; an error naming what is missing.
Status MakeTransport(const Group& g, TransportKind kind, std::unique_ptr<Transport>* out) {
  auto missing = [&](const std::string& what) {
    const char* name = NameOf(kTransportKinds, static_cast<int64_t>(kind));
    return Status::Error("the transport '" + std::string(name) + "' is not attached to the group " +
                         RankList(g.world_ranks) + ": it needs " + what);
  };
  switch (kind) {
    case TransportKind::kShm:
      if (!g.shm) return missing("a shared-memory segment (every rank of the group on one node)");
      *out = std::make_unique<ShmTransport>(*g.shm, g.one_shot_max);
      return Status::Ok();
    case TransportKind::kMpi:
      if (!g.has_mpi) return missing("an MPI communicator (an MPI launcher)");
      *out = std::make_unique<MpiTransport>(g.mpi);
      return Status::Ok();
    case TransportKind::kHier:
      if (!g.local || !g.has_mpi) {
        return missing("node-local shared memory and an MPI communicator (a group spanning "
                       "nodes, under an MPI launcher)");
      }
    {
      NodeLayout layout = NodeLayout::Of(g.node_of);
      const bool rails = g.has_rail && layout.per_node == g.local->size();
      *out = std::make_unique<HierTransport>(*g.local, g.is_leader ? &g.leaders : nullptr,
                                             rails ? &g.rail : nullptr, g.mpi, layout,
                                             g.one_shot_max);
      return Status::Ok();
    }
  }
  return Status::Error("unknown transport code " + std::to_string(static_cast<int>(kind)) +
                       "; expected " + CodeList(kTransportKinds));
}

// A transport holds the parts it was built on: rebuild it when a part is replaced.
Status Rebuild(Group& g) {
  // An MPI wait asks the group's segment, where there is one, whether a peer has left.
  if (g.shm) {
    ShmGroup* shm = g.shm.get();
    g.mpi.peer_gone = [shm] { return shm->AnyGone(); };
    g.mpi.on_call = [shm](uint64_t n) { shm->PublishMpiCall(n); };
    g.mpi.behind = [shm](uint64_t mine, bool ask) { return shm->MpiBehind(mine, ask); };
    g.mpi.failed = [shm](uint64_t n, const std::string& e) { shm->MpiFailed(n, e); };
    g.mpi.peer_failed = [shm](uint64_t n) { return shm->MpiPeerFailed(n); };
    g.mpi.stall_s = shm->stall_s();
  } else {
    g.mpi.peer_gone = nullptr;
    g.mpi.on_call = nullptr;
    g.mpi.behind = nullptr;
    g.mpi.failed = nullptr;
    g.mpi.peer_failed = nullptr;
  }
  if (g.transport == nullptr) return Status::Ok();
  return MakeTransport(g, g.transport_kind, &g.transport);
}

}  // namespace

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
  std::lock_guard<std::mutex> lock(g->mu);
  (which == 0 ? g->shm : g->local).reset(shm);
  return Rebuild(*g);
}

Status GroupAttachMpi(int64_t id, int which, MpiHandle comm, int rank, int size,
                      std::vector<int> world_ranks) {
  std::shared_ptr<Group> g = GroupFind(id);
  if (g == nullptr) return Status::Error("no group " + std::to_string(id));
  if (!MpiLoaded()) return Status::Error("MPI is not loaded");
  std::lock_guard<std::mutex> lock(g->mu);
  MpiComm& m = which == 0 ? g->mpi : which == 1 ? g->leaders : g->rail;
  m.comm = comm;
  m.rank = rank;
  m.size = size;
  m.timeout_s = g->timeout_s;
  m.world_ranks = std::move(world_ranks);
  m.stall_s = StallSecondsFromEnv();
  m.watch = std::make_shared<MpiWatch>();
  m.watch->world_ranks = m.world_ranks;
  MpiWatchAdd(m.watch);
  if (which == 0) {
    g->has_mpi = true;
  } else if (which == 1) {
    g->is_leader = true;
  } else {
    g->has_rail = true;
  }
  return Rebuild(*g);
}

Status GroupSetNodes(int64_t id, std::vector<int> node_of) {
  std::shared_ptr<Group> g = GroupFind(id);
  if (g == nullptr) return Status::Error("no group " + std::to_string(id));
  if (static_cast<int>(node_of.size()) != g->size) {
    return Status::Error("node_of must name a node for each of the group's " +
                         std::to_string(g->size) + " ranks");
  }
  std::lock_guard<std::mutex> lock(g->mu);
  g->node_of = std::move(node_of);
  return Rebuild(*g);
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

Status GroupSetTransport(int64_t id, TransportKind kind) {
  std::shared_ptr<Group> g = GroupFind(id);
  if (g == nullptr) return Status::Error("no group " + std::to_string(id));
  std::lock_guard<std::mutex> lock(g->mu);
  std::unique_ptr<Transport> t;
  SPMD_RETURN_IF_ERROR(MakeTransport(*g, kind, &t));
  g->transport = std::move(t);
  g->transport_kind = kind;
  return Status::Ok();
}

Status GroupCheckSignature(int64_t id, const std::string& described) {
  std::shared_ptr<Group> g = GroupFind(id);
  if (g == nullptr) return Status::Ok();  // a group of one registers nothing here
  std::lock_guard<std::mutex> lock(g->mu);
  if (g->transport == nullptr) {
    return Status::Error("group " + std::to_string(id) + " has no CPU transport to compare "
                         "the calls of its ranks on");
  }
  const Signature sig{HashText(described),
                      [](const void* c) { return *static_cast<const std::string*>(c); },
                      &described};
  return g->transport->Barrier(sig);
}

namespace {

// The shared memory a sequence check of group g runs on: the whole group's, or for a group
// spanning nodes its ranks' on this node; null for neither. Not under the group's lock: the
// check never waits, and a CPU collective of the group may. The segments are attached when the
// group is set up, before any GPU call of it.
ShmGroup* SequenceShm(const Group& g) { return g.shm ? g.shm.get() : g.local.get(); }

// What the GPU module calls must not throw into it (an XLA handler): an exception is an
// error, and an error goes into error[0..error_size) with 1 returned.
template <typename F>
int ForGpu(const char* what, char* error, size_t error_size, const F& body) {
  Status s = Status::Ok();
  try {
    s = body();
  } catch (const std::exception& e) {
    s = Status::Error(std::string(what) + " failed: " + e.what());
  }
  if (s.ok()) return 0;
  if (error_size > 0) {
    std::strncpy(error, s.message().c_str(), error_size - 1);
    error[error_size - 1] = 0;
  }
  return 1;
}

int CheckSignatureForGpu(int64_t group, const char* described, char* error, size_t error_size) {
  return ForGpu("comparing the call", error, error_size,
                [&] { return GroupCheckSignature(group, described); });
}

int SequenceForGpu(int64_t group, uint64_t hash, const char* described, size_t len, char* error,
                   size_t error_size) {
  return ForGpu("the sequence check", error, error_size, [&] {
    return GroupSequence(group, hash, std::string_view(described, len));
  });
}

}  // namespace

Status GroupSequence(int64_t id, uint64_t hash, std::string_view described) {
  std::shared_ptr<Group> g = GroupFind(id);
  ShmGroup* shm = g == nullptr ? nullptr : SequenceShm(*g);  // no group: a group of one
  if (shm == nullptr || shm->size() == 1) return Status::Ok();
  return shm->Sequence(hash, described);
}

void GroupSequenceReset(int64_t id) {
  std::shared_ptr<Group> g = GroupFind(id);
  ShmGroup* shm = g == nullptr ? nullptr : SequenceShm(*g);
  if (shm != nullptr) shm->SequenceReset();
}

const GpuHooks* HooksForGpu() {
  static const GpuHooks hooks{&CheckSignatureForGpu, &SequenceForGpu, &RecorderBegin,
                              &RecorderEndIn, &RecorderSetTimes};
  return &hooks;
}

Status GroupBoardUse(int64_t id) {
  std::shared_ptr<Group> g = GroupFind(id);
  if (g == nullptr || !g->shm) {
    return Status::Error("the group " + std::to_string(id) + " has no shared-memory segment");
  }
  board::Use(g->shm.get());
  return Status::Ok();
}

void GroupDestroy(int64_t id) {
  std::shared_ptr<Group> g = RegistryOf<Group>().Remove(id);
  if (g == nullptr) return;
  std::lock_guard<std::mutex> lock(g->mu);  // wait for a collective still running
  // Sends that have not met their receivers yet: they complete before MPI frees the group.
  if (g->has_mpi) {
    if (Status s = g->mpi.FlushSends(); !s.ok()) {
      std::fprintf(stderr, "spmd: releasing the group: %s\n", s.message().c_str());
    }
  }
}

}  // namespace spmd
