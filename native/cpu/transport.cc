// The CPU transports; see transport.h.
#include "transport.h"

#include <cstring>
#include <string>

#include "spmd/alltoallv.h"

namespace spmd {
namespace {

bool IsHalf(xla::ffi::DataType d) {
  return d == xla::ffi::DataType::F16 || d == xla::ffi::DataType::BF16;
}

// Scratch kept between calls (grows, never shrinks), so the hot path allocates nothing once
// warm: the compressed allreduce's wire copies, and the hierarchical allreduce's leader buffer
// and float32 copies.
thread_local std::vector<uint16_t> wire_in, wire_out;
thread_local Leaves wire_in_leaves, wire_out_leaves;
thread_local std::vector<char> hier_scratch;
thread_local std::vector<float> hier_wide_in, hier_wide_out;
// all_to_allv over MPI: every rank's counts, and this rank's offsets.
thread_local std::vector<int64_t> a2av_records;
thread_local a2av::Plan a2av_plan;
thread_local std::vector<char> a2av_send, a2av_recv;

size_t Elements(const Leaves& leaves) {
  size_t count = 0;
  for (const Leaf& l : leaves) count += l.bytes / l.elem;
  return count;
}

}  // namespace

// -- the interface ----------------------------------------------------------------------------

const std::vector<size_t>& Transport::Blocks(xla::ffi::Span<const int64_t> sizes, size_t row,
                                             size_t equal) {
  blocks_.assign(static_cast<size_t>(size_), equal);
  for (size_t r = 0; r < sizes.size(); ++r) blocks_[r] = static_cast<size_t>(sizes[r]) * row;
  return blocks_;
}

Status Transport::Allreduce(const Signature& sig, ReduceOp op, const Leaves& in,
                            const Leaves& out) {
  SPMD_RETURN_IF_ERROR(Check(sig));
  return AllreduceLeaves(sig, op, in, out);
}

Status Transport::AllreduceNarrowed(const Signature& sig, bool bf16, float div, const Leaves& in,
                                    const Leaves& out) {
  SPMD_RETURN_IF_ERROR(Check(sig));
  return AllreduceNarrowedLeaves(sig, bf16, div, in, out);
}

Status Transport::Allgatherv(const Signature& sig, xla::ffi::Span<const int64_t> sizes,
                             const Leaves& in, const Leaves& out) {
  SPMD_RETURN_IF_ERROR(Check(sig));
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  for (size_t i = 0; i < in.size(); ++i) {
    size_t row = total ? out[i].bytes / static_cast<size_t>(total) : 0;
    SPMD_RETURN_IF_ERROR(AllgathervLeaf(sig, in[i], out[i], Blocks(sizes, row, in[i].bytes)));
  }
  return Status::Ok();
}

Status Transport::ReduceScatterv(const Signature& sig, ReduceOp op,
                                 xla::ffi::Span<const int64_t> sizes, const Leaves& in,
                                 const Leaves& out) {
  SPMD_RETURN_IF_ERROR(Check(sig));
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  for (size_t i = 0; i < in.size(); ++i) {
    size_t row = total ? in[i].bytes / static_cast<size_t>(total) : 0;
    SPMD_RETURN_IF_ERROR(
        ReduceScattervLeaf(sig, op, in[i], out[i], Blocks(sizes, row, out[i].bytes)));
  }
  return Status::Ok();
}

Status Transport::Broadcast(const Signature& sig, int root, const Leaves& in, const Leaves& out) {
  SPMD_RETURN_IF_ERROR(Check(sig));
  for (size_t i = 0; i < in.size(); ++i) {
    SPMD_RETURN_IF_ERROR(BroadcastLeaf(sig, root, in[i], out[i]));
  }
  return Status::Ok();
}

Status Transport::AllToAll(const Signature& sig, const Leaves& in, const Leaves& out) {
  SPMD_RETURN_IF_ERROR(Check(sig));
  for (size_t i = 0; i < in.size(); ++i) {
    size_t block = in[i].bytes / static_cast<size_t>(size_);
    SPMD_RETURN_IF_ERROR(AllToAllLeaf(sig, in[i], out[i], block));
  }
  return Status::Ok();
}

Status Transport::AllToAllv(const Signature& sig, const Leaf& in, const Leaf& out,
                            const a2av::Rows& rows, const std::vector<int64_t>& record,
                            const a2av::Planner& planner) {
  SPMD_RETURN_IF_ERROR(Check(sig));
  return AllToAllvNow(sig, in, out, rows, record, planner);
}

Status Transport::Barrier(const Signature& sig) {
  SPMD_RETURN_IF_ERROR(Check(sig));
  return BarrierNow(sig);
}

// -- shared memory ----------------------------------------------------------------------------

Status ShmTransport::AllreduceLeaves(const Signature& sig, ReduceOp op, const Leaves& in,
                                     const Leaves& out) {
  return shm_.Allreduce(sig, op, in, out, one_shot_max_);
}

// The conversions happen in the copies the algorithm makes anyway (shm.h).
Status ShmTransport::AllreduceNarrowedLeaves(const Signature& sig, bool bf16, float div,
                                             const Leaves& in, const Leaves& out) {
  return shm_.AllreduceNarrowed(sig, bf16, div, in, out, one_shot_max_);
}

Status ShmTransport::AllgathervLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                                    const std::vector<size_t>& bytes) {
  return shm_.Allgatherv(sig, in, out, bytes);
}

