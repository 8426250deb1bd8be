// Block-scaled codecs of the quantized all-reduce, compiled both for the GPU kernels and for the
// CPU reference the tests check them with (one source, so both round the same way).
//
// A block is kBlock = 32 consecutive values with one float32 scale, scale = amax / qmax (amax the
// largest magnitude in the block). Each value is stored as q = round(v / scale):
//   fp8  E4M3 (qmax 448, round to nearest even, saturating), 8 bits  -> 9 bits per value with the scale
//   int8 (qmax 127, round to nearest even),                  8 bits  -> 9 bits per value
//   int4 (qmax 7, round to nearest even, stored as q + 8),   4 bits  -> 5 bits per value
// Decoding gives q * scale. Error of one value v of a block with largest magnitude amax:
//   int8, int4: |v - dec(enc(v))| <= amax / (2 qmax)                  (half a step)
//   fp8 E4M3:   |v - dec(enc(v))| <= |v| / 16 + amax / (448 * 1024)    (half an ulp, or half the
//                                                                        smallest subnormal step)
// (plus float32 rounding of the scale arithmetic, a few ulp of amax).
// Two kinds of block are special. One holding a NaN or an infinity decodes as NaN throughout
// (scale NaN), so that an overflow check after the all-reduce still sees it. One whose amax is
// below kFlush = 2^-100 decodes as zeros (scale 0): below that, qmax / amax could overflow and
// amax / qmax lose bits as a subnormal.
//
// Arithmetic goes through MulRn/AddRn so that nvcc cannot contract a multiply and an add into one
// fused operation on the GPU: the host and the device compute bit-identical results.
#ifndef SPMD_CUDA_CODEC_H_
#define SPMD_CUDA_CODEC_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "spmd/tables.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#define SPMD_HD __host__ __device__ __forceinline__
#else
#define SPMD_HD inline
#endif

