// The XLA FFI handlers of the CPU collectives. Each takes, after the ordering operand, the leaves
// of one fused call and returns, after the ordering result, their results. The ordering operand
// is the previous collective's ordering result: that data dependency makes XLA run collectives
// in program order (see spmd/ops/_core.py).
#include "handlers.h"

#include <cstring>
#include <string>
#include <vector>

#include "groups.h"
#include "messages.h"
#include "spmd/common.h"
#include "spmd/call.h"
#include "reduce.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace spmd {
namespace {

// Op codes for signatures and messages.
enum Code : uint64_t {
  kAllreduce = 1,
  kAllgather,
  kReduceScatter,
  kBroadcast,
  kAllToAll,
  kSendRecv,
  kBarrier
};
const char* kNames[] = {"?", "allreduce", "allgather", "reduce_scatter", "broadcast",
                        "all_to_all", "sendrecv", "barrier"};
const char* kReduceNames[] = {"sum", "prod", "max", "min"};

// A decoded call: the group, the leaves, and what every rank must agree on.
struct Call : CallBase {
  explicit Call(Code c) : CallBase(kNames[c]), code(c) {}
  Code code;
  std::shared_ptr<Group> group;  // held for the whole call (spmd/registry.h)
  std::vector<std::vector<int64_t>> dims;  // of the inputs
  std::vector<ffi::DataType> dtypes;       // of the inputs (`in` may be swapped for wire copies)
  // Static parameters, formatted only when ranks disagree (never on the hot path).
  int32_t op = -1;
  int32_t wire = 0;  // allreduce compression: 1 float16, 2 bfloat16 (spmd/ops/_allreduce.py)
  int64_t div = 1;   // compressed: each rank's values are scaled by 1/div (op avg)
  int64_t root = -1;
  int role = kRoleForward;
  ffi::Span<const int64_t> sizes;
  bool has_sizes = false;

  std::string Params() const {
    std::string p;
    if (op >= 0) p += std::string("op=") + (div > 1 ? "avg" : kReduceNames[op]);
    if (wire) p += std::string(", compression=") + (wire == 2 ? "bf16" : "fp16");
    if (root >= 0) p += (p.empty() ? "" : ", ") + std::string("root=") + std::to_string(root);
    if (has_sizes) {
      p += (p.empty() ? "" : ", ") + std::string("sizes=[");
      for (size_t i = 0; i < sizes.size(); ++i) p += (i ? "," : "") + std::to_string(sizes[i]);
      p += "]";
    }
    return p;
  }
  uint64_t hash = 1469598103934665603ull;

  void Mix(uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      hash ^= (x >> (8 * i)) & 0xff;
      hash *= 1099511628211ull;
    }
  }
  std::string Describe() const {
    std::string s = std::string(kNames[code]) + "(" + Params() + ") of ";
    if (dtypes.empty()) s += "no arrays";
    for (size_t i = 0; i < dtypes.size(); ++i) {
      s += (i ? ", " : "") + std::string(DtypeName(dtypes[i])) + "[";
      for (size_t k = 0; k < dims[i].size(); ++k) {
        s += (k ? "," : "") + std::to_string(dims[i][k]);
      }
      s += "]";
    }
    if (role == kRoleJvp) s += " [JVP]";
    if (role == kRoleBackward) s += kBackwardTag;
    return s;
  }
  ShmGroup::Signature Sig() const {
    return {hash, [](const void* c) { return static_cast<const Call*>(c)->Describe(); }, this};
  }
};

ffi::Error Fail(const Call& call, const std::string& message) { return call.Fail(message); }

// Finds the group, decodes the ordering operand/result and the leaves, and hashes what ranks
// must agree on. `vary_rows`: the inputs' first dimension may differ between ranks (allgatherv).
ffi::Error Decode(Call& call, int64_t group_id, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  bool vary_rows) {
  call.role = RoleOf(group_id);
  call.group = GroupFind(GroupIdOf(group_id));
  if (call.group == nullptr) return call.GroupMissing();
  call.set_world_rank(call.group->world_ranks[call.group->rank]);
  if (ffi::Error e = call.Decode(args, rets); e.failure()) return e;
  call.Mix(call.code);
  call.Mix(static_cast<uint64_t>(call.role));
  for (const Leaf& l : call.in) {
    call.dims.emplace_back(l.dims.begin(), l.dims.end());
    call.dtypes.push_back(l.dtype);
    call.Mix(static_cast<uint64_t>(l.dtype));
    call.Mix(l.dims.size());
    for (size_t k = vary_rows ? 1 : 0; k < l.dims.size(); ++k) {
      call.Mix(static_cast<uint64_t>(l.dims[k]));
    }
  }
  return ffi::Error::Success();
}

