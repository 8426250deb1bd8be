// The mixture-of-experts exchange's planning and row arithmetic; see moe.h.
#include "moe.h"

#include <algorithm>
#include <cstring>

#include "reduce.h"

namespace spmd {
namespace moe {
namespace {

template <typename T>
SPMD_ALWAYS_INLINE void ScaleBody(char* dst, const char* src, size_t bytes, const char* w) {
  if (w == nullptr) {
    std::memcpy(dst, src, bytes);
    return;
  }
  T v;
  std::memcpy(&v, w, sizeof(T));
  T* __restrict d = reinterpret_cast<T*>(dst);
  const T* __restrict s = reinterpret_cast<const T*>(src);
  for (size_t i = 0, n = bytes / sizeof(T); i < n; ++i) d[i] = v * s[i];
}

template <typename T>
SPMD_ALWAYS_INLINE void AddBody(char* dst, const char* src, size_t bytes, const char* w) {
  T* __restrict d = reinterpret_cast<T*>(dst);
  const T* __restrict s = reinterpret_cast<const T*>(src);
  const size_t n = bytes / sizeof(T);
  if (w == nullptr) {
    for (size_t i = 0; i < n; ++i) d[i] = d[i] + s[i];
    return;
  }
  T v;
  std::memcpy(&v, w, sizeof(T));
  for (size_t i = 0; i < n; ++i) d[i] = d[i] + v * s[i];
}

#if defined(__x86_64__)
#define SPMD_AVX2 __attribute__((target("avx2")))
#else
#define SPMD_AVX2
#endif
template <typename T>
SPMD_AVX2 void ScaleAvx2(char* dst, const char* src, size_t bytes, const char* w) {
  ScaleBody<T>(dst, src, bytes, w);
}
template <typename T>
SPMD_AVX2 void AddAvx2(char* dst, const char* src, size_t bytes, const char* w) {
  AddBody<T>(dst, src, bytes, w);
}

template <typename T>
void Scale(char* dst, const char* src, size_t bytes, const char* w) {
  ScaleBody<T>(dst, src, bytes, w);
}
template <typename T>
void Add(char* dst, const char* src, size_t bytes, const char* w) {
  AddBody<T>(dst, src, bytes, w);
}

// The same arithmetic (no fused multiply-adds: -ffp-contract=off), in wider registers.
a2av::RowFn Best(a2av::RowFn plain, a2av::RowFn avx2) {
#if defined(__x86_64__)
  if (HasAvx2F16c()) return avx2;
#endif
  (void)avx2;
  return plain;
}

// float16 and bfloat16: each product (and sum) in float32, rounded once.
template <bool kBf16>
float Widen(uint16_t h) {
  return kBf16 ? Bf16ToFloat(h) : HalfToFloat(h);
}
template <bool kBf16>
uint16_t Narrow(float f) {
  return kBf16 ? FloatToBf16(f) : FloatToHalf(f);
}

template <bool kBf16>
void ScaleHalf(char* dst, const char* src, size_t bytes, const char* w) {
  if (w == nullptr) {
    std::memcpy(dst, src, bytes);
    return;
  }
  uint16_t h;
  std::memcpy(&h, w, 2);
  const float v = Widen<kBf16>(h);
  auto* d = reinterpret_cast<uint16_t*>(dst);
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (size_t i = 0, n = bytes / 2; i < n; ++i) d[i] = Narrow<kBf16>(v * Widen<kBf16>(s[i]));
}

template <bool kBf16>
void AddHalf(char* dst, const char* src, size_t bytes, const char* w) {
  float v = 1;
  if (w != nullptr) {
    uint16_t h;
    std::memcpy(&h, w, 2);
    v = Widen<kBf16>(h);
  }
  auto* d = reinterpret_cast<uint16_t*>(dst);
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (size_t i = 0, n = bytes / 2; i < n; ++i) {
    d[i] = Narrow<kBf16>(Widen<kBf16>(d[i]) + v * Widen<kBf16>(s[i]));
  }
}

}  // namespace

bool RowFns(xla::ffi::DataType dtype, a2av::RowFn* scale, a2av::RowFn* add) {
  using xla::ffi::DataType;
  switch (dtype) {
    case DataType::F32:
      *scale = Best(Scale<float>, ScaleAvx2<float>);
      *add = Best(Add<float>, AddAvx2<float>);
      return true;
    case DataType::F64:
      *scale = Best(Scale<double>, ScaleAvx2<double>);
      *add = Best(Add<double>, AddAvx2<double>);
      return true;
    case DataType::F16:
      *scale = ScaleHalf<false>, *add = AddHalf<false>;
      return true;
    case DataType::BF16:
      *scale = ScaleHalf<true>, *add = AddHalf<true>;
      return true;
    default:
      return false;
  }
}

const std::vector<int64_t>& Exchange::Count(const int32_t* ids, int64_t assignments,
                                            int64_t rows, int64_t out_rows,
                                            const std::string& bad) {
  record_.assign(RecordLen(experts_), 0);
  record_[kRows] = rows;
  record_[kOutRows] = out_rows;
  record_[kAssign] = assignments;
  record_[kBad] = bad.empty() ? 0 : 1;
  record_[kSlots] = slots_;
  record_[kCapacity] = capacity_;
  sorted_.clear();
  if (!bad.empty()) return record_;
  // A counting sort by expert, stable; id E (dropped) is counted nowhere.
  int64_t* counts = record_.data() + kCounts;
  for (int64_t a = 0; a < assignments; ++a) {
    if (ids[a] < experts_) ++counts[ids[a]];
  }
  thread_local std::vector<int64_t> next;
  next.assign(static_cast<size_t>(experts_), 0);
  int64_t total = 0;
  for (int64_t e = 0; e < experts_; ++e) {
    next[e] = total;
    total += counts[e];
  }
  sorted_.resize(static_cast<size_t>(total));
  // Token after token; with a capacity, first choices of every token first (the order of
  // spmd.moe.route's queue positions, so that an assignment's row in its block is its position).
  const int64_t ways = capacity_ > 0 ? k_ : 1, step = capacity_ > 0 ? k_ : 1;
  for (int64_t c = 0; c < ways; ++c) {
    for (int64_t a = c; a < assignments; a += step) {
      if (ids[a] < experts_) sorted_[next[ids[a]]++] = static_cast<int32_t>(a);
    }
  }
  return record_;
}

std::string Exchange::Plan(const int64_t* all, a2av::Plan* p, a2av::Rows* rows,
                           int32_t* sizes) {
  const size_t len = RecordLen(experts_);
  const int64_t per = experts_ / n_;
  auto rec = [&](int r) { return all + static_cast<size_t>(r) * len; };
  auto who = [&](int r) { return "rank " + std::to_string((*world_)[r]); };
  for (int r = 0; r < n_; ++r) {
    if (rec(r)[kBad] != 0) {
      return who(r) + " passed expert ids or arrays that do not fit its routing (its own error "
             "says which)";
    }
  }
  if (experts_ % n_ != 0) {
    return std::to_string(experts_) + " experts do not split evenly over the " +
           std::to_string(n_) + " ranks of the group";
  }
  // The layouts hold every rank's tokens at most once per expert: sized from this rank's count.
  for (int r = 1; r < n_; ++r) {
    if (rec(r)[kAssign] != rec(0)[kAssign]) {
      return who(0) + " routes " + std::to_string(rec(0)[kAssign]) + " assignments, but " +
             who(r) + " " + std::to_string(rec(r)[kAssign]) + "; spmd.moe needs the same " +
             "number of tokens on every rank of the group (pad the batch)";
    }
  }
  // Rows rank a sends rank b in the dispatch's direction (the combine's go back from b to a).
  auto rows_to = [&](int a, int b) {
    int64_t s = 0;
    for (int64_t j = 0; j < per; ++j) s += rec(a)[kCounts + b * per + j];
    return s;
  };
  // Rows rank `src` sends to local expert j of rank r.
  auto got = [&](int src, int r, int64_t j) { return rec(src)[kCounts + r * per + j]; };
  for (int r = 0; r < n_; ++r) {
    const int64_t room = combine_ ? rec(r)[kRows] : rec(r)[kOutRows];
    const int64_t slots = rec(r)[kSlots], cap = rec(r)[kCapacity];
    int64_t held = 0;  // rows of rank r's experts' layout
    for (int src = 0; src < n_; ++src) held += rows_to(src, r);
    if (slots > 0) held = per * slots;
    if (held > room && combine_) {
      return who(r) + "'s experts hold " + std::to_string(held) + " rows, but its y has " +
             std::to_string(room) + "; expected the rows dispatch returns for this routing and "
             "group";
    }
    if (held > room) {  // the grouped layout sized by spmd.moe.dispatch's out_rows
      return who(r) + "'s experts receive " + std::to_string(held) + " rows, but its output " +
             "holds out_rows=" + std::to_string(room) + "; pass out_rows=" +
             std::to_string(held) + " or more (spmd.moe.dispatch's default holds any " +
             "routing)";
    }
    for (int64_t j = 0; j < per && slots > 0; ++j) {
      int64_t g = 0;
      for (int src = 0; src < n_; ++src) {
        g += got(src, r, j);
        if (cap > 0 && got(src, r, j) > cap) {
          return who(src) + " sends " + std::to_string(got(src, r, j)) + " rows to expert " +
                 std::to_string(r * per + j) + ", more than its capacity of " +
                 std::to_string(cap) + " rows per rank";
        }
      }
      if (g > slots) {
        return "expert " + std::to_string(r * per + j) + " receives " + std::to_string(g) +
               " rows, more than its " + std::to_string(slots) + " slots";
      }
    }
  }
  const size_t row = rows->row;
  p->send_bytes.assign(n_, 0);
  p->send_off.assign(n_, 0);
  p->recv_bytes.assign(n_, 0);
  p->recv_off.assign(n_, 0);
  p->most = p->total = 0;
  for (int a = 0; a < n_; ++a) {
    for (int b = 0; b < n_; ++b) {
      const size_t bytes = static_cast<size_t>(rows_to(a, b)) * row;
      if (a != b) {
        p->most = std::max(p->most, bytes);
        p->total += bytes;
      }
      if (a == me_) (combine_ ? p->recv_bytes : p->send_bytes)[b] = bytes;
      if (b == me_) (combine_ ? p->send_bytes : p->recv_bytes)[a] = bytes;
    }
  }
  size_t s = 0, r = 0;
  for (int j = 0; j < n_; ++j) {
    p->send_off[j] = s;
    p->recv_off[j] = r;
    s += p->send_bytes[j];
    r += p->recv_bytes[j];
  }
  p->received = r;
  // This rank's experts' layout: expert j's rows from rank 0, rank 1, ..., then expert j + 1's;
  // with slots, expert j's block starts at row j * slots, and with a capacity, rank s's rows
  // start at row s * capacity of it. The rows between are zeros (`gaps_`, dispatch).
  thread_local std::vector<int64_t> start;
  start.assign(static_cast<size_t>(per) + 1, 0);
  for (int64_t j = 0; j < per; ++j) {
    int64_t g = 0;
    for (int src = 0; src < n_; ++src) g += got(src, me_, j);
    start[j + 1] = slots_ > 0 ? (j + 1) * slots_ : start[j] + g;
    if (!combine_) sizes[j] = static_cast<int32_t>(g);
  }
  gaps_.clear();
  place_.clear();
  for (int src = 0; src < n_; ++src) {
    for (int64_t j = 0; j < per; ++j) {
      const int64_t from = capacity_ > 0 ? j * slots_ + src * capacity_ : start[j];
      const int64_t c = got(src, me_, j);
      for (int64_t i = 0; i < c; ++i) place_.push_back(static_cast<int32_t>(from + i));
      if (capacity_ > 0 && c < capacity_) gaps_.push_back({from + c, capacity_ - c});
      if (capacity_ == 0) start[j] += c;
    }
  }
  if (slots_ > 0 && capacity_ == 0) {
    for (int64_t j = 0; j < per; ++j) {
      if (start[j] < (j + 1) * slots_) gaps_.push_back({start[j], (j + 1) * slots_ - start[j]});
    }
  }
  rows->gaps = slots_ > 0 ? &gaps_ : nullptr;
  rows->send_index = combine_ ? place_.data() : sorted_.data();
  rows->recv_index = combine_ ? sorted_.data() : place_.data();
  return std::string();
}

}  // namespace moe
}  // namespace spmd
