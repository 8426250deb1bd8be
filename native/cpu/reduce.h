// Element-wise reductions used by the shared-memory collectives.
//
// Every reduction combines the ranks' buffers in rank order 0, 1, ..., n-1 so that each rank
// computes bit-identical results. float16 and bfloat16 accumulate in float32 and round once.
#ifndef SPMD_CPU_REDUCE_H_
#define SPMD_CPU_REDUCE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace spmd {

// Reduction codes, shared with Python (spmd/ops/_core.py, _REDUCE_OPS).
enum class ReduceOp : int32_t { kSum = 0, kProd = 1, kMax = 2, kMin = 3 };

inline float HalfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t man = (absx & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(absx >> 23);
    uint32_t r = man >> (shift + 1 - 1 + 13 - 13);
    // Shift so that the result has 10 fraction bits relative to 2^-24.
    uint32_t total = static_cast<uint32_t>(shift) + 13 + 1 - 1;
    r = man >> total;
    uint32_t rem = man & ((1u << total) - 1);
    uint32_t half = 1u << (total - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (absx - 0x38000000u) >> 13;
  uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

template <typename T>
inline T Combine(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kSum:
      return static_cast<T>(a + b);
    case ReduceOp::kProd:
      return static_cast<T>(a * b);
    case ReduceOp::kMax:
      return a < b ? b : (a == a ? a : a);  // NaN in a propagates
    case ReduceOp::kMin:
      return b < a ? b : a;
  }
  return a;
}

// out[i] = src[0][i] (op) src[1][i] (op) ... (op) src[n-1][i], left to right.
template <typename T>
void ReduceTyped(ReduceOp op, T* out, const void* const* src, int n, size_t count) {
  const T* s0 = static_cast<const T*>(src[0]);
  if (n == 1) {
    if (out != s0) std::memmove(out, s0, count * sizeof(T));
    return;
  }
  const T* s1 = static_cast<const T*>(src[1]);
  switch (op) {  // the common 2-operand sum gets a loop the compiler vectorises
    case ReduceOp::kSum:
      for (size_t i = 0; i < count; ++i) out[i] = static_cast<T>(s0[i] + s1[i]);
      break;
    default:
      for (size_t i = 0; i < count; ++i) out[i] = Combine(op, s0[i], s1[i]);
  }
  for (int r = 2; r < n; ++r) {
    const T* s = static_cast<const T*>(src[r]);
    if (op == ReduceOp::kSum) {
      for (size_t i = 0; i < count; ++i) out[i] = static_cast<T>(out[i] + s[i]);
    } else {
      for (size_t i = 0; i < count; ++i) out[i] = Combine(op, out[i], s[i]);
    }
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void ReduceHalf(ReduceOp op, uint16_t* out, const void* const* src, int n, size_t count) {
  constexpr size_t kBlock = 256;
  float acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    size_t m = count - base < kBlock ? count - base : kBlock;
    const uint16_t* s0 = static_cast<const uint16_t*>(src[0]) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = ToF(s0[i]);
    for (int r = 1; r < n; ++r) {
      const uint16_t* s = static_cast<const uint16_t*>(src[r]) + base;
      for (size_t i = 0; i < m; ++i) acc[i] = Combine(op, acc[i], ToF(s[i]));
    }
    for (size_t i = 0; i < m; ++i) out[base + i] = FromF(acc[i]);
  }
}

inline void ReduceBool(ReduceOp op, uint8_t* out, const void* const* src, int n, size_t count) {
  // sum and max are logical or; prod and min are logical and.
  bool any = op == ReduceOp::kSum || op == ReduceOp::kMax;
  const uint8_t* s0 = static_cast<const uint8_t*>(src[0]);
  for (size_t i = 0; i < count; ++i) out[i] = s0[i] != 0;
  for (int r = 1; r < n; ++r) {
    const uint8_t* s = static_cast<const uint8_t*>(src[r]);
    if (any) {
      for (size_t i = 0; i < count; ++i) out[i] = out[i] | (s[i] != 0);
    } else {
      for (size_t i = 0; i < count; ++i) out[i] = out[i] & (s[i] != 0);
    }
  }
}

// Reduces `count` elements of `dtype`; false if the dtype is not reducible.
inline bool Reduce(xla::ffi::DataType dtype, ReduceOp op, void* out, const void* const* src, int n,
                   size_t count) {
  using xla::ffi::DataType;
  switch (dtype) {
    case DataType::F32:
      ReduceTyped(op, static_cast<float*>(out), src, n, count);
      return true;
    case DataType::F64:
      ReduceTyped(op, static_cast<double*>(out), src, n, count);
      return true;
    case DataType::S8:
      ReduceTyped(op, static_cast<int8_t*>(out), src, n, count);
      return true;
    case DataType::U8:
      ReduceTyped(op, static_cast<uint8_t*>(out), src, n, count);
      return true;
    case DataType::S32:
      ReduceTyped(op, static_cast<int32_t*>(out), src, n, count);
      return true;
    case DataType::S64:
      ReduceTyped(op, static_cast<int64_t*>(out), src, n, count);
      return true;
    case DataType::F16:
      ReduceHalf<HalfToFloat, FloatToHalf>(op, static_cast<uint16_t*>(out), src, n, count);
      return true;
    case DataType::BF16:
      ReduceHalf<Bf16ToFloat, FloatToBf16>(op, static_cast<uint16_t*>(out), src, n, count);
      return true;
    case DataType::PRED:
      ReduceBool(op, static_cast<uint8_t*>(out), src, n, count);
      return true;
    default:
      return false;
  }
}

}  // namespace spmd

#endif  // SPMD_CPU_REDUCE_H_