ffi::Error FromStatus(const Call& call, const Status& s) { return call.FromStatus(s); }

// The MPI path checks that every rank made the same call before it moves data, as shared memory
// does in its first sync: MPI does not compare shapes, and an allreduce of 4 elements meeting one
// of 6 would return garbage in the 2 extra elements. One allgather of 8 bytes per call (once per
// fused call, not per leaf); the descriptions are exchanged only when the hashes differ.
Status MpiCheck(const Call& call, const MpiComm& comm) {
  return comm.CheckSame(call.hash, call.Describe());
}

// Whether the group moves this call's data over its MPI communicator (the fall-back order of
// the per-leaf ops below: shared memory when chosen, else MPI, else shared memory).
bool OverMpi(const Group& g) { return !(g.backend == Backend::kShm && g.shm) && g.has_mpi; }

Status NoBackend(const Call&) {
  return Status::Error("this group has no transport for the operation (send/recv/sendrecv need "
                       "MPI; the file-store communicator has only shared memory)");
}

// -- allreduce --------------------------------------------------------------------------------

Status AllreduceMpi(const Call& call, const MpiComm& comm, ReduceOp op,
                    const std::vector<Leaf>& in, const std::vector<Leaf>& out) {
  for (size_t i = 0; i < in.size(); ++i) {
    SPMD_RETURN_IF_ERROR(comm.Allreduce(in[i].data, out[i].data, in[i].bytes / in[i].elem,
                                        in[i].dtype, op));
  }
  (void)call;
  return Status::Ok();
}

thread_local std::vector<char> hier_scratch;
thread_local std::vector<float> hier_wide_in, hier_wide_out;

// Hierarchical: reduce inside the node, across node leaders over MPI, then broadcast inside the
// node, leaf by leaf.
Status AllreduceHier(const Call& call, Group& g, ReduceOp op, const std::vector<Leaf>& in,
                     const std::vector<Leaf>& out) {
  SPMD_RETURN_IF_ERROR(g.local->Allreduce(call.Sig(), op, in, out, g.one_shot_max));
  for (size_t i = 0; i < out.size(); ++i) {
    const Leaf& o = out[i];
    if (!g.is_leader) {  // only the leader's value is read; no scratch here
      SPMD_RETURN_IF_ERROR(g.local->Broadcast(call.Sig(), 0, o, o));
      continue;
    }
    if (hier_scratch.size() < o.bytes) hier_scratch.resize(o.bytes);
    Leaf tmp = ScratchLeaf(hier_scratch.data(), o.bytes, o.dtype, o.elem);
    SPMD_RETURN_IF_ERROR(g.leaders.Allreduce(o.data, tmp.data, o.bytes / o.elem, o.dtype, op));
    SPMD_RETURN_IF_ERROR(g.local->Broadcast(call.Sig(), 0, tmp, o));
  }
  return Status::Ok();
}

bool IsHalf(ffi::DataType d) { return d == ffi::DataType::F16 || d == ffi::DataType::BF16; }

// Hierarchical sums and products of float16/bfloat16 run in float32 from end to end, the leaves
// widened into one buffer and rounded once at the end, as the flat paths round once (rounding
// each node's partial result first would round twice). Max and min are exact: they stay narrow.
Status AllreduceHierWide(const Call& call, Group& g, ReduceOp op, const std::vector<Leaf>& in,
                         const std::vector<Leaf>& out) {
  size_t count = 0;
  for (const Leaf& l : in) count += l.bytes / l.elem;
  if (hier_wide_in.size() < count) {
    hier_wide_in.resize(count);
    hier_wide_out.resize(count);
  }
  size_t at = 0;
  for (const Leaf& l : in) {
    size_t n = l.bytes / l.elem;
    HalfToFloats(l.dtype == ffi::DataType::BF16, reinterpret_cast<const uint16_t*>(l.data),
                 hier_wide_in.data() + at, n);
    at += n;
  }
  const size_t bytes = count * sizeof(float);
  std::vector<Leaf> win{
      ScratchLeaf(hier_wide_in.data(), bytes, ffi::DataType::F32, sizeof(float))};
  std::vector<Leaf> wout{
      ScratchLeaf(hier_wide_out.data(), bytes, ffi::DataType::F32, sizeof(float))};
  SPMD_RETURN_IF_ERROR(AllreduceHier(call, g, op, win, wout));
  at = 0;
  for (const Leaf& l : out) {
    size_t n = l.bytes / l.elem;
    FloatsToHalf(l.dtype == ffi::DataType::BF16, hier_wide_out.data() + at,
                 reinterpret_cast<uint16_t*>(l.data), n);
    at += n;
  }
  return Status::Ok();
}

