// all_to_allv's counts, shared by the CPU transports and the GPU handler.
//
// Before any row moves, every rank of the group publishes a record of its call: its rows, its
// output's rows, whether its send counts must add up to its rows exactly, and its send and
// receive counts. Every rank then checks every rank's record in the same order (Verdict), so a
// bad count on one rank (negative, not adding up, disagreeing with what the peer sends, more
// rows than the output holds) is the same error on every rank instead of a hang or a mismatched
// transfer. The records also give each rank its offsets (Plan) and every rank the same number of
// pipeline steps.
#ifndef SPMD_ALLTOALLV_H_
#define SPMD_ALLTOALLV_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "spmd/call.h"
#include "xla/ffi/api/ffi.h"

namespace spmd {
namespace a2av {

// Whether y holds rows like x's: x's dtype and x's shape after axis 0; *row: bytes per row.
inline bool SameRows(const Leaf& x, const Leaf& y, size_t* row) {
  bool same = x.dims.size() >= 1 && y.dims.size() == x.dims.size() && y.dtype == x.dtype;
  *row = x.elem;
  for (size_t k = 1; same && k < x.dims.size(); ++k) {
    same = y.dims[k] == x.dims[k];
    *row *= static_cast<size_t>(x.dims[k]);
  }
  return same;
}

// The operands x [rows, ...], send_counts and recv_counts (int32[n]), then `indices` int32
// vectors (send_index and/or recv_index, see Rows), and the result [out_rows, ...] as the
// Python side makes them; *row: bytes per row.
inline xla::ffi::Error CheckShapes(const CallBase& call, int n, size_t* row, size_t indices = 0) {
  if (call.in.size() != 3 + indices || call.out.size() != 1) {
    return call.Fail("expected operands x, send_counts, recv_counts, " +
                     std::to_string(indices) + " index vectors and one result");
  }
  for (size_t i = 3; i < call.in.size(); ++i) {
    if (call.in[i].dtype != xla::ffi::DataType::S32 || call.in[i].dims.size() != 1) {
      return call.Fail("send_index and recv_index must be int32 vectors");
    }
  }
  for (size_t i = 1; i < 3; ++i) {
    const Leaf& c = call.in[i];
    if (c.dtype != xla::ffi::DataType::S32 || c.dims.size() != 1 || c.dims[0] != n) {
      return call.Fail("send_counts and recv_counts must be int32[" + std::to_string(n) +
                       "], one count per rank of the group");
    }
  }
  if (!SameRows(call.in[0], call.out[0], row)) {
    return call.Fail("the result must have x's dtype and x's shape after axis 0");
  }
  return xla::ffi::Error::Success();
}

// A record: [rows, out_rows, exact, bad, send[0..n), recv[0..n)], int64 each. rows: the rows
// the rank sends from (x's, or send_index's length); bad: 1 when its indices failed CheckRows.
enum : size_t { kRows = 0, kOutRows = 1, kExact = 2, kBad = 3, kSend = 4 };
inline size_t RecordLen(int n) { return kSend + 2 * static_cast<size_t>(n); }

inline void Fill(int64_t* rec, int64_t rows, int64_t out_rows, bool exact, const int32_t* send,
                 const int32_t* recv, int n, bool bad = false) {
  rec[kRows] = rows;
  rec[kOutRows] = out_rows;
  rec[kExact] = exact ? 1 : 0;
  rec[kBad] = bad ? 1 : 0;
  for (int j = 0; j < n; ++j) {
    rec[kSend + j] = send[j];
    rec[kSend + n + j] = recv[j];
  }
}

inline std::string Counts(const int64_t* c, int n) {
  std::string s = "[";
  constexpr int kShown = 16;
  for (int j = 0; j < n && j < kShown; ++j) s += (j ? ", " : "") + std::to_string(c[j]);
  if (n > kShown) s += ", ...";
  return s + "]";
}

// The first problem in the ranks' records (`all`: n records, rank after rank), checked in the
// same order on every rank; empty if there is none. `world`: the group's world ranks, as the
// message names them.
inline std::string Verdict(const int64_t* all, int n, const std::vector<int>& world) {
  const size_t len = RecordLen(n);
  auto rec = [&](int r) { return all + r * len; };
  auto who = [&](int r) { return "rank " + std::to_string(world[r]); };
  for (int r = 0; r < n; ++r) {
    if (rec(r)[kBad] != 0) {
      return who(r) + " passed a send_index or recv_index that is out of range or repeats a "
             "row (its own error says which)";
    }
  }
  for (int r = 0; r < n; ++r) {
    const int64_t* send = rec(r) + kSend;
    const int64_t* recv = send + n;
    for (int j = 0; j < n; ++j) {
      if (send[j] < 0 || recv[j] < 0) {
        bool s = send[j] < 0;
        return who(r) + " passed " + (s ? "send_counts=" : "recv_counts=") +
               Counts(s ? send : recv, n) + ", which holds a negative count; counts are rows, 0 "
               "or more";
      }
    }
    int64_t sent = 0;
    for (int j = 0; j < n; ++j) sent += send[j];
    const int64_t rows = rec(r)[kRows];
    if (rec(r)[kExact] ? sent != rows : sent > rows) {
      return who(r) + " passed send_counts=" + Counts(send, n) + ", which add up to " +
             std::to_string(sent) + " rows, but its x has " + std::to_string(rows) +
             " rows; the send counts must add up to x.shape[0]";
    }
  }
  for (int r = 0; r < n; ++r) {
    const int64_t* recv = rec(r) + kSend + n;
    for (int j = 0; j < n; ++j) {
      const int64_t sends = rec(j)[kSend + r];
      if (recv[j] != sends) {
        return who(r) + " expects " + std::to_string(recv[j]) + " rows from " + who(j) +
               " (its recv_counts[" + std::to_string(j) + "]), but " + who(j) + " sends " +
               std::to_string(sends) + " (its send_counts[" + std::to_string(r) +
               "]); pass recv_counts=None to have them exchanged";
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    int64_t received = 0;
    for (int j = 0; j < n; ++j) received += rec(r)[kSend + n + j];
    if (received > rec(r)[kOutRows]) {
      return who(r) + " receives " + std::to_string(received) + " rows, but its output holds " +
             "out_rows=" + std::to_string(rec(r)[kOutRows]) + "; pass out_rows=" +
             std::to_string(received) + " or more";
    }
  }
  return "";
}

// Where this rank's blocks start in its input and output, once the records are known to be
// good. Bytes; `row`: bytes per row.
struct Plan {
  std::vector<size_t> send_bytes, send_off, recv_bytes, recv_off;
  size_t received = 0;  // bytes this rank receives, itself included
  size_t most = 0;      // the largest block between two different ranks (same on every rank)
  size_t total = 0;     // bytes moving between different ranks (same on every rank)
};

inline void MakePlan(const int64_t* all, int n, int me, size_t row, Plan* p) {
  const size_t len = RecordLen(n);
  const int64_t* mine = all + me * len;
  p->send_bytes.assign(n, 0);
  p->send_off.assign(n, 0);
  p->recv_bytes.assign(n, 0);
  p->recv_off.assign(n, 0);
  size_t s = 0, r = 0;
  for (int j = 0; j < n; ++j) {
    p->send_off[j] = s;
    p->recv_off[j] = r;
    p->send_bytes[j] = static_cast<size_t>(mine[kSend + j]) * row;
    p->recv_bytes[j] = static_cast<size_t>(mine[kSend + n + j]) * row;
    s += p->send_bytes[j];
    r += p->recv_bytes[j];
  }
  p->received = r;
  p->most = p->total = 0;
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      size_t bytes = static_cast<size_t>(all[a * len + kSend + b]) * row;
      p->most = std::max(p->most, bytes);
      p->total += bytes;
    }
  }
}

// dst = w * src over `bytes` of elements of the rows' dtype, or dst += w * src; `w` points to
// one element of that dtype, or is nullptr for 1 (the moe exchange, spmd/../cpu/moe.h).
using RowFn = void (*)(char* dst, const char* src, size_t bytes, const char* w);

// The row indices of an indexed all_to_allv (spmd.ops.all_to_allv_indexed). With S rows sent
// (the send counts' sum) and R received (the receive counts'), the rows a rank sends, in order,
// are x's first S rows, or with a send_index x[send_index[i] / repeat] for i < S; received row i
// (in member order) lands in row i of the output, or with a recv_index in row recv_index[i].
// send_index[:S] is a permutation of 0 .. S - 1 (S at most x's rows * repeat), recv_index[:R] a
// permutation of 0 .. R - 1; entries past them are not read. So the rows past R are the zeros of
// a plain call, and the transpose of each index is the other.
//
// The moe exchange adds weights and sums. With a send_weight, the row sent for entry i is
// scaled by send_weight[send_index[i]]. With reduce > 0, received row i is added, scaled by
// recv_weight[recv_index[i]] (1 without weights), into output row recv_index[i] / reduce, one
// of `targets` rows; recv_index need not be a permutation, and targets no row reaches are zeros.
// The first row to reach a target is written, the others added: with two rows per target the
// sum is the same whichever comes first.
struct Rows {
  const int32_t* send_index = nullptr;
  int64_t repeat = 1;
  const int32_t* recv_index = nullptr;
  size_t row = 0;  // bytes per row

