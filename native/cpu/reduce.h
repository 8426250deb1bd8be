// Element-wise reductions used by the shared-memory collectives.
//
// Every reduction combines the ranks' buffers in rank order 0, 1, ..., n-1 so that each rank
// computes bit-identical results. float16 and bfloat16 accumulate in float32 and round once.
#ifndef SPMD_CPU_REDUCE_H_
#define SPMD_CPU_REDUCE_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "spmd/common.h"
#include "xla/ffi/api/ffi.h"

namespace spmd {

// float16 <-> float32, as x86's F16C instructions do it (the fast path below uses them, and
// every rank must get the same bits whichever path it takes): widening is exact and quiets a
// signalling NaN; narrowing rounds to nearest even, half subnormals included, overflows to
// infinity, and keeps a NaN's upper payload bits with the quiet bit set. Checked against F16C
// for all 2^16 halves and all 2^32 floats.
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
    bits = sign | 0x7f800000u | man << 13 | (man != 0 ? 0x400000u : 0);
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | (absx >> 13 & 0x3ffu));
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // inf, or rounds to it
  if (absx < 0x38800000u) {  // below half's smallest normal: a subnormal or zero
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);  // under half the smallest
    // The value is man * 2^(e - 150) with the implicit bit in man; in units of half's smallest
    // subnormal (2^-24) that is man >> (126 - e), e in [102, 112].
    uint32_t man = (absx & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - (absx >> 23);
    uint32_t r = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;  // may carry into the smallest normal
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

inline uint16_t FloatToBf16(float f) {  // round to nearest even, NaN stays NaN (branch-free)
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  uint32_t quiet = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

namespace half_detail {

#if defined(__x86_64__)
// Eight at a time with F16C; a short tail goes through a padded block so that every element
// takes the same instructions.
__attribute__((target("avx,f16c"))) inline void HalfToFloatF16c(const uint16_t* in, float* out,
                                                               size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  if (i < n) {
    alignas(32) uint16_t h[8] = {};
    alignas(32) float f[8];
    std::memcpy(h, in + i, (n - i) * 2);
    _mm256_store_ps(f, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h))));
    std::memcpy(out + i, f, (n - i) * 4);
  }
}

__attribute__((target("avx,f16c"))) inline void FloatToHalfF16c(const float* in, uint16_t* out,
                                                               size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  if (i < n) {
    alignas(32) float f[8] = {};
    alignas(32) uint16_t h[8];
    std::memcpy(f, in + i, (n - i) * 4);
    _mm_store_si128(reinterpret_cast<__m128i*>(h),
                    _mm256_cvtps_ph(_mm256_load_ps(f), _MM_FROUND_TO_NEAREST_INT));
    std::memcpy(out + i, h, (n - i) * 2);
  }
}

inline bool HasF16c() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  }();
  return yes;
}
#endif

}  // namespace half_detail

#if defined(__GNUC__)
#define SPMD_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define SPMD_ALWAYS_INLINE inline
#endif

