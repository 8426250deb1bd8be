// The shared-memory segment of a group (shm.h): mapping it, the sync points and their
// deadlines, the signature check, and the staging probe.
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <set>
#include <thread>

#include "board.h"
#include "messages.h"
#include "mpi.h"
#include "shm.h"
#include "shm_copy.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPMD_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define SPMD_PAUSE() asm volatile("yield")
#else
#define SPMD_PAUSE() ((void)0)
#endif

namespace spmd {

using shm::RoundUp;

namespace {
// This process's mapped groups, for MarkAllLeaving.
std::mutex live_mu;
std::set<ShmGroup*>& Live() {
  static auto* live = new std::set<ShmGroup*>();  // never destroyed: used at exit
  return *live;
}
}  // namespace

static std::atomic<bool> dumps_stack{false};  // SetDumpsStack

void ShmGroup::SetDumpsStack(bool on) {
  dumps_stack.store(on);
  std::lock_guard<std::mutex> lock(live_mu);
  for (ShmGroup* g : Live()) g->ctrl(g->rank_)->dumps.store(on ? 1 : 0);
}

void ShmGroup::MarkAllLeaving() {
  std::lock_guard<std::mutex> lock(live_mu);
  for (ShmGroup* g : Live()) g->ctrl(g->rank_)->leaving.store(1, std::memory_order_release);
}

size_t ShmGroup::SegmentBytes(int size, size_t chunk) {
  return RoundUp(size * sizeof(Ctrl), 4096) + static_cast<size_t>(size) * 4 * chunk;
}

Status ShmGroup::Open(const std::string& name, bool create, int rank, int size, size_t chunk,
                      Staging staging, double timeout_s, std::vector<int> world_ranks,
                      ShmGroup** out) {
  size_t bytes = SegmentBytes(size, chunk);
  int fd = shm_open(name.c_str(), create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
  if (fd < 0) {
    return Status::Error("cannot " + std::string(create ? "create" : "open") +
                         " the shared-memory segment " + name + ": " + std::strerror(errno));
  }
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return Status::Error("cannot size the shared-memory segment " + name + " to " +
                         std::to_string(bytes) + " bytes: " + std::strerror(err) +
                         " (is /dev/shm large enough?)");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    return Status::Error("cannot map the shared-memory segment " + name + ": " +
                         std::strerror(err));
  }
  auto* g = new ShmGroup();
  g->name_ = name;
  g->rank_ = rank;
  g->size_ = size;
  g->chunk_ = chunk;
  g->bytes_ = bytes;
  g->base_ = static_cast<char*>(base);
  g->data_ = g->base_ + RoundUp(size * sizeof(Ctrl), 4096);
  g->timeout_s_ = timeout_s;
  g->staging_ = staging;
  g->world_ranks_ = std::move(world_ranks);
  g->ctrl(rank)->pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
  g->ctrl(rank)->leaving.store(0, std::memory_order_release);
  g->ctrl(rank)->calls.store(0, std::memory_order_release);
  g->ctrl(rank)->mpi_calls.store(0, std::memory_order_release);
  g->ctrl(rank)->dumps.store(dumps_stack.load() ? 1 : 0, std::memory_order_release);
  if (const char* v = std::getenv("SPMD_STALL_WARN"); v != nullptr && *v != 0) {
    char* end = nullptr;
    const double s = std::strtod(v, &end);
    if (end != v && s >= 0) g->stall_s_ = s;  // the Python side rejects a bad value first
  }
  {
    std::lock_guard<std::mutex> lock(live_mu);
    Live().insert(g);
  }
  *out = g;
  return Status::Ok();
}

ShmGroup::~ShmGroup() {
  board::Forget(this);
  {
    std::lock_guard<std::mutex> lock(live_mu);
    Live().erase(this);
  }
  if (base_ != nullptr) munmap(base_, bytes_);
}

std::string ShmGroup::Gone(int r) const { return GoneSeen(r, visible_); }

std::string ShmGroup::GoneSeen(int r, const std::vector<char>& seen) const {
  if (ctrl(r)->leaving.load(std::memory_order_acquire) != 0) {
    return "is exiting (its Python program ended, or called sys.exit)";
  }
  const int32_t pid = ctrl(r)->pid.load(std::memory_order_acquire);
  if (!seen.empty() && seen[r] && pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
    return "has ended (its process " + std::to_string(pid) + " is gone)";
  }
  return "";
}

std::string ShmGroup::AnyGone() {
  if (watched_.empty()) {
    watched_.assign(size_, 0);
    for (int r = 0; r < size_; ++r) {
      const int32_t pid = ctrl(r)->pid.load(std::memory_order_acquire);
      watched_[r] = pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
    }
  }
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const std::string why = GoneSeen(r, watched_);
    if (!why.empty()) return "rank " + std::to_string(world_ranks_[r]) + " " + why;
  }
  return "";
}