  const char* send_weight = nullptr;
  const char* recv_weight = nullptr;
  size_t elem = 0;  // bytes per weight: the rows' dtype
  int64_t reduce = 0;
  size_t targets = 0;
  RowFn scale = nullptr, add = nullptr;     // set with weights or reduce
  std::vector<uint8_t>* touched = nullptr;  // reduce: one flag per target
  std::vector<int32_t>* by_x = nullptr;     // scratch for Move (nullptr: the exchange's order)
  // Where received rows do not fill a prefix of the output: the rows between them, as (first
  // row, rows), zeroed instead of the rows past the received ones.
  const std::vector<std::pair<int64_t, int64_t>>* gaps = nullptr;

  bool plain() const { return send_index == nullptr && recv_index == nullptr; }

  // The pipeline's piece of each block in bytes, from the transport's `cb`: in reduce mode a
  // whole number of rows where one fits (and still a multiple of `align`), so that every piece
  // written is whole rows; 0 where none fits (then Prepare's `whole` is false).
  size_t Piece(size_t cb, size_t align) const {
    if (reduce <= 0) return cb;
    size_t unit = row;
    while (unit % align != 0) unit += row;  // lcm(row, align): align is a power of two
    return unit <= cb ? cb / unit * unit : 0;
  }

  // Before any row lands in y (`bytes` long, `received`: the bytes the counts bring): zeros
  // past the rows received; in reduce mode, no target reached yet, or, where pieces may split
  // rows (`whole` false), zeros everywhere and every piece added. zero(dst, len) writes zeros.
  template <typename Z>
  void Prepare(char* y, size_t bytes, size_t received, bool whole, const Z& zero) const {
    if (reduce <= 0 && gaps != nullptr) {
      for (const auto& g : *gaps) zero(y + g.first * row, g.second * row);
      return;
    }
    if (reduce <= 0) {
      if (bytes > received) zero(y + received, bytes - received);
      return;
    }
    touched->assign(targets, whole ? 0 : 1);
    if (!whole) zero(y, bytes);
  }

