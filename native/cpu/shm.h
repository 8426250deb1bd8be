// Shared-memory collectives among the ranks of one group on one node: the CPU counterpart of the
// GPU IPC all-reduce. Every rank maps one segment holding, per rank, a control block and two
// parities of a staging slot and a result slot. Buffers are registered once, when the group is
// created; a collective only copies through them.
//
// Synchronisation: each rank owns an `arrive` counter. A sync point increments it to t and waits
// until every peer's counter reaches t. Data written in the phase that ends with sync t lives in
// parity t % 2 and is read in the phase after it; it is overwritten two syncs later, when every
// reader has provably finished. Every wait has a deadline, so a missing rank is an error naming
// it, not a hang.
//
// shm_segment.cc maps the segment and holds the sync points, the signature check and the
// staging probe; shm_copy.{h,cc} the copies into and out of the slots; shm_collectives.cc the
// collectives.
#ifndef SPMD_CPU_SHM_H_
#define SPMD_CPU_SHM_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "reduce.h"
#include "spmd/signature.h"
#include "spmd/alltoallv.h"
#include "spmd/call.h"
#include "spmd/status.h"
#include "spmd/tables.h"

namespace spmd {

// Where each block of `bytes` starts when the blocks are laid end to end, and (one more entry)
// where the last one ends.
inline void BlockStarts(const std::vector<size_t>& bytes, std::vector<size_t>* off) {
  off->assign(bytes.size() + 1, 0);
  for (size_t r = 0; r < bytes.size(); ++r) (*off)[r + 1] = (*off)[r] + bytes[r];
}

// The shared-memory collectives of one group's ranks on one node (see above).
class ShmGroup {
 public:
  // How a rank writes what it stages for the others in calls of kProbeMin bytes or more
  // (SPMD_SHM_STAGING). kCached: normal stores, so a reader sharing the writer's last-level
  // cache copies from it. kStreamed: non-temporal stores, so the reader copies from memory, and
  // never pulls modified lines out of another core's cache, which is several times slower where
  // the two cores do not share a cache (other CCD or socket, or a VM whose cores the host placed
  // so). kAuto: each such call times a token passed round the ranks and streams when a hop takes
  // longer than a shared cache's; a broadcast streams without probing.
  enum class Staging { kAuto = 0, kCached = 1, kStreamed = 2 };
  static constexpr NamedCode kStagingModes[] = {{"auto", 0}, {"cached", 1}, {"streamed", 2}};

  // Creates (`create`) or attaches to the named POSIX shared-memory segment.
  static Status Open(const std::string& name, bool create, int rank, int size, size_t chunk,
                     Staging staging, double timeout_s, std::vector<int> world_ranks,
                     ShmGroup** out);
  ~ShmGroup();
  static size_t SegmentBytes(int size, size_t chunk);

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t chunk() const { return chunk_; }

  // Each collective first publishes its call's signature and fails on every rank alike when
  // the ranks' signatures differ.
  Status Barrier(const Signature& sig);
  // Inputs and outputs are lists of leaves with equal byte sizes (outputs may alias inputs).
  Status Allreduce(const Signature& sig, ReduceOp op, const std::vector<Leaf>& in,
                   const std::vector<Leaf>& out, size_t one_shot_max);
  // Compressed sum of float32 leaves: each rank's values divided by `div` and rounded to
  // bfloat16 (`bf16`) or float16 as they are staged, summed in float32 in rank order, the sum
  // rounded once and widened into `out`. Half the bytes of Allreduce cross shared memory.
  Status AllreduceNarrowed(const Signature& sig, bool bf16, float div, const std::vector<Leaf>& in,
                           const std::vector<Leaf>& out, size_t one_shot_max);
  // Per leaf: rank r contributes bytes[r] (in rank order in the output).
  Status Allgatherv(const Signature& sig, const Leaf& in, const Leaf& out,
                    const std::vector<size_t>& bytes);
  // Per leaf: block r of the input (bytes[r]) is reduced over ranks into rank r's output.
  Status ReduceScatterv(const Signature& sig, ReduceOp op, const Leaf& in, const Leaf& out,
                        const std::vector<size_t>& bytes);
  Status Broadcast(const Signature& sig, int root, const Leaf& in, const Leaf& out);
  // Input and output hold `size` blocks of `block` bytes; output block j = rank j's block rank.
  Status AllToAll(const Signature& sig, const Leaf& in, const Leaf& out, size_t block);
  // Rows of `row` bytes, as many for each rank as the plan made from every rank's `record` says
  // (spmd/alltoallv.h: `planner`). The records travel in the first sync, next to the
  // signatures; every rank plans from them all, so every rank fails alike on a bad count.
  Status AllToAllv(const Signature& sig, const Leaf& in, const Leaf& out,
                   const a2av::Rows& rows, const std::vector<int64_t>& record,
                   const a2av::Planner& planner);