// Widens `n` float16 (`bf16` false) or bfloat16 values to float32.
SPMD_ALWAYS_INLINE void HalfToFloats(bool bf16, const uint16_t* in, float* out, size_t n) {
  if (bf16) {
    for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
    return;
  }
#if defined(__x86_64__)
  if (half_detail::HasF16c()) return half_detail::HalfToFloatF16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

// Rounds `n` float32 values to float16 (`bf16` false) or bfloat16.
SPMD_ALWAYS_INLINE void FloatsToHalf(bool bf16, const float* in, uint16_t* out, size_t n) {
  if (bf16) {
    for (size_t i = 0; i < n; ++i) out[i] = FloatToBf16(in[i]);
    return;
  }
#if defined(__x86_64__)
  if (half_detail::HasF16c()) return half_detail::FloatToHalfF16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

// out[i] = FloatToHalf/FloatToBf16(in[i] * (1.0f / div)): what a rank sends in a compressed
// allreduce (spmd.ops.allreduce(compression=...)). A product with the float32 reciprocal, as XLA
// computes `x / n` and as the XLA casts of small compressed calls compute `x * (1 / n)`, so both
// paths give the same bits. Skipped when div is 1 (exact either way). `round(floats, halves,
// count)` does the rounding; the scaling runs in L1-sized blocks.
template <typename Round>
SPMD_ALWAYS_INLINE void NarrowWith(const Round& round, const float* in, float div, uint16_t* out,
                                   size_t n) {
  if (div == 1.0f) return round(in, out, n);
  const float scale = 1.0f / div;
  constexpr size_t kBlock = 512;
  alignas(64) float x[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    size_t m = n - base < kBlock ? n - base : kBlock;
    for (size_t i = 0; i < m; ++i) x[i] = in[base + i] * scale;
    round(x, out + base, m);
  }
}

inline void NarrowFloatsBody(bool bf16, const float* in, float div, uint16_t* out, size_t n) {
  NarrowWith([bf16](const float* f, uint16_t* h, size_t m) { FloatsToHalf(bf16, f, h, m); }, in,
             div, out, n);
}

#if defined(__x86_64__)
// FloatToBf16, 16 at a time with AVX2: the same integer rounding, so the same bits.
__attribute__((target("avx2"))) inline __m256i RoundToBf16Avx2(__m256i x) {
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)),
                       _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1))),
      16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

__attribute__((target("avx2"))) inline void FloatsToBf16Avx2(const float* in, uint16_t* out,
                                                             size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i a = RoundToBf16Avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    __m256i b = RoundToBf16Avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 8)));
    // packus interleaves 128-bit lanes (a0-3 b0-3 a4-7 b4-7): put them back in order.
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), p);
  }
  for (; i < n; ++i) out[i] = FloatToBf16(in[i]);
}

// NarrowFloats where the CPU has AVX2: bfloat16 through FloatsToBf16Avx2, float16 through F16C.
__attribute__((target("avx2,f16c"))) inline void NarrowFloatsAvx2(bool bf16, const float* in,
                                                                  float div, uint16_t* out,
                                                                  size_t n) {
  NarrowWith(
      [bf16](const float* f, uint16_t* h, size_t m) {
        bf16 ? FloatsToBf16Avx2(f, h, m) : FloatsToHalf(false, f, h, m);
      },
      in, div, out, n);
}

__attribute__((target("avx2,f16c"))) inline void WidenBf16Avx2(const uint16_t* in, float* out,
                                                               size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

inline bool HasAvx2F16c() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return yes;
}
#endif

inline void NarrowFloats(bool bf16, const float* in, float div, uint16_t* out, size_t n) {
#if defined(__x86_64__)
  if (HasAvx2F16c()) return NarrowFloatsAvx2(bf16, in, div, out, n);
#endif
  NarrowFloatsBody(bf16, in, div, out, n);
}

// HalfToFloats, with bfloat16 widened 8 at a time where the CPU has AVX2.
inline void WidenHalves(bool bf16, const uint16_t* in, float* out, size_t n) {
#if defined(__x86_64__)
  if (bf16 && HasAvx2F16c()) return WidenBf16Avx2(in, out, n);
#endif
  HalfToFloats(bf16, in, out, n);
}