Status ShmTransport::ReduceScattervLeaf(const Signature& sig, ReduceOp op, const Leaf& in,
                                        const Leaf& out, const std::vector<size_t>& bytes) {
  return shm_.ReduceScatterv(sig, op, in, out, bytes);
}

Status ShmTransport::BroadcastLeaf(const Signature& sig, int root, const Leaf& in,
                                   const Leaf& out) {
  return shm_.Broadcast(sig, root, in, out);
}

Status ShmTransport::AllToAllLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                                  size_t block) {
  return shm_.AllToAll(sig, in, out, block);
}

Status ShmTransport::AllToAllvNow(const Signature& sig, const Leaf& in, const Leaf& out,
                                  const a2av::Rows& rows, const std::vector<int64_t>& record,
                                  const a2av::Planner& planner) {
  return shm_.AllToAllv(sig, in, out, rows, record, planner);
}

Status ShmTransport::BarrierNow(const Signature& sig) { return shm_.Barrier(sig); }

// -- MPI --------------------------------------------------------------------------------------

Status MpiTransport::AllreduceLeaves(const Signature&, ReduceOp op, const Leaves& in,
                                     const Leaves& out) {
  for (size_t i = 0; i < in.size(); ++i) {
    SPMD_RETURN_IF_ERROR(
        comm_.Allreduce(in[i].data, out[i].data, in[i].bytes / in[i].elem, in[i].dtype, op));
  }
  return Status::Ok();
}

Status MpiTransport::AllreduceNarrowedLeaves(const Signature& sig, bool bf16, float div,
                                             const Leaves& in, const Leaves& out) {
  const size_t count = Elements(in);
  if (wire_in.size() < count) {
    wire_in.resize(count);
    wire_out.resize(count);
  }
  const xla::ffi::DataType dt = bf16 ? xla::ffi::DataType::BF16 : xla::ffi::DataType::F16;
  wire_in_leaves.clear();
  wire_out_leaves.clear();
  size_t at = 0;
  for (const Leaf& l : in) {
    size_t n = l.bytes / l.elem;
    NarrowFloats(bf16, reinterpret_cast<const float*>(l.data), div, wire_in.data() + at, n);
    wire_in_leaves.push_back(ScratchLeaf(wire_in.data() + at, n * 2, dt, 2));
    wire_out_leaves.push_back(ScratchLeaf(wire_out.data() + at, n * 2, dt, 2));
    at += n;
  }
  SPMD_RETURN_IF_ERROR(AllreduceLeaves(sig, ReduceOp::kSum, wire_in_leaves, wire_out_leaves));
  at = 0;
  for (const Leaf& l : out) {
    size_t n = l.bytes / l.elem;
    WidenHalves(bf16, wire_out.data() + at, reinterpret_cast<float*>(l.data), n);
    at += n;
  }
  return Status::Ok();
}

