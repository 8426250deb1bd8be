// Shared-memory collectives; see shm.h for the protocol.
#include "shm.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>

#include "messages.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPMD_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define SPMD_PAUSE() asm volatile("yield")
#else
#define SPMD_PAUSE() ((void)0)
#endif

namespace spmd {
namespace {

constexpr size_t kAlign = 64;
size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Results larger than the last-level cache go to memory anyway: writing them with
// non-temporal stores skips the read-for-ownership of every destination line, a third of the
// memory traffic of a copy. Smaller results are written normally so they stay cached for the
// op that reads them next.
constexpr size_t kStreamMin = size_t{16} << 20;

// Where StreamCopy also stores what it copies: nowhere, normally (cached), or non-temporally.
enum Also { kNoAlso, kCachedAlso, kStreamedAlso };

// Copies `len` bytes from src to dst with non-temporal stores; with kAlso, the same pass stores
// them to `also` too, so that a rank staging its own block of an allgather or a broadcast and
// copying it to its output reads its input once. (64 MiB allgather on 2 cores, staging copy and
// output copy fused against one after the other: 0.83-0.90x the time in a C model of the loop,
// 0.77-0.95x in spmd.)
template <Also kAlso>
void StreamCopy(char* dst, const char* src, size_t len, char* also) {
#if defined(__x86_64__)
  // Head: up to dst's 16-byte boundary (the other destination takes the same bytes normally).
  size_t head = std::min(len, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  if (kAlso != kNoAlso) std::memcpy(also, src, head);
  dst += head;
  src += head;
  also += kAlso != kNoAlso ? head : 0;
  len -= head;
  // kStreamedAlso: the caller ensures that `also` is as far from a 16-byte boundary as dst.
  size_t body = len / 64 * 64;
  for (size_t i = 0; i < body; i += 64) {
    __m128i v[4];
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16 * k));
    }
    for (int k = 0; k < 4; ++k) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16 * k), v[k]);
    }
    for (int k = 0; k < 4 && kAlso == kCachedAlso; ++k) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(also + i + 16 * k), v[k]);
    }
    for (int k = 0; k < 4 && kAlso == kStreamedAlso; ++k) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(also + i + 16 * k), v[k]);
    }
  }
  std::memcpy(dst + body, src + body, len - body);
  if (kAlso != kNoAlso) std::memcpy(also + body, src + body, len - body);
#else
  std::memcpy(dst, src, len);
  if (kAlso != kNoAlso) std::memcpy(also, src, len);
#endif
}

// A streamed two-shot allreduce (Exact::ReduceStep) reduces into blocks of this size, which
// stay in L1 on their way to the result slot and the output.
constexpr size_t kReduceBlock = size_t{8} << 10;

// Staged copies (broadcast, allgather) move in pieces: while the other ranks copy piece k out
// of the slots, the ranks staging fill piece k+1. From kPipelineMin bytes a call is cut into
// about kPipelineSteps pieces of at most kPieceMax bytes, so that the root of a broadcast and
// the ranks it feeds are not one whole copy after the other, and a piece stays in the cache
// between its staging and its copies out. Below kPipelineMin a call is one step: a sync per
// piece would cost more than it overlaps. (2 ranks on 2 cores, against one step per 1 MiB
// chunk: broadcast of 1-4 MiB 0.74-0.80x the time, of 16 and 64 MiB 0.80x and 0.90x; allgather
// of 2-4 MiB 0.48-0.76x, of 16 and 64 MiB 0.95x; 256 KiB in 8 pieces took 1.1x.)
constexpr size_t kPipelineMin = size_t{512} << 10;
constexpr size_t kPipelineSteps = 8;
constexpr size_t kPieceMax = size_t{512} << 10;

size_t Piece(size_t bytes, size_t chunk) {
  if (bytes < kPipelineMin) return chunk;
  return std::min({chunk, kPieceMax, RoundUp(bytes / kPipelineSteps, kAlign)});
}

