// MPI through the library mpi4py loaded, resolved at run time with dlsym: spmd never links
// against an MPI, so it works with whichever implementation the launcher and mpi4py agree on.
//
// Handles (MPI_Comm, MPI_Datatype, MPI_Op, MPI_Request) are passed as integers of pointer width;
// they are ints in MPICH's ABI and pointers in Open MPI's and the standard ABI, and either way fit
// the argument register or 8-byte stack slot the calling convention gives them. Every operation
// is non-blocking and polled with a deadline, so a rank that never arrives is an error, not a
// hang.
#ifndef SPMD_CPU_MPI_H_
#define SPMD_CPU_MPI_H_

#include <atomic>
#include <cstddef>
#include <deque>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "reduce.h"
#include "spmd/signature.h"
#include "spmd/status.h"
#include "xla/ffi/api/ffi.h"

namespace spmd {

using MpiHandle = intptr_t;

// Handles of the MPI constants spmd uses, read by Python from mpi4py.
struct MpiConstants {
  MpiHandle byte, c_bool, int8, uint8, int32, int64, float32, float64;
  MpiHandle sum, prod, max, min, land, lor;
};

// Loads the MPI functions from `library` (already loaded by mpi4py), and chooses once how calls
// carry counts: with the MPI-4 large-count functions (MPI_Iallreduce_c, ...) where the library
// has them and `prefer_large_count`, else with the classic ones, whose counts and displacements
// are ints: a call of more than `classic_max_count` elements (2^31-1; less for tests) is split
// into calls of at most that many, and an allgather or all_to_all whose displacements pass it
// goes point to point. Each element is reduced by one MPI call either way, so results are those
// of the large-count path wherever the MPI's reduction order does not depend on the count (any
// call of up to `classic_max_count` elements: the same single call; every split call on two
// ranks, where a sum has one order).
Status MpiLoad(const std::string& library, const MpiConstants& constants, bool prefer_large_count,
               int64_t classic_max_count);
bool MpiLoaded();
// Whether the loaded calls are the large-count ones (false before MpiLoad).
bool MpiLargeCount();
// Whether `library` has the MPI-4 large-count functions spmd uses.
Status MpiHasLargeCount(const std::string& library, bool* has);

// What a point-to-point message holds: sent ahead of the data, so that a receiver checks the
// dtype and shape it receives into, not only the byte count (the same bytes as float32[4] and
// int32[2,2] are not the same message). Dimensions past the 8th are folded into the 8th.
struct MessageShape {
  static constexpr int kDims = 8;
  uint64_t bytes = 0, dtype = 0, ndims = 0, dims[kDims] = {};