  // After the last row: zeros in the targets that no row reached (reduce mode).
  void Finish(char* y) const {
    if (reduce <= 0) return;
    const uint8_t* t = touched->data();
    for (size_t i = 0; i < targets; ++i) {
      if (!t[i]) std::memset(y + i * row, 0, row);
    }
  }

  // Copies bytes [off, off + len) of the sequence of rows sent from x to dst, with
  // copy(dst, src, bytes).
  template <typename F>
  void Read(const char* x, char* dst, size_t off, size_t len, const F& copy) const {
    if (send_index == nullptr) return copy(dst, x + off, len);
    while (len != 0) {
      const size_t i = off / row, at = off - i * row, part = std::min(len, row - at);
      const int32_t a = send_index[i];
      const char* src = x + static_cast<size_t>(a / repeat) * row + at;
      if (send_weight != nullptr) {
        scale(dst, src, part, send_weight + static_cast<size_t>(a) * elem);
      } else {
        copy(dst, src, part);
      }
      dst += part;
      off += part;
      len -= part;
    }
  }

  // Copies len bytes from src to bytes [off, off + len) of the sequence of rows received, in y.
  template <typename F>
  void Write(char* y, size_t off, const char* src, size_t len, const F& copy) const {
    if (recv_index == nullptr) return copy(y + off, src, len);
    while (len != 0) {
      const size_t i = off / row, at = off - i * row, part = std::min(len, row - at);
      const int32_t a = recv_index[i];
      if (reduce <= 0) {
        copy(y + static_cast<size_t>(a) * row + at, src, part);
      } else {
        const size_t t = static_cast<size_t>(a / reduce);
        const char* w = recv_weight ? recv_weight + static_cast<size_t>(a) * elem : nullptr;
        uint8_t& seen = (*touched)[t];
        (seen ? add : scale)(y + t * row + at, src, part, w);
        seen = 1;
      }
      src += part;
      off += part;
      len -= part;
    }
  }