// Where each rank's block starts in the concatenation of blocks of ``bytes`` (one more entry:
// the total), and the largest block.
std::vector<size_t> Offsets(const std::vector<size_t>& bytes, size_t* most) {
  std::vector<size_t> off(bytes.size() + 1, 0);
  for (size_t r = 0; r < bytes.size(); ++r) {
    off[r + 1] = off[r] + bytes[r];
    *most = std::max(*most, bytes[r]);
  }
  return off;
}

// Copies into a collective's output: streaming when the output is large (see kStreamMin).
// The destructor fences, so the streamed stores are ordered before whatever follows the op.
class OutCopy {
 public:
  explicit OutCopy(size_t out_bytes) : stream_(out_bytes >= kStreamMin) {}
  ~OutCopy() {
#if defined(__x86_64__)
    if (stream_) _mm_sfence();
#endif
  }
  void operator()(void* dst, const void* src, size_t len) const {
    if (stream_) {
      StreamCopy<kNoAlso>(static_cast<char*>(dst), static_cast<const char*>(src), len, nullptr);
    } else {
      std::memcpy(dst, src, len);
    }
  }
  // Copies `len` bytes of what this rank publishes both into its slot (`far`: streamed, see
  // ShmGroup::Staging) and into the output.
  void Publish(char* slot, char* dst, const char* src, size_t len, bool far) const {
    if (stream_) {
      if (far && (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(slot)) % 16) {
        StreamCopy<kNoAlso>(slot, src, len, nullptr);  // 16-byte stores cannot align on both
        StreamCopy<kNoAlso>(dst, src, len, nullptr);
      } else if (far) {
        StreamCopy<kStreamedAlso>(dst, src, len, slot);
      } else {
        StreamCopy<kCachedAlso>(dst, src, len, slot);
      }
    } else if (far) {
      StreamCopy<kNoAlso>(slot, src, len, nullptr);
      std::memcpy(dst, src, len);
    } else {
      std::memcpy(slot, src, len);
      std::memcpy(dst, slot, len);
    }
  }

 private:
  bool stream_;
};

}  // namespace

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
  *out = g;
  return Status::Ok();
}

ShmGroup::~ShmGroup() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

bool ShmGroup::Oversubscribed() const {
  static const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(size_) > cores;
}

bool ShmGroup::WaitFor(const std::atomic<uint64_t>& a, uint64_t v,
                       std::chrono::steady_clock::time_point* deadline) const {
  // Oversubscribed (more ranks than cores): yield early so that the ranks we wait for can run.
  const int spin_limit = Oversubscribed() ? 16 : 4096;
  int spins = 0;
  while (a.load(std::memory_order_acquire) < v) {
    if (++spins < spin_limit) {
      SPMD_PAUSE();
      continue;
    }
    sched_yield();
    if ((spins & 1023) != 0) continue;
    auto now = std::chrono::steady_clock::now();
    if (*deadline == std::chrono::steady_clock::time_point{}) {
      *deadline = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s_));
    } else if (now > *deadline) {
      return false;
    }
  }
  return true;
}

Status ShmGroup::TimedOut(uint64_t t, const std::vector<int>& missing) {
  broken_ = true;
  broken_reason_ = "the shared-memory group of ranks " + RankList(world_ranks_) +
                   " is unusable: an earlier collective timed out";
  return Status::Error("timed out after " + std::to_string(static_cast<int>(timeout_s_)) +
                       " s waiting for ranks " + RankList(missing) + " of the group " +
                       RankList(world_ranks_) + " (collective #" + std::to_string(t) +
                       "): they never made the matching call. Every rank of a group must "
                       "make the same collective calls in the same order; raise "
                       "SPMD_TIMEOUT if they are just slow");
}

Status ShmGroup::Sync() {
  if (broken_) return Status::Error(broken_reason_);
#if defined(__x86_64__)
  _mm_sfence();  // streamed (non-temporal) stores of the phase are visible before we arrive
#endif
  uint64_t t = ++epoch_;
  ctrl(rank_)->arrive.store(t, std::memory_order_release);
  // One deadline for the whole barrier (set once the wait gets long), not one per peer.
  std::chrono::steady_clock::time_point deadline{};
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || WaitFor(ctrl(r)->arrive, t, &deadline)) continue;
    std::vector<int> missing;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_ && ctrl(q)->arrive.load(std::memory_order_acquire) < t) {
        missing.push_back(world_ranks_[q]);
      }
    }
    return TimedOut(t, missing);
  }
  return Status::Ok();
}

