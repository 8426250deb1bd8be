// The XLA FFI handlers of the GPU collectives: the same operands, results and attributes as the
// CPU handlers (native/cpu/handlers.cc), enqueued on the stream XLA gives the handler; all but
// all_to_allv (which reads its counts on the host) never synchronise the host. After the
// ordering operand come the leaves of one fused call.
#include "handlers.h"

#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "custom_ar.h"
#include "groups.h"
#include "timing.h"
#include "spmd/alltoallv.h"
#include "spmd/call.h"
#include "spmd/common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace spmd {
namespace {

NcclType NcclTypeOf(ffi::DataType d) {
  switch (d) {
    case ffi::DataType::S8:
      return kNcclInt8;
    case ffi::DataType::PRED:
    case ffi::DataType::U8:
      return kNcclUint8;
    case ffi::DataType::S32:
      return kNcclInt32;
    case ffi::DataType::S64:
      return kNcclInt64;
    case ffi::DataType::F16:
      return kNcclFloat16;
    case ffi::DataType::BF16:
      return kNcclBfloat16;
    case ffi::DataType::F64:
      return kNcclFloat64;
    default:
      return kNcclFloat32;
  }
}

// NCCL's reduction codes are spmd's (ReduceOp); on bool, sum/max are logical or (max of 0/1
// bytes) and prod/min logical and (min).
NcclOp NcclOpOf(int32_t op, ffi::DataType d) {
  static_assert(static_cast<int>(ReduceOp::kSum) == kNcclSum &&
                    static_cast<int>(ReduceOp::kProd) == kNcclProd &&
                    static_cast<int>(ReduceOp::kMax) == kNcclMax &&
                    static_cast<int>(ReduceOp::kMin) == kNcclMin,
                "ReduceOp codes are NCCL's");
  const auto o = static_cast<ReduceOp>(op);
  if (d == ffi::DataType::PRED) {
    return (o == ReduceOp::kSum || o == ReduceOp::kMax) ? kNcclMax : kNcclMin;
  }
  return static_cast<NcclOp>(op);
}

// The custom kernels' element type for `d`, matched by dtype name (car::kCustomDtypes).
bool CustomDType(ffi::DataType d, car::DType* t) {
  const char* name = DtypeName(d);
  for (const NamedCode& c : car::kCustomDtypes) {
    if (std::strcmp(c.name, name) == 0) {
      *t = static_cast<car::DType>(c.code);
      return true;
    }
  }
  return false;
}

// Errors name the op as "<op> (GPU)". A call is recorded (the flight recorder, through the CPU
// module) from its start until the handler returns: enqueued, or failed.
struct Call : CallBase {
  Call(const char* op, CallCode c) : CallBase(op), code(c) {}
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  ~Call() {
    RecordEnd(slot, failed());
    timed.End(!failed());
  }
  cudaStream_t stream = nullptr;
  std::shared_ptr<CudaGroup> group;  // held for the whole call (spmd/registry.h)
  CallCode code;
  size_t slot = SIZE_MAX;
  GpuTimed timed;  // the GPU's times of the call, for the timeline (timing.h)

