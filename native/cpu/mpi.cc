// MPI collectives through the library mpi4py loaded; see mpi.h.
#include "mpi.h"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <thread>
#include <type_traits>

#include "board.h"
#include "messages.h"
#include "spmd/call.h"

namespace spmd {
namespace {

using H = MpiHandle;
using Count = int64_t;  // MPI_Count
using Aint = intptr_t;  // MPI_Aint

struct Fns {
  int (*Iallreduce_c)(const void*, void*, Count, H, H, H, H*);
  int (*Iallgatherv_c)(const void*, Count, H, void*, const Count*, const Aint*, H, H, H*);
  int (*Ireduce_scatter_c)(const void*, void*, const Count*, H, H, H, H*);
  int (*Ibcast_c)(void*, Count, H, int, H, H*);
  int (*Ialltoall_c)(const void*, Count, H, void*, Count, H, H, H*);
  int (*Ialltoallv_c)(const void*, const Count*, const Aint*, H, void*, const Count*, const Aint*,
                      H, H, H*);
  int (*Isend_c)(const void*, Count, H, int, int, H, H*);
  int (*Irecv_c)(void*, Count, H, int, int, H, H*);
  // The classic calls (MPI-3, int counts and displacements), for libraries without the above.
  int (*Iallreduce)(const void*, void*, int, H, H, H, H*);
  int (*Iallgatherv)(const void*, int, H, void*, const int*, const int*, H, H, H*);
  int (*Ireduce_scatter)(const void*, void*, const int*, H, H, H, H*);
  int (*Ireduce)(const void*, void*, int, H, H, int, H, H*);
  int (*Ibcast)(void*, int, H, int, H, H*);
  int (*Ialltoall)(const void*, int, H, void*, int, H, H, H*);
  int (*Ialltoallv)(const void*, const int*, const int*, H, void*, const int*, const int*, H, H,
                    H*);
  int (*Isend)(const void*, int, H, int, int, H, H*);
  int (*Irecv)(void*, int, H, int, int, H, H*);
  int (*Ibarrier)(H, H*);
  int (*Test)(H*, int*, void*);
  int (*Cancel)(H*);
  int (*Request_free)(H*);
  int (*Error_string)(int, char*, int*);
};

Fns fns;
MpiConstants consts;
bool loaded = false;
// Chosen once at MpiLoad: the MPI-4 large-count calls, or the classic ones with at most
// `max_count` elements (or bytes) per call, larger calls split (see MpiLoad in mpi.h).
bool large_count = false;
size_t max_count = std::numeric_limits<int>::max();

// Open MPI's vectorised ops (op/avx, since 4.1) sum MPI_INT8_T and MPI_UINT8_T with saturating
// adds in blocks of 32 elements and wrapping ones elsewhere: 100 + 100 gave 127 or -56 by position
// in 4.1.4 and 5.0.11 (open-mpi/ompi#8045, closed as won't fix). There 8-bit sums travel as int32,
// whose sum wraps to the same bits as spmd's other paths.
bool widen_byte_sums = false;

// Whether `n` elements fit one classic call.
bool Fits(size_t n) { return n <= max_count; }

template <typename F>
bool Resolve(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

Status Check(int code, const char* what) {
  if (code == 0) return Status::Ok();
  char text[1024] = {0};
  int len = 0;
  if (fns.Error_string(code, text, &len) != 0) std::strcpy(text, "unknown MPI error");
  return Status::Error(std::string(what) + " failed in MPI: " + text);
}

H Datatype(xla::ffi::DataType dtype) {
  using xla::ffi::DataType;
  switch (dtype) {
    case DataType::F32:
      return consts.float32;
    case DataType::F64:
      return consts.float64;
    case DataType::S8:
      return consts.int8;
    case DataType::U8:
      return consts.uint8;
    case DataType::S32:
      return consts.int32;
    case DataType::S64:
      return consts.int64;
    case DataType::PRED:
      return consts.c_bool;
    default:
      return 0;
  }
}

H Op(ReduceOp op, bool logical) {
  switch (op) {
    case ReduceOp::kSum:
      return logical ? consts.lor : consts.sum;
    case ReduceOp::kProd:
      return logical ? consts.land : consts.prod;
    case ReduceOp::kMax:
      return logical ? consts.lor : consts.max;
    case ReduceOp::kMin:
      return logical ? consts.land : consts.min;
  }
  return consts.sum;
}

bool IsHalf(xla::ffi::DataType d) {
  return d == xla::ffi::DataType::F16 || d == xla::ffi::DataType::BF16;
}

// Scratch for float16/bfloat16 reductions, kept between calls (grows, never shrinks).
thread_local std::vector<float> scratch_in, scratch_out;

// Floating max/min over MPI. MPI combines the ranks' values in whatever order its algorithm
// takes, with each rank's own buffer in its own place, and IEEE comparisons leave NaN and the two
// zeros unordered: ranks could get different results. So the values travel as integer keys that
// order them totally, as reduce.h's Combine does (NaN above everything for max and below for min,
// -0 below +0), MPI takes the integer max/min, which no order changes, and the keys go back to
// floats with NaN made the canonical quiet NaN.
thread_local std::vector<int64_t> key_in, key_out;
thread_local std::vector<int32_t> wide_in, wide_out;  // widen_byte_sums

template <typename F, typename I>
void ToKeys(const F* in, I* out, size_t n, bool max) {
  using U = std::make_unsigned_t<I>;
  constexpr U sign = U{1} << (sizeof(U) * 8 - 1);
  F q = std::numeric_limits<F>::quiet_NaN();
  U nan;
  std::memcpy(&nan, &q, sizeof(nan));
  if (!max) nan |= sign;
  for (size_t i = 0; i < n; ++i) {
    U b;
    std::memcpy(&b, &in[i], sizeof(b));
    if (in[i] != in[i]) b = nan;
    out[i] = static_cast<I>((b & sign) ? b ^ (sign - 1) : b);
  }
}

template <typename F, typename I>
void FromKeys(const I* in, F* out, size_t n) {
  using U = std::make_unsigned_t<I>;
  constexpr U sign = U{1} << (sizeof(U) * 8 - 1);
  for (size_t i = 0; i < n; ++i) {
    U b = static_cast<U>(in[i]);
    if (b & sign) b ^= sign - 1;
    std::memcpy(&out[i], &b, sizeof(b));
    if (out[i] != out[i]) out[i] = std::numeric_limits<F>::quiet_NaN();
  }
}

bool IsFloating(xla::ffi::DataType d) {
  return IsHalf(d) || d == xla::ffi::DataType::F32 || d == xla::ffi::DataType::F64;
}

// How a reduction travels over MPI. Most dtypes go as they are. float16/bfloat16 go as float32
// (scratch), so that they are reduced in float32 and rounded once. Floating max/min go as keys
// (ToKeys). Under Open MPI, int8/uint8 sums go as int32 (widen_byte_sums). Stage fills the
// buffers MPI reads and writes; Finish turns MPI's result into `out`.
struct Reduction {
  xla::ffi::DataType dtype;
  bool keyed, wide, bytes_widened;
  const void* send;
  void* recv;
  H type, op;
  size_t elem;  // bytes per element of `type`
};

Reduction Stage(xla::ffi::DataType dtype, ReduceOp op, const void* in, size_t n_in, void* out,
                size_t n_out) {
  const bool max = op == ReduceOp::kMax;
  const bool byte = dtype == xla::ffi::DataType::S8 || dtype == xla::ffi::DataType::U8;
  Reduction r{dtype, (max || op == ReduceOp::kMin) && IsFloating(dtype),
              dtype == xla::ffi::DataType::F64, widen_byte_sums && byte && op == ReduceOp::kSum,
              in, out, Datatype(dtype),
              Op(op, dtype == xla::ffi::DataType::PRED), ElemBytes(dtype)};
  const float* f = static_cast<const float*>(in);
  if (IsHalf(dtype)) {
    if (scratch_in.size() < n_in) scratch_in.resize(n_in);
    if (scratch_out.size() < n_out) scratch_out.resize(n_out);
    HalfToFloats(dtype == xla::ffi::DataType::BF16, static_cast<const uint16_t*>(in),
                 scratch_in.data(), n_in);
    f = scratch_in.data();
    r.send = scratch_in.data();
    r.recv = scratch_out.data();
    r.type = consts.float32;
    r.elem = sizeof(float);
  }
  if (r.bytes_widened) {
    if (wide_in.size() < n_in) wide_in.resize(n_in);
    if (wide_out.size() < n_out) wide_out.resize(n_out);
    if (dtype == xla::ffi::DataType::S8) {
      std::copy_n(static_cast<const int8_t*>(in), n_in, wide_in.data());
    } else {
      std::copy_n(static_cast<const uint8_t*>(in), n_in, wide_in.data());
    }
    r.send = wide_in.data();
    r.recv = wide_out.data();
    r.type = consts.int32;
    r.elem = sizeof(int32_t);
  }
  if (r.keyed) {
    if (key_in.size() < n_in) key_in.resize(n_in);
    if (key_out.size() < n_out) key_out.resize(n_out);
    if (r.wide) {
      ToKeys(static_cast<const double*>(in), key_in.data(), n_in, max);
    } else {
      ToKeys(f, reinterpret_cast<int32_t*>(key_in.data()), n_in, max);
    }
    r.send = key_in.data();
    r.recv = key_out.data();
    r.type = r.wide ? consts.int64 : consts.int32;
    r.elem = r.wide ? 8 : 4;
    r.op = max ? consts.max : consts.min;
  }
  return r;
}

void Finish(const Reduction& r, void* out, size_t n_out) {
  if (r.bytes_widened) {  // the low byte: the sum modulo 256, signed or not
    uint8_t* o = static_cast<uint8_t*>(out);
    for (size_t i = 0; i < n_out; ++i) o[i] = static_cast<uint8_t>(wide_out[i]);
    return;
  }
  const bool half = IsHalf(r.dtype);
  if (r.keyed && r.wide) {
    FromKeys(key_out.data(), static_cast<double*>(out), n_out);
  } else if (r.keyed) {
    FromKeys(reinterpret_cast<const int32_t*>(key_out.data()),
             half ? scratch_out.data() : static_cast<float*>(out), n_out);
  }
  if (half) {
    FloatsToHalf(r.dtype == xla::ffi::DataType::BF16, scratch_out.data(),
                 static_cast<uint16_t*>(out), n_out);
  }
}

bool HasLargeCount(void* lib) {
  for (const char* name : {"MPI_Iallreduce_c", "MPI_Iallgatherv_c", "MPI_Ireduce_scatter_c",
                           "MPI_Ibcast_c", "MPI_Ialltoall_c", "MPI_Ialltoallv_c", "MPI_Isend_c",
                           "MPI_Irecv_c"}) {
    if (dlsym(lib, name) == nullptr) return false;
  }
  return true;
}

void* OpenMpi(const std::string& library, Status* status) {
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(library.c_str(), RTLD_NOW);
  if (lib == nullptr) {
    *status = Status::Error("cannot open the MPI library " + library + ": " + dlerror());
  }
  return lib;
}

}  // namespace

Status MpiHasLargeCount(const std::string& library, bool* has) {
  Status s = Status::Ok();
  void* lib = OpenMpi(library, &s);
  if (lib == nullptr) return s;
  *has = HasLargeCount(lib);
  return Status::Ok();
}

Status MpiLoad(const std::string& library, const MpiConstants& constants, bool prefer_large_count,
               int64_t classic_max_count) {
  Status opened = Status::Ok();
  void* lib = OpenMpi(library, &opened);
  if (lib == nullptr) return opened;
  if (classic_max_count < 1 || classic_max_count > std::numeric_limits<int>::max()) {
    return Status::Error("the most elements per classic MPI call must be between 1 and " +
                         std::to_string(std::numeric_limits<int>::max()) + "; got " +
                         std::to_string(classic_max_count));
  }
  bool ok = Resolve(lib, "MPI_Iallreduce", &fns.Iallreduce) &&
            Resolve(lib, "MPI_Iallgatherv", &fns.Iallgatherv) &&
            Resolve(lib, "MPI_Ireduce_scatter", &fns.Ireduce_scatter) &&
            Resolve(lib, "MPI_Ireduce", &fns.Ireduce) && Resolve(lib, "MPI_Ibcast", &fns.Ibcast) &&
            Resolve(lib, "MPI_Ialltoall", &fns.Ialltoall) &&
            Resolve(lib, "MPI_Ialltoallv", &fns.Ialltoallv) &&
            Resolve(lib, "MPI_Isend", &fns.Isend) && Resolve(lib, "MPI_Irecv", &fns.Irecv) &&
            Resolve(lib, "MPI_Ibarrier", &fns.Ibarrier) && Resolve(lib, "MPI_Test", &fns.Test) &&
            Resolve(lib, "MPI_Cancel", &fns.Cancel) &&
            Resolve(lib, "MPI_Request_free", &fns.Request_free) &&
            Resolve(lib, "MPI_Error_string", &fns.Error_string);
  if (!ok) {
    return Status::Error("the MPI library " + library +
                         " lacks the MPI-3 non-blocking functions spmd needs (MPI_Iallreduce, "
                         "MPI_Ibarrier, ...); use an MPI of version 3 or later");
  }
  large_count = prefer_large_count && HasLargeCount(lib);
  if (large_count) {
    Resolve(lib, "MPI_Iallreduce_c", &fns.Iallreduce_c);
    Resolve(lib, "MPI_Iallgatherv_c", &fns.Iallgatherv_c);
    Resolve(lib, "MPI_Ireduce_scatter_c", &fns.Ireduce_scatter_c);
    Resolve(lib, "MPI_Ibcast_c", &fns.Ibcast_c);
    Resolve(lib, "MPI_Ialltoall_c", &fns.Ialltoall_c);
    Resolve(lib, "MPI_Ialltoallv_c", &fns.Ialltoallv_c);
    Resolve(lib, "MPI_Isend_c", &fns.Isend_c);
    Resolve(lib, "MPI_Irecv_c", &fns.Irecv_c);
  }
  max_count = static_cast<size_t>(classic_max_count);
  widen_byte_sums = dlsym(lib, "ompi_mpi_comm_world") != nullptr;  // Open MPI's
  consts = constants;
  loaded = true;
  return Status::Ok();
}

bool MpiLargeCount() { return large_count; }

bool MpiLoaded() { return loaded; }

Status MpiComm::Usable() const {
  if (!broken) return Status::Ok();
  return Status::Error("the MPI group " + RankList(world_ranks) +
                       " is unusable: an earlier collective on it failed (MPI may still "
                       "complete that call, so no later call is started): " + broken_by);
}

namespace {
// MpiSetOversubscribed: with more ranks than cores on the node, a waiting rank yields its core
// after every poll; otherwise after 1024 (a yield per poll cost about 1.7 us per call there).
std::atomic<bool> yield_each_poll{false};
std::mutex watches_mu;
std::vector<std::weak_ptr<MpiWatch>> watches;
}  // namespace

void MpiWatchAdd(const std::shared_ptr<MpiWatch>& w) {
  std::lock_guard<std::mutex> lock(watches_mu);
  watches.erase(std::remove_if(watches.begin(), watches.end(),
                               [](const std::weak_ptr<MpiWatch>& p) { return p.expired(); }),
                watches.end());
  watches.push_back(w);
}

std::vector<std::shared_ptr<MpiWatch>> MpiWatches() {
  std::lock_guard<std::mutex> lock(watches_mu);
  std::vector<std::shared_ptr<MpiWatch>> out;
  for (const auto& p : watches) {
    if (auto w = p.lock()) out.push_back(std::move(w));
  }
  return out;
}

void MpiSetOversubscribed(bool on) { yield_each_poll.store(on); }
bool MpiOversubscribed() { return yield_each_poll.load(std::memory_order_relaxed); }

double StallSecondsFromEnv() {
  const char* v = std::getenv("SPMD_STALL_WARN");
  if (v == nullptr || *v == 0) return 30;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  return end != v && s >= 0 ? s : 30;  // the Python side rejects a bad value first
}

std::string MpiComm::Behind(bool ask) const {
  std::string late = behind ? behind(calls_, ask) : std::string();
  if (watch != nullptr) {
    std::lock_guard<std::mutex> lock(watch->mu);
    if (watch->verdict_call == calls_ && !watch->late.empty()) {
      late += (late.empty() ? "" : " And ") + watch->late;
    }
  }
  return late;
}

Status MpiComm::Broke(const Status& error, bool own) const {
  broken = true;  // the call cannot complete, and MPI cannot cancel it
  broken_by = error.message();
  if (own && failed && current_ != nullptr) failed(calls_, error.message());
  if (own && watch != nullptr && current_ != nullptr && watch->failed.load() == 0) {
    std::lock_guard<std::mutex> lock(watch->mu);
    watch->failure = error.message();
    watch->failed.store(calls_, std::memory_order_release);
  }
  return error;
}

std::string MpiComm::PeerFailed(uint64_t n) const {
  if (peer_failed) {
    if (std::string first = peer_failed(n); !first.empty()) return first;
  }
  if (watch == nullptr) return "";
  const uint64_t failed = watch->peer_failed.load(std::memory_order_acquire);
  if (failed == 0 || failed > n) return "";
  std::lock_guard<std::mutex> lock(watch->mu);
  return PeerFailedMessage(failed, n, world_ranks, watch->peer_rank, watch->peer_failure);
}

std::string MpiComm::WatchGone() const {
  if (watch == nullptr || !watch->has_gone.load(std::memory_order_acquire)) return "";
  std::lock_guard<std::mutex> lock(watch->mu);
  return watch->verdict_call == calls_ ? watch->gone : std::string();
}

Status MpiComm::Wait(H* requests, int n, const char* what) const {
  auto start = std::chrono::steady_clock::now();
  int spins = 0;
  bool reported = false;
  // The watch sees this wait (a collective's only: a point-to-point peer may rightly be late).
  struct Waiting {
    MpiWatch* w;
    ~Waiting() {
      if (w != nullptr) w->waiting_since_ns.store(0, std::memory_order_release);
    }
  } waiting{current_ != nullptr ? watch.get() : nullptr};
  if (waiting.w != nullptr) {
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           start.time_since_epoch()).count();
    waiting.w->waiting_since_ns.store(ns > 0 ? ns : 1, std::memory_order_release);
  }
  // A collective's description, and the ranks that have not started it (where they can be
  // seen): for the stall report and the timeout.
  auto where = [&] {
    return (current_ != nullptr ? current_->Describe() : std::string(what)) +
           " over MPI (collective #" + std::to_string(calls_) + " of the group " +
           RankList(world_ranks) + ")";
  };
  std::optional<board::Wait> on_board;  // made once the wait gets long (board.h)
  for (int i = 0; i < n; ++i) {
    for (;;) {
      int done = 0;
      alignas(16) char status[256];
      SPMD_RETURN_IF_ERROR(Check(fns.Test(&requests[i], &done, status), what));
      if (done) break;
      if (yield_each_poll.load(std::memory_order_relaxed)) sched_yield();
      if (++spins % 1024 == 0) {
        sched_yield();
        if (spins % (1024 * 16) == 0) {
          // A peer on the node that failed this collective (or an earlier one): it will not
          // come, and its error says why.
          if (current_ != nullptr) {
            if (std::string first = PeerFailed(calls_); !first.empty()) {
              return Broke(Status::Error(first), false);
            }
          }
          std::string gone = peer_gone ? peer_gone() : std::string();
          if (gone.empty() && current_ != nullptr) gone = WatchGone();
          if (!gone.empty()) {
            // A peer that found a deadlock this wait is part of raises and exits: its exit is
            // the deadlock's doing, and the board holds the verdict every rank should give.
            if (on_board) {
              if (std::string dead = on_board->Poll(); !dead.empty()) {
                return Broke(Status::Error(dead));
              }
            }
            const std::string in = current_ != nullptr
                                       ? where()
                                       : std::string(what) + " over MPI on the group " +
                                             RankList(world_ranks);
            // A rank whose Python program ended made fewer calls; a process gone without
            // that (a signal, os._exit) says nothing about its calls.
            const bool exiting = gone.find("is exiting") != std::string::npos;
            return Broke(Status::Error(
                gone + " while this rank waited for it in " + in +
                (exiting ? ": it made fewer collective calls than this rank. Every rank of a "
                           "group must make the same collective calls in the same order"
                         : ": its process ended without its Python program exiting (killed "
                           "by a signal, or os._exit)")));
          }
        }
        if (!on_board) {  // a point-to-point wait's peers are not listed: not judged
          on_board.emplace(current_ != nullptr ? board::Key("mpi", world_ranks, calls_) : 0,
                           current_ != nullptr ? world_ranks : std::vector<int>{},
                           current_ != nullptr ? where()
                                               : std::string(what) + " over MPI on the group " +
                                                     RankList(world_ranks));
        }
        if (std::string dead = on_board->Poll(); !dead.empty()) {
          return Broke(Status::Error(dead));
        }
        std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
        const bool in_collective = current_ != nullptr && (behind || watch != nullptr);
        if (!reported && in_collective && stall_s > 0 && waited.count() > stall_s) {
          const std::string late = Behind(true);
          if (!late.empty()) {  // (the watch's verdict may come a little later)
            reported = true;
            const std::string msg =
                "[rank " + std::to_string(world_ranks[rank]) + "] spmd: stalled: this rank has " +
                "waited " + std::to_string(static_cast<int>(waited.count())) + " s in " +
                where() + " for " + late + " (SPMD_STALL_WARN; the wait ends with an error " +
                "after SPMD_TIMEOUT.)\n";
            std::fputs(msg.c_str(), stderr);
            std::fflush(stderr);
          }
        }
        if (waited.count() > timeout_s) {
          const std::string late = in_collective ? Behind(false) : std::string();
          if (!late.empty()) {
            return Broke(Status::Error("timed out after " +
                                       std::to_string(static_cast<int>(timeout_s)) + " s in " +
                                       where() + " waiting for " + late));
          }
          return Broke(Status::Error(std::string(what) + " over MPI on the group " +
                               RankList(world_ranks) + " timed out after " +
                               std::to_string(static_cast<int>(timeout_s)) +
                               " s: at least one rank of the group never made the matching "
                               "call. Every rank of a group must make the same collective calls "
                               "in the same order; raise SPMD_TIMEOUT if they are just slow"));
        }
      }
    }
  }
  return Status::Ok();
}

Status MpiComm::Pieces(size_t count, const char* what,
                       const std::function<int(size_t, int, H*)>& start) const {
  for (size_t at = 0; at < count; at += max_count) {
    const int n = static_cast<int>(std::min(count - at, max_count));
    H request = 0;
    SPMD_RETURN_IF_ERROR(Check(start(at, n, &request), what));
    SPMD_RETURN_IF_ERROR(Wait(&request, 1, what));
  }
  return Status::Ok();
}

Status MpiComm::Exchange(const void* in, const std::vector<size_t>& send_bytes,
                         const std::vector<size_t>& send_off, void* out,
                         const std::vector<size_t>& recv_bytes,
                         const std::vector<size_t>& recv_off, const char* what) const {
  constexpr int kTag = 0x5d3;  // (SendRecv's tags differ: no message of one matches the other)
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<H> requests;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    for (size_t at = 0; at < recv_bytes[p]; at += max_count) {
      const int n = static_cast<int>(std::min(recv_bytes[p] - at, max_count));
      requests.push_back(0);
      SPMD_RETURN_IF_ERROR(Check(fns.Irecv(dst + recv_off[p] + at, n, consts.byte, p, kTag, comm,
                                           &requests.back()),
                                 what));
    }
  }
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    for (size_t at = 0; at < send_bytes[p]; at += max_count) {
      const int n = static_cast<int>(std::min(send_bytes[p] - at, max_count));
      requests.push_back(0);
      SPMD_RETURN_IF_ERROR(Check(fns.Isend(src + send_off[p] + at, n, consts.byte, p, kTag, comm,
                                           &requests.back()),
                                 what));
    }
  }
  if (dst + recv_off[rank] != src + send_off[rank]) {
    std::memmove(dst + recv_off[rank], src + send_off[rank], send_bytes[rank]);
  }
  return Wait(requests.data(), static_cast<int>(requests.size()), what);
}

