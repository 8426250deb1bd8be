// The shared-memory collectives (shm.h): what each op stages, reduces and copies out between
// the sync points.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "shm.h"
#include "shm_copy.h"
#include "spmd/alltoallv.h"

namespace spmd {
namespace {

using shm::kAlign;
using shm::kNoAlso;
using shm::OutCopy;
using shm::RoundUp;
using shm::StreamCopy;

// A streamed two-shot allreduce (Exact::ReduceStep) reduces into blocks of this size, which
// stay in L1 on their way to the result slot and the output.
constexpr size_t kReduceBlock = size_t{8} << 10;

// Staged copies (broadcast, allgather) move in pieces: while the other ranks copy piece k out
// of the slots, the ranks staging fill piece k+1. From kPipelineMin bytes a call is cut into
// about kPipelineSteps pieces of at most kPieceMax bytes, so that the root of a broadcast and
// the ranks it feeds are not one whole copy after the other, and a piece stays in the cache
// between its staging and its copies out. Below kPipelineMin a call is one step: a sync per
// piece would cost more than it overlaps (measured in docs/performance.md, "Shared memory").
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
  std::vector<size_t> off;
  BlockStarts(bytes, &off);
  for (size_t b : bytes) *most = std::max(*most, b);
  return off;
}

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
// all_to_allv: every rank's counts, and this rank's offsets.
thread_local std::vector<int64_t> a2av_records;
thread_local a2av::Plan a2av_plan;

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
  // Our own block goes to the output in the pass that stages it (OutCopy::Publish), so the
  // input is read from memory once.
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
      // Normal stores: reducing into L1 blocks and streaming them out was slower (measured in
      // docs/performance.md, "Shared memory").
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
  // Streamed under auto without a probe: only the root writes, and cached staging would have
  // every reader pull the root's modified lines out of its cache, which was slower in every
  // placement measured (docs/performance.md, "Shared memory").
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

Status ShmGroup::AllToAllv(const Signature& sig, const Leaf& in, const Leaf& out,
                           const a2av::Rows& rows, const std::vector<int64_t>& record,
                           const a2av::Planner& planner) {
  const int n = size_, me = rank_;
  const size_t len = record.size() * sizeof(int64_t);
  if (len > chunk_) {  // the same on every rank: n and the chunk are the group's
    return Status::Error("a group of " + std::to_string(n) + " ranks needs " +
                         std::to_string(len) + " bytes per rank for its counts, more than a " +
                         "shared-memory slot holds; use the MPI transport");
  }
  // The counts go in the slots of the first sync; every rank has read them before the slots of
  // that parity are written again, two syncs later.
  uint64_t t = next();
  std::memcpy(slot(me, t), record.data(), len);
  SPMD_RETURN_IF_ERROR(Begin(sig));
  if (a2av_records.size() < record.size() * n) a2av_records.resize(record.size() * n);
  for (int r = 0; r < n; ++r) std::memcpy(&a2av_records[r * record.size()], slot(r, t), len);
  const a2av::Plan& p = a2av_plan;
  std::string bad = planner(a2av_records.data(), &a2av_plan);
  if (!bad.empty()) return Status::Error(bad);
  // As AllToAll, with blocks of their own sizes: step by step, each rank stages the next piece
  // of every block it sends, and copies out the pieces staged for it. Every rank knows every
  // block, so all take the same number of steps. Summed rows need whole rows per piece.
  const size_t piece = rows.Piece(chunk_ / n / kAlign * kAlign, kAlign);
  const size_t cb = piece != 0 ? piece : chunk_ / n / kAlign * kAlign;
  const OutCopy put(out.bytes);
  rows.Prepare(out.data, out.bytes, p.received, piece != 0,
               [&put](char* dst, size_t len) { put.Zero(dst, len); });
  auto stage = [this](char* dst, const char* src, size_t len) { Stage(dst, src, len); };
  if (p.send_bytes[me] != 0) {
    rows.Move(in.data, p.send_off[me], out.data, p.recv_off[me], p.send_bytes[me], put);
  }
  bool first = false;
  SPMD_RETURN_IF_ERROR(Place(sig, p.total, &first));
  for (size_t lo = 0; lo < p.most; lo += cb) {
    t = next();
    for (int j = 0; j < n; ++j) {
      if (j != me && lo < p.send_bytes[j]) {
        rows.Read(in.data, slot(me, t) + j * cb, p.send_off[j] + lo,
                  std::min(cb, p.send_bytes[j] - lo), stage);
      }
    }
    SPMD_RETURN_IF_ERROR(Sync());
    for (int j = 0; j < n; ++j) {
      if (j != me && lo < p.recv_bytes[j]) {
        rows.Write(out.data, p.recv_off[j] + lo, slot(j, t) + me * cb,
                   std::min(cb, p.recv_bytes[j] - lo), put);
      }
    }
  }
  rows.Finish(out.data);
  return Status::Ok();
}

}  // namespace spmd