  // Finds the group, decodes the leaves, compares the call with the other ranks' where that is
  // due (`check`: the call written out by the Python lowering, role included; `site`: which
  // call of which program it is, see CheckCall) and starts the call's record (a call that
  // fails the comparison is recorded as failed).
  ffi::Error Start(cudaStream_t s, int64_t group_attr, int64_t site, std::string_view check,
                   ffi::RemainingArgs args, ffi::RemainingRets rets) {
    stream = s;
    group = CudaGroupFind(GroupIdOf(group_attr));
    if (group == nullptr) return GroupMissing();
    set_world_rank(group->world_rank());
    if (ffi::Error e = Decode(args, rets); e.failure()) return e;
    // A call XLA captures in a CUDA graph runs this once, at the capture; its replays run
    // without it, so they are neither compared by the sequence check nor recorded.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const bool captured = cudaStreamIsCapturing(s, &capture) == cudaSuccess &&
                          capture != cudaStreamCaptureStatusNone;
    uint64_t hash = 0;
    const Status c = CheckCall(*group, site, check, code, captured, &hash);
    if (!captured) {
      const bool p2p = check.empty();
      uint64_t bytes = 0;
      for (const Leaf& l : (p2p && in.empty() ? out : in)) bytes += l.bytes;
      const uint64_t n = ++(p2p ? group->p2p_calls : group->calls);
      slot = RecordBegin(group->id, n, hash, bytes, code);
      if (c.ok()) timed.Begin(stream, slot, group->id, n);
    }
    return c.ok() ? ffi::Error::Success() : Fail(c.message());
  }
};

// Every NCCL path goes through here first.
ffi::Error NeedNccl(const Call& call) {
  if (call.group->nccl != nullptr) return ffi::Error::Success();
  return call.Fail("this group has no NCCL communicator (NCCL failed to start for it)");
}

car::Call CarCall(const Call& call) {
  const CudaGroup& g = *call.group;
  return car::Call{&g.peers, g.rank, call.stream, g.timeout_ns, 0};
}

Status CopyAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0 || dst == src) return Status::Ok();
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string("cudaMemcpyAsync failed: ") + cudaGetErrorString(e));
}

// -- allreduce --------------------------------------------------------------------------------

// algos: per leaf, the path Python's all-reduce chain chose (car::Algo codes); codec: the quantized
// path's codec.
ffi::Error AllreduceFfi(cudaStream_t stream, int64_t group, int64_t site,
                        std::string_view check, int32_t op,
                        ffi::Span<const int64_t> algos, int32_t codec_code,
                        ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call("allreduce (GPU)", kAllreduce);
  if (ffi::Error e = call.Start(stream, group, site, check, args, rets); e.failure()) return e;
  CudaGroup& g = *call.group;
  if (!HasCode(kReduceOps, op)) return call.Fail("unknown reduction code " + std::to_string(op));
  if (algos.size() != call.in.size()) {
    return call.Fail("got " + std::to_string(algos.size()) + " algorithm codes for " +
                     std::to_string(call.in.size()) + " arrays");
  }
  for (int64_t a : algos) {
    if (!HasCode(car::kAlgos, a)) return call.Fail("unknown algorithm code " + std::to_string(a));
  }
  std::lock_guard<std::mutex> lock(g.mu);
  // The custom paths first, each leaf one launch; then every NCCL leaf in one NCCL group.
  for (size_t i = 0; i < call.in.size(); ++i) {
    auto algo = static_cast<car::Algo>(algos[i]);
    if (algo == car::Algo::kNccl) continue;
    car::DType t;
    const bool sum = op == static_cast<int32_t>(ReduceOp::kSum);
    if (!g.car_ready || !sum || !CustomDType(call.in[i].dtype, &t)) {
      return call.Fail(std::string("the custom all-reduce was chosen for a leaf it cannot take (") +
                       (g.car_ready ? "" : "not registered for this group, ") + "op=" +
                       NameOf(kReduceOps, op) + ")");
    }
    const void* in = call.in[i].data;
    void* out = call.out[i].data;
    size_t count = call.in[i].bytes / call.in[i].elem;
    Status s = algo == car::Algo::kQuantized
                   ? car::QuantizedAllReduce(CarCall(call), static_cast<codec::Codec>(codec_code),
                                             t, &in, &out, count)
                   : car::AllReduce(CarCall(call), algo, t, &in, &out, count);
    if (!s.ok()) return call.FromStatus(s);
  }
  bool any_nccl = false;
  for (size_t i = 0; i < call.in.size(); ++i) {
    any_nccl |= static_cast<car::Algo>(algos[i]) == car::Algo::kNccl && call.in[i].bytes != 0;
  }
  if (!any_nccl) return ffi::Error::Success();
  if (ffi::Error e = NeedNccl(call); e.failure()) return e;
  NcclGroup group_call;
  if (!group_call.status().ok()) return call.FromStatus(group_call.status());
  for (size_t i = 0; i < call.in.size(); ++i) {
    if (static_cast<car::Algo>(algos[i]) != car::Algo::kNccl || call.in[i].bytes == 0) continue;
    Status s = NcclAllReduce(call.in[i].data, call.out[i].data, call.in[i].bytes / call.in[i].elem,
                             NcclTypeOf(call.in[i].dtype), NcclOpOf(op, call.in[i].dtype), g.nccl,
                             stream);
    if (!s.ok()) return call.FromStatus(s);
  }
  return call.FromStatus(group_call.End());
}