bool ShmGroup::Oversubscribed() const {
  static const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  // Also where the machine runs more of the job's ranks than this group holds (the group of a
  // node's ranks, with other nodes' ranks on the same cores: simulated nodes, test hosts).
  return static_cast<unsigned>(size_) > cores || MpiOversubscribed();
}

ShmGroup::Wait ShmGroup::WaitFor(int r, const std::atomic<uint64_t>& a, uint64_t v,
                                 uint64_t sync,
                                 std::chrono::steady_clock::time_point* deadline) const {
  // Oversubscribed (more ranks than cores): yield early so that the ranks we wait for can run.
  const int spin_limit = Oversubscribed() ? 16 : 4096;
  // A long wait sleeps instead of yielding, so that it leaves the core to the work it waits
  // for: from kSleepAfter, in naps of kNap, from kLongAfter of kLongNap. A peer arriving then is
  // seen at most one nap late.
  using std::chrono::microseconds;
  using std::chrono::milliseconds;
  constexpr auto kSleepAfter = milliseconds(10), kLongAfter = milliseconds(200);
  constexpr auto kNap = microseconds(50), kLongNap = microseconds(500);
  const auto timeout = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(timeout_s_));
  microseconds nap{0};
  bool reported = false;
  int spins = 0;
  std::optional<board::Wait> on_board;  // made once the wait gets long
  while (a.load(std::memory_order_acquire) < v) {
    if (++spins < spin_limit) {
      SPMD_PAUSE();
      continue;
    }
    if (nap.count() != 0) {
      std::this_thread::sleep_for(nap);
    } else {
      sched_yield();
      if ((spins & 1023) != 0) continue;
    }
    const uint64_t verdict = ctrl(0)->verdict.load(std::memory_order_acquire);
    if ((verdict >> kVerdictShift) == sync && (verdict & kFailedBit) != 0) return Wait::kFailed;
    // The peer may have reached v just before it left: look once more after seeing it gone.
    if (!Gone(r).empty()) {
      return a.load(std::memory_order_acquire) < v ? Wait::kGone : Wait::kArrived;
    }
    auto now = std::chrono::steady_clock::now();
    if (*deadline == std::chrono::steady_clock::time_point{}) {
      *deadline = now + timeout;
    } else if (now > *deadline) {
      return Wait::kTimedOut;
    }
    if (!on_board) {
      const std::string what = current_ != nullptr ? current_->Describe() : "a collective";
      on_board.emplace(board::Key("shm", world_ranks_, sync), world_ranks_,
                       what + " (collective #" + std::to_string(calls_) + " of the group " +
                           RankList(world_ranks_) + ")");
    }
    if (std::string dead = on_board->Poll(); !dead.empty()) {
      deadlock_ = std::move(dead);
      return Wait::kDeadlock;
    }
    const auto waited = now - (*deadline - timeout);  // since this sync's wait got long
    nap = waited > kLongAfter ? kLongNap : waited > kSleepAfter ? kNap : microseconds(0);
    const double waited_s = std::chrono::duration<double>(waited).count();
    if (!reported && stall_s_ > 0 && waited_s > stall_s_) {
      reported = true;
      ReportStall(r, waited_s);
    }
  }
  return Wait::kArrived;
}