Status MpiTransport::AllgathervLeaf(const Signature&, const Leaf& in, const Leaf& out,
                                    const std::vector<size_t>& bytes) {
  return comm_.Allgatherv(in.data, out.data, bytes);
}

Status MpiTransport::ReduceScattervLeaf(const Signature&, ReduceOp op, const Leaf& in,
                                        const Leaf& out, const std::vector<size_t>& bytes) {
  std::vector<size_t> counts;
  for (size_t b : bytes) counts.push_back(b / in.elem);
  return comm_.ReduceScatterv(in.data, out.data, counts, in.dtype, op);
}

Status MpiTransport::BroadcastLeaf(const Signature&, int root, const Leaf& in, const Leaf& out) {
  if (comm_.rank == root) std::memcpy(out.data, in.data, in.bytes);
  return comm_.Broadcast(out.data, out.bytes, root);
}

Status MpiTransport::AllToAllLeaf(const Signature&, const Leaf& in, const Leaf& out,
                                  size_t block) {
  return comm_.AllToAll(in.data, out.data, block);
}

Status MpiTransport::AllToAllvNow(const Signature&, const Leaf& in, const Leaf& out,
                                  const a2av::Rows& rows, const std::vector<int64_t>& record,
                                  const a2av::Planner& planner) {
  const int n = size_;
  if (a2av_records.size() < record.size() * n) a2av_records.resize(record.size() * n);
  SPMD_RETURN_IF_ERROR(comm_.Allgatherv(record.data(), a2av_records.data(),
                                        std::vector<size_t>(n, record.size() * sizeof(int64_t))));
  const a2av::Plan& p = a2av_plan;
  std::string bad = planner(a2av_records.data(), &a2av_plan);
  if (!bad.empty()) return Status::Error(bad);
  rows.Prepare(out.data, out.bytes, p.received, true,  // rows land whole (below)
               [](char* dst, size_t len) { std::memset(dst, 0, len); });
  // Indexed rows go through scratch: gathered before MPI sends them, placed after it receives.
  const char* send = in.data;
  char* recv = out.data;
  auto copy = [](char* dst, const char* src, size_t len) { std::memcpy(dst, src, len); };
  if (rows.send_index != nullptr) {
    size_t sent = 0;
    for (int j = 0; j < n; ++j) sent += p.send_bytes[j];
    if (a2av_send.size() < sent) a2av_send.resize(sent);
    rows.Read(in.data, a2av_send.data(), 0, sent, copy);
    send = a2av_send.data();
  }
  if (rows.recv_index != nullptr) {
    if (a2av_recv.size() < p.received) a2av_recv.resize(p.received);
    recv = a2av_recv.data();
  }
  SPMD_RETURN_IF_ERROR(
      comm_.AllToAllv(send, p.send_bytes, p.send_off, recv, p.recv_bytes, p.recv_off));
  if (rows.recv_index != nullptr) rows.Write(out.data, 0, recv, p.received, copy);
  rows.Finish(out.data);
  return Status::Ok();
}

Status MpiTransport::BarrierNow(const Signature&) { return comm_.Barrier(); }

// -- hierarchical -----------------------------------------------------------------------------

NodeLayout NodeLayout::Of(const std::vector<int>& node_of) {
  NodeLayout l;
  std::vector<int> count;
  for (int n : node_of) {
    if (n < 0) return NodeLayout{};
    if (n >= static_cast<int>(count.size())) count.resize(n + 1, 0);
    ++count[n];
  }
  l.nodes = static_cast<int>(count.size());
  l.per_node = count.empty() ? 0 : count[0];
  for (int c : count) l.per_node = c == l.per_node ? l.per_node : 0;
  l.contiguous = l.per_node > 0;
  for (size_t r = 0; l.contiguous && r < node_of.size(); ++r) {
    l.contiguous = node_of[r] == static_cast<int>(r) / l.per_node;
  }
  return l;
}