Status MpiComm::Allreduce(const void* in, void* out, size_t count, xla::ffi::DataType dtype,
                          ReduceOp op) const {
  SPMD_RETURN_IF_ERROR(Usable());
  Reduction r = Stage(dtype, op, in, count, out, count);
  if (r.type == 0) return Status::Error("allreduce over MPI does not support this dtype");
  if (large_count) {
    H request = 0;
    SPMD_RETURN_IF_ERROR(Check(
        fns.Iallreduce_c(r.send, r.recv, static_cast<Count>(count), r.type, r.op, comm, &request),
        "allreduce"));
    SPMD_RETURN_IF_ERROR(Wait(&request, 1, "allreduce"));
  } else {
    // Element by element, the pieces reduce as the whole would.
    const char* send = static_cast<const char*>(r.send);
    char* recv = static_cast<char*>(r.recv);
    SPMD_RETURN_IF_ERROR(Pieces(count, "allreduce", [&](size_t at, int n, H* request) {
      return fns.Iallreduce(send + at * r.elem, recv + at * r.elem, n, r.type, r.op, comm,
                            request);
    }));
  }
  Finish(r, out, count);
  return Status::Ok();
}

Status MpiComm::Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes,
                           const std::vector<size_t>* at_bytes) const {
  SPMD_RETURN_IF_ERROR(Usable());
  std::vector<size_t> at(size);
  size_t next = 0, extent = 0;
  for (int r = 0; r < size; ++r) {
    at[r] = at_bytes != nullptr ? (*at_bytes)[r] : next;
    next += bytes[r];
    extent = std::max(extent, at[r] + bytes[r]);
  }
  H request = 0;
  if (large_count) {
    std::vector<Count> counts(bytes.begin(), bytes.end());
    std::vector<Aint> displs(at.begin(), at.end());
    SPMD_RETURN_IF_ERROR(Check(fns.Iallgatherv_c(in, counts[rank], consts.byte, out,
                                                 counts.data(), displs.data(), consts.byte, comm,
                                                 &request),
                               "allgather"));
  } else if (Fits(extent)) {
    std::vector<int> counts(bytes.begin(), bytes.end()), displs(at.begin(), at.end());
    SPMD_RETURN_IF_ERROR(Check(fns.Iallgatherv(in, counts[rank], consts.byte, out, counts.data(),
                                               displs.data(), consts.byte, comm, &request),
                               "allgather"));
  } else {
    // Displacements past an int: this rank's block to every peer, point to point.
    return Exchange(in, std::vector<size_t>(size, bytes[rank]), std::vector<size_t>(size, 0), out,
                    bytes, at, "allgather");
  }
  return Wait(&request, 1, "allgather");
}