namespace {

// Whether process `pid` is stopped (SIGSTOP, Ctrl-Z, a debugger): Linux's /proc state T or t.
bool IsStopped(int32_t pid) {
  if (pid <= 0) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // the state follows the command name
  return close != nullptr && close[1] == ' ' && (close[2] == 'T' || close[2] == 't');
}

}  // namespace

void ShmGroup::ReportStall(int r, double waited_s) const {
  const uint64_t theirs = ctrl(r)->calls.load(std::memory_order_relaxed);
  const std::string what = current_ != nullptr ? current_->Describe() : "a collective";
  std::string where = theirs < calls_   ? "it has not reached this collective"
                      : theirs == calls_ ? "it is in this collective too, but has not arrived"
                                         : "it is past this collective";
  // One rank asks for the stack: the lowest rank other than the stalled one.
  const bool ask = ctrl(r)->dumps.load() != 0 && rank_ == (r == 0 ? 1 : 0);
  const int32_t pid = ctrl(r)->pid.load();
  const bool stopped = IsStopped(pid);
  if (stopped) {
    where += "; its process " + std::to_string(pid) +
             " is stopped (SIGSTOP, Ctrl-Z or a debugger) and runs on only when continued " +
             "(kill -CONT " + std::to_string(pid) + ")";
  }
  std::string msg = "[rank " + std::to_string(world_ranks_[rank_]) + "] spmd: stalled: " +
                    "this rank has waited " + std::to_string(static_cast<int>(waited_s)) +
                    " s in " + what + " (collective #" + std::to_string(calls_) +
                    " of the group " + RankList(world_ranks_) + ") for rank " +
                    std::to_string(world_ranks_[r]) + ", which has started " +
                    std::to_string(theirs) + " collectives on the group: " + where + "." +
                    (ask && !stopped ? " Its Python stack follows in its output." : "") +
                    " (SPMD_STALL_WARN; the wait ends with an error after SPMD_TIMEOUT.)\n";
  std::fputs(msg.c_str(), stderr);
  std::fflush(stderr);
  if (ask && pid > 0) kill(pid, SIGUSR1);
}

void ShmGroup::MpiFailed(uint64_t n, const std::string& error) {
  Ctrl* c = ctrl(rank_);
  std::strncpy(c->mpi_failure, error.c_str(), sizeof(c->mpi_failure) - 1);
  c->mpi_failure[sizeof(c->mpi_failure) - 1] = 0;
  c->mpi_failed.store(n, std::memory_order_release);  // after the text
}

std::string ShmGroup::MpiPeerFailed(uint64_t n) const {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const uint64_t failed = ctrl(r)->mpi_failed.load(std::memory_order_acquire);
    if (failed == 0 || failed > n) continue;
    return PeerFailedMessage(failed, n, world_ranks_, world_ranks_[r], ctrl(r)->mpi_failure);
  }
  return "";
}

std::string ShmGroup::MpiBehind(uint64_t mine, bool ask) const {
  std::string late;
  int asker = -1;
  for (int r = 0; r < size_ && asker < 0; ++r) {
    if (ctrl(r)->mpi_calls.load(std::memory_order_relaxed) >= mine) asker = r;
  }
  for (int r = 0; r < size_; ++r) {
    const uint64_t theirs = ctrl(r)->mpi_calls.load(std::memory_order_relaxed);
    if (r == rank_ || theirs >= mine) continue;
    const int32_t pid = ctrl(r)->pid.load();
    std::string what = "rank " + std::to_string(world_ranks_[r]) + ", which has started " +
                       std::to_string(theirs) + " collectives over MPI on the group: it has " +
                       "not reached this collective";
    if (IsStopped(pid)) {
      what += "; its process " + std::to_string(pid) + " is stopped (SIGSTOP, Ctrl-Z or a " +
              "debugger) and runs on only when continued (kill -CONT " + std::to_string(pid) +
              ")";
    } else if (ask && asker == rank_ && pid > 0 && ctrl(r)->dumps.load() != 0) {
      what += ". Its Python stack follows in its output";
      kill(pid, SIGUSR1);
    }
    late += (late.empty() ? "" : "; and ") + what;
  }
  return late.empty() ? late : late + ".";
}