namespace {

// `count` elements of `elem` bytes cut into `parts` pieces as even as whole elements allow:
// piece k is bytes[k] long and starts at off[k].
void EvenPieces(size_t count, size_t elem, int parts, std::vector<size_t>* bytes,
                std::vector<size_t>* off) {
  bytes->assign(static_cast<size_t>(parts), 0);
  off->assign(static_cast<size_t>(parts), 0);
  size_t at = 0;
  for (int k = 0; k < parts; ++k) {
    const size_t n = count / parts + (static_cast<size_t>(k) < count % parts ? 1 : 0);
    (*bytes)[k] = n * elem;
    (*off)[k] = at;
    at += n * elem;
  }
}

// The hierarchical ops' scratch and layouts, kept between calls.
thread_local std::vector<size_t> hier_bytes, hier_off, hier_node, hier_at, hier_starts;
thread_local std::vector<char> hier_piece, hier_regroup, hier_done;

const std::vector<size_t>& Starts(const std::vector<size_t>& bytes) {
  BlockStarts(bytes, &hier_starts);
  return hier_starts;
}

}  // namespace

Status HierTransport::AllreduceLeaves(const Signature& sig, ReduceOp op, const Leaves& in,
                                      const Leaves& out) {
  bool half = false;
  for (const Leaf& l : in) half = half || IsHalf(l.dtype);
  if (!half || (op != ReduceOp::kSum && op != ReduceOp::kProd)) return Steps(sig, op, in, out);
  // Max and min are exact: only sums and products widen. The half-precision leaves go widened,
  // the others as they are (every rank splits alike).
  Leaves half_in, half_out, rest_in, rest_out;
  for (size_t i = 0; i < in.size(); ++i) {
    (IsHalf(in[i].dtype) ? half_in : rest_in).push_back(in[i]);
    (IsHalf(in[i].dtype) ? half_out : rest_out).push_back(out[i]);
  }
  if (!half_in.empty()) SPMD_RETURN_IF_ERROR(Widened(sig, op, half_in, half_out));
  if (!rest_in.empty()) SPMD_RETURN_IF_ERROR(Steps(sig, op, rest_in, rest_out));
  return Status::Ok();
}

Status HierTransport::Steps(const Signature& sig, ReduceOp op, const Leaves& in,
                            const Leaves& out) {
  if (rail_ != nullptr) {
    if (in.size() == 1) return RailAllreduce(sig, op, in[0], out[0]);
    // Several leaves: those of one dtype go as one buffer (three steps for them all, not three
    // per leaf), packed into scratch in leaf order and unpacked after.
    hier_done.assign(in.size(), 0);
    for (size_t i = 0; i < in.size(); ++i) {
      if (hier_done[i]) continue;
      size_t total = 0;
      for (size_t j = i; j < in.size(); ++j) total += in[j].dtype == in[i].dtype ? in[j].bytes : 0;
      if (hier_scratch.size() < total) hier_scratch.resize(total);
      size_t at = 0;
      for (size_t j = i; j < in.size(); ++j) {
        if (in[j].dtype != in[i].dtype) continue;
        std::memcpy(hier_scratch.data() + at, in[j].data, in[j].bytes);
        at += in[j].bytes;
      }
      Leaf all = ScratchLeaf(hier_scratch.data(), total, in[i].dtype, in[i].elem);
      SPMD_RETURN_IF_ERROR(RailAllreduce(sig, op, all, all));
      at = 0;
      for (size_t j = i; j < in.size(); ++j) {
        if (in[j].dtype != in[i].dtype) continue;
        std::memcpy(out[j].data, hier_scratch.data() + at, out[j].bytes);
        at += out[j].bytes;
        hier_done[j] = 1;
      }
    }
    return Status::Ok();
  }
  // Unequal nodes: through the node leaders.
  SPMD_RETURN_IF_ERROR(local_.Allreduce(sig, op, in, out, one_shot_max_));
  for (const Leaf& o : out) {
    if (leaders_ == nullptr) {  // only the leader's value is read; no scratch here
      SPMD_RETURN_IF_ERROR(local_.Broadcast(sig, 0, o, o));
      continue;
    }
    if (hier_scratch.size() < o.bytes) hier_scratch.resize(o.bytes);
    Leaf tmp = ScratchLeaf(hier_scratch.data(), o.bytes, o.dtype, o.elem);
    SPMD_RETURN_IF_ERROR(leaders_->Allreduce(o.data, tmp.data, o.bytes / o.elem, o.dtype, op));
    SPMD_RETURN_IF_ERROR(local_.Broadcast(sig, 0, tmp, o));
  }
  return Status::Ok();
}