Status MpiComm::ReduceScatterv(const void* in, void* out, const std::vector<size_t>& counts,
                               xla::ffi::DataType dtype, ReduceOp op) const {
  SPMD_RETURN_IF_ERROR(Usable());
  size_t total = 0;
  for (size_t x : counts) total += x;
  Reduction r = Stage(dtype, op, in, total, out, counts[rank]);
  if (r.type == 0) return Status::Error("reduce_scatter over MPI does not support this dtype");
  if (large_count || Fits(total)) {
    H request = 0;
    if (large_count) {
      std::vector<Count> c(counts.begin(), counts.end());
      SPMD_RETURN_IF_ERROR(Check(
          fns.Ireduce_scatter_c(r.send, r.recv, c.data(), r.type, r.op, comm, &request),
          "reduce_scatter"));
    } else {
      std::vector<int> c(counts.begin(), counts.end());
      SPMD_RETURN_IF_ERROR(
          Check(fns.Ireduce_scatter(r.send, r.recv, c.data(), r.type, r.op, comm, &request),
                "reduce_scatter"));
    }
    SPMD_RETURN_IF_ERROR(Wait(&request, 1, "reduce_scatter"));
  } else {
    // More elements than an int counts: each rank's block reduced to it, in pieces.
    const char* send = static_cast<const char*>(r.send);
    char* recv = static_cast<char*>(r.recv);
    size_t off = 0;
    for (int root = 0; root < size; ++root) {
      SPMD_RETURN_IF_ERROR(Pieces(counts[root], "reduce_scatter", [&](size_t at, int n, H* q) {
        return fns.Ireduce(send + (off + at) * r.elem, root == rank ? recv + at * r.elem : nullptr,
                           n, r.type, r.op, root, comm, q);
      }));
      off += counts[root];
    }
  }
  Finish(r, out, counts[rank]);
  return Status::Ok();
}