// -- allgather(v) / reduce_scatter(v) ---------------------------------------------------------

// No sizes: every rank contributes its whole input. With sizes (rows per rank): one broadcast per
// rank into its place, fused in one NCCL group (NCCL has no allgatherv).
ffi::Error AllgatherFfi(cudaStream_t stream, int64_t group, int64_t site,
                        std::string_view check, ffi::Span<const int64_t> sizes,
                        ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call(sizes.size() ? "allgatherv (GPU)" : "allgather (GPU)", kAllgather);
  if (ffi::Error e = call.Start(stream, group, site, check, args, rets); e.failure()) return e;
  if (ffi::Error e = NeedNccl(call); e.failure()) return e;
  CudaGroup& g = *call.group;
  if (sizes.size() != 0 && static_cast<int>(sizes.size()) != g.size) {
    return call.Fail("sizes has " + std::to_string(sizes.size()) + " entries for a group of " +
                     std::to_string(g.size));
  }
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  // Checked before the NCCL group opens: leaving it early would launch only part of the group
  // while the other ranks launch all of it.
  for (size_t i = 0; i < call.in.size() && sizes.size() != 0; ++i) {
    const Leaf& in = call.in[i];
    size_t row = total ? call.out[i].bytes / static_cast<size_t>(total) : 0;
    size_t bytes = static_cast<size_t>(sizes[g.rank]) * row;
    if (bytes != in.bytes) {
      return call.Fail("this rank passed " + std::to_string(in.bytes / in.elem) +
                       " elements, sizes says " + std::to_string(bytes / in.elem));
    }
  }
  std::lock_guard<std::mutex> lock(g.mu);
  NcclGroup group_call;
  if (!group_call.status().ok()) return call.FromStatus(group_call.status());
  for (size_t i = 0; i < call.in.size(); ++i) {
    const Leaf& in = call.in[i];
    const Leaf& out = call.out[i];
    if (sizes.size() == 0) {
      if (in.bytes == 0) continue;
      Status s = NcclAllGather(in.data, out.data, in.bytes, kNcclUint8, g.nccl, stream);
      if (!s.ok()) return call.FromStatus(s);
      continue;
    }
    size_t row = total ? out.bytes / static_cast<size_t>(total) : 0;
    size_t offset = 0;
    for (int r = 0; r < g.size; ++r) {
      size_t bytes = static_cast<size_t>(sizes[r]) * row;
      if (bytes != 0) {
        Status s = NcclBroadcast(in.data, out.data + offset, bytes, kNcclUint8, r, g.nccl, stream);
        if (!s.ok()) return call.FromStatus(s);
      }
      offset += bytes;
    }
  }
  return call.FromStatus(group_call.End());
}