// Piece k of the node's sum on local rank k, that piece summed over the nodes on rail k, the
// pieces gathered inside the node. `in` and `out` may be one buffer: each step reads what the
// one before wrote, and the peers read only the shared slots.
Status HierTransport::RailAllreduce(const Signature& sig, ReduceOp op, const Leaf& in,
                                    const Leaf& out) {
  const int k = local_.rank();
  EvenPieces(in.bytes / in.elem, in.elem, local_.size(), &hier_bytes, &hier_off);
  const size_t len = hier_bytes[k];
  if (hier_piece.size() < len) hier_piece.resize(len);
  Leaf piece = ScratchLeaf(hier_piece.data(), len, in.dtype, in.elem);
  SPMD_RETURN_IF_ERROR(local_.ReduceScatterv(sig, op, in, piece, hier_bytes));
  Leaf mine = ScratchLeaf(out.data + hier_off[k], len, in.dtype, in.elem);
  if (len > 0) {  // (every rank of rail k has a piece of the same length)
    SPMD_RETURN_IF_ERROR(rail_->Allreduce(piece.data, mine.data, len / in.elem, in.dtype, op));
  }
  return local_.Allgatherv(sig, mine, out, hier_bytes);
}

Status HierTransport::Widened(const Signature& sig, ReduceOp op, const Leaves& in,
                              const Leaves& out) {
  const size_t count = Elements(in);
  if (hier_wide_in.size() < count) {
    hier_wide_in.resize(count);
    hier_wide_out.resize(count);
  }
  size_t at = 0;
  for (const Leaf& l : in) {
    size_t n = l.bytes / l.elem;
    HalfToFloats(l.dtype == xla::ffi::DataType::BF16, reinterpret_cast<const uint16_t*>(l.data),
                 hier_wide_in.data() + at, n);
    at += n;
  }
  const size_t bytes = count * sizeof(float);
  Leaves win{
      ScratchLeaf(hier_wide_in.data(), bytes, xla::ffi::DataType::F32, sizeof(float))};
  Leaves wout{
      ScratchLeaf(hier_wide_out.data(), bytes, xla::ffi::DataType::F32, sizeof(float))};
  SPMD_RETURN_IF_ERROR(Steps(sig, op, win, wout));
  at = 0;
  for (const Leaf& l : out) {
    size_t n = l.bytes / l.elem;
    FloatsToHalf(l.dtype == xla::ffi::DataType::BF16, hier_wide_out.data() + at,
                 reinterpret_cast<uint16_t*>(l.data), n);
    at += n;
  }
  return Status::Ok();
}

// Rank (n, k) (node n, local index k) sends its block over rail k, which places block (m, k) of
// every node m; then node m's blocks are gathered inside the node, one node after another.
Status HierTransport::AllgathervLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                                     const std::vector<size_t>& bytes) {
  if (!BlocksOnRails()) return MpiTransport::AllgathervLeaf(sig, in, out, bytes);
  const int nodes = layout_.nodes, per = layout_.per_node, k = local_.rank();
  const std::vector<size_t>& off = Starts(bytes);
  hier_node.assign(nodes, 0);
  hier_at.assign(nodes, 0);
  for (int m = 0; m < nodes; ++m) {
    hier_node[m] = bytes[m * per + k];
    hier_at[m] = off[m * per + k];
  }
  SPMD_RETURN_IF_ERROR(rail_->Allgatherv(in.data, out.data, hier_node, &hier_at));
  for (int m = 0; m < nodes; ++m) {
    hier_bytes.assign(bytes.begin() + m * per, bytes.begin() + (m + 1) * per);
    Leaf part = ScratchLeaf(out.data + off[m * per], off[(m + 1) * per] - off[m * per],
                            out.dtype, out.elem);
    Leaf mine = ScratchLeaf(out.data + off[m * per + k], bytes[m * per + k], out.dtype, out.elem);
    SPMD_RETURN_IF_ERROR(local_.Allgatherv(sig, mine, part, hier_bytes));
  }
  return Status::Ok();
}