Status MpiComm::Broadcast(void* buf, size_t bytes, int root) const {
  SPMD_RETURN_IF_ERROR(Usable());
  if (!large_count) {
    char* b = static_cast<char*>(buf);
    return Pieces(bytes, "broadcast", [&](size_t at, int n, H* request) {
      return fns.Ibcast(b + at, n, consts.byte, root, comm, request);
    });
  }
  H request = 0;
  SPMD_RETURN_IF_ERROR(Check(
      fns.Ibcast_c(buf, static_cast<Count>(bytes), consts.byte, root, comm, &request),
      "broadcast"));
  return Wait(&request, 1, "broadcast");
}

Status MpiComm::AllToAll(const void* in, void* out, size_t block_bytes) const {
  SPMD_RETURN_IF_ERROR(Usable());
  H request = 0;
  if (large_count) {
    SPMD_RETURN_IF_ERROR(Check(fns.Ialltoall_c(in, static_cast<Count>(block_bytes), consts.byte,
                                               out, static_cast<Count>(block_bytes), consts.byte,
                                               comm, &request),
                               "all_to_all"));
  } else if (Fits(block_bytes * size)) {
    const int n = static_cast<int>(block_bytes);
    SPMD_RETURN_IF_ERROR(Check(
        fns.Ialltoall(in, n, consts.byte, out, n, consts.byte, comm, &request), "all_to_all"));
  } else {
    std::vector<size_t> blocks(size, block_bytes), offs(size);
    for (int p = 0; p < size; ++p) offs[p] = p * block_bytes;
    return Exchange(in, blocks, offs, out, blocks, offs, "all_to_all");
  }
  return Wait(&request, 1, "all_to_all");
}