  // The staging probe on its own (every rank calls it): *hop_ns, on rank 0, the mean time of
  // one hop of a token passed kProbeLaps times round the ranks; NaN on the others.
  Status Hop(const Signature& sig, double* hop_ns);

  // Signature check for a group of ops run as one call (the fused list of leaves counts as
  // one op); exposed so that composite algorithms check once.
  Status Begin(const Signature& sig);

  // Whether this process prints its Python stack on SIGUSR1 (spmd.init registers faulthandler
  // for it when nothing else handles the signal): a peer reporting a stall asks for it.
  static void SetDumpsStack(bool on);

  // The sequence check of calls made elsewhere (the GPU handlers' calls after their first,
  // fully compared run; spmd/signature.h, GpuHooks::sequence): this rank's next call on the
  // group has signature `hash` (`described`: the call written out). Each rank publishes, per
  // call, a chain of its calls' hashes in a ring of its control block, and compares it with
  // what each peer has published for the latest call both rings still hold: nothing waits, and
  // a difference is found at the first call after both ranks made the differing one (within
  // kSequenceRing calls of each other). The error names the first call that differs with each
  // rank's call. Costs a lock, a hash lookup and a cache line from each peer per call.
  static constexpr uint64_t kSequenceRing = 64;
  static constexpr int kBoardMembers = 256;  // the largest group the wait board judges
  static constexpr uint64_t kSequenceTexts = 64;
  Status Sequence(uint64_t hash, std::string_view described);
  // Forgets this rank's calls (for the tests: every rank, between two barriers of the group).
  void SequenceReset();

  // The wait board's slots, when this is the world group's segment (board.h): this rank's
  // wait published (`count` < 0: members unknown) or withdrawn; and BoardDeadlock, the
  // description of every rank's wait when no wait on the board can complete, else "".
  void BoardPublish(uint64_t key, int64_t since_ns, const std::vector<int>& members, int count,
                    const std::string& what);
  void BoardWithdraw();
  std::string BoardDeadlock(int64_t now_ns, int64_t settled_ns) const;
  // A deadlock found is declared on the board, so that the ranks that have not looked yet fail
  // with it too (once one has failed, it is no longer on the board for them to see):
  // BoardDeclared: whether one was declared at `since_ns` or later, and *text its description.
  void BoardDeclare(const std::string& text, int64_t now_ns);
  bool BoardDeclared(int64_t since_ns, std::string* text) const;

  // Marks this process's ranks of every group as leaving (Python is exiting), so that a peer
  // waiting for one of them in a collective fails at once naming it instead of waiting for
  // SPMD_TIMEOUT. Called at interpreter exit (spmd.init registers it).
  static void MarkAllLeaving();

 private:
  struct alignas(64) Ctrl {
    std::atomic<uint64_t> arrive;
    std::atomic<int32_t> pid;      // the rank's process, for a waiting peer to see it gone
    std::atomic<int32_t> leaving;  // set as the rank's process exits (MarkAllLeaving)
    std::atomic<uint64_t> calls;   // collectives this rank has started on the group
    std::atomic<uint64_t> mpi_calls;  // those over the group's MPI communicator (MpiComm)
    std::atomic<int32_t> dumps;    // its Python stack is printed on SIGUSR1 (faulthandler)
    char pad0[28];
    uint64_t sig[2];
    char pad1[48];
    char desc[512];
    char failure[512];  // why this rank failed the sync its verdict names (Fail)
    alignas(64) std::atomic<uint64_t> token;  // the staging probe's ring (Ring)
    // Rank 0's only: the group's verdict on its latest decided sync (Decide), on a line of its
    // own. (t << kVerdictShift) | failed bit | the rank that failed it.
    alignas(64) std::atomic<uint64_t> verdict;
    // The wait board (board.h; the world group's segment only): the wait this rank has
    // published. `board_gen` is odd while one is, and changes before and after the others.
    alignas(64) std::atomic<uint64_t> board_gen;
    std::atomic<int64_t> board_since_ns;  // steady clock (one per machine) at the wait's start
    std::atomic<uint64_t> board_key;      // equal for the ranks of one matching wait
    std::atomic<int32_t> board_count;     // members listed; -1: not judged (see board.h)
    std::atomic<int32_t> board_member[kBoardMembers];  // the wait's group, by world rank
    char board_what[256];
    char board_verdict[2048];  // the deadlock this rank found (BoardDeclare)
    // Rank 0's only: when a deadlock was last declared (0: never), and by which rank.
    alignas(64) std::atomic<int64_t> board_declared_ns;
    std::atomic<int32_t> board_declarer;
    // Sequence: the calls this rank has published, and call n's entry at n % kSequenceRing
    // (`n` is written last, and zeroed first while the entry changes).
    alignas(64) std::atomic<uint64_t> seq_latest;
    struct SeqEntry {
      std::atomic<uint64_t> n, chain, hash;
    } seq_ring[kSequenceRing];
    // The calls' texts by signature, for a peer's error: open addressing from hash %
    // kSequenceTexts; `hash` is written after the text, once (0: free).
    struct SeqText {
      std::atomic<uint64_t> hash;
      char text[248];
    } seq_texts[kSequenceTexts];