  static MessageShape Of(size_t bytes, xla::ffi::DataType dtype,
                         xla::ffi::Span<const int64_t> dims);
  bool operator==(const MessageShape& o) const;
  std::string Describe() const;  // "float32[2,2]"
};

// What a communicator and the peer watch (spmd/runtime/_watch.py) tell each other, for groups
// whose ranks no shared-memory segment shows (a group spanning nodes): how many collectives this
// process has started on the communicator and since when it waits in one (read by the watch,
// which asks the peers over TCP), and the watch's verdict on the call waited for: a peer that
// left before reaching it (`gone`, which ends the wait), the peers that have not reached it
// (`late`, for the stall report and the timeout).
struct MpiWatch {
  std::vector<int> world_ranks;
  std::atomic<uint64_t> started{0};
  std::atomic<int64_t> waiting_since_ns{0};  // steady clock; 0: not waiting in a collective
  std::atomic<bool> has_gone{false};
  std::mutex mu;  // guards the verdict and the failures' texts
  uint64_t verdict_call = 0;
  std::string gone, late;
  // This rank's failure of a collective on the communicator (MpiComm::Broke; 0: none), which the
  // watch tells the peers once (mpi_watch_failures), and the first failure a peer told this
  // rank of (the watch's server): its collective #peer_failed, its world rank and its error. A
  // collective that starts after a peer failed it, or waits for such a peer, fails at once
  // naming that failure, as the node's segment makes it within a node.
  std::atomic<uint64_t> failed{0}, peer_failed{0};
  bool failure_told = false;
  std::string failure, peer_failure;
  int peer_rank = -1;
};
// Registers a communicator's watch (GroupAttachMpi); the watches alive, for the watch thread.
void MpiWatchAdd(const std::shared_ptr<MpiWatch>& w);
std::vector<std::shared_ptr<MpiWatch>> MpiWatches();
// Whether this node runs more ranks than it has cores: then an MPI wait yields its core after
// every poll of its requests, so that the rank it waits for gets to run (4 ranks on 2 cores: a
// 4-byte allreduce took 158 us yielding every 1024 polls, 41 us yielding every poll).
void MpiSetOversubscribed(bool on);
bool MpiOversubscribed();
// SPMD_STALL_WARN in seconds (30 unset; 0: never), as the Python side checked it.
double StallSecondsFromEnv();

// The sends of one communicator still waiting for their receivers, oldest first: each message's
// copy and shape, and its MPI requests; and buffers of completed sends, for the next sends'
// copies (no allocation per send in a steady pipeline). Shared with the send progress thread
// (MpiSendProgress), which tests the oldest now and then, under `mu`.
struct MpiSendQueue {
  struct Pending {
    std::vector<char> data;
    MessageShape shape;
    std::vector<MpiHandle> requests;
  };
  std::mutex mu;
  std::deque<Pending> sends;
  std::vector<std::vector<char>> spare;
  static constexpr size_t kSpare = 4;  // buffers kept
  bool watched = false;                // registered with the progress thread (its mutex)
};

// Whether a thread of this process moves the sends that wait for their receivers while the rank
// does something else (Python passes: MPI runs with MPI_THREAD_MULTIPLE, and SPMD_MPI_PROGRESS is
// not 0). MPI moves a message only inside MPI calls: a send larger than MPI's eager limit (MPICH:
// one shared-memory cell, 64 KiB) returns with most of its data still here, and without such a
// thread the receiver waits until the sender's next call into MPI, after whatever it computes
// meanwhile (a GPipe stage's next backward pass: 154 ms steps instead of 103 in
// benchmarks/results/plan-cpu2-n2.md), or for ever if the sender's next call is a collective over
// shared memory. The thread tests the oldest pending send of each communicator about every 50 us
// while any is pending, and sleeps otherwise.
void MpiSendProgress(bool on);
// Stops the thread (at interpreter exit, before MPI is finalized): it calls MPI no more.
void MpiSendProgressStop();

// The collectives spmd runs over MPI, on communicator `comm` of `size` ranks. Counts are
// elements; reductions work on every dtype spmd supports (float16/bfloat16 through float32).
struct MpiComm {
  MpiHandle comm = 0;
  int rank = 0, size = 1;
  double timeout_s = 300;
  std::vector<int> world_ranks;

  Status Allreduce(const void* in, void* out, size_t count, xla::ffi::DataType dtype,
                   ReduceOp op) const;
  // Rank r's bytes[r] land at byte `displs[r]` of `out` (without displs, one after another).
  Status Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes,
                    const std::vector<size_t>* displs = nullptr) const;
  Status ReduceScatterv(const void* in, void* out, const std::vector<size_t>& counts,
                        xla::ffi::DataType dtype, ReduceOp op) const;
  Status Broadcast(void* buf, size_t bytes, int root) const;
  Status AllToAll(const void* in, void* out, size_t block_bytes) const;
  // Bytes to and from each rank, at byte offsets into `in` and `out`.
  Status AllToAllv(const void* in, const std::vector<size_t>& send_bytes,
                   const std::vector<size_t>& send_off, void* out,
                   const std::vector<size_t>& recv_bytes,
                   const std::vector<size_t>& recv_off) const;
  // Sends `send` (described by `send_shape`) to group rank dst and receives into `recv`
  // (expecting `recv_shape`) from group rank src; dst or src < 0: no such half. A message whose
  // shape differs from the one expected is received into scratch and is an error naming the
  // sender, its shape and the one expected.
  // The send does not wait for its receiver: the message is copied, and its MPI send completes
  // while this rank goes on (moved by the progress thread, MpiSendProgress, and checked at each
  // later call on the communicator). A pipeline
  // stage then runs ahead of its neighbour instead of meeting it at every message, and two
  // ranks that send to each other before they receive do not wait on each other. At most
  // kSendsAhead sends wait for their receivers at once; one more waits for the oldest.
  Status SendRecv(const void* send, const MessageShape& send_shape, int dst, void* recv,
                  const MessageShape& recv_shape, int src) const;
  static constexpr size_t kSendsAhead = 64;
  // Waits for every send still waiting for its receiver (the group is being released).
  Status FlushSends() const;
  Status Barrier() const;
  // Signature check before each collective (an allgather of a hash; the descriptions follow
  // only when the hashes differ): a clear error on every rank instead of mixed data.
  Status CheckSame(const Signature& sig) const;