  // A rank's own block: `len` bytes from byte `from` of what it sends to byte `to` of what it
  // receives (both on row boundaries).
  template <typename F>
  void Move(const char* x, size_t from, char* y, size_t to, size_t len, const F& copy) const {
    if (send_index == nullptr) return Write(y, to, x + from, len, copy);
    if (reduce > 0) {  // the sent rows are not scaled (the combine): straight to their targets
      for (size_t done = 0; done < len; done += row) {
        const size_t a = static_cast<size_t>(send_index[(from + done) / row] / repeat);
        Write(y, to + done, x + a * row, row, copy);
      }
      return;
    }
    // A gather, row by row in the order of x's rows (one ascending pass; a token's assignments
    // one after the other) rather than the exchange's (by expert: a pass over x per expert,
    // each over rows far apart): spmd.moe's dispatch of 16 MiB per rank moved its own rows in
    // about 0.7x the time. Where send_index repeats a value or holds a negative one (neither
    // happens in the MoE exchange, the one caller that sets by_x), in the exchange's order.
    const size_t count = len / row;
    const int32_t* key = send_index + from / row;
    if (by_x != nullptr && count > 1) {
      int32_t lo = 0, hi = 0;
      for (size_t i = 0; i < count; ++i) {
        lo = std::min(lo, key[i]);
        hi = std::max(hi, key[i]);
      }
      by_x->assign(static_cast<size_t>(hi) + 1, -1);
      bool unique = lo >= 0;
      for (size_t i = 0; i < count && unique; ++i) {
        int32_t& slot = (*by_x)[key[i]];
        unique = slot < 0;
        slot = static_cast<int32_t>(i);
      }
      if (unique) {
        for (const int32_t i : *by_x) {
          if (i < 0) continue;
          const size_t at = static_cast<size_t>(i) * row;
          Read(x, y + Target(to + at), from + at, row, copy);
        }
        return;
      }
    }
    for (size_t done = 0; done < len; done += row) Read(x, y + Target(to + done), from + done,
                                                          row, copy);
  }

 private:
  size_t Target(size_t off) const {
    return recv_index == nullptr ? off : static_cast<size_t>(recv_index[off / row]) * row;
  }
};

// Given every rank's record (rank after rank): the first problem in them, the same on every
// rank, or this rank's plan (the moe exchange also fills its rows' indices there). A reference
// to a callable `std::string(const int64_t* all, Plan* plan)` that outlives the call it is
// passed to (a named lambda): nothing is allocated per call.
class Planner {
 public:
  template <typename F>
  Planner(const F& f)  // NOLINT(google-explicit-constructor): passed as the lambda itself
      : fn_(&f), call_([](const void* fn, const int64_t* all, Plan* plan) {
          return (*static_cast<const F*>(fn))(all, plan);
        }) {}
  std::string operator()(const int64_t* all, Plan* plan) const { return call_(fn_, all, plan); }

 private:
  const void* fn_;
  std::string (*call_)(const void*, const int64_t*, Plan*);
};

// all_to_allv's planner: Verdict, then MakePlan. `world`: the group's world ranks.
inline std::string CountsPlan(const int64_t* all, int n, int me, size_t row,
                              const std::vector<int>& world, Plan* plan) {
  std::string bad = Verdict(all, n, world);
  if (bad.empty()) MakePlan(all, n, me, row, plan);
  return bad;
}

// Why this rank's indices break Rows' rules; empty when they hold. `sent`, `received`: the
// rows its send and receive counts add up to; `limit`: x's rows * repeat. `seen`: scratch.
inline std::string CheckRows(const int32_t* send_index, int64_t send_len, int64_t sent,
                             int64_t limit, const int32_t* recv_index, int64_t recv_len,
                             int64_t received, std::vector<uint8_t>* seen) {
  auto permutation = [&](const int32_t* idx, int64_t len, int64_t used, const char* what,
                         const char* counts) {
    if (len < used) {
      return std::string(what) + " has " + std::to_string(len) + " entries, but " + counts +
             " add up to " + std::to_string(used) + " rows; expected one entry per row";
    }
    seen->assign(static_cast<size_t>(used), 0);
    for (int64_t i = 0; i < used; ++i) {
      const int64_t v = idx[i];
      if (v < 0 || v >= used) {
        return std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(v) +
               " is out of range; the first " + std::to_string(used) + " entries must be a " +
               "permutation of 0 to " + std::to_string(used - 1);
      }
      if ((*seen)[v]++) {
        return std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(v) +
               " repeats an earlier entry; the first " + std::to_string(used) + " entries " +
               "must be a permutation of 0 to " + std::to_string(used - 1);
      }
    }
    return std::string();
  };
  if (send_index != nullptr) {
    if (sent > limit) {
      return "the send counts add up to " + std::to_string(sent) + " rows, more than x's " +
             "rows times repeat (" + std::to_string(limit) + ")";
    }
    std::string bad = permutation(send_index, send_len, sent, "send_index", "the send counts");
    if (!bad.empty()) return bad;
  }
  if (recv_index != nullptr) {
    return permutation(recv_index, recv_len, received, "recv_index", "the receive counts");
  }
  return std::string();
}

}  // namespace a2av
}  // namespace spmd

#endif  // SPMD_ALLTOALLV_H_
