// The flight recorder; see recorder.h.
#include "recorder.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace spmd {
namespace {

// Opening and snapshots take the mutex; recording does not: each call owns its slot (the ring
// would have to wrap around while it runs to be written by another), and its number comes from
// an atomic add on the header's count.
std::mutex g_mu;
std::atomic<RecorderHeader*> g_head{nullptr};  // followed by the records
size_t g_bytes = 0;
bool g_mapped = false;  // a file mapping (else new[])

Record* Slots(RecorderHeader* head) { return reinterpret_cast<Record*>(head + 1); }

int64_t NowNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// Only between collectives (at spmd.init): a call recording meanwhile would write freed memory.
void Release() {
  RecorderHeader* head = g_head.exchange(nullptr);
  if (head == nullptr) return;
  if (g_mapped) {
    munmap(head, g_bytes);
  } else {
    delete[] reinterpret_cast<char*>(head);
  }
  g_bytes = 0;
}

}  // namespace

Status RecorderOpen(const std::string& path, size_t capacity) {
  std::lock_guard<std::mutex> lock(g_mu);
  Release();
  if (capacity == 0) return Status::Ok();
  const size_t bytes = sizeof(RecorderHeader) + capacity * sizeof(Record);
  void* mem = nullptr;
  if (!path.empty()) {
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return Status::Error("cannot create " + path + ": " + std::strerror(errno));
    const bool sized = ftruncate(fd, static_cast<off_t>(bytes)) == 0;
    mem = sized ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    const int err = errno;
    close(fd);
    if (mem == MAP_FAILED) {
      return Status::Error("cannot map " + path + ": " + std::strerror(err));
    }
    g_mapped = true;
  } else {
    mem = new char[bytes]();
    g_mapped = false;
  }
  auto* head = static_cast<RecorderHeader*>(mem);
  std::memset(head, 0, sizeof(RecorderHeader));
  head->capacity = capacity;
  head->magic = kRecorderMagic;
  g_bytes = bytes;
  g_head.store(head);
  return Status::Ok();
}

size_t RecorderBegin(int64_t group, uint64_t call, uint64_t hash, uint64_t bytes, int32_t code,
                     int8_t transport) {
  RecorderHeader* head = g_head.load(std::memory_order_acquire);
  if (head == nullptr) return SIZE_MAX;
  const uint64_t seq = __atomic_add_fetch(&head->count, 1, __ATOMIC_RELAXED);
  const size_t slot = (seq - 1) % head->capacity;
  Slots(head)[slot] = Record{seq, group, call, hash, NowNs(), 0, bytes, code, kRunning,
                             transport, 0};
  return slot;
}

void RecorderEnd(size_t slot, bool failed) { RecorderEndIn(slot, failed ? kFailed : kDone); }

void RecorderEndIn(size_t slot, int8_t state) {
  if (slot == SIZE_MAX) return;
  RecorderHeader* head = g_head.load(std::memory_order_acquire);
  if (head == nullptr || slot >= head->capacity) return;
  Record& r = Slots(head)[slot];
  r.end_ns = NowNs();
  r.state = state;
}

void RecorderSetTimes(size_t slot, int64_t group, uint64_t call, int64_t start_ns,
                      int64_t end_ns) {
  RecorderHeader* head = g_head.load(std::memory_order_acquire);
  if (head == nullptr || slot >= head->capacity) return;
  Record& r = Slots(head)[slot];
  if (r.group != group || r.call != call || r.transport != kRecordGpu) return;  // overwritten
  r.start_ns = start_ns;
  r.end_ns = end_ns;
  r.state = kDone;
}

std::string RecorderSnapshot() {
  std::lock_guard<std::mutex> lock(g_mu);
  RecorderHeader* head = g_head.load();
  if (head == nullptr) return std::string();
  return std::string(reinterpret_cast<const char*>(head), g_bytes);
}

}  // namespace spmd