namespace {
// Calls from this size decide how they stage (ShmGroup::Staging); smaller ones stage cached.
constexpr size_t kProbeMin = size_t{1} << 20;
// Laps of the probe's token, and the hop time above which the ranks are taken not to share a
// cache. (2 vCPUs of a VM whose host moves them, in a C model: a hop took 35-45 ns when staged
// copies ran at 12-15 GB/s, about 200 ns when they ran at 1.7-3.4 GB/s; streamed staging ran at
// 10-12 GB/s either way. This probe, polling included, reads 50-65 ns in the first state.)
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
      if (!WaitFor(ctrl(prev)->token, lap(k), &deadline)) {
        return TimedOut(epoch_, {world_ranks_[prev]});
      }
    }
    std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    *hop_ns = took.count() / (kProbeLaps * size_);
    *far = *hop_ns > kFarHopNs;
    ctrl(0)->token.store(lap(kProbeLaps + 1) + (*far ? 1 : 0), std::memory_order_release);
    return Status::Ok();
  }
  for (int k = 1; k <= kProbeLaps; ++k) {
    if (!WaitFor(ctrl(prev)->token, lap(k), &deadline)) {
      return TimedOut(epoch_, {world_ranks_[prev]});
    }
    ctrl(rank_)->token.store(lap(k), std::memory_order_release);
  }
  // Rank 0 cannot move the token on before this rank reaches the call's next sync.
  if (!WaitFor(ctrl(0)->token, lap(kProbeLaps + 1), &deadline)) {
    return TimedOut(epoch_, {world_ranks_[0]});
  }
  *far = (ctrl(0)->token.load(std::memory_order_acquire) & 1) != 0;
  return Status::Ok();
}

void ShmGroup::Stage(char* slot, const char* src, size_t len) const {
  if (far_) {
    StreamCopy<kNoAlso>(slot, src, len, nullptr);
  } else {
    std::memcpy(slot, src, len);
  }
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
  uint64_t t = next();
  ctrl(rank_)->sig[t & 1] = sig.hash;
  SPMD_RETURN_IF_ERROR(Sync());
  for (int r = 0; r < size_; ++r) {
    if (ctrl(r)->sig[t & 1] != sig.hash) return Mismatch(sig);
  }
  return Status::Ok();
}

Status ShmGroup::Barrier(const Signature& sig) { return Begin(sig); }