// Without sizes: NCCL's reduce-scatter. With sizes: one reduce per rank onto that rank.
ffi::Error ReduceScatterFfi(cudaStream_t stream, int64_t group, int64_t site,
                            std::string_view check, int32_t op,
                            ffi::Span<const int64_t> sizes, ffi::RemainingArgs args,
                            ffi::RemainingRets rets) {
  Call call(sizes.size() ? "reduce_scatterv (GPU)" : "reduce_scatter (GPU)",
            kReduceScatter);
  if (ffi::Error e = call.Start(stream, group, site, check, args, rets); e.failure()) return e;
  if (ffi::Error e = NeedNccl(call); e.failure()) return e;
  CudaGroup& g = *call.group;
  if (!HasCode(kReduceOps, op)) return call.Fail("unknown reduction code " + std::to_string(op));
  if (sizes.size() != 0 && static_cast<int>(sizes.size()) != g.size) {
    return call.Fail("sizes has " + std::to_string(sizes.size()) + " entries for a group of " +
                     std::to_string(g.size));
  }
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  std::lock_guard<std::mutex> lock(g.mu);
  NcclGroup group_call;
  if (!group_call.status().ok()) return call.FromStatus(group_call.status());
  for (size_t i = 0; i < call.in.size(); ++i) {
    const Leaf& in = call.in[i];
    const Leaf& out = call.out[i];
    NcclType t = NcclTypeOf(in.dtype);
    NcclOp o = NcclOpOf(op, in.dtype);
    if (sizes.size() == 0) {
      if (out.bytes == 0) continue;
      Status s = NcclReduceScatter(in.data, out.data, out.bytes / out.elem, t, o, g.nccl, stream);
      if (!s.ok()) return call.FromStatus(s);
      continue;
    }
    size_t row = total ? in.bytes / static_cast<size_t>(total) : 0;
    size_t offset = 0;
    for (int r = 0; r < g.size; ++r) {
      size_t bytes = static_cast<size_t>(sizes[r]) * row;
      if (bytes != 0) {
        // The output is only written on the root; other ranks pass their input as a valid
        // pointer NCCL never writes.
        void* dst = r == g.rank ? static_cast<void*>(out.data) : static_cast<void*>(in.data);
        Status s = NcclReduce(in.data + offset, dst, bytes / in.elem, t, o, r, g.nccl, stream);
        if (!s.ok()) return call.FromStatus(s);
      }
      offset += bytes;
    }
  }
  return call.FromStatus(group_call.End());
}

// -- broadcast, all_to_all --------------------------------------------------------------------

ffi::Error BroadcastFfi(cudaStream_t stream, int64_t group, int64_t site,
                        std::string_view check, int64_t root, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  Call call("broadcast (GPU)", kBroadcast);
  if (ffi::Error e = call.Start(stream, group, site, check, args, rets); e.failure()) return e;
  if (ffi::Error e = NeedNccl(call); e.failure()) return e;
  CudaGroup& g = *call.group;
  std::lock_guard<std::mutex> lock(g.mu);
  NcclGroup group_call;
  if (!group_call.status().ok()) return call.FromStatus(group_call.status());
  for (size_t i = 0; i < call.in.size(); ++i) {
    if (call.out[i].bytes == 0) continue;
    Status s = NcclBroadcast(call.in[i].data, call.out[i].data, call.out[i].bytes, kNcclUint8,
                             static_cast<int>(root), g.nccl, stream);
    if (!s.ok()) return call.FromStatus(s);
  }
  return call.FromStatus(group_call.End());
}

// Block p of the input goes to rank p; block p of the output comes from rank p.
ffi::Error AllToAllFfi(cudaStream_t stream, int64_t group, int64_t site,
                       std::string_view check, ffi::RemainingArgs args,
                       ffi::RemainingRets rets) {
  Call call("all_to_all (GPU)", kAllToAll);
  if (ffi::Error e = call.Start(stream, group, site, check, args, rets); e.failure()) return e;
  if (ffi::Error e = NeedNccl(call); e.failure()) return e;
  CudaGroup& g = *call.group;
  std::lock_guard<std::mutex> lock(g.mu);
  for (size_t i = 0; i < call.in.size(); ++i) {
    size_t block = call.in[i].bytes / static_cast<size_t>(g.size);
    Status s = CopyAsync(call.out[i].data + g.rank * block, call.in[i].data + g.rank * block,
                         block, stream);
    if (!s.ok()) return call.FromStatus(s);
  }
  NcclGroup group_call;
  if (!group_call.status().ok()) return call.FromStatus(group_call.status());
  for (size_t i = 0; i < call.in.size(); ++i) {
    size_t block = call.in[i].bytes / static_cast<size_t>(g.size);
    if (block == 0) continue;
    for (int p = 0; p < g.size; ++p) {
      if (p == g.rank) continue;
      Status s = NcclSend(call.in[i].data + p * block, block, kNcclUint8, p, g.nccl, stream);
      if (s.ok()) s = NcclRecv(call.out[i].data + p * block, block, kNcclUint8, p, g.nccl, stream);
      if (!s.ok()) return call.FromStatus(s);
    }
  }
  return call.FromStatus(group_call.End());
}

// -- all_to_allv ------------------------------------------------------------------------------

Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string(what) + " failed: " + cudaGetErrorString(e));
}