// Max and min of floating values do not depend on the order of the operands, so that every path
// gives every rank the same result (mpi.cc computes them the same way): NaN if either operand is
// NaN (the canonical quiet NaN), +0 for the max of -0 and +0 and -0 for their min.
template <typename T>
inline T Combine(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::kSum:
      return static_cast<T>(a + b);
    case ReduceOp::kProd:
      return static_cast<T>(a * b);
    case ReduceOp::kMax:
    case ReduceOp::kMin:
      if constexpr (std::is_floating_point_v<T>) {
        if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
        if (a == b) return std::signbit(a) == (op == ReduceOp::kMax) ? b : a;
      }
      return (op == ReduceOp::kMax) == (a < b) ? b : a;
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

// acc[i] = acc[i] (op) x[i], with the op fixed at compile time so that the loop vectorises.
template <ReduceOp kOp>
SPMD_ALWAYS_INLINE void Accumulate(float* acc, const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = Combine(kOp, acc[i], x[i]);
}

// float16 and bfloat16: widen each rank's block, combine in float32 in rank order, round once.
SPMD_ALWAYS_INLINE void ReduceHalfBody(bool bf16, ReduceOp op, uint16_t* out,
                                       const void* const* src, int n, size_t count) {
  constexpr size_t kBlock = 512;
  alignas(64) float acc[kBlock];
  alignas(64) float x[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    size_t m = count - base < kBlock ? count - base : kBlock;
    HalfToFloats(bf16, static_cast<const uint16_t*>(src[0]) + base, acc, m);
    for (int r = 1; r < n; ++r) {
      HalfToFloats(bf16, static_cast<const uint16_t*>(src[r]) + base, x, m);
      switch (op) {
        case ReduceOp::kSum:
          Accumulate<ReduceOp::kSum>(acc, x, m);
          break;
        case ReduceOp::kProd:
          Accumulate<ReduceOp::kProd>(acc, x, m);
          break;
        case ReduceOp::kMax:
          Accumulate<ReduceOp::kMax>(acc, x, m);
          break;
        case ReduceOp::kMin:
          Accumulate<ReduceOp::kMin>(acc, x, m);
          break;
      }
    }
    FloatsToHalf(bf16, acc, out + base, m);
  }
}

#if defined(__x86_64__)
// The same loops compiled for AVX2 (twice SSE2's width), taken where the CPU has it.
__attribute__((target("avx2,f16c"))) inline void ReduceHalfAvx2(bool bf16, ReduceOp op,
                                                                uint16_t* out,
                                                                const void* const* src, int n,
                                                                size_t count) {
  ReduceHalfBody(bf16, op, out, src, n, count);
}
#endif

inline void ReduceHalf(bool bf16, ReduceOp op, uint16_t* out, const void* const* src, int n,
                       size_t count) {
#if defined(__x86_64__)
  if (HasAvx2F16c()) return ReduceHalfAvx2(bf16, op, out, src, n, count);
#endif
  ReduceHalfBody(bf16, op, out, src, n, count);
}

// The reducing rank's step of a compressed allreduce, in one pass over memory: its own float32
// values (divided by `div` and rounded to the half type, as the other ranks' were when they
// staged them in src[r], r != me) combined in rank order with the others', summed in float32,
// rounded once into `res` (what the others copy out) and widened into `out`.
SPMD_ALWAYS_INLINE void ReduceNarrowedBody(bool bf16, float div, int me, const float* own,
                                           const void* const* src, int n, uint16_t* res,
                                           float* out, size_t count) {
  constexpr size_t kBlock = 512;
  alignas(64) float acc[kBlock];
  alignas(64) float x[kBlock];
  alignas(64) uint16_t h[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    size_t m = count - base < kBlock ? count - base : kBlock;
    for (int r = 0; r < n; ++r) {
      float* dst = r == 0 ? acc : x;
      const uint16_t* half = static_cast<const uint16_t*>(src[r]) + base;
      if (r == me) {
        NarrowFloats(bf16, own + base, div, h, m);
        half = h;
      }
      HalfToFloats(bf16, half, dst, m);
      if (r > 0) Accumulate<ReduceOp::kSum>(acc, x, m);
    }
    NarrowFloats(bf16, acc, 1.0f, res + base, m);
    HalfToFloats(bf16, res + base, out + base, m);
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) inline void ReduceNarrowedAvx2(
    bool bf16, float div, int me, const float* own, const void* const* src, int n,
    uint16_t* res, float* out, size_t count) {
  ReduceNarrowedBody(bf16, div, me, own, src, n, res, out, count);
}
#endif

inline void ReduceNarrowed(bool bf16, float div, int me, const float* own, const void* const* src,
                           int n, uint16_t* res, float* out, size_t count) {
#if defined(__x86_64__)
  if (HasAvx2F16c()) return ReduceNarrowedAvx2(bf16, div, me, own, src, n, res, out, count);
#endif
  ReduceNarrowedBody(bf16, div, me, own, src, n, res, out, count);
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
      ReduceHalf(false, op, static_cast<uint16_t*>(out), src, n, count);
      return true;
    case DataType::BF16:
      ReduceHalf(true, op, static_cast<uint16_t*>(out), src, n, count);
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