Status AllreduceImpl(Call& call, ReduceOp op) {
  Group& g = *call.group;
  Backend b = g.backend;
  if (b == Backend::kShm && g.shm) {
    return g.shm->Allreduce(call.Sig(), op, call.in, call.out, g.one_shot_max);
  }
  if (b == Backend::kHier && g.local) {
    // Shared memory compares the calls inside each node; this compares them across nodes, on
    // every rank of the group, so that every rank raises (not only the node leaders).
    if (g.has_mpi) SPMD_RETURN_IF_ERROR(MpiCheck(call, g.mpi));
    bool half = false;
    for (const Leaf& l : call.in) half = half || IsHalf(l.dtype);
    if (!half || (op != ReduceOp::kSum && op != ReduceOp::kProd)) {
      return AllreduceHier(call, g, op, call.in, call.out);
    }
    // The half-precision leaves go widened; the others as they are (every rank splits alike).
    std::vector<Leaf> half_in, half_out, rest_in, rest_out;
    for (size_t i = 0; i < call.in.size(); ++i) {
      (IsHalf(call.in[i].dtype) ? half_in : rest_in).push_back(call.in[i]);
      (IsHalf(call.in[i].dtype) ? half_out : rest_out).push_back(call.out[i]);
    }
    if (!half_in.empty()) SPMD_RETURN_IF_ERROR(AllreduceHierWide(call, g, op, half_in, half_out));
    if (!rest_in.empty()) SPMD_RETURN_IF_ERROR(AllreduceHier(call, g, op, rest_in, rest_out));
    return Status::Ok();
  }
  if (g.has_mpi) {
    SPMD_RETURN_IF_ERROR(MpiCheck(call, g.mpi));
    return AllreduceMpi(call, g.mpi, op, call.in, call.out);
  }
  if (g.shm) return g.shm->Allreduce(call.Sig(), op, call.in, call.out, g.one_shot_max);
  return NoBackend(call);
}

// Compressed (every leaf float32; spmd/ops/_allreduce.py sends the others exactly): on shared
// memory the conversions happen in the algorithm's own copies; elsewhere the leaves are narrowed
// into scratch buffers, reduced as float16/bfloat16 (float32 accumulation, one rounding), and
// widened into the outputs.
thread_local std::vector<uint16_t> wire_in, wire_out;

Status AllreduceCompressed(Call& call) {
  Group& g = *call.group;
  const bool bf16 = call.wire == 2;
  const float div = static_cast<float>(call.div);
  for (const Leaf& l : call.in) {
    if (l.dtype != ffi::DataType::F32) {
      return Status::Error(std::string("compression needs float32 leaves, got ") +
                           DtypeName(l.dtype));
    }
  }
  if (g.backend == Backend::kShm && g.shm) {
    return g.shm->AllreduceNarrowed(call.Sig(), bf16, div, call.in, call.out, g.one_shot_max);
  }
  size_t count = 0;
  for (const Leaf& l : call.in) count += l.bytes / l.elem;
  if (wire_in.size() < count) {
    wire_in.resize(count);
    wire_out.resize(count);
  }
  const ffi::DataType dt = bf16 ? ffi::DataType::BF16 : ffi::DataType::F16;
  std::vector<Leaf> in, out;
  size_t at = 0;
  for (const Leaf& l : call.in) {
    size_t n = l.bytes / l.elem;
    NarrowFloats(bf16, reinterpret_cast<const float*>(l.data), div, wire_in.data() + at, n);
    in.push_back(ScratchLeaf(wire_in.data() + at, n * 2, dt, 2));
    out.push_back(ScratchLeaf(wire_out.data() + at, n * 2, dt, 2));
    at += n;
  }
  std::swap(call.in, in);
  std::swap(call.out, out);
  Status s = AllreduceImpl(call, ReduceOp::kSum);
  std::swap(call.in, in);
  std::swap(call.out, out);
  SPMD_RETURN_IF_ERROR(s);
  at = 0;
  for (const Leaf& l : call.out) {
    size_t n = l.bytes / l.elem;
    WidenHalves(bf16, wire_out.data() + at, reinterpret_cast<float*>(l.data), n);
    at += n;
  }
  return Status::Ok();
}