// Node m's part of the input reduced inside the node, local rank k keeping block (m, k) of it;
// those blocks reduced over rail k, rank (n, k) keeping its own. Half-precision sums and
// products go over the whole group's MPI, which rounds once.
Status HierTransport::ReduceScattervLeaf(const Signature& sig, ReduceOp op, const Leaf& in,
                                         const Leaf& out, const std::vector<size_t>& bytes) {
  const bool rounds_twice = IsHalf(in.dtype) && (op == ReduceOp::kSum || op == ReduceOp::kProd);
  if (!BlocksOnRails() || rounds_twice) {
    return MpiTransport::ReduceScattervLeaf(sig, op, in, out, bytes);
  }
  const int nodes = layout_.nodes, per = layout_.per_node, k = local_.rank();
  const std::vector<size_t>& off = Starts(bytes);
  size_t total = 0;
  for (int m = 0; m < nodes; ++m) total += bytes[m * per + k];
  if (hier_piece.size() < total) hier_piece.resize(total);
  hier_at.assign(nodes, 0);  // the rail's counts, in elements
  size_t at = 0;
  for (int m = 0; m < nodes; ++m) {
    hier_bytes.assign(bytes.begin() + m * per, bytes.begin() + (m + 1) * per);
    Leaf part = ScratchLeaf(in.data + off[m * per], off[(m + 1) * per] - off[m * per], in.dtype,
                            in.elem);
    Leaf mine = ScratchLeaf(hier_piece.data() + at, bytes[m * per + k], in.dtype, in.elem);
    SPMD_RETURN_IF_ERROR(local_.ReduceScatterv(sig, op, part, mine, hier_bytes));
    hier_at[m] = bytes[m * per + k] / in.elem;
    at += bytes[m * per + k];
  }
  return rail_->ReduceScatterv(hier_piece.data(), out.data, hier_at, in.dtype, op);
}

// Block (n, l) -> (m, k) travels inside node n from local rank l to k, then over rail k from
// node n to m: the input regrouped by destination local rank, an all_to_all inside the node,
// regrouped by destination node, an all_to_all over the rail, whose result is in source order.
Status HierTransport::AllToAllLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                                   size_t block) {
  if (!BlocksOnRails() || in.bytes > kHierAllToAllMax) {
    return MpiTransport::AllToAllLeaf(sig, in, out, block);
  }
  const size_t nodes = layout_.nodes, per = layout_.per_node;
  if (hier_regroup.size() < 2 * in.bytes) hier_regroup.resize(2 * in.bytes);
  char* a = hier_regroup.data();
  char* b = a + in.bytes;
  for (size_t l = 0; l < per; ++l) {  // a[l][m] = in[m][l]: block for (m, l)
    for (size_t m = 0; m < nodes; ++m) {
      std::memcpy(a + (l * nodes + m) * block, in.data + (m * per + l) * block, block);
    }
  }
  SPMD_RETURN_IF_ERROR(local_.AllToAll(sig, ScratchLeaf(a, in.bytes, in.dtype, in.elem),
                                       ScratchLeaf(b, in.bytes, in.dtype, in.elem),
                                       nodes * block));
  for (size_t l = 0; l < per; ++l) {  // b[l][m]: from (n, l) for (m, k); into a[m][l]
    for (size_t m = 0; m < nodes; ++m) {
      std::memcpy(a + (m * per + l) * block, b + (l * nodes + m) * block, block);
    }
  }
  return rail_->AllToAll(a, out.data, per * block);
}

}  // namespace spmd
