// The XLA FFI handlers of the CPU collectives: each decodes its call (spmd/call.h), hashes what
// the ranks must agree on, and makes one call on its group's transport (transport.h) under the
// group's lock. Point-to-point calls go straight to the group's MPI communicator.
#include "handlers.h"

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "groups.h"
#include "messages.h"
#include "moe.h"
#include "recorder.h"
#include "reduce.h"
#include "spmd/alltoallv.h"
#include "spmd/call.h"
#include "spmd/common.h"
#include "spmd/tables.h"
#include "transport.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace spmd {
namespace {

// Op codes: hashed into the signature, and named in messages.
using Code = CallCode;  // spmd/record.h

// A CPU call: its group, its leaves, and what every rank must agree on.
struct Call : CallBase {
  explicit Call(Code c) : CallBase(NameOf(kCallCodes, c)), code(c) {}

  Code code;
  std::shared_ptr<Group> group;  // held for the whole call (spmd/registry.h)
  int role = kRoleForward;
  // Static parameters: hashed as they are set, formatted only when ranks disagree.
  int32_t op = -1;
  int32_t wire = 0;
  int64_t div = 1;  // compressed: each rank's values are scaled by 1/div (op avg)
  int64_t root = -1;
  ffi::Span<const int64_t> sizes;
  bool has_sizes = false;
  // The call as the user wrote it where the native parameters do not show it (op="avg", which
  // runs as a sum; the axes the Python side moved to axis 0), hashed with the rest.
  std::string_view meaning;  // the call's attribute, which outlives the call
  uint64_t hash = kFnvOffset;  // FNV-1a (spmd/signature.h)

  void Mix(uint64_t x) {
    for (int i = 0; i < 8; ++i) {
      hash ^= (x >> (8 * i)) & 0xff;
      hash *= kFnvPrime;
    }
  }

  // Finds the group and decodes the leaves; hashes the op, the role and the inputs' dtypes and
  // shapes. `vary_rows`: the inputs' first dimension may differ between ranks (allgatherv).
  ffi::Error Start(int64_t group_attr, std::string_view what, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, bool vary_rows = false) {
    role = RoleOf(group_attr);
    meaning = what;
    group = GroupFind(GroupIdOf(group_attr));
    if (group == nullptr) return GroupMissing();
    set_world_rank(group->world_rank());
    if (ffi::Error e = Decode(args, rets); e.failure()) return e;
    Mix(code);
    Mix(static_cast<uint64_t>(role));
    for (char c : meaning) Mix(static_cast<uint8_t>(c));
    Mix(meaning.size());
    for (const Leaf& l : in) {
      Mix(static_cast<uint64_t>(l.dtype));
      Mix(l.dims.size());
      for (size_t k = vary_rows ? 1 : 0; k < l.dims.size(); ++k) {
        Mix(static_cast<uint64_t>(l.dims[k]));
      }
    }
    return ffi::Error::Success();
  }

  ffi::Error SetOp(int32_t code) {
    if (!HasCode(kReduceOps, code)) return Fail("unknown reduction code " + std::to_string(code));
    op = code;
    Mix(static_cast<uint64_t>(op));
    return ffi::Error::Success();
  }

  // Rows per rank, or none.
  ffi::Error SetSizes(ffi::Span<const int64_t> s) {
    if (s.size() != 0 && static_cast<int>(s.size()) != group->size) {
      return Fail("sizes has " + std::to_string(s.size()) + " entries for a group of " +
                  std::to_string(group->size));
    }
    for (int64_t x : s) Mix(static_cast<uint64_t>(x));
    sizes = s;
    has_sizes = true;
    return ffi::Error::Success();
  }

  std::string Params() const {
    std::string p(meaning);
    if (op >= 0 && meaning.find("op=") == std::string_view::npos) {
      p += std::string(p.empty() ? "" : ", ") + "op=" + (div > 1 ? "avg" : NameOf(kReduceOps, op));
    }
    if (wire) p += std::string(", compression=") + NameOf(kWires, wire);
    if (root >= 0) p += (p.empty() ? "" : ", ") + std::string("root=") + std::to_string(root);
    if (has_sizes && sizes.size() != 0) {
      p += (p.empty() ? "" : ", ") + std::string("sizes=[");
      for (size_t i = 0; i < sizes.size(); ++i) p += (i ? "," : "") + std::to_string(sizes[i]);
      p += "]";
    }
    return p;
  }