ffi::Error AllreduceFfi(int64_t group, int32_t op, int32_t wire, int64_t div,
                        ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call(kAllreduce);
  if (ffi::Error e = Decode(call, group, args, rets, false); e.failure()) return e;
  if (op < 0 || op > 3) return Fail(call, "unknown reduction code " + std::to_string(op));
  if (wire < 0 || wire > 2 || div < 1 || (wire == 0 && div != 1) ||
      (wire != 0 && op != static_cast<int32_t>(ReduceOp::kSum))) {
    return Fail(call, "bad compression attributes wire=" + std::to_string(wire) +
                          ", div=" + std::to_string(div));
  }
  call.op = op;
  call.wire = wire;
  call.div = div;
  call.Mix(static_cast<uint64_t>(op));
  call.Mix(static_cast<uint64_t>(wire));
  call.Mix(static_cast<uint64_t>(div));
  std::lock_guard<std::mutex> lock(call.group->mu);
  if (wire != 0) return FromStatus(call, AllreduceCompressed(call));
  return FromStatus(call, AllreduceImpl(call, static_cast<ReduceOp>(op)));
}

// -- allgather(v) / reduce_scatter(v) ---------------------------------------------------------

// Per leaf, the bytes of each rank's rows: `sizes` rows per rank, `row` bytes per row.
std::vector<size_t> RowBytes(ffi::Span<const int64_t> sizes, size_t row) {
  std::vector<size_t> b;
  for (int64_t s : sizes) b.push_back(static_cast<size_t>(s) * row);
  return b;
}

ffi::Error AllgatherFfi(int64_t group, ffi::Span<const int64_t> sizes, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  Call call(kAllgather);
  if (ffi::Error e = Decode(call, group, args, rets, sizes.size() != 0); e.failure()) return e;
  Group& g = *call.group;
  // No sizes: every rank contributes its whole input (allgather).
  if (!(sizes.size() == 0) && static_cast<int>(sizes.size()) != g.size) {
    return Fail(call, "sizes has " + std::to_string(sizes.size()) + " entries for a group of " +
                          std::to_string(g.size));
  }
  int64_t total = 0;
  for (int64_t s : sizes) {
    total += s;
    call.Mix(static_cast<uint64_t>(s));
  }
  call.sizes = sizes;
  call.has_sizes = true;
  std::lock_guard<std::mutex> lock(g.mu);
  if (OverMpi(g)) {
    if (Status s = MpiCheck(call, g.mpi); !s.ok()) return FromStatus(call, s);
  }
  for (size_t i = 0; i < call.in.size(); ++i) {
    std::vector<size_t> bytes(g.size, call.in[i].bytes);
    if (!(sizes.size() == 0)) {
      bytes = RowBytes(sizes, total ? call.out[i].bytes / static_cast<size_t>(total) : 0);
    }
    Status s;
    if (g.backend == Backend::kShm && g.shm) {
      s = g.shm->Allgatherv(call.Sig(), call.in[i], call.out[i], bytes);
    } else if (g.has_mpi) {
      s = g.mpi.Allgatherv(call.in[i].data, call.out[i].data, bytes);
    } else if (g.shm) {
      s = g.shm->Allgatherv(call.Sig(), call.in[i], call.out[i], bytes);
    } else {
      s = NoBackend(call);
    }
    if (!s.ok()) return FromStatus(call, s);
  }
  return ffi::Error::Success();
}