Status MpiComm::AllToAllv(const void* in, const std::vector<size_t>& send_bytes,
                          const std::vector<size_t>& send_off, void* out,
                          const std::vector<size_t>& recv_bytes,
                          const std::vector<size_t>& recv_off) const {
  SPMD_RETURN_IF_ERROR(Usable());
  H request = 0;
  if (large_count) {
    thread_local std::vector<Count> sc, rc;
    thread_local std::vector<Aint> sd, rd;
    sc.assign(send_bytes.begin(), send_bytes.end());
    rc.assign(recv_bytes.begin(), recv_bytes.end());
    sd.assign(send_off.begin(), send_off.end());
    rd.assign(recv_off.begin(), recv_off.end());
    SPMD_RETURN_IF_ERROR(Check(fns.Ialltoallv_c(in, sc.data(), sd.data(), consts.byte, out,
                                                rc.data(), rd.data(), consts.byte, comm,
                                                &request),
                               "all_to_allv"));
    return Wait(&request, 1, "all_to_allv");
  }
  size_t extent = 0;
  for (int p = 0; p < size; ++p) {
    extent = std::max({extent, send_off[p] + send_bytes[p], recv_off[p] + recv_bytes[p]});
  }
  if (!Fits(extent)) {
    return Exchange(in, send_bytes, send_off, out, recv_bytes, recv_off, "all_to_allv");
  }
  thread_local std::vector<int> sc, rc, sd, rd;
  sc.assign(send_bytes.begin(), send_bytes.end());
  rc.assign(recv_bytes.begin(), recv_bytes.end());
  sd.assign(send_off.begin(), send_off.end());
  rd.assign(recv_off.begin(), recv_off.end());
  SPMD_RETURN_IF_ERROR(Check(fns.Ialltoallv(in, sc.data(), sd.data(), consts.byte, out, rc.data(),
                                            rd.data(), consts.byte, comm, &request),
                             "all_to_allv"));
  return Wait(&request, 1, "all_to_allv");
}

