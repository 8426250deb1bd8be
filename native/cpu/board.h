// The wait board: how the ranks of a job on one machine learn, within about a second, that
// every one of them waits inside spmd for something no other rank will ever do (a deadlock),
// instead of waiting for SPMD_TIMEOUT.
//
// A wait that lasts (kPublishAfter) publishes itself in this rank's slot of the world group's
// shared-memory segment: a key that the ranks of one matching wait share (the kind of wait, its
// group and its call number), the group's world ranks, and the wait written out. Once it has
// lasted kSettled, it looks at the board now and then (kCheckEvery): when every rank of the job
// has published a wait at least kSettled old, and no published wait has every member of its
// group waiting with its key (such a wait would complete), no rank can move again, and every
// rank fails naming what each rank waits for. A rank computing, saving a checkpoint or waiting
// outside spmd publishes nothing, so the board never calls that a deadlock; nor a wait whose
// peers cannot be listed (point-to-point, a group of more than ShmGroup::kBoardMembers ranks,
// two waits of one process at once), which is published as not judged.
//
// Where the world group has one segment (every rank on one machine) the board is that segment.
// A job spanning nodes has none; there the peer watch (spmd/runtime/_watch.py) plays its part:
// each process's wait is read over TCP (Mine), world rank 0 judges the job's waits (Judge) when
// it has waited kSettled itself, and a deadlock it finds is handed to every rank (Declare).
#ifndef SPMD_CPU_BOARD_H_
#define SPMD_CPU_BOARD_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace spmd {

class ShmGroup;

namespace board {

constexpr int64_t kPublishAfterNs = 20'000'000;  // 20 ms
constexpr int64_t kSettledNs = 500'000'000;      // 0.5 s
constexpr int64_t kCheckEveryNs = 100'000'000;   // 0.1 s

// The world group's segment becomes the board (Use); a segment being unmapped stops being it.
void Use(ShmGroup* world);
void Forget(const ShmGroup* group);

// The key of a wait of `kind` on the group of `members` (world ranks), its `n`-th of the kind.
uint64_t Key(std::string_view kind, const std::vector<int>& members, uint64_t n);

int64_t NowNs();  // steady clock, the same for every process of the machine

// One rank's wait as the board shows it: its key, its group's world ranks and the wait written
// out.
struct Seen {
  uint64_t key = 0;
  std::vector<int> members;
  std::string what;
};
// The deadlock's description if no wait of `seen` (indexed by world rank, every rank of the job
// waiting, each wait settled and judged) can complete, that is if none has every member of its
// group waiting with its key; "" otherwise.
std::string Judge(const std::vector<Seen>& seen, const std::vector<int>& world_ranks);

// This process's wait for the peer watch, one line: "0" (none published), or
// "1 <id> <age ns> <key> <count> <member,member,...> <what>" (`count` < 0: not judged; `id`
// changes with every wait).
std::string Mine();
// A deadlock the peer watch found that includes this process's waits: every wait started before
// now ends with `text`.
void Declare(const std::string& text);

// One wait of this process: published at its first Poll after kPublishAfterNs, withdrawn when
// it ends. `members` empty: not judged.
class Wait {
 public:
  Wait(uint64_t key, std::vector<int> members, std::string what);
  ~Wait();
  Wait(const Wait&) = delete;
  Wait& operator=(const Wait&) = delete;
  // From the wait's slow path (every millisecond or so): publishes it once it has lasted, and
  // returns the deadlock's description once there is one ("" otherwise).
  std::string Poll();

 private:
  uint64_t key_;
  std::vector<int> members_;
  std::string what_;
  int64_t start_ns_;
  int64_t next_check_ns_ = 0;
  bool published_ = false;
};

}  // namespace board
}  // namespace spmd

#endif  // SPMD_CPU_BOARD_H_