ffi::Error ReduceScatterFfi(int64_t group, int32_t op, ffi::Span<const int64_t> sizes,
                            ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call(kReduceScatter);
  if (ffi::Error e = Decode(call, group, args, rets, false); e.failure()) return e;
  Group& g = *call.group;
  if (op < 0 || op > 3) return Fail(call, "unknown reduction code " + std::to_string(op));
  // No sizes: the input splits into equal blocks (reduce_scatter).
  if (!(sizes.size() == 0) && static_cast<int>(sizes.size()) != g.size) {
    return Fail(call, "sizes has " + std::to_string(sizes.size()) + " entries for a group of " +
                          std::to_string(g.size));
  }
  int64_t total = 0;
  call.Mix(static_cast<uint64_t>(op));
  for (int64_t s : sizes) {
    total += s;
    call.Mix(static_cast<uint64_t>(s));
  }
  call.op = op;
  call.sizes = sizes;
  call.has_sizes = true;
  std::lock_guard<std::mutex> lock(g.mu);
  if (OverMpi(g)) {
    if (Status s = MpiCheck(call, g.mpi); !s.ok()) return FromStatus(call, s);
  }
  for (size_t i = 0; i < call.in.size(); ++i) {
    std::vector<size_t> bytes(g.size, call.out[i].bytes);
    if (!(sizes.size() == 0)) {
      bytes = RowBytes(sizes, total ? call.in[i].bytes / static_cast<size_t>(total) : 0);
    }
    Status s;
    if (g.backend == Backend::kShm && g.shm) {
      s = g.shm->ReduceScatterv(call.Sig(), static_cast<ReduceOp>(op), call.in[i], call.out[i],
                                bytes);
    } else if (g.has_mpi) {
      std::vector<size_t> counts;
      for (size_t b : bytes) counts.push_back(b / call.in[i].elem);
      s = g.mpi.ReduceScatterv(call.in[i].data, call.out[i].data, counts, call.in[i].dtype,
                               static_cast<ReduceOp>(op));
    } else if (g.shm) {
      s = g.shm->ReduceScatterv(call.Sig(), static_cast<ReduceOp>(op), call.in[i], call.out[i],
                                bytes);
    } else {
      s = NoBackend(call);
    }
    if (!s.ok()) return FromStatus(call, s);
  }
  return ffi::Error::Success();
}

// -- broadcast, all_to_all --------------------------------------------------------------------

ffi::Error BroadcastFfi(int64_t group, int64_t root, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  Call call(kBroadcast);
  if (ffi::Error e = Decode(call, group, args, rets, false); e.failure()) return e;
  Group& g = *call.group;
  call.root = root;
  call.Mix(static_cast<uint64_t>(root));
  std::lock_guard<std::mutex> lock(g.mu);
  if (OverMpi(g)) {
    if (Status s = MpiCheck(call, g.mpi); !s.ok()) return FromStatus(call, s);
  }
  for (size_t i = 0; i < call.in.size(); ++i) {
    Status s;
    if (g.backend == Backend::kShm && g.shm) {
      s = g.shm->Broadcast(call.Sig(), static_cast<int>(root), call.in[i], call.out[i]);
    } else if (g.has_mpi) {
      if (g.rank == root) std::memcpy(call.out[i].data, call.in[i].data, call.in[i].bytes);
      s = g.mpi.Broadcast(call.out[i].data, call.out[i].bytes, static_cast<int>(root));
    } else if (g.shm) {
      s = g.shm->Broadcast(call.Sig(), static_cast<int>(root), call.in[i], call.out[i]);
    } else {
      s = NoBackend(call);
    }
    if (!s.ok()) return FromStatus(call, s);
  }
  return ffi::Error::Success();
}

ffi::Error AllToAllFfi(int64_t group, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call(kAllToAll);
  if (ffi::Error e = Decode(call, group, args, rets, false); e.failure()) return e;
  Group& g = *call.group;
  std::lock_guard<std::mutex> lock(g.mu);
  if (OverMpi(g)) {
    if (Status s = MpiCheck(call, g.mpi); !s.ok()) return FromStatus(call, s);
  }
  for (size_t i = 0; i < call.in.size(); ++i) {
    size_t block = call.in[i].bytes / static_cast<size_t>(g.size);
    Status s;
    if (g.backend == Backend::kShm && g.shm) {
      s = g.shm->AllToAll(call.Sig(), call.in[i], call.out[i], block);
    } else if (g.has_mpi) {
      s = g.mpi.AllToAll(call.in[i].data, call.out[i].data, block);
    } else if (g.shm) {
      s = g.shm->AllToAll(call.Sig(), call.in[i], call.out[i], block);
    } else {
      s = NoBackend(call);
    }
    if (!s.ok()) return FromStatus(call, s);
  }
  return ffi::Error::Success();
}