Status ShmGroup::PeerGone(uint64_t t, int r) {
  broken_ = true;
  broken_reason_ = "the shared-memory group of ranks " + RankList(world_ranks_) +
                   " is unusable: rank " + std::to_string(world_ranks_[r]) + " left it";
  const bool exiting = ctrl(r)->leaving.load(std::memory_order_acquire) != 0;
  // A rank whose Python program ended made fewer calls; a process gone without that (a signal,
  // os._exit) says nothing about its calls.
  const std::string why =
      exiting ? ": it made fewer collective calls than this rank. Every rank of a group must "
                "make the same collective calls in the same order"
              : ": its process ended without its Python program exiting (killed by a signal, "
                "or os._exit)";
  return Fail(t, Status::Error("rank " + std::to_string(world_ranks_[r]) + " " + Gone(r) +
                               " while this rank waited for it in collective #" +
                               std::to_string(t) + " of the group " +
                               RankList(world_ranks_) + why));
}

Status ShmGroup::TimedOut(uint64_t t, const std::vector<int>& missing) {
  broken_ = true;
  broken_reason_ = "the shared-memory group of ranks " + RankList(world_ranks_) +
                   " is unusable: an earlier collective timed out";
  return Fail(t, Status::Error(
                     "timed out after " + std::to_string(static_cast<int>(timeout_s_)) +
                     " s waiting for ranks " + RankList(missing) + " of the group " +
                     RankList(world_ranks_) + " (collective #" + std::to_string(t) +
                     "): they never made the matching call. Every rank of a group must "
                     "make the same collective calls in the same order; raise "
                     "SPMD_TIMEOUT if they are just slow"));
}

Status ShmGroup::Deadlocked(uint64_t t) {
  broken_ = true;
  broken_reason_ = "the shared-memory group of ranks " + RankList(world_ranks_) +
                   " is unusable: an earlier collective of it was part of a deadlock";
  return Fail(t, Status::Error(deadlock_));
}

Status ShmGroup::Decide(uint64_t t) {
  std::atomic<uint64_t>& word = ctrl(0)->verdict;
  uint64_t v = word.load(std::memory_order_seq_cst);
  while ((v >> kVerdictShift) < t) {
    if (word.compare_exchange_weak(v, t << kVerdictShift, std::memory_order_seq_cst)) {
      return Status::Ok();
    }
  }
  if ((v >> kVerdictShift) == t && (v & kFailedBit) != 0) return FailedByPeer(t, v);
  return Status::Ok();
}

Status ShmGroup::Fail(uint64_t t, const Status& error) {
  std::strncpy(ctrl(rank_)->failure, error.message().c_str(), sizeof(Ctrl::failure) - 1);
  ctrl(rank_)->failure[sizeof(Ctrl::failure) - 1] = 0;
  std::atomic<uint64_t>& word = ctrl(0)->verdict;
  uint64_t v = word.load(std::memory_order_seq_cst);
  const uint64_t failed = (t << kVerdictShift) | kFailedBit | static_cast<uint64_t>(rank_);
  while ((v >> kVerdictShift) < t) {
    if (word.compare_exchange_weak(v, failed, std::memory_order_seq_cst)) return error;
  }
  if ((v >> kVerdictShift) == t && (v & kFailedBit) == 0) {
    broken_ = false;  // every peer arrived after all, and one completed the sync: so does this
    broken_reason_.clear();
    return Status::Ok();
  }
  return error;  // a peer failed it first: this rank's own reason is as true
}