namespace {

// The leaves of a fused allreduce laid end to end in a "virtual" byte space of what travels
// (wire bytes), each starting on a 64-byte boundary so that any split at a multiple of 64 falls
// between elements.
struct Virtual {
  std::vector<size_t> start, bytes;
  size_t total = 0;
  explicit Virtual(std::vector<size_t> wire_bytes) : bytes(std::move(wire_bytes)) {
    for (size_t b : bytes) {
      start.push_back(total);
      total += RoundUp(b, kAlign);
    }
  }
  // Calls fn(leaf index, wire offset in leaf, length) for the parts of [lo, hi) that hold data.
  template <typename F>
  void Pieces(size_t lo, size_t hi, F&& fn) const {
    for (size_t i = 0; i < bytes.size(); ++i) {
      size_t a = std::max(lo, start[i]);
      size_t b = std::min(hi, start[i] + bytes[i]);
      if (a < b) fn(i, a - start[i], b - a);
    }
  }
};

// What an allreduce sends is what it reads: leaves travel as they are.
struct Exact {
  ReduceOp op;
  size_t WireBytes(const Leaf& l) const { return l.bytes; }
  void Stage(char* dst, const Leaf& in, size_t off, size_t len, bool far) const {
    if (far) {
      StreamCopy<kNoAlso>(dst, in.data + off, len, nullptr);
    } else {
      std::memcpy(dst, in.data + off, len);
    }
  }
  void Reduce(const Leaf& in, void* dst, const void* const* src, int n, size_t len) const {
    spmd::Reduce(in.dtype, op, dst, src, n, len / in.elem);
  }
  // Two-shot: this rank's sub-chunk, from its input and the others' staged copies (src[me] is
  // set here), into `res` for the others and into the output. Streamed (`far`): reduced block
  // by block into L1 and published from there (src is advanced).
  void ReduceStep(const OutCopy& put, const Leaf& in, const Leaf& out, size_t off, size_t len,
                  const void** src, int n, int me, char* res, bool far) const {
    src[me] = in.data + off;
    if (!far) {
      Reduce(in, res, src, n, len);
      put(out.data + off, res, len);
      return;
    }
    alignas(64) char block[kReduceBlock];
    for (size_t q = 0; q < len; q += kReduceBlock) {
      size_t b = std::min(kReduceBlock, len - q);
      Reduce(in, block, src, n, b);
      put.Publish(res + q, out.data + off + q, block, b, true);
      for (int r = 0; r < n; ++r) src[r] = static_cast<const char*>(src[r]) + b;
    }
  }
  // The reduced wire bytes at `src` into the output.
  void Out(const OutCopy& put, const Leaf& out, size_t off, const char* src, size_t len) const {
    put(out.data + off, src, len);
  }
  // One-shot: reduce straight into the output.
  void ReduceOut(const Leaf& in, const Leaf& out, size_t off, const void* const* src, int n,
                 size_t len) const {
    Reduce(in, out.data + off, src, n, len);
  }
};

// Compressed: float32 leaves travel as float16/bfloat16 (2 wire bytes per element), divided by
// `div` before they are rounded; the sum accumulates in float32 and is rounded once (reduce.h),
// then widened into the output. The conversions happen in the copies the algorithm makes anyway.
struct Narrowed {
  bool bf16;
  float div;
  std::vector<uint16_t>* scratch;  // one-shot sums
  size_t WireBytes(const Leaf& l) const { return l.bytes / 2; }
  void Stage(char* dst, const Leaf& in, size_t off, size_t len, bool) const {
    NarrowFloats(bf16, reinterpret_cast<const float*>(in.data) + off / 2, div,
                 reinterpret_cast<uint16_t*>(dst), len / 2);
  }
  void Reduce(const Leaf&, void* dst, const void* const* src, int n, size_t len) const {
    ReduceHalf(bf16, ReduceOp::kSum, static_cast<uint16_t*>(dst), src, n, len / 2);
  }
  // One pass: the own values rounded on the fly (reduce.h, ReduceNarrowed).
  void ReduceStep(const OutCopy&, const Leaf& in, const Leaf& out, size_t off, size_t len,
                  const void** src, int n, int me, char* res, bool) const {
    ReduceNarrowed(bf16, div, me, reinterpret_cast<const float*>(in.data) + off / 2, src, n,
                   reinterpret_cast<uint16_t*>(res), reinterpret_cast<float*>(out.data) + off / 2,
                   len / 2);
  }
  void Out(const OutCopy&, const Leaf& out, size_t off, const char* src, size_t len) const {
    WidenHalves(bf16, reinterpret_cast<const uint16_t*>(src),
                 reinterpret_cast<float*>(out.data) + off / 2, len / 2);
  }
  void ReduceOut(const Leaf& in, const Leaf& out, size_t off, const void* const* src, int n,
                 size_t len) const {
    if (scratch->size() < len / 2) scratch->resize(len / 2);
    Reduce(in, scratch->data(), src, n, len);
    Out(OutCopy(0), out, off, reinterpret_cast<const char*>(scratch->data()), len);
  }
};

thread_local std::vector<uint16_t> narrowed_scratch;

}  // namespace