// -- point to point, barrier ------------------------------------------------------------------

// send: src < 0 and no result; recv: dst < 0 and no operand.
ffi::Error SendRecvFfi(int64_t group, int64_t src, int64_t dst, ffi::RemainingArgs args,
                       ffi::RemainingRets rets) {
  Call call(kSendRecv);
  if (ffi::Error e = Decode(call, group, args, rets, false); e.failure()) return e;
  Group& g = *call.group;
  if (!g.has_mpi) return FromStatus(call, NoBackend(call));
  std::lock_guard<std::mutex> lock(g.mu);
  const Leaf* in = call.in.empty() ? nullptr : &call.in[0];
  const Leaf* out = call.out.empty() ? nullptr : &call.out[0];
  return FromStatus(call, g.mpi.SendRecv(in ? in->data : nullptr, in ? in->bytes : 0,
                                         static_cast<int>(dst), out ? out->data : nullptr,
                                         out ? out->bytes : 0, static_cast<int>(src)));
}

ffi::Error BarrierFfi(int64_t group, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call(kBarrier);
  if (ffi::Error e = Decode(call, group, args, rets, false); e.failure()) return e;
  Group& g = *call.group;
  std::lock_guard<std::mutex> lock(g.mu);
  if (g.backend != Backend::kMpi && g.shm) return FromStatus(call, g.shm->Barrier(call.Sig()));
  if (g.has_mpi) {
    if (Status s = MpiCheck(call, g.mpi); !s.ok()) return FromStatus(call, s);
    return FromStatus(call, g.mpi.Barrier());
  }
  if (g.shm) return FromStatus(call, g.shm->Barrier(call.Sig()));
  return FromStatus(call, NoBackend(call));
}

}  // namespace

// spmd_allreduce: attrs group (i64), op (i32), wire (i32: 0 exact, 1 float16, 2 bfloat16),
// div (i64: compressed values are multiplied by 1.0f / div before rounding).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllreduce_, AllreduceFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<int32_t>("op")
                                  .Attr<int32_t>("wire")
                                  .Attr<int64_t>("div")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_allgather: attrs group, sizes (rows per rank).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllgather_, AllgatherFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<ffi::Span<const int64_t>>("sizes")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_reduce_scatter: attrs group, op, sizes (rows per rank).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kReduceScatter_, ReduceScatterFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<int32_t>("op")
                                  .Attr<ffi::Span<const int64_t>>("sizes")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_broadcast: attrs group, root (group rank).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBroadcast_, BroadcastFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("root")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_all_to_all: attr group; operand and result hold `size` blocks along their first axis.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAll_, AllToAllFfi,
                              ffi::Ffi::Bind().Attr<int64_t>("group").RemainingArgs().RemainingRets());
// spmd_sendrecv: attrs group, src, dst (group ranks; -1 for none).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSendRecv_, SendRecvFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("src")
                                  .Attr<int64_t>("dst")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_barrier: attr group.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrier_, BarrierFfi,
                              ffi::Ffi::Bind().Attr<int64_t>("group").RemainingArgs().RemainingRets());

const HandlerEntry* CpuHandlers() {
  static const HandlerEntry entries[] = {
      {"spmd_allreduce", reinterpret_cast<void*>(kAllreduce_)},
      {"spmd_allgather", reinterpret_cast<void*>(kAllgather_)},
      {"spmd_reduce_scatter", reinterpret_cast<void*>(kReduceScatter_)},
      {"spmd_broadcast", reinterpret_cast<void*>(kBroadcast_)},
      {"spmd_all_to_all", reinterpret_cast<void*>(kAllToAll_)},
      {"spmd_sendrecv", reinterpret_cast<void*>(kSendRecv_)},
      {"spmd_barrier", reinterpret_cast<void*>(kBarrier_)},
      {nullptr, nullptr},
  };
  return entries;
}

}  // namespace spmd
