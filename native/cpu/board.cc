// The wait board; see board.h. The slots are the world group's control blocks (shm.h, Ctrl).
#include "board.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>

#include "messages.h"
#include "shm.h"

namespace spmd {
namespace board {
namespace {

std::mutex mu;                  // guards everything here
ShmGroup* the_board = nullptr;  // the world group's segment, or null
int waits = 0;                  // this process's published waits
// The latest published wait (for Mine); `mine_count` < 0: not judged.
uint64_t mine_id = 0;
Seen mine;
int mine_count = -1;
int64_t mine_since_ns = 0;
// A deadlock the peer watch declared (Declare), and when this process was told.
std::string declared;
int64_t declared_ns = 0;

uint64_t Mix(uint64_t h, uint64_t v) {  // FNV-1a over the value's bytes
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string OneLine(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

}  // namespace

void Use(ShmGroup* world) {
  std::lock_guard<std::mutex> lock(mu);
  the_board = world;
}

void Forget(const ShmGroup* group) {
  std::lock_guard<std::mutex> lock(mu);
  if (the_board == group) the_board = nullptr;
}

uint64_t Key(std::string_view kind, const std::vector<int>& members, uint64_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : kind) h = Mix(h, static_cast<unsigned char>(c));
  h = Mix(h, members.size());
  for (int m : members) h = Mix(h, static_cast<uint64_t>(m));
  return Mix(h, n);
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Wait::Wait(uint64_t key, std::vector<int> members, std::string what)
    : key_(key), members_(std::move(members)), what_(std::move(what)), start_ns_(NowNs()) {}

Wait::~Wait() {
  if (!published_) return;
  std::lock_guard<std::mutex> lock(mu);
  if (--waits == 0 && the_board != nullptr) the_board->BoardWithdraw();
}

std::string Mine() {
  std::lock_guard<std::mutex> lock(mu);
  if (waits == 0) return "0";
  std::string members;
  for (int m : mine.members) members += (members.empty() ? "" : ",") + std::to_string(m);
  return "1 " + std::to_string(mine_id) + " " + std::to_string(NowNs() - mine_since_ns) + " " +
         std::to_string(mine.key) + " " + std::to_string(waits == 1 ? mine_count : -1) + " " +
         (members.empty() ? "-" : members) + " " + OneLine(mine.what);
}

void Declare(const std::string& text) {
  std::lock_guard<std::mutex> lock(mu);
  declared = text;
  declared_ns = NowNs();
}

std::string Judge(const std::vector<Seen>& seen, const std::vector<int>& world_ranks) {
  const int size = static_cast<int>(seen.size());
  for (int r = 0; r < size; ++r) {
    bool completes = true;  // every member of its group waits with its key
    for (int m : seen[r].members) {
      completes = completes && m >= 0 && m < size && seen[m].key == seen[r].key;
    }
    if (completes) return "";
  }
  std::string text = "deadlock: every rank of the job waits inside spmd, and no wait can "
                     "complete (each waits for a rank that waits for something else):";
  for (int r = 0; r < size; ++r) {
    text += (r == 0 ? " " : "; ") + std::string("rank ") + std::to_string(world_ranks[r]) +
            " waits in " + seen[r].what;
  }
  return text + ". Every rank of a group must make the same calls in the same order";
}

std::string Wait::Poll() {
  const int64_t now = NowNs();
  if (now - start_ns_ < kPublishAfterNs) return "";
  std::lock_guard<std::mutex> lock(mu);
  if (!published_) {
    published_ = true;
    // Two waits of one process at once (two threads): neither is judged, since one may end
    // and let the process move on.
    const bool alone = ++waits == 1;
    const int count = alone && !members_.empty() &&
                              members_.size() <= static_cast<size_t>(ShmGroup::kBoardMembers)
                          ? static_cast<int>(members_.size())
                          : -1;
    // The latest published wait, as the segment's slot shows it: once a second one is
    // published it stays not judged until the process publishes a wait alone again.
    ++mine_id;
    mine = Seen{key_, members_, what_};
    mine_count = count;
    mine_since_ns = start_ns_;
    if (the_board != nullptr) the_board->BoardPublish(key_, start_ns_, members_, count, what_);
    next_check_ns_ = start_ns_ + kSettledNs;
  }
  if (declared_ns != 0 && declared_ns >= start_ns_) return declared;  // the peer watch's
  if (the_board == nullptr) return "";
  // A deadlock declared while this wait was on includes it.
  std::string text;
  if (the_board->BoardDeclared(start_ns_, &text)) return text;
  if (now < next_check_ns_) return "";
  next_check_ns_ = now + kCheckEveryNs;
  text = the_board->BoardDeadlock(now, kSettledNs);
  if (!text.empty()) the_board->BoardDeclare(text, now);
  return text;
}

}  // namespace board

void ShmGroup::BoardDeclare(const std::string& text, int64_t now_ns) {
  Ctrl* c = ctrl(rank_);
  std::strncpy(c->board_verdict, text.c_str(), sizeof(c->board_verdict) - 1);
  c->board_verdict[sizeof(c->board_verdict) - 1] = 0;
  ctrl(0)->board_declarer.store(rank_, std::memory_order_relaxed);
  ctrl(0)->board_declared_ns.store(now_ns, std::memory_order_release);
}

bool ShmGroup::BoardDeclared(int64_t since_ns, std::string* text) const {
  const int64_t at = ctrl(0)->board_declared_ns.load(std::memory_order_acquire);
  if (at == 0 || at < since_ns) return false;
  const int r = ctrl(0)->board_declarer.load(std::memory_order_relaxed);
  if (r < 0 || r >= size_) return false;
  char copy[sizeof(Ctrl::board_verdict)];
  std::memcpy(copy, ctrl(r)->board_verdict, sizeof(copy));
  copy[sizeof(copy) - 1] = 0;
  *text = copy;
  return true;
}

void ShmGroup::BoardPublish(uint64_t key, int64_t since_ns, const std::vector<int>& members,
                            int count, const std::string& what) {
  Ctrl* c = ctrl(rank_);
  const uint64_t gen = c->board_gen.load(std::memory_order_relaxed);
  if (gen & 1) c->board_gen.store(gen + 1, std::memory_order_release);  // withdraw first
  c->board_since_ns.store(since_ns, std::memory_order_relaxed);
  c->board_key.store(key, std::memory_order_relaxed);
  c->board_count.store(count, std::memory_order_relaxed);
  for (int i = 0; i < count; ++i) c->board_member[i].store(members[i], std::memory_order_relaxed);
  std::strncpy(c->board_what, what.c_str(), sizeof(c->board_what) - 1);
  c->board_what[sizeof(c->board_what) - 1] = 0;
  c->board_gen.store((gen | 1) + (gen & 1 ? 2 : 0), std::memory_order_release);
}

void ShmGroup::BoardWithdraw() {
  Ctrl* c = ctrl(rank_);
  const uint64_t gen = c->board_gen.load(std::memory_order_relaxed);
  if (gen & 1) c->board_gen.store(gen + 1, std::memory_order_release);
}

std::string ShmGroup::BoardDeadlock(int64_t now_ns, int64_t settled_ns) const {
  std::vector<board::Seen> seen(size_);
  for (int r = 0; r < size_; ++r) {
    const Ctrl* c = ctrl(r);
    const uint64_t gen = c->board_gen.load(std::memory_order_acquire);
    if ((gen & 1) == 0) return "";  // rank r is not waiting inside spmd
    board::Seen& s = seen[r];
    const int64_t since_ns = c->board_since_ns.load(std::memory_order_relaxed);
    s.key = c->board_key.load(std::memory_order_relaxed);
    const int count = c->board_count.load(std::memory_order_relaxed);
    if (count < 0 || count > kBoardMembers) return "";  // not judged
    for (int i = 0; i < count; ++i) {
      s.members.push_back(c->board_member[i].load(std::memory_order_relaxed));
    }
    char what[sizeof(c->board_what)];
    std::memcpy(what, c->board_what, sizeof(what));
    what[sizeof(what) - 1] = 0;
    s.what = what;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (c->board_gen.load(std::memory_order_relaxed) != gen) return "";  // it moved on
    if (now_ns - since_ns < settled_ns) return "";
  }
  return board::Judge(seen, world_ranks_);
}

}  // namespace spmd