// Every rank's record (spmd/alltoallv.h) into `all`, through an NCCL all-gather in device memory
// taken from the stream's pool for the call; waits for the stream. `mine` is in `all` already,
// at this rank's place.
Status GatherRecords(CudaGroup& g, std::vector<int64_t>* all, cudaStream_t stream) {
  const size_t len = all->size() / static_cast<size_t>(g.size) * sizeof(int64_t);
  char* dev = nullptr;
  SPMD_RETURN_IF_ERROR(CudaCheck(
      cudaMallocAsync(reinterpret_cast<void**>(&dev), len * g.size, stream), "cudaMallocAsync"));
  char* host = reinterpret_cast<char*>(all->data());
  Status s = CudaCheck(cudaMemcpyAsync(dev + g.rank * len, host + g.rank * len, len,
                                       cudaMemcpyHostToDevice, stream),
                       "cudaMemcpyAsync");
  if (s.ok()) s = NcclAllGather(dev + g.rank * len, dev, len, kNcclUint8, g.nccl, stream);
  if (s.ok()) {
    s = CudaCheck(cudaMemcpyAsync(host, dev, len * g.size, cudaMemcpyDeviceToHost, stream),
                  "cudaMemcpyAsync");
  }
  Status freed = CudaCheck(cudaFreeAsync(dev, stream), "cudaFreeAsync");
  Status synced = CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return !s.ok() ? s : !freed.ok() ? freed : synced;
}

// Operands x [rows, ...], send_counts and recv_counts (int32[size], on the device); result
// [out_rows, ...]. The counts come to the host (the handler waits for the stream, so XLA must not
// capture it in a CUDA graph: Python registers it without the command-buffer trait), every
// rank's counts travel to every rank and are checked before any row moves, so a bad count is
// the same error on every rank instead of transfers NCCL cannot match. Then one NCCL group of
// sends and receives, and zeros past the rows received.
ffi::Error AllToAllvFfi(cudaStream_t stream, int64_t group, int64_t site,
                        std::string_view check, bool exact, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  Call call("all_to_allv (GPU)", kAllToAllv);
  if (ffi::Error e = call.Start(stream, group, site, check, args, rets); e.failure()) return e;
  if (ffi::Error e = NeedNccl(call); e.failure()) return e;
  CudaGroup& g = *call.group;
  const int n = g.size;
  size_t row = 0;
  if (ffi::Error e = a2av::CheckShapes(call, n, &row); e.failure()) return e;
  const Leaf& x = call.in[0];
  const Leaf& y = call.out[0];
  std::lock_guard<std::mutex> lock(g.mu);
  thread_local std::vector<int32_t> counts;
  thread_local std::vector<int64_t> all;
  thread_local a2av::Plan plan;
  counts.resize(2 * static_cast<size_t>(n));
  const size_t len = a2av::RecordLen(n);
  all.assign(len * n, 0);
  Status s = CudaCheck(cudaMemcpyAsync(counts.data(), call.in[1].data, n * sizeof(int32_t),
                                       cudaMemcpyDeviceToHost, stream),
                       "cudaMemcpyAsync");
  if (s.ok()) {
    s = CudaCheck(cudaMemcpyAsync(counts.data() + n, call.in[2].data, n * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream),
                  "cudaMemcpyAsync");
  }
  if (s.ok()) s = CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (!s.ok()) return call.FromStatus(s);
  a2av::Fill(all.data() + g.rank * len, x.dims[0], y.dims[0], exact, counts.data(),
             counts.data() + n, n);
  if (Status gs = GatherRecords(g, &all, stream); !gs.ok()) return call.FromStatus(gs);
  std::string bad = a2av::Verdict(all.data(), n, g.world_ranks);
  if (!bad.empty()) return call.Fail(bad);
  a2av::MakePlan(all.data(), n, g.rank, row, &plan);
  s = CopyAsync(y.data + plan.recv_off[g.rank], x.data + plan.send_off[g.rank],
                plan.send_bytes[g.rank], stream);
  if (s.ok() && y.bytes > plan.received) {
    s = CudaCheck(cudaMemsetAsync(y.data + plan.received, 0, y.bytes - plan.received, stream),
                  "cudaMemsetAsync");
  }
  if (!s.ok()) return call.FromStatus(s);
  if (plan.total == 0) return ffi::Error::Success();
  NcclGroup group_call;
  if (!group_call.status().ok()) return call.FromStatus(group_call.status());
  for (int p = 0; p < n; ++p) {
    if (p == g.rank) continue;
    if (plan.send_bytes[p] != 0) {
      s = NcclSend(x.data + plan.send_off[p], plan.send_bytes[p], kNcclUint8, p, g.nccl, stream);
    }
    if (s.ok() && plan.recv_bytes[p] != 0) {
      s = NcclRecv(y.data + plan.recv_off[p], plan.recv_bytes[p], kNcclUint8, p, g.nccl, stream);
    }
    if (!s.ok()) return call.FromStatus(s);
  }
  return call.FromStatus(group_call.End());
}