MessageShape MessageShape::Of(size_t bytes, xla::ffi::DataType dtype,
                              xla::ffi::Span<const int64_t> dims) {
  MessageShape m;
  m.bytes = bytes;
  m.dtype = static_cast<uint64_t>(dtype);
  m.ndims = dims.size();
  for (size_t k = 0; k < dims.size(); ++k) {
    const size_t at = std::min<size_t>(k, kDims - 1);
    m.dims[at] = k < kDims ? static_cast<uint64_t>(dims[k]) : m.dims[at] * 1000003u + dims[k];
  }
  return m;
}

bool MessageShape::operator==(const MessageShape& o) const {
  return std::memcmp(this, &o, sizeof(MessageShape)) == 0;
}

std::string MessageShape::Describe() const {
  std::string s = DtypeName(static_cast<xla::ffi::DataType>(dtype)) + std::string("[");
  for (uint64_t k = 0; k < ndims && k < static_cast<uint64_t>(kDims); ++k) {
    s += (k ? "," : "") + std::to_string(dims[k]);
  }
  return s + (ndims > static_cast<uint64_t>(kDims) ? ",...]" : "]");
}

namespace {
// Starts sending (receiving) `bytes` to (from) group rank `peer`: one request with the large-count
// calls, else one per piece of at most max_count bytes (at least one, so that an empty message
// is still a message). Both sides split the same byte count alike, and MPI keeps the order of
// messages between two ranks on one tag, so the pieces match.
// `large(at, count, request)` / `classic(at, count, request)`: the MPI call of one piece.
template <typename Large, typename Classic>
int StartPieces(char* b, size_t bytes, std::vector<H>* requests, Large large, Classic classic) {
  if (large_count) {
    requests->push_back(0);
    return large(b, static_cast<Count>(bytes), &requests->back());
  }
  size_t at = 0;
  do {
    const int n = static_cast<int>(std::min(bytes - at, max_count));
    requests->push_back(0);
    const int code = classic(b + at, n, &requests->back());
    if (code != 0) return code;
    at += n;
  } while (at < bytes);
  return 0;
}

int StartSend(const void* buf, size_t bytes, int peer, int tag, H comm, std::vector<H>* requests) {
  return StartPieces(
      const_cast<char*>(static_cast<const char*>(buf)), bytes, requests,
      [&](char* at, Count n, H* r) { return fns.Isend_c(at, n, consts.byte, peer, tag, comm, r); },
      [&](char* at, int n, H* r) { return fns.Isend(at, n, consts.byte, peer, tag, comm, r); });
}

int StartRecv(void* buf, size_t bytes, int peer, int tag, H comm, std::vector<H>* requests) {
  return StartPieces(
      static_cast<char*>(buf), bytes, requests,
      [&](char* at, Count n, H* r) { return fns.Irecv_c(at, n, consts.byte, peer, tag, comm, r); },
      [&](char* at, int n, H* r) { return fns.Irecv(at, n, consts.byte, peer, tag, comm, r); });
}
}  // namespace