  std::string Describe() const {
    std::string s = std::string(NameOf(kCallCodes, code)) + "(" + Params() + ") of ";
    if (in.empty()) s += "no arrays";
    for (size_t i = 0; i < in.size(); ++i) {
      s += (i ? ", " : "") + std::string(DtypeName(in[i].dtype)) + "[";
      for (size_t k = 0; k < in[i].dims.size(); ++k) {
        s += (k ? "," : "") + std::to_string(in[i].dims[k]);
      }
      s += "]";
    }
    if (role == kRoleJvp) s += " [JVP]";
    if (role == kRoleBackward) s += kBackwardTag;
    return s;
  }

  Signature Sig() const {
    return {hash, [](const void* c) { return static_cast<const Call*>(c)->Describe(); }, this};
  }

  // `fn(transport)` under the group's lock.
  template <typename F>
  ffi::Error Run(F&& fn) const {
    std::lock_guard<std::mutex> lock(group->mu);
    if (group->transport == nullptr) {
      return Fail("this group has no transport: the Python group layer (spmd.runtime) chooses "
                  "one at the group's first collective, which has not happened in this process");
    }
    uint64_t bytes = 0;
    for (const Leaf& l : in) bytes += l.bytes;
    const size_t slot = RecorderBegin(group->id, ++group->calls, hash, bytes, code,
                                      static_cast<int8_t>(group->transport_kind));
    const Status s = fn(*group->transport);
    RecorderEnd(slot, !s.ok());
    return FromStatus(s);
  }
};

// -- collectives ------------------------------------------------------------------------------

ffi::Error AllreduceFfi(int64_t group, std::string_view meaning, int32_t op, int32_t wire,
                        int64_t div,
                        ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call(kAllreduce);
  if (ffi::Error e = call.Start(group, meaning, args, rets); e.failure()) return e;
  if (ffi::Error e = call.SetOp(op); e.failure()) return e;
  if ((wire != 0 && !HasCode(kWires, wire)) || div < 1 || (wire == 0 && div != 1) ||
      (wire != 0 && op != static_cast<int32_t>(ReduceOp::kSum))) {
    return call.Fail("bad compression attributes wire=" + std::to_string(wire) +
                     ", div=" + std::to_string(div));
  }
  call.wire = wire;
  call.div = div;
  call.Mix(static_cast<uint64_t>(wire));
  call.Mix(static_cast<uint64_t>(div));
  // Compressed calls take float32 leaves only: the Python side sends the others exactly.
  for (const Leaf& l : call.in) {
    if (wire != 0 && l.dtype != ffi::DataType::F32) {
      return call.Fail(std::string("compression needs float32 leaves, got ") +
                       DtypeName(l.dtype));
    }
  }
  const Signature sig = call.Sig();
  return call.Run([&](Transport& t) {
    if (wire == 0) return t.Allreduce(sig, static_cast<ReduceOp>(op), call.in, call.out);
    return t.AllreduceNarrowed(sig, wire == static_cast<int32_t>(Wire::kBf16),
                               static_cast<float>(div), call.in, call.out);
  });
}

ffi::Error AllgatherFfi(int64_t group, std::string_view meaning, ffi::Span<const int64_t> sizes,
                        ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  Call call(kAllgather);
  const bool vary = sizes.size() != 0;
  if (ffi::Error e = call.Start(group, meaning, args, rets, vary); e.failure()) return e;
  if (ffi::Error e = call.SetSizes(sizes); e.failure()) return e;
  const Signature sig = call.Sig();
  return call.Run([&](Transport& t) { return t.Allgatherv(sig, sizes, call.in, call.out); });
}

ffi::Error ReduceScatterFfi(int64_t group, std::string_view meaning, int32_t op,
                            ffi::Span<const int64_t> sizes,
                            ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call(kReduceScatter);
  if (ffi::Error e = call.Start(group, meaning, args, rets); e.failure()) return e;
  if (ffi::Error e = call.SetOp(op); e.failure()) return e;
  if (ffi::Error e = call.SetSizes(sizes); e.failure()) return e;
  const Signature sig = call.Sig();
  return call.Run([&](Transport& t) {
    return t.ReduceScatterv(sig, static_cast<ReduceOp>(op), sizes, call.in, call.out);
  });
}

ffi::Error BroadcastFfi(int64_t group, std::string_view meaning, int64_t root,
                        ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  Call call(kBroadcast);
  if (ffi::Error e = call.Start(group, meaning, args, rets); e.failure()) return e;
  call.root = root;
  call.Mix(static_cast<uint64_t>(root));
  const Signature sig = call.Sig();
  return call.Run([&](Transport& t) {
    return t.Broadcast(sig, static_cast<int>(root), call.in, call.out);
  });
}

ffi::Error AllToAllFfi(int64_t group, std::string_view meaning, ffi::RemainingArgs args,
                       ffi::RemainingRets rets) {
  Call call(kAllToAll);
  if (ffi::Error e = call.Start(group, meaning, args, rets); e.failure()) return e;
  const Signature sig = call.Sig();
  return call.Run([&](Transport& t) { return t.AllToAll(sig, call.in, call.out); });
}

// Operands x [rows, ...], send_counts and recv_counts (int32[size]), then send_index (when
// repeat > 0) and recv_index (when placed), int32 vectors (spmd/alltoallv.h, Rows); result
// [out_rows, ...]. The rows of x, of the indices and of the result may differ between ranks;
// the rest of their shape may not. With a send_index, the rows the counts may add up to are
// x's rows * repeat (exact: the Python side passes False).
ffi::Error AllToAllvFfi(int64_t group, std::string_view meaning, bool exact, int64_t repeat,
                        bool placed,
                        ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call(kAllToAllv);
  const bool vary_rows = true;
  if (ffi::Error e = call.Start(group, meaning, args, rets, vary_rows); e.failure()) return e;
  const int n = call.group->size;
  a2av::Rows rows;
  const size_t indices = (repeat > 0 ? 1 : 0) + (placed ? 1 : 0);
  if (ffi::Error e = a2av::CheckShapes(call, n, &rows.row, indices); e.failure()) return e;
  call.Mix(exact ? 1 : 0);
  call.Mix(static_cast<uint64_t>(repeat));
  call.Mix(placed ? 1 : 0);
  const Leaf& x = call.in[0];
  const auto* send = reinterpret_cast<const int32_t*>(call.in[1].data);
  const auto* recv = reinterpret_cast<const int32_t*>(call.in[2].data);
  int64_t rows_from = x.dims[0], send_len = 0, recv_len = 0, sent = 0, received = 0;
  if (repeat > 0) {
    rows.send_index = reinterpret_cast<const int32_t*>(call.in[3].data);
    rows.repeat = repeat;
    send_len = call.in[3].dims[0];
    rows_from = x.dims[0] * repeat;
  }
  if (placed) {
    rows.recv_index = reinterpret_cast<const int32_t*>(call.in[3 + (repeat > 0)].data);
    recv_len = call.in[3 + (repeat > 0)].dims[0];
  }
  for (int j = 0; j < n; ++j) {
    sent += send[j];
    received += recv[j];
  }
  thread_local std::vector<uint8_t> seen;
  const std::string bad_rows = a2av::CheckRows(rows.send_index, send_len, sent, rows_from,
                                               rows.recv_index, recv_len, received, &seen);
  thread_local std::vector<int64_t> record;
  record.resize(a2av::RecordLen(n));
  a2av::Fill(record.data(), rows_from, call.out[0].dims[0], exact, send, recv, n,
             !bad_rows.empty());
  const Signature sig = call.Sig();
  const std::vector<int>& world = call.group->world_ranks;
  const int me = call.group->rank;
  auto planner = [&](const int64_t* all, a2av::Plan* plan) {
    return a2av::CountsPlan(all, n, me, rows.row, world, plan);
  };
  ffi::Error result = call.Run([&](Transport& t) {
    return t.AllToAllv(sig, x, call.out[0], rows, record, planner);
  });
  // Every rank fails (the records name this one); this rank says what is wrong.
  if (result.failure() && !bad_rows.empty()) return call.Fail(bad_rows);
  return result;
}

void CopyRow(char* dst, const char* src, size_t bytes, const char*) {
  std::memcpy(dst, src, bytes);
}

// spmd.moe's exchange (moe.h). Operands x, ids (int32 [T * k]) and, when weighted, weights (x's
// dtype, [T * k]); results: the dispatch's rows and their count per local expert (int32
// [E / size]), or the combine's output. `tokens`: x (dispatch) or the output (combine) has one
// row per token, else one per assignment.
ffi::Error MoeExchangeFfi(int64_t group, std::string_view meaning, bool combine, int64_t k,
                          int64_t experts, bool tokens, bool weighted, int64_t slots,
                          int64_t capacity, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  Call call(combine ? kMoeCombine : kMoeDispatch);
  const bool vary_rows = true;
  if (ffi::Error e = call.Start(group, meaning, args, rets, vary_rows); e.failure()) return e;
  const int n = call.group->size;
  if (call.in.size() != (weighted ? 3u : 2u) || call.out.size() != (combine ? 1u : 2u)) {
    return call.Fail("expected operands x, ids and (weighted) weights, and the result rows and "
                     "(dispatch) their counts per expert");
  }
  const Leaf& x = call.in[0];
  const Leaf& ids = call.in[1];
  const Leaf& y = call.out[0];
  if (k < 1 || experts < 1 || slots < 0 || capacity < 0 || (capacity > 0 && slots == 0) ||
      ids.dtype != ffi::DataType::S32 || ids.dims.size() != 1) {
    return call.Fail("expected k >= 1, experts >= 1, slots and capacity >= 0 (a capacity "
                     "with slots) and int32 ids [T * k]");
  }
  a2av::Rows rows;
  if (!a2av::SameRows(x, y, &rows.row)) {
    return call.Fail("the result must have x's dtype and x's shape after axis 0");
  }
  call.Mix(combine ? 1 : 0);
  call.Mix(static_cast<uint64_t>(k));
  call.Mix(static_cast<uint64_t>(experts));
  call.Mix(tokens ? 1 : 0);
  call.Mix(weighted ? 1 : 0);
  call.Mix(capacity > 0 ? 2 : slots > 0 ? 1 : 0);  // the layout (its sizes go in the records)
  // What only this rank can see goes in its record, so that every rank fails.
  const int64_t assignments = ids.dims[0];
  const auto* id = reinterpret_cast<const int32_t*>(ids.data);
  const int64_t token_rows = (combine ? y : x).dims[0];
  std::string bad;
  if (assignments % k != 0 || token_rows != (tokens ? assignments / k : assignments)) {
    bad = "its ids have " + std::to_string(assignments) + " entries for k=" + std::to_string(k) +
          ", but its " + (combine ? "output" : "x") + " has " + std::to_string(token_rows) +
          " rows";
  }
  const bool math = weighted || (combine && tokens);
  if (bad.empty() && math && !moe::RowFns(x.dtype, &rows.scale, &rows.add)) {
    bad = std::string("weighted or summed rows must be float16, bfloat16, float32 or float64, "
                      "not ") + DtypeName(x.dtype);
  }
  if (bad.empty() && weighted) {
    const Leaf& w = call.in[2];
    if (w.dtype != x.dtype || w.dims.size() != 1 || w.dims[0] != assignments) {
      bad = "its weights must be one per assignment (" + std::to_string(assignments) +
            ") in x's dtype";
    }
    (combine ? rows.recv_weight : rows.send_weight) = w.data;
    rows.elem = x.elem;
  }
  for (int64_t a = 0; bad.empty() && a < assignments; ++a) {
    if (id[a] < 0 || id[a] > experts) {
      bad = "ids[" + std::to_string(a) + "] = " + std::to_string(id[a]) + " is out of range; " +
            "expected an expert from 0 to " + std::to_string(experts - 1) + ", or " +
            std::to_string(experts) + " for a dropped assignment";
    }
  }
  if (!math) rows.scale = CopyRow;
  rows.repeat = !combine && tokens ? k : 1;
  rows.reduce = combine ? (tokens ? k : 1) : 0;
  rows.targets = static_cast<size_t>(y.dims[0]);
  thread_local std::vector<uint8_t> touched;
  rows.touched = &touched;
  thread_local std::vector<int32_t> by_x;
  rows.by_x = &by_x;
  thread_local moe::Exchange exchange;  // its buffers are kept from call to call
  exchange.Reset(combine, k, experts, slots, capacity, n, call.group->rank,
                 &call.group->world_ranks);
  const std::vector<int64_t>& record = exchange.Count(id, assignments, x.dims[0], y.dims[0], bad);
  int32_t* sizes = combine ? nullptr : reinterpret_cast<int32_t*>(call.out[1].data);
  if (sizes != nullptr && call.out[1].bytes != static_cast<size_t>(experts / n) * 4) {
    return call.Fail("the counts per expert must be int32 [experts / group size]");
  }
  auto planner = [&](const int64_t* all, a2av::Plan* plan) {
    return exchange.Plan(all, plan, &rows, sizes);
  };
  const Signature sig = call.Sig();
  ffi::Error result = call.Run([&](Transport& t) {
    return t.AllToAllv(sig, x, y, rows, record, planner);
  });
  if (result.failure() && !bad.empty()) return call.Fail(bad);
  return result;
}

ffi::Error BarrierFfi(int64_t group, std::string_view meaning, ffi::RemainingArgs args,
                      ffi::RemainingRets rets) {
  Call call(kBarrier);
  if (ffi::Error e = call.Start(group, meaning, args, rets); e.failure()) return e;
  const Signature sig = call.Sig();
  return call.Run([&](Transport& t) { return t.Barrier(sig); });
}

// -- point to point ---------------------------------------------------------------------------

// send: src < 0 and no result; recv: dst < 0 and no operand. Always over MPI, whatever the
// group's transport; only the two ranks of a transfer take part.
ffi::Error SendRecvFfi(int64_t group, std::string_view meaning, int64_t src, int64_t dst,
                       ffi::RemainingArgs args,
                       ffi::RemainingRets rets) {
  Call call(kSendRecv);
  // Errors name the op as the user called it.
  call.set_op(src < 0 ? "send" : dst < 0 ? "recv" : "sendrecv");
  if (ffi::Error e = call.Start(group, meaning, args, rets); e.failure()) return e;
  Group& g = *call.group;
  if (!g.has_mpi) {
    return call.Fail("this group has no transport for the operation (send/recv/sendrecv need "
                     "MPI; the file-store communicator has only shared memory)");
  }
  std::lock_guard<std::mutex> lock(g.mu);
  const Leaf* in = call.in.empty() ? nullptr : &call.in[0];
  const Leaf* out = call.out.empty() ? nullptr : &call.out[0];
  const MessageShape none;
  const MessageShape sent = in ? MessageShape::Of(in->bytes, in->dtype, in->dims) : none;
  const MessageShape expected = out ? MessageShape::Of(out->bytes, out->dtype, out->dims) : none;
  const size_t slot = RecorderBegin(g.id, ++g.p2p_calls, call.hash, in ? in->bytes : out->bytes,
                                    kSendRecv, kRecordP2p);
  const Status s = g.mpi.SendRecv(in ? in->data : nullptr, sent, static_cast<int>(dst),
                                  out ? out->data : nullptr, expected, static_cast<int>(src));
  RecorderEnd(slot, !s.ok());
  return call.FromStatus(s);
}

// -- a point in the chain ------------------------------------------------------------------------

// spmd_after (ops/_ordering.after): its operands, copied to its results. It communicates
// nothing: as a link of the chain it runs after the calls before it, so that what reads its
// results waits for them.
ffi::Error AfterFfi(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  for (size_t i = 1; i < args.size() && i < rets.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!out.has_value()) return out.error();
    if ((*out)->untyped_data() != in->untyped_data()) {
      std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// spmd_after: no attributes; the operands after the order value come back as the results.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAfter_, AfterFfi,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
// spmd_allreduce: attrs group (i64), op (i32), wire (i32: 0 exact, else a Wire code),
// div (i64: compressed values are multiplied by 1.0f / div before rounding).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllreduce_, AllreduceFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<std::string_view>("meaning")
                                  .Attr<int32_t>("op")
                                  .Attr<int32_t>("wire")
                                  .Attr<int64_t>("div")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_allgather: attrs group, sizes (rows per rank).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllgather_, AllgatherFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<std::string_view>("meaning")
                                  .Attr<ffi::Span<const int64_t>>("sizes")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_reduce_scatter: attrs group, op, sizes (rows per rank).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kReduceScatter_, ReduceScatterFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<std::string_view>("meaning")
                                  .Attr<int32_t>("op")
                                  .Attr<ffi::Span<const int64_t>>("sizes")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_broadcast: attrs group, root (group rank).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBroadcast_, BroadcastFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<std::string_view>("meaning")
                                  .Attr<int64_t>("root")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_all_to_all: attr group; operand and result hold `size` blocks along their first axis.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAll_, AllToAllFfi,
                              ffi::Ffi::Bind().Attr<int64_t>("group")
                                  .Attr<std::string_view>("meaning")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_sendrecv: attrs group, src, dst (group ranks; -1 for none).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kSendRecv_, SendRecvFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<std::string_view>("meaning")
                                  .Attr<int64_t>("src")
                                  .Attr<int64_t>("dst")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_all_to_allv: attrs group, exact (the send counts add up to x's rows, else at most),
// repeat (0: no send_index operand) and placed (a recv_index operand).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kAllToAllv_, AllToAllvFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<std::string_view>("meaning")
                                  .Attr<bool>("exact")
                                  .Attr<int64_t>("repeat")
                                  .Attr<bool>("placed")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_moe_exchange: attrs group, combine, k, experts, tokens, weighted, slots, capacity
// (MoeExchangeFfi, moe.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kMoeExchange_, MoeExchangeFfi,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("group")
                                  .Attr<std::string_view>("meaning")
                                  .Attr<bool>("combine")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("experts")
                                  .Attr<bool>("tokens")
                                  .Attr<bool>("weighted")
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("capacity")
                                  .RemainingArgs()
                                  .RemainingRets());
// spmd_barrier: attr group.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBarrier_, BarrierFfi,
                              ffi::Ffi::Bind().Attr<int64_t>("group")
                                  .Attr<std::string_view>("meaning")
                                  .RemainingArgs()
                                  .RemainingRets());

const HandlerEntry* CpuHandlers() {
  static const HandlerEntry entries[] = {
      {"spmd_allreduce", reinterpret_cast<void*>(kAllreduce_)},
      {"spmd_allgather", reinterpret_cast<void*>(kAllgather_)},
      {"spmd_reduce_scatter", reinterpret_cast<void*>(kReduceScatter_)},
      {"spmd_broadcast", reinterpret_cast<void*>(kBroadcast_)},
      {"spmd_all_to_all", reinterpret_cast<void*>(kAllToAll_)},
      {"spmd_all_to_allv", reinterpret_cast<void*>(kAllToAllv_)},
      {"spmd_sendrecv", reinterpret_cast<void*>(kSendRecv_)},
      {"spmd_barrier", reinterpret_cast<void*>(kBarrier_)},
      {"spmd_moe_exchange", reinterpret_cast<void*>(kMoeExchange_)},
      {"spmd_after", reinterpret_cast<void*>(kAfter_)},
      {nullptr, nullptr},
  };
  return entries;
}

}  // namespace spmd