// -- point to point, barrier ------------------------------------------------------------------

// send: src < 0 and no result; recv: dst < 0 and no operand.
ffi::Error SendRecvFfi(cudaStream_t stream, int64_t group, int64_t site,
                       std::string_view check, int64_t src, int64_t dst,
                       ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call("sendrecv (GPU)", kSendRecv);
  if (ffi::Error e = call.Start(stream, group, site, check, args, rets); e.failure()) return e;
  if (ffi::Error e = NeedNccl(call); e.failure()) return e;
  CudaGroup& g = *call.group;
  std::lock_guard<std::mutex> lock(g.mu);
  NcclGroup group_call;
  if (!group_call.status().ok()) return call.FromStatus(group_call.status());
  if (dst >= 0 && !call.in.empty() && call.in[0].bytes != 0) {
    Status s = NcclSend(call.in[0].data, call.in[0].bytes, kNcclUint8, static_cast<int>(dst),
                        g.nccl, stream);
    if (!s.ok()) return call.FromStatus(s);
  }
  if (src >= 0 && !call.out.empty() && call.out[0].bytes != 0) {
    Status s = NcclRecv(call.out[0].data, call.out[0].bytes, kNcclUint8, static_cast<int>(src),
                        g.nccl, stream);
    if (!s.ok()) return call.FromStatus(s);
  }
  return call.FromStatus(group_call.End());
}

// A one-byte allreduce: every rank's later work on this stream waits for every rank.
ffi::Error BarrierFfi(cudaStream_t stream, int64_t group, int64_t site,
                      std::string_view check, ffi::RemainingArgs args,
                      ffi::RemainingRets rets) {
  Call call("barrier (GPU)", kBarrier);
  if (ffi::Error e = call.Start(stream, group, site, check, args, rets); e.failure()) return e;
  if (ffi::Error e = NeedNccl(call); e.failure()) return e;
  CudaGroup& g = *call.group;
  std::lock_guard<std::mutex> lock(g.mu);
  return call.FromStatus(NcclAllReduce(g.scratch, g.scratch, 1, kNcclUint8, kNcclMax, g.nccl,
                                        stream));
}

// -- all-reduce + RMSNorm -----------------------------------------------------------------------