  // Set when a call timed out. MPI cannot cancel a collective, so the abandoned call may still
  // complete once the late ranks arrive: the communicator is not used again (every later call
  // fails at once instead of matching the abandoned one), and the job should stop (spmd.init's
  // abort hook stops it on an uncaught error).
  mutable bool broken = false;
  mutable std::string broken_by;  // the error that broke it

  // Where the group's ranks share a node: which peer has left ("rank N is exiting ..."; "" if
  // none), from the group's shared-memory segment (ShmGroup::AnyGone). A wait that outlasts a
  // millisecond asks it now and then, so that a peer that left is an error at once instead of at
  // the timeout. Unset: waits run to the timeout.
  std::function<std::string()> peer_gone;
  // Also where the ranks share a node: `on_call(n)` publishes that this rank has started its
  // n-th collective over MPI on the group (CheckSame counts them), and `behind(n, ask)` names
  // the ranks that have not ("" when none): a wait longer than `stall_s` (SPMD_STALL_WARN)
  // prints them, once, and a timeout names them; `ask`: the report asks a lagging rank for its
  // Python stack (one waiting rank asks).
  std::function<void(uint64_t)> on_call;
  std::function<std::string(uint64_t, bool)> behind;
  // Also where the ranks share a node: `failed(n, error)` publishes that this rank failed its
  // n-th collective (ShmGroup::MpiFailed), and `peer_failed(n)` names a peer's failure of
  // collective n or an earlier one ("" if none): a collective that starts after a peer failed
  // it, or waits for such a peer, fails at once naming that failure.
  std::function<void(uint64_t, const std::string&)> failed;
  std::function<std::string(uint64_t)> peer_failed;
  double stall_s = 30;
  // Shared with the peer watch; set where the communicator is attached.
  std::shared_ptr<MpiWatch> watch;

 private:
  Status Usable() const;
  // Polls `requests` to completion, or fails after the deadline naming the group.
  Status Wait(MpiHandle* requests, int n, const char* what) const;
  // The classic path's split call: `start(at, n, &request)` starts the call on elements
  // [at, at + n), n at most the classic limit; the pieces run one after another.
  Status Pieces(size_t count, const char* what,
                const std::function<int(size_t, int, MpiHandle*)>& start) const;
  // The classic path's all_to_allv (and allgatherv) whose displacements pass an int: bytes to
  // and from every peer by point-to-point messages of at most the classic limit each.
  Status Exchange(const void* in, const std::vector<size_t>& send_bytes,
                  const std::vector<size_t>& send_off, void* out,
                  const std::vector<size_t>& recv_bytes, const std::vector<size_t>& recv_off,
                  const char* what) const;
  // The peers that have not reached collective #calls_: the segment's and the watch's.
  std::string Behind(bool ask) const;
  // The watch's verdict that a peer left before collective #calls_ ("" if none).
  std::string WatchGone() const;
  // A peer's failure of collective #n or an earlier one ("" if none): from the node's segment
  // (`peer_failed`), else as the peer watch was told of it.
  std::string PeerFailed(uint64_t n) const;
  // The group is broken by `error`, this rank's failure of the collective under way (peers on
  // the node are told: `failed`) or, `own` false, a peer's (already told). Returns `error`.
  Status Broke(const Status& error, bool own = true) const;
  // The sends still waiting for their receivers (shared with the progress thread).
  // RetireSends drops those done, and waits for the oldest while more than `keep` remain.
  std::shared_ptr<MpiSendQueue> sends_ = std::make_shared<MpiSendQueue>();
  Status RetireSends(size_t keep) const;
  // The collective under way (CheckSame to its end; null in point-to-point calls), for the
  // stall report and the timeout, and how many have started.
  mutable const Signature* current_ = nullptr;
  mutable uint64_t calls_ = 0;
};

}  // namespace spmd

#endif  // SPMD_CPU_MPI_H_