namespace {
// Drops the sends of `q` that are done, oldest first, up to the first still under way (under
// q.mu). MPI_Test also moves every message of the process a step on.
Status DropDone(MpiSendQueue& q) {
  while (!q.sends.empty()) {
    MpiSendQueue::Pending& oldest = q.sends.front();
    // (MPI_Test of a request already completed, now MPI_REQUEST_NULL, says it is done.)
    for (H& r : oldest.requests) {
      int done = 0;
      alignas(16) char status[256];
      SPMD_RETURN_IF_ERROR(Check(fns.Test(&r, &done, status), "send"));
      if (!done) return Status::Ok();  // the oldest is still under way
    }
    if (q.spare.size() < MpiSendQueue::kSpare) q.spare.push_back(std::move(oldest.data));
    q.sends.pop_front();
  }
  return Status::Ok();
}

// The send progress thread (MpiSendProgress in mpi.h). Its state is never destroyed: the thread
// may outlive static destruction at exit (it is detached).
struct Progress {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::weak_ptr<MpiSendQueue>> queues;  // those that have had a pending send
  bool on = false, running = false, stop = false, wake = false;
};

Progress& progress() {
  static Progress* p = new Progress;
  return *p;
}

void ProgressLoop() {
  Progress& p = progress();
  std::vector<std::shared_ptr<MpiSendQueue>> live;  // (its capacity kept from round to round)
  std::unique_lock<std::mutex> lock(p.mu);
  while (!p.stop) {
    live.clear();
    for (const auto& w : p.queues) {
      if (auto q = w.lock()) live.push_back(std::move(q));
    }
    if (live.size() != p.queues.size()) p.queues.assign(live.begin(), live.end());
    p.wake = false;
    lock.unlock();
    bool pending = false;
    for (const auto& q : live) {
      // A rank's own call on the communicator holds the queue while it sends or waits for its
      // sends (moving them itself): skip it this round.
      std::unique_lock<std::mutex> held(q->mu, std::try_to_lock);
      if (!held.owns_lock()) {
        pending = true;
        continue;
      }
      // An error stays with the send: the rank's next call on the communicator meets it.
      (void)DropDone(*q);
      pending = pending || !q->sends.empty();
    }
    live.clear();  // (a communicator released meanwhile frees its queue)
    lock.lock();
    if (p.stop) break;
    if (pending) {
      p.cv.wait_for(lock, std::chrono::microseconds(50), [&] { return p.stop; });
    } else {
      p.cv.wait(lock, [&] { return p.stop || p.wake; });
    }
  }
  p.running = false;
  p.cv.notify_all();
}

// A send was queued on `q` (held by the caller): the thread, if on, tests it from now on.
void ProgressWatch(const std::shared_ptr<MpiSendQueue>& q) {
  Progress& p = progress();
  std::lock_guard<std::mutex> lock(p.mu);
  if (!p.on || p.stop) return;
  if (!q->watched) {
    q->watched = true;
    p.queues.push_back(q);
  }
  p.wake = true;
  if (!p.running) {
    p.running = true;
    std::thread(ProgressLoop).detach();
  }
  p.cv.notify_all();
}
}  // namespace

void MpiSendProgress(bool on) {
  Progress& p = progress();
  std::lock_guard<std::mutex> lock(p.mu);
  p.on = on;
}