// Operands x, residual, weight; results normed, residual_out. algo: 1 or 2 = the fused kernel
// (one-shot or two-shot by rows), 0 = NCCL all-reduce into residual_out, then the norm kernel.
ffi::Error AllreduceRmsNormFfi(cudaStream_t stream, int64_t group, int64_t site,
                               std::string_view check, float eps, int32_t algo,
                               ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call("allreduce_rmsnorm (GPU)", kAllreduceRmsNorm);
  if (ffi::Error e = call.Start(stream, group, site, check, args, rets); e.failure()) return e;
  CudaGroup& g = *call.group;
  if (call.in.size() != 3 || call.out.size() != 2) {
    return call.Fail("expected operands x, residual, weight and results normed, residual_out");
  }
  car::DType t;
  if (!CustomDType(call.in[0].dtype, &t)) {
    return call.Fail("x must be float32, float16 or bfloat16");
  }
  if (call.in[0].bytes == 0 && call.out[0].bytes == 0 && call.out[1].bytes == 0) {
    return ffi::Error::Success();  // no rows or no columns: nothing to do on any rank
  }
  auto wdims = call.in[2].dims;
  size_t hidden = wdims.size() == 1 ? static_cast<size_t>(wdims[0]) : 0;
  size_t rows = hidden ? call.in[0].bytes / call.in[0].elem / hidden : 0;
  size_t plane = rows * hidden * call.in[0].elem;
  if (hidden == 0 || plane != call.in[0].bytes || call.in[1].bytes != plane ||
      call.in[2].bytes != hidden * call.in[0].elem || call.out[0].bytes != plane ||
      call.out[1].bytes != plane) {
    return call.Fail("x, residual, normed and residual_out must be [rows, hidden] and weight "
                     "[hidden], all of x's dtype");
  }
  std::lock_guard<std::mutex> lock(g.mu);
  const void* x = call.in[0].data;
  const void* residual = call.in[1].data;
  const void* weight = call.in[2].data;
  void* normed = call.out[0].data;
  void* res_out = call.out[1].data;
  if (algo != 0) {
    if (!g.car_ready) {
      return call.Fail("the fused kernel was chosen but the custom all-reduce is not registered "
                       "for this group");
    }
    return call.FromStatus(car::AllReduceRmsNorm(CarCall(call), static_cast<car::Algo>(algo), t,
                                                 &x, &residual, &weight, eps, rows, hidden,
                                                 &normed, &res_out));
  }
  if (ffi::Error e = NeedNccl(call); e.failure()) return e;
  Status s = NcclAllReduce(x, res_out, call.in[0].bytes / call.in[0].elem,
                           NcclTypeOf(call.in[0].dtype), kNcclSum, g.nccl, stream);
  if (s.ok()) s = car::RmsNorm(stream, t, res_out, residual, weight, eps, rows, hidden, normed, res_out);
  return call.FromStatus(s);
}

}  // namespace

// All attrs: group (i64) first; see the Python lowering (lower_collective in spmd.ops).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllreduce, AllreduceFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("check")
                                  .Attr<int32_t>("op")
                                  .Attr<ffi::Span<const int64_t>>("algos")
                                  .Attr<int32_t>("codec")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllgather, AllgatherFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("check")
                                  .Attr<ffi::Span<const int64_t>>("sizes")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaReduceScatter, ReduceScatterFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("check")
                                  .Attr<int32_t>("op")
                                  .Attr<ffi::Span<const int64_t>>("sizes")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaBroadcast, BroadcastFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("check")
                                  .Attr<int64_t>("root")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllToAll, AllToAllFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("check")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllToAllv, AllToAllvFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("check")
                                  .Attr<bool>("exact")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaSendRecv, SendRecvFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("check")
                                  .Attr<int64_t>("src")
                                  .Attr<int64_t>("dst")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaBarrier, BarrierFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("check")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllreduceRmsNorm, AllreduceRmsNormFfi,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("site")
                                  .Attr<std::string_view>("check")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("algo")
                                  .RemainingArgs()
                                  .RemainingRets());

const HandlerEntry* CudaHandlers() {
  static const HandlerEntry entries[] = {
      {"spmd_cuda_allreduce", reinterpret_cast<void*>(kCudaAllreduce)},
      {"spmd_cuda_allgather", reinterpret_cast<void*>(kCudaAllgather)},
      {"spmd_cuda_reduce_scatter", reinterpret_cast<void*>(kCudaReduceScatter)},
      {"spmd_cuda_broadcast", reinterpret_cast<void*>(kCudaBroadcast)},
      {"spmd_cuda_all_to_all", reinterpret_cast<void*>(kCudaAllToAll)},
      {"spmd_cuda_all_to_allv", reinterpret_cast<void*>(kCudaAllToAllv)},
      {"spmd_cuda_sendrecv", reinterpret_cast<void*>(kCudaSendRecv)},
      {"spmd_cuda_barrier", reinterpret_cast<void*>(kCudaBarrier)},
      {"spmd_cuda_allreduce_rmsnorm", reinterpret_cast<void*>(kCudaAllreduceRmsNorm)},
      {nullptr, nullptr},
  };
  return entries;
}

}  // namespace spmd
