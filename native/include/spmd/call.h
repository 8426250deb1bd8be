// The call layer the CPU and the GPU FFI handlers share: the dtypes the collectives take, the
// leaves of a fused call decoded from XLA's buffers, and the errors a handler returns.
//
// Every handler takes, after a one-byte ordering operand, the leaves of one fused call, and
// returns, after a one-byte ordering result, their results. The ordering operand is the previous
// collective's ordering result: that data dependency makes XLA run collectives in program order.
#ifndef SPMD_CALL_H_
#define SPMD_CALL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "spmd/common.h"
#include "spmd/status.h"
#include "xla/ffi/api/ffi.h"

namespace spmd {

// One row of a handler table for the Python module to hand to jax.ffi.register_ffi_target.
struct HandlerEntry {
  const char* name;  // the custom-call target name
  void* handler;     // an XLA_FFI_Handler*
};

struct DtypeInfo {
  xla::ffi::DataType type;
  const char* name;
  size_t bytes;
};

// The dtypes spmd's collectives take, in the order messages (and the Python side) list them.
inline constexpr DtypeInfo kDtypes[] = {
    {xla::ffi::DataType::F16, "float16", 2}, {xla::ffi::DataType::BF16, "bfloat16", 2},
    {xla::ffi::DataType::F32, "float32", 4}, {xla::ffi::DataType::F64, "float64", 8},
    {xla::ffi::DataType::S8, "int8", 1},     {xla::ffi::DataType::U8, "uint8", 1},
    {xla::ffi::DataType::S32, "int32", 4},   {xla::ffi::DataType::S64, "int64", 8},
    {xla::ffi::DataType::PRED, "bool", 1},
};

inline const DtypeInfo* FindDtype(xla::ffi::DataType d) {
  for (const DtypeInfo& t : kDtypes) {
    if (t.type == d) return &t;
  }
  return nullptr;
}

// Bytes per element; 0 for a dtype the collectives do not take.
inline size_t ElemBytes(xla::ffi::DataType d) {
  const DtypeInfo* t = FindDtype(d);
  return t ? t->bytes : 0;
}

inline const char* DtypeName(xla::ffi::DataType d) {
  const DtypeInfo* t = FindDtype(d);
  return t ? t->name : "unsupported";
}

// One array of a fused call, or a scratch buffer standing in for one.
struct Leaf {
  char* data;
  size_t bytes;
  xla::ffi::DataType dtype;
  size_t elem;  // bytes per element
  // XLA's dimensions, valid for the call; empty for scratch leaves.
  xla::ffi::Span<const int64_t> dims;
};

inline Leaf ScratchLeaf(void* data, size_t bytes, xla::ffi::DataType dtype, size_t elem) {
  return Leaf{static_cast<char*>(data), bytes, dtype, elem, {}};
}

// One handler call: the op as its errors name it, the caller's world rank (once its group is
// found), and the decoded leaves. Each platform's handlers derive their call from it.
class CallBase {
 public:
  explicit CallBase(const char* op) : op_(op) {}

  const char* op() const { return op_; }
  void set_op(const char* op) { op_ = op; }
  std::vector<Leaf> in, out;

  // Errors name the rank from here on.
  void set_world_rank(int rank) { world_rank_ = rank; }

  // The operands and results after the ordering ones, into `in` and `out`; an error for an
  // operand of a dtype the collectives do not take.
  xla::ffi::Error Decode(xla::ffi::RemainingArgs args, xla::ffi::RemainingRets rets) {
    for (size_t i = 1; i < args.size(); ++i) {
      auto b = args.get<xla::ffi::AnyBuffer>(i);
      if (!b.has_value()) return b.error();
      xla::ffi::DataType dt = b->element_type();
      size_t w = ElemBytes(dt);
      if (w == 0) return Fail(UnsupportedDtypeMessage());
      in.push_back({static_cast<char*>(b->untyped_data()), b->size_bytes(), dt, w,
                    b->dimensions()});
    }
    for (size_t i = 1; i < rets.size(); ++i) {
      auto b = rets.get<xla::ffi::AnyBuffer>(i);
      if (!b.has_value()) return b.error();
      xla::ffi::DataType dt = (*b)->element_type();
      out.push_back({static_cast<char*>((*b)->untyped_data()), (*b)->size_bytes(), dt,
                     ElemBytes(dt), (*b)->dimensions()});
    }
    return xla::ffi::Error::Success();
  }

  // "spmd.SpmdError: rank N: <op>: <message>"; the call counts as failed from here on.
  xla::ffi::Error Fail(const std::string& message) const {
    failed_ = true;
    return xla::ffi::Error(xla::ffi::ErrorCode::kInternal,
                           std::string(kErrorMarker) + "rank " + std::to_string(world_rank_) +
                               ": " + op_ + ": " + message);
  }

  // Whether Fail was called (the GPU handlers' records say so).
  bool failed() const { return failed_; }

  xla::ffi::Error FromStatus(const Status& s) const {
    return s.ok() ? xla::ffi::Error::Success() : Fail(s.message());
  }

  // No group has the call's id, so there is no rank to name.
  xla::ffi::Error GroupMissing() const {
    return xla::ffi::Error(xla::ffi::ErrorCode::kFailedPrecondition,
                           std::string(kErrorMarker) + op_ +
                               ": its group is not initialized (spmd.finalize() was called, or "
                               "the program was compiled in another process); call spmd.init() "
                               "first");
  }

 private:
  static std::string UnsupportedDtypeMessage() {
    std::string names;
    constexpr size_t n = sizeof(kDtypes) / sizeof(kDtypes[0]);
    for (size_t i = 0; i < n; ++i) {
      names += (i == 0 ? "" : i + 1 == n ? " and " : ", ") + std::string(kDtypes[i].name);
    }
    return "unsupported dtype; spmd's collectives take " + names + " arrays";
  }

  const char* op_;
  int world_rank_ = -1;
  mutable bool failed_ = false;
};

}  // namespace spmd

#endif  // SPMD_CALL_H_