template <typename Codec>
Status ShmGroup::AllreduceWith(const Codec& codec, const Signature& sig,
                               const std::vector<Leaf>& in, const std::vector<Leaf>& out,
                               size_t one_shot_max) {
  const int n = size_, me = rank_;
  std::vector<size_t> wire;
  for (const Leaf& l : in) wire.push_back(codec.WireBytes(l));
  Virtual v(std::move(wire));
  std::vector<const void*> src(n);
  if (v.total <= std::min(one_shot_max, chunk_)) {
    // One-shot: everyone publishes everything, everyone reduces everything in rank order.
    uint64_t t = next();
    v.Pieces(0, v.total, [&](size_t i, size_t off, size_t len) {
      codec.Stage(slot(me, t) + v.start[i] + off, in[i], off, len, false);
    });
    SPMD_RETURN_IF_ERROR(Begin(sig));
    v.Pieces(0, v.total, [&](size_t i, size_t off, size_t len) {
      for (int r = 0; r < n; ++r) src[r] = slot(r, t) + v.start[i] + off;
      codec.ReduceOut(in[i], out[i], off, src.data(), n, len);
    });
    return Status::Ok();
  }
  // Two-shot: step by step, rank j reduces sub-chunk j of the step from every rank's staged
  // copy (its own straight from its input) and publishes it; the others copy it out.
  const OutCopy put(v.total);
  const size_t cb = chunk_ / n / kAlign * kAlign;
  const size_t step = cb * n;
  bool first = true;
  SPMD_RETURN_IF_ERROR(Place(sig, v.total, &first));
  size_t prev_lo = 0;
  uint64_t prev_t = 0;
  auto copy_out = [&](size_t lo, uint64_t tr) {
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      size_t a = lo + j * cb;
      v.Pieces(a, std::min(a + cb, v.total), [&](size_t i, size_t off, size_t len) {
        codec.Out(put, out[i], off, res(j, tr) + (v.start[i] + off - lo), len);
      });
    }
  };
  for (size_t lo = 0; lo < v.total; lo += step) {
    uint64_t t = next();
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      size_t a = lo + j * cb;
      v.Pieces(a, std::min(a + cb, v.total), [&](size_t i, size_t off, size_t len) {
        codec.Stage(slot(me, t) + (v.start[i] + off - lo), in[i], off, len, far_);
      });
    }
    if (!first) copy_out(prev_lo, prev_t);
    SPMD_RETURN_IF_ERROR(Step(sig, &first));
    uint64_t tr = next();
    size_t a = lo + me * cb;
    v.Pieces(a, std::min(a + cb, v.total), [&](size_t i, size_t off, size_t len) {
      size_t so = v.start[i] + off - lo;
      for (int r = 0; r < n; ++r) src[r] = slot(r, t) + so;  // src[me]: ReduceStep sets it
      codec.ReduceStep(put, in[i], out[i], off, len, src.data(), n, me, res(me, tr) + so, far_);
    });
    SPMD_RETURN_IF_ERROR(Sync());
    prev_lo = lo;
    prev_t = tr;
  }
  if (first) return Begin(sig);
  copy_out(prev_lo, prev_t);
  return Status::Ok();
}

Status ShmGroup::Allreduce(const Signature& sig, ReduceOp op, const std::vector<Leaf>& in,
                           const std::vector<Leaf>& out, size_t one_shot_max) {
  return AllreduceWith(Exact{op}, sig, in, out, one_shot_max);
}

Status ShmGroup::AllreduceNarrowed(const Signature& sig, bool bf16, float div,
                                   const std::vector<Leaf>& in, const std::vector<Leaf>& out,
                                   size_t one_shot_max) {
  return AllreduceWith(Narrowed{bf16, div, &narrowed_scratch}, sig, in, out, one_shot_max);
}

Status ShmGroup::Allgatherv(const Signature& sig, const Leaf& in, const Leaf& out,
                            const std::vector<size_t>& bytes) {
  const int n = size_, me = rank_;
  size_t most = 0;
  const std::vector<size_t> off = Offsets(bytes, &most);
  // Our own block goes to the output in the pass that stages it (OutCopy::Stage), so the input
  // is read from memory once.
  const OutCopy put(off[n]);
  const bool own = out.data + off[me] != in.data;
  const size_t piece = Piece(most, chunk_);
  bool first = true;
  SPMD_RETURN_IF_ERROR(Place(sig, off[n], &first));
  for (size_t lo = 0; first || lo < most; lo += piece) {
    uint64_t t = next();
    if (lo < bytes[me]) {
      size_t len = std::min(piece, bytes[me] - lo);
      if (own) {
        put.Publish(slot(me, t), out.data + off[me] + lo, in.data + lo, len, far_);
      } else {
        Stage(slot(me, t), in.data + lo, len);
      }
    }
    SPMD_RETURN_IF_ERROR(Step(sig, &first));
    for (int r = 0; r < n; ++r) {
      if (r == me || lo >= bytes[r]) continue;
      put(out.data + off[r] + lo, slot(r, t), std::min(piece, bytes[r] - lo));
    }
  }
  return Status::Ok();
}