void MpiSendProgressStop() {
  Progress& p = progress();
  std::unique_lock<std::mutex> lock(p.mu);
  p.on = false;
  p.stop = true;
  p.cv.notify_all();
  p.cv.wait(lock, [&] { return !p.running; });
}

Status MpiComm::RetireSends(size_t keep) const {
  MpiSendQueue& q = *sends_;
  std::lock_guard<std::mutex> lock(q.mu);
  while (q.sends.size() > keep) {
    MpiSendQueue::Pending& oldest = q.sends.front();
    SPMD_RETURN_IF_ERROR(
        Wait(oldest.requests.data(), static_cast<int>(oldest.requests.size()), "send"));
    if (q.spare.size() < MpiSendQueue::kSpare) q.spare.push_back(std::move(oldest.data));
    q.sends.pop_front();
  }
  return DropDone(q);
}

Status MpiComm::FlushSends() const { return RetireSends(0); }

Status MpiComm::SendRecv(const void* send, const MessageShape& send_shape, int dst, void* recv,
                         const MessageShape& recv_shape, int src) const {
  SPMD_RETURN_IF_ERROR(Usable());
  current_ = nullptr;  // not a collective: no stall report of the group's calls
  SPMD_RETURN_IF_ERROR(RetireSends(kSendsAhead));
  // The shape goes first, on its own tag; the data follows once the receiver has checked it.
  constexpr int kTag = 0x5d1, kShapeTag = 0x5d2;
  std::vector<H> shape_request, requests;
  MessageShape got_shape;
  if (src >= 0) {
    SPMD_RETURN_IF_ERROR(Check(
        StartRecv(&got_shape, sizeof(MessageShape), src, kShapeTag, comm, &shape_request),
        "recv"));
  }
  if (dst >= 0) {
    MpiSendQueue& q = *sends_;
    std::lock_guard<std::mutex> lock(q.mu);
    MpiSendQueue::Pending& out = q.sends.emplace_back();
    out.shape = send_shape;
    const char* from = static_cast<const char*>(send);
    if (!q.spare.empty()) {  // a completed send's buffer, reused
      out.data = std::move(q.spare.back());
      q.spare.pop_back();
    }
    out.data.assign(from, from + send_shape.bytes);
    SPMD_RETURN_IF_ERROR(Check(
        StartSend(&out.shape, sizeof(MessageShape), dst, kShapeTag, comm, &out.requests), "send"));
    SPMD_RETURN_IF_ERROR(Check(
        StartSend(out.data.data(), send_shape.bytes, dst, kTag, comm, &out.requests), "send"));
    ProgressWatch(sends_);
  }
  std::string bad;
  std::vector<char> scratch;
  if (src >= 0) {
    SPMD_RETURN_IF_ERROR(
        Wait(shape_request.data(), static_cast<int>(shape_request.size()), "recv"));
    // A message of another shape is still received (into scratch), so that its sender's send
    // completes; this rank then fails naming both shapes.
    void* into = recv;
    if (!(got_shape == recv_shape)) {
      bad = "rank " + std::to_string(world_ranks[src]) + " sent " + got_shape.Describe() +
            " (" + std::to_string(got_shape.bytes) + " bytes), but this rank receives into " +
            recv_shape.Describe() + " (" + std::to_string(recv_shape.bytes) + " bytes); the " +
            "shape and dtype a rank receives into must be those its peer sends";
      scratch.resize(got_shape.bytes);
      into = scratch.data();
    }
    SPMD_RETURN_IF_ERROR(
        Check(StartRecv(into, got_shape.bytes, src, kTag, comm, &requests), "recv"));
    SPMD_RETURN_IF_ERROR(Wait(requests.data(), static_cast<int>(requests.size()), "recv"));
  }
  SPMD_RETURN_IF_ERROR(RetireSends(kSendsAhead));
  return bad.empty() ? Status::Ok() : Status::Error(bad);
}

Status MpiComm::Barrier() const {
  SPMD_RETURN_IF_ERROR(Usable());
  H request = 0;
  SPMD_RETURN_IF_ERROR(Check(fns.Ibarrier(comm, &request), "barrier"));
  return Wait(&request, 1, "barrier");
}

Status MpiComm::CheckSame(const Signature& sig) const {
  SPMD_RETURN_IF_ERROR(Usable());
  // A peer has already failed this collective, or an earlier one.
  if (std::string first = PeerFailed(calls_ + 1); !first.empty()) {
    return Broke(Status::Error(first), false);
  }
  current_ = &sig;  // valid until the op's end: every later wait is in a later op or a send/recv
  ++calls_;
  if (on_call) on_call(calls_);
  if (watch != nullptr) watch->started.store(calls_, std::memory_order_release);
  const uint64_t hash = sig.hash;
  std::vector<uint64_t> all(size);
  SPMD_RETURN_IF_ERROR(Allgatherv(&hash, all.data(), std::vector<size_t>(size, 8)));
  bool same = true;
  for (uint64_t h : all) same = same && h == hash;
  if (same) return Status::Ok();
  constexpr size_t kDesc = 512;
  std::vector<char> text(kDesc * size, 0), own(kDesc, 0);
  std::strncpy(own.data(), sig.Describe().c_str(), kDesc - 1);
  SPMD_RETURN_IF_ERROR(Allgatherv(own.data(), text.data(), std::vector<size_t>(size, kDesc)));
  std::vector<std::string> descs;
  for (int r = 0; r < size; ++r) descs.emplace_back(&text[r * kDesc]);
  return Status::Error(MismatchMessage(world_ranks, descs));
}

}  // namespace spmd