namespace spmd {
namespace codec {

// The quantized all-reduce's codecs (kNone: not quantized).
enum class Codec : int32_t { kNone = 0, kFp8 = 1, kInt8 = 2, kInt4 = 3 };
inline constexpr NamedCode kCodecs[] = {{"fp8", 1}, {"int8", 2}, {"int4", 3}};

constexpr int kBlock = 32;
constexpr float kFlush = 7.88860905e-31f;  // 2^-100

SPMD_HD float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

SPMD_HD float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

SPMD_HD float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

SPMD_HD float Rint(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // round half to even in the default rounding mode
#endif
}

SPMD_HD uint32_t Bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

SPMD_HD float FromBits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

SPMD_HD float Ldexp(float x, int e) {  // exact for the exponents used here (|e| < 126)
  return MulRn(x, FromBits(static_cast<uint32_t>(e + 127) << 23));
}

// float -> E4M3 (bias 7, no infinities, largest finite 448 = 0x7E, NaN 0x7F), round to nearest
// even, saturating at +-448.
SPMD_HD uint8_t FloatToE4m3(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // The conversion instruction (Ada, Hopper and later) rounds and saturates the same way; the GPU
  // test checks the kernel against the CPU reference bit for bit.
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
#endif
  uint32_t bits = Bits(f);
  uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;     // NaN
  if (a >= Bits(448.0f)) return sign | 0x7e;   // saturate (infinity included)
  if (a < Bits(0.015625f)) {                   // below 2^-6: subnormal steps of 2^-9
    float m = Rint(Ldexp(FromBits(a), 9));     // 0..8; 8 is the smallest normal, 0x08
    return sign | static_cast<uint8_t>(m);
  }
  // Round the float's 23-bit mantissa to 3 bits, to nearest even; a carry moves the exponent.
  uint32_t lsb = (a >> 20) & 1u;
  a += 0x7ffffu + lsb;
  a &= ~0xfffffu;
  int e = static_cast<int>(a >> 23) - 127;
  uint32_t m = (a >> 20) & 7u;
  if (e > 8 || (e == 8 && m > 6)) return sign | 0x7e;
  return sign | static_cast<uint8_t>(((e + 7) << 3) | m);
}

SPMD_HD float E4m3ToFloat(uint8_t v) {
  int e = (v >> 3) & 0xf;
  int m = v & 7;
  float mag;
  if (e == 0xf && m == 7) {
    mag = FromBits(0x7fc00000u);
  } else if (e == 0) {
    mag = Ldexp(static_cast<float>(m), -9);
  } else {
    mag = Ldexp(static_cast<float>(8 + m), e - 10);  // (1 + m/8) * 2^(e-7)
  }
  return (v & 0x80) ? -mag : mag;
}

SPMD_HD float QMax(Codec c) {
  return c == Codec::kFp8 ? 448.0f : c == Codec::kInt8 ? 127.0f : 7.0f;
}

// Payload bytes of one block (the scale is stored apart, one float32 per block).
SPMD_HD int PayloadBytes(Codec c) { return c == Codec::kInt4 ? kBlock / 2 : kBlock; }

// Folds one magnitude into a block's running largest magnitude; a NaN sticks (fmaxf would drop
// it). The result does not depend on the order the values come in.
SPMD_HD float AmaxFold(float amax, float a) { return (a > amax || a != a) ? a : amax; }

// The scale stored for a block whose largest magnitude is amax, and the factor values are
// multiplied by before rounding.
SPMD_HD void BlockScale(Codec c, float amax, float* scale, float* inv) {
  if (!(amax <= 3.40282347e38f)) {  // NaN or infinity: the block decodes as NaN
    *scale = FromBits(0x7fc00000u);
    *inv = 0.0f;
  } else if (amax < kFlush) {  // zeros, or too small to scale: the block decodes as zeros
    *scale = 0.0f;
    *inv = 0.0f;
  } else {
    *scale = DivRn(amax, QMax(c));
    *inv = DivRn(QMax(c), amax);
  }
}

// The 8-bit code of value x (fp8, int8) or the 4-bit code in the low bits (int4, stored as q + 8).
SPMD_HD uint8_t EncodeValue(Codec c, float x, float inv) {
  if (c == Codec::kInt4) {
    float q = fminf(fmaxf(Rint(MulRn(x, inv)), -7.0f), 7.0f);
    return static_cast<uint8_t>(static_cast<int>(q) + 8);
  }
  if (c == Codec::kInt8) {
    float q = fminf(fmaxf(Rint(MulRn(x, inv)), -127.0f), 127.0f);
    return static_cast<uint8_t>(static_cast<int8_t>(q));
  }
  return FloatToE4m3(MulRn(x, inv));
}

// Encodes n <= kBlock values (the rest of the block counts as zeros); returns the scale.
SPMD_HD float EncodeBlock(Codec c, const float* v, int n, uint8_t* payload) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = AmaxFold(amax, fabsf(v[i]));
  float scale, inv;
  BlockScale(c, amax, &scale, &inv);
  if (c == Codec::kInt4) {
    for (int i = 0; i < kBlock; i += 2) {
      uint8_t lo = EncodeValue(c, i < n ? v[i] : 0.0f, inv);
      uint8_t hi = EncodeValue(c, i + 1 < n ? v[i + 1] : 0.0f, inv);
      payload[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  } else {
    for (int i = 0; i < kBlock; ++i) payload[i] = EncodeValue(c, i < n ? v[i] : 0.0f, inv);
  }
  return scale;
}

// Decodes one block's value i.
SPMD_HD float DecodeValue(Codec c, const uint8_t* payload, float scale, int i) {
  float q;
  if (c == Codec::kInt4) {
    q = static_cast<float>(static_cast<int>((payload[i / 2] >> (4 * (i & 1))) & 0xf) - 8);
  } else if (c == Codec::kInt8) {
    q = static_cast<float>(static_cast<int8_t>(payload[i]));
  } else {
    q = E4m3ToFloat(payload[i]);
  }
  return MulRn(q, scale);
}

// The quantized all-reduce's arithmetic, for one block of n values at every rank (inputs[r] the
// block of rank r): every rank's block is encoded, decoded and summed in rank order in float32,
// and the sum is encoded once more (each rank reduces its slice of blocks and shares the result
// encoded), so the result is dec(enc(sum_r dec(enc(x_r)))), the same on every rank.
SPMD_HD void ReduceBlockReference(Codec c, int world, const float* const* inputs, int n,
                                  float* out) {
  uint8_t payload[kBlock];
  float acc[kBlock];
  for (int i = 0; i < kBlock; ++i) acc[i] = 0.0f;
  for (int r = 0; r < world; ++r) {
    float s = EncodeBlock(c, inputs[r], n, payload);
    for (int i = 0; i < n; ++i) acc[i] = AddRn(acc[i], DecodeValue(c, payload, s, i));
  }
  float s = EncodeBlock(c, acc, n, payload);
  for (int i = 0; i < n; ++i) out[i] = DecodeValue(c, payload, s, i);
}

}  // namespace codec
}  // namespace spmd

#endif  // SPMD_CUDA_CODEC_H_