Status ShmGroup::ReduceScatterv(const Signature& sig, ReduceOp op, const Leaf& in,
                                const Leaf& out, const std::vector<size_t>& bytes) {
  const int n = size_, me = rank_;
  size_t most = 0;
  const std::vector<size_t> off = Offsets(bytes, &most);
  const size_t cb = chunk_ / n / kAlign * kAlign;
  std::vector<const void*> src(n);
  bool first = true;
  SPMD_RETURN_IF_ERROR(Place(sig, off[n], &first));
  for (size_t lo = 0; first || lo < most; lo += cb) {
    uint64_t t = next();
    for (int j = 0; j < n; ++j) {
      if (j == me || lo >= bytes[j]) continue;
      Stage(slot(me, t) + j * cb, in.data + off[j] + lo, std::min(cb, bytes[j] - lo));
    }
    SPMD_RETURN_IF_ERROR(Step(sig, &first));
    if (lo < bytes[me]) {
      size_t len = std::min(cb, bytes[me] - lo);
      for (int r = 0; r < n; ++r) {
        src[r] = r == me ? in.data + off[me] + lo : slot(r, t) + me * cb;
      }
      // Normal stores: reducing into L1 blocks streamed out took 1.1-1.4x the time at 64 MiB.
      Reduce(in.dtype, op, out.data + lo, src.data(), n, len / in.elem);
    }
  }
  return Status::Ok();
}

Status ShmGroup::Broadcast(const Signature& sig, int root, const Leaf& in, const Leaf& out) {
  const int me = rank_;
  const OutCopy put(in.bytes);
  const bool own = me == root && out.data != in.data;
  const size_t piece = Piece(in.bytes, chunk_);
  bool first = true;
  // Streamed under auto without a probe: 2 ranks on 2 cores, 4-64 MiB, took 0.6-0.7x the time
  // of cached staging in every placement seen (the readers pull the root's modified lines).
  SPMD_RETURN_IF_ERROR(Place(sig, in.bytes, &first, /*always_far=*/true));
  for (size_t lo = 0; first || lo < in.bytes; lo += piece) {
    uint64_t t = next();
    size_t len = std::min(piece, in.bytes - lo);
    if (me == root && len) {
      if (own) {
        put.Publish(slot(me, t), out.data + lo, in.data + lo, len, far_);
      } else {
        Stage(slot(me, t), in.data + lo, len);
      }
    }
    SPMD_RETURN_IF_ERROR(Step(sig, &first));
    if (me != root && len) put(out.data + lo, slot(root, t), len);
  }
  return Status::Ok();
}

Status ShmGroup::AllToAll(const Signature& sig, const Leaf& in, const Leaf& out, size_t block) {
  const int n = size_, me = rank_;
  const size_t cb = chunk_ / n / kAlign * kAlign;
  const OutCopy put(block * n);
  put(out.data + me * block, in.data + me * block, block);
  bool first = true;
  SPMD_RETURN_IF_ERROR(Place(sig, block * n, &first));
  for (size_t lo = 0; first || lo < block; lo += cb) {
    uint64_t t = next();
    size_t len = lo < block ? std::min(cb, block - lo) : 0;
    for (int j = 0; j < n; ++j) {
      if (j != me && len) Stage(slot(me, t) + j * cb, in.data + j * block + lo, len);
    }
    SPMD_RETURN_IF_ERROR(Step(sig, &first));
    for (int j = 0; j < n; ++j) {
      if (j != me && len) put(out.data + j * block + lo, slot(j, t) + me * cb, len);
    }
  }
  return Status::Ok();
}

}  // namespace spmd
