// GPU times of recorded calls; see timing.h.
#include "timing.h"

#include <time.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <vector>

namespace spmd {
namespace {

struct Pending {
  size_t slot;
  int64_t group;
  uint64_t call;
  cudaEvent_t start, end;
};

constexpr size_t kMaxPending = 1 << 16;  // past this, calls keep their enqueueing times

std::atomic<const GpuHooks*> g_hooks{nullptr};
std::atomic<bool> g_on{false};
std::mutex g_mu;
std::deque<Pending> g_pending;
std::vector<cudaEvent_t> g_free;
// The clocks' meeting point: an event the host waited for, and CLOCK_MONOTONIC right after.
cudaEvent_t g_ref = nullptr;
int64_t g_ref_ns = 0;
bool g_ref_failed = false;

int64_t NowNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// Under g_mu.
cudaEvent_t Take() {
  if (!g_free.empty()) {
    cudaEvent_t e = g_free.back();
    g_free.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  return cudaEventCreate(&e) == cudaSuccess ? e : nullptr;
}

// Under g_mu: the reference event, at the first timed call, on a stream of its own that waits
// for no other work (so the host waits for nothing else, such as a kernel that waits for a
// peer); events of one device share one clock.
bool Anchor() {
  if (g_ref != nullptr || g_ref_failed) return g_ref != nullptr;
  cudaStream_t own = nullptr;
  cudaEvent_t ref = nullptr;
  const bool ok = cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking) == cudaSuccess &&
                  cudaEventCreate(&ref) == cudaSuccess &&
                  cudaEventRecord(ref, own) == cudaSuccess &&
                  cudaEventSynchronize(ref) == cudaSuccess;
  g_ref_ns = NowNs();
  if (own != nullptr) cudaStreamDestroy(own);
  if (!ok) {
    if (ref != nullptr) cudaEventDestroy(ref);
    g_ref_failed = true;
    return false;
  }
  g_ref = ref;
  return true;
}

// Under g_mu: the times of the oldest queued calls the GPU has passed.
void Drain() {
  const GpuHooks* hooks = g_hooks.load();
  while (!g_pending.empty()) {
    Pending& p = g_pending.front();
    const cudaError_t q = cudaEventQuery(p.end);
    if (q == cudaErrorNotReady) return;
    float start_ms = 0, end_ms = 0;
    if (q == cudaSuccess && hooks != nullptr && hooks->record_times != nullptr &&
        cudaEventElapsedTime(&start_ms, g_ref, p.start) == cudaSuccess &&
        cudaEventElapsedTime(&end_ms, g_ref, p.end) == cudaSuccess) {
      hooks->record_times(p.slot, p.group, p.call,
                          g_ref_ns + static_cast<int64_t>(static_cast<double>(start_ms) * 1e6),
                          g_ref_ns + static_cast<int64_t>(static_cast<double>(end_ms) * 1e6));
    }
    g_free.push_back(p.start);
    g_free.push_back(p.end);
    g_pending.pop_front();
  }
}

}  // namespace

void GpuTimingSet(const GpuHooks* hooks, bool on) {
  g_hooks.store(hooks);
  g_on.store(on);
}

bool GpuTimingOn() { return g_on.load(std::memory_order_relaxed); }

bool GpuTimed::Begin(cudaStream_t stream, size_t slot, int64_t group, uint64_t call) {
  if (!GpuTimingOn() || slot == SIZE_MAX) return false;
  std::lock_guard<std::mutex> lock(g_mu);
  Drain();
  if (g_pending.size() >= kMaxPending || !Anchor()) return false;
  start_ = Take();
  end_ = Take();
  if (start_ == nullptr || end_ == nullptr || cudaEventRecord(start_, stream) != cudaSuccess) {
    if (start_ != nullptr) g_free.push_back(start_);
    if (end_ != nullptr) g_free.push_back(end_);
    start_ = end_ = nullptr;
    return false;
  }
  stream_ = stream;
  slot_ = slot;
  group_ = group;
  call_ = call;
  return true;
}

void GpuTimed::End(bool keep) {
  if (start_ == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!keep || cudaEventRecord(end_, stream_) != cudaSuccess) {
    g_free.push_back(start_);
    g_free.push_back(end_);
  } else {
    g_pending.push_back({slot_, group_, call_, start_, end_});
  }
  start_ = end_ = nullptr;
}

void GpuTimingFlush(double wait_s) {
  const int64_t deadline = NowNs() + static_cast<int64_t>(wait_s * 1e9);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(g_mu);
      Drain();
      if (g_pending.empty() || NowNs() >= deadline) return;
    }
    const timespec pause{0, 1000000};  // 1 ms
    nanosleep(&pause, nullptr);
  }
}

}  // namespace spmd
