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
#include <string>
#include <vector>

#include "spmd/call.h"
#include "xla/ffi/api/ffi.h"

namespace spmd {
namespace a2av {

// The operands x [rows, ...], send_counts and recv_counts (int32[n]) and the result
// [out_rows, ...] as the Python side makes them; *row: bytes per row.
inline xla::ffi::Error CheckShapes(const CallBase& call, int n, size_t* row) {
  if (call.in.size() != 3 || call.out.size() != 1) {
    return call.Fail("expected operands x, send_counts, recv_counts and one result");
  }
  for (size_t i = 1; i < 3; ++i) {
    const Leaf& c = call.in[i];
    if (c.dtype != xla::ffi::DataType::S32 || c.dims.size() != 1 || c.dims[0] != n) {
      return call.Fail("send_counts and recv_counts must be int32[" + std::to_string(n) +
                       "], one count per rank of the group");
    }
  }
  const Leaf& x = call.in[0];
  const Leaf& y = call.out[0];
  bool same = x.dims.size() >= 1 && y.dims.size() == x.dims.size() && y.dtype == x.dtype;
  *row = x.elem;
  for (size_t k = 1; same && k < x.dims.size(); ++k) {
    same = y.dims[k] == x.dims[k];
    *row *= static_cast<size_t>(x.dims[k]);
  }
  if (!same) return call.Fail("the result must have x's dtype and x's shape after axis 0");
  return xla::ffi::Error::Success();
}

// A record: [rows, out_rows, exact, send[0..n), recv[0..n)], int64 each.
enum : size_t { kRows = 0, kOutRows = 1, kExact = 2, kSend = 3 };
inline size_t RecordLen(int n) { return kSend + 2 * static_cast<size_t>(n); }

inline void Fill(int64_t* rec, int64_t rows, int64_t out_rows, bool exact, const int32_t* send,
                 const int32_t* recv, int n) {
  rec[kRows] = rows;
  rec[kOutRows] = out_rows;
  rec[kExact] = exact ? 1 : 0;
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

}  // namespace a2av
}  // namespace spmd

#endif  // SPMD_ALLTOALLV_H_