Status ShmGroup::FailedByPeer(uint64_t t, uint64_t verdict) {
  const int r = static_cast<int>(verdict & (kFailedBit - 1));
  broken_ = true;
  broken_reason_ = "the shared-memory group of ranks " + RankList(world_ranks_) +
                   " is unusable: rank " + std::to_string(world_ranks_[r]) +
                   " failed an earlier collective";
  return Status::Error("collective #" + std::to_string(t) + " of the group " +
                       RankList(world_ranks_) + " failed on rank " +
                       std::to_string(world_ranks_[r]) + " before this rank could complete it" +
                       " (so no rank completes it): " + ctrl(r)->failure +
                       ". The group is unusable from now on");
}

Status ShmGroup::Sync() {
  if (broken_) return Status::Error(broken_reason_);
#if defined(__x86_64__)
  _mm_sfence();  // streamed (non-temporal) stores of the phase are visible before we arrive
#endif
  uint64_t t = ++epoch_;
  ctrl(rank_)->arrive.store(t, std::memory_order_seq_cst);
  // One deadline for the whole barrier (set once the wait gets long), not one per peer.
  std::chrono::steady_clock::time_point deadline{};
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const Wait w = WaitFor(r, ctrl(r)->arrive, t, t, &deadline);
    if (w == Wait::kArrived) continue;
    if (w == Wait::kFailed) return FailedByPeer(t, ctrl(0)->verdict.load());
    if (w == Wait::kGone) return PeerGone(t, r);
    if (w == Wait::kDeadlock) return Deadlocked(t);
    std::vector<int> missing;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_ && ctrl(q)->arrive.load(std::memory_order_acquire) < t) {
        missing.push_back(world_ranks_[q]);
      }
    }
    return TimedOut(t, missing);
  }
  SPMD_RETURN_IF_ERROR(Decide(t));
  if (visible_.empty()) {  // every rank has published its pid by now
    visible_.assign(size_, 0);
    for (int r = 0; r < size_; ++r) {
      const int32_t pid = ctrl(r)->pid.load(std::memory_order_acquire);
      visible_[r] = pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
    }
  }
  return Status::Ok();
}

namespace {
// Calls from this size decide how they stage (ShmGroup::Staging); smaller ones stage cached.
constexpr size_t kProbeMin = size_t{1} << 20;
// Laps of the probe's token, and the hop time above which the ranks are taken not to share a
// cache: a hop well under it goes with fast cached staging, well over it with cached staging
// several times slower than streamed (measured in docs/performance.md, "Shared memory").
constexpr int kProbeLaps = 8;
constexpr double kFarHopNs = 100;
}  // namespace

Status ShmGroup::Place(const Signature& sig, size_t bytes, bool* first, bool always_far) {
  far_ = staging_ == Staging::kStreamed;
  // Oversubscribed ranks take turns on a core, where staged lines are still cached.
  if (bytes < kProbeMin || size_ == 1 || Oversubscribed()) {
    return Status::Ok();
  }
  if (always_far) {
    if (staging_ == Staging::kAuto) far_ = true;
    return Status::Ok();
  }
  SPMD_RETURN_IF_ERROR(Begin(sig));
  *first = false;
  // Every rank probes, whatever its staging: the ranks agree on what they wait for even where
  // SPMD_SHM_STAGING differs between them.
  bool far = false;
  double hop_ns = 0;
  SPMD_RETURN_IF_ERROR(Ring(&far, &hop_ns));
  if (staging_ == Staging::kAuto) far_ = far;
  return Status::Ok();
}

Status ShmGroup::Hop(const Signature& sig, double* hop_ns) {
  SPMD_RETURN_IF_ERROR(Begin(sig));
  bool far = false;
  return Ring(&far, hop_ns);
}