    // The collective over MPI this rank failed (MpiFailed; 0: none), and why.
    alignas(64) std::atomic<uint64_t> mpi_failed;
    char mpi_failure[512];
  };
  // Call n's entry in rank r's ring, or false when the ring no longer (or not yet) holds it.
  bool SeqRead(int r, uint64_t n, uint64_t* chain, uint64_t* hash) const;
  std::string SeqMismatch(int r, uint64_t upto);
  // Publishes this rank's text of a signature; rank r's text of `hash` ("" if not published).
  void SeqPublishText(uint64_t hash, const std::string& text);
  std::string SeqText(int r, uint64_t hash) const;

  ShmGroup() = default;
  Ctrl* ctrl(int r) const { return reinterpret_cast<Ctrl*>(base_ + r * sizeof(Ctrl)); }
  char* slot(int r, uint64_t t) const { return data_ + (r * 4 + (t & 1)) * chunk_; }
  char* res(int r, uint64_t t) const { return data_ + (r * 4 + 2 + (t & 1)) * chunk_; }
  uint64_t next() const { return epoch_ + 1; }  // the sync point the current phase ends with
  Status Sync();
  // More ranks in the group than cores on the machine.
  bool Oversubscribed() const;
  // Waits until rank r's `a` reaches v: spinning, then yielding. kTimedOut once the deadline,
  // set the first time the wait gets long, has passed; kGone once rank r's process has ended or
  // is exiting (checked about every millisecond of a long wait).
  // kFailed: a peer has failed sync `sync` (the one this wait belongs to), so it cannot
  // complete.
  // kDeadlock: the wait board (board.h) finds that no rank of the job can move again
  // (deadlock_ says why).
  enum class Wait { kArrived, kTimedOut, kGone, kFailed, kDeadlock };
  Wait WaitFor(int r, const std::atomic<uint64_t>& a, uint64_t v, uint64_t sync,
               std::chrono::steady_clock::time_point* deadline) const;
  // No half-finished collective: every sync ends with one verdict for the whole group, taken
  // by the first rank to decide, in rank 0's `verdict` word. A rank that has seen every peer
  // arrive at sync t records "t completed" unless a peer recorded "t failed" first (then it
  // fails too, naming that peer's failure); a rank that fails sync t (a timeout, a peer gone)
  // records "t failed" unless "t completed" is there (then every peer had arrived after all:
  // it completes). So a late rank cannot complete a collective a peer has already given up on.
  static constexpr int kVerdictShift = 20;
  static constexpr uint64_t kFailedBit = uint64_t{1} << (kVerdictShift - 1);
  // After every peer arrived at sync t: Ok, or the error of a peer's earlier failure of t.
  Status Decide(uint64_t t);
  // This rank fails sync t with `error`: the error, or Ok where t completed after all.
  Status Fail(uint64_t t, const Status& error);
  // This rank fails sync t as part of a deadlock (deadlock_).
  Status Deadlocked(uint64_t t);
  // The error of the peer that failed sync t (its text from its control block).
  Status FailedByPeer(uint64_t t, uint64_t verdict);
  // Why rank r is gone ("" if it is not); GoneSeen: with `seen` saying whose process can be
  // seen gone (visible_ or watched_).
  std::string Gone(int r) const;
  std::string GoneSeen(int r, const std::vector<char>& seen) const;

 public:
  // The first peer that has left, as "rank N is exiting ..." ("" if none): for waits outside
  // this group's own collectives (the MPI transport's). A peer whose process this process did
  // not see at the first call is never seen gone (another PID namespace).
  std::string AnyGone();
  // For the group's MPI communicator (MpiComm::on_call, behind): publishes that this rank has
  // started its n-th collective over MPI; names the ranks that have not started collective
  // `mine` ("rank 3, which has started 41 collectives over MPI on the group: it has not reached
  // this collective; ..."), or "" when all have. `ask`: the lowest rank that has started it
  // asks each one named for its Python stack (SIGUSR1), as ReportStall does.
  void PublishMpiCall(uint64_t n) { ctrl(rank_)->mpi_calls.store(n, std::memory_order_relaxed); }
  // This rank failed its n-th collective over MPI with `error` (a timeout, a peer gone): a peer
  // still waiting in that collective, or arriving at it later, fails at once naming it
  // (MpiPeerFailed) instead of waiting for its own timeout or guessing why this rank left.
  void MpiFailed(uint64_t n, const std::string& error);
  std::string MpiPeerFailed(uint64_t n) const;
  std::string MpiBehind(uint64_t mine, bool ask) const;
  double stall_s() const { return stall_s_; }

 private:
  Status TimedOut(uint64_t t, const std::vector<int>& missing);
  Status PeerGone(uint64_t t, int r);
  // Starts a call moving `bytes`: from kProbeMin bytes, checks the signatures at once (clearing
  // *first) and decides how this call stages (far_, see Staging); `always_far`: streamed under
  // kAuto without probing. Every rank of a call passes the same arguments.
  Status Place(const Signature& sig, size_t bytes, bool* first, bool always_far = false);
  // The probe's token ring, after a Begin: *far (every rank) is rank 0's verdict; *hop_ns is
  // rank 0's measurement (NaN on the others).
  Status Ring(bool* far, double* hop_ns);
  // One wait of the ring for rank r's token to reach v.
  Status RingWait(int r, uint64_t v, std::chrono::steady_clock::time_point* deadline);
  // What this call's staging writes: into slots (`far_`: streamed).
  void Stage(char* slot, const char* src, size_t len) const;
  // The sync ending a step: the first step of a collective also checks the signatures.
  Status Step(const Signature& sig, bool* first) {
    if (!*first) return Sync();
    *first = false;
    return Begin(sig);
  }
  Status Mismatch(const Signature& sig);
  // The allreduce algorithm (one-shot or two-shot), with the codec deciding what travels.
  template <typename Codec>
  Status AllreduceWith(const Codec& codec, const Signature& sig, const std::vector<Leaf>& in,
                       const std::vector<Leaf>& out, size_t one_shot_max);

  std::string name_;
  int rank_ = 0, size_ = 1;
  size_t chunk_ = 0, bytes_ = 0;
  char* base_ = nullptr;
  char* data_ = nullptr;
  uint64_t epoch_ = 0;
  double timeout_s_ = 300;
  Staging staging_ = Staging::kAuto;
  bool far_ = false;        // this call streams what it stages
  uint64_t probes_ = 0;     // staging probes so far (the same count on every rank)
  bool broken_ = false;
  std::string broken_reason_;
  mutable std::string deadlock_;  // the wait board's description of the deadlock (kDeadlock)
  // Per peer: whether this process saw the peer's process once (after the first sync, when
  // every rank has published its pid). Only those can be seen gone: a peer in another PID
  // namespace sharing this node's /dev/shm never is, and is left to the deadline.
  std::vector<char> visible_;
  std::vector<char> watched_;  // AnyGone's own record of which peers' processes it saw
  uint64_t calls_ = 0;                // collectives started on this group (Begin)
  const Signature* current_ = nullptr;  // the collective under way, for a stall report
  double stall_s_ = 30;               // SPMD_STALL_WARN: report a wait longer than this (0: never)
  // Prints, once per wait, which rank this one has waited `waited_s` for and where that rank
  // is; asks it for its Python stack (SIGUSR1) when it registered for that.
  void ReportStall(int r, double waited_s) const;
  std::vector<int> world_ranks_;
  // Sequence's own state: calls so far, their chain, and each signature's text seen here.
  std::mutex seq_mu_;
  uint64_t seq_calls_ = 0, seq_chain_ = 0;
  std::unordered_map<uint64_t, std::string> seq_texts_;
  std::string seq_broken_;
};

}  // namespace spmd

#endif  // SPMD_CPU_SHM_H_