Status ShmGroup::RingWait(int r, uint64_t v, std::chrono::steady_clock::time_point* deadline) {
  // Between syncs: a failure here is one of the next sync, which this rank will not reach.
  const Wait w = WaitFor(r, ctrl(r)->token, v, epoch_ + 1, deadline);
  if (w == Wait::kFailed) return FailedByPeer(epoch_ + 1, ctrl(0)->verdict.load());
  if (w == Wait::kGone) return PeerGone(epoch_ + 1, r);
  if (w == Wait::kDeadlock) return Deadlocked(epoch_ + 1);
  if (w == Wait::kTimedOut) return TimedOut(epoch_ + 1, {world_ranks_[r]});
  return Status::Ok();
}

Status ShmGroup::Ring(bool* far, double* hop_ns) {
  // Rank 0 passes the token round the ranks kProbeLaps times, timing it, then publishes its
  // verdict in the low bit of one last token.
  *hop_ns = std::numeric_limits<double>::quiet_NaN();
  const uint64_t base = ++probes_ * 2 * (kProbeLaps + 2);
  const int prev = (rank_ + size_ - 1) % size_;
  std::chrono::steady_clock::time_point deadline{};
  auto lap = [&](int k) { return base + 2 * static_cast<uint64_t>(k); };
  if (rank_ == 0) {
    auto start = std::chrono::steady_clock::now();
    for (int k = 1; k <= kProbeLaps; ++k) {
      ctrl(0)->token.store(lap(k), std::memory_order_release);
      SPMD_RETURN_IF_ERROR(RingWait(prev, lap(k), &deadline));
    }
    std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    *hop_ns = took.count() / (kProbeLaps * size_);
    *far = *hop_ns > kFarHopNs;
    ctrl(0)->token.store(lap(kProbeLaps + 1) + (*far ? 1 : 0), std::memory_order_release);
    return Status::Ok();
  }
  for (int k = 1; k <= kProbeLaps; ++k) {
    SPMD_RETURN_IF_ERROR(RingWait(prev, lap(k), &deadline));
    ctrl(rank_)->token.store(lap(k), std::memory_order_release);
  }
  // Rank 0 cannot move the token on before this rank reaches the call's next sync.
  SPMD_RETURN_IF_ERROR(RingWait(0, lap(kProbeLaps + 1), &deadline));
  *far = (ctrl(0)->token.load(std::memory_order_acquire) & 1) != 0;
  return Status::Ok();
}

Status ShmGroup::Mismatch(const Signature& sig) {
  // Every rank saw the same signatures, so every rank is here: exchange the descriptions.
  std::string mine = sig.Describe();
  std::strncpy(ctrl(rank_)->desc, mine.c_str(), sizeof(Ctrl::desc) - 1);
  ctrl(rank_)->desc[sizeof(Ctrl::desc) - 1] = 0;
  SPMD_RETURN_IF_ERROR(Sync());
  std::vector<std::string> descs;
  for (int r = 0; r < size_; ++r) descs.emplace_back(ctrl(r)->desc);
  std::string msg = MismatchMessage(world_ranks_, descs);
  SPMD_RETURN_IF_ERROR(Sync());  // nobody rewrites a description before all have read them
  return Status::Error(msg);
}

Status ShmGroup::Begin(const Signature& sig) {
  ctrl(rank_)->calls.store(++calls_, std::memory_order_relaxed);
  current_ = &sig;
  uint64_t t = next();
  ctrl(rank_)->sig[t & 1] = sig.hash;
  SPMD_RETURN_IF_ERROR(Sync());
  for (int r = 0; r < size_; ++r) {
    if (ctrl(r)->sig[t & 1] != sig.hash) return Mismatch(sig);
  }
  return Status::Ok();
}

Status ShmGroup::Barrier(const Signature& sig) { return Begin(sig); }

}  // namespace spmd
