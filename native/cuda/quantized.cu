// The quantized all-reduce: two-shot on block-scaled fp8/int8/int4 codes (codec.h); see
// custom_ar.h.
#include "custom_ar.cuh"

namespace spmd {
namespace car {
namespace {

// A codec block of 32 values is handled by 4 neighbouring lanes of a warp, 8 values each: a
// warp reads and writes 256 consecutive values, and the lanes of a block find its largest
// magnitude with two shuffles. The unit u = 4 * block + lane-in-block.
constexpr int kQLanes = 4;
constexpr int kQVals = codec::kBlock / kQLanes;

__device__ __forceinline__ unsigned QMask() { return 0xfu << (threadIdx.x & 31 & ~(kQLanes - 1)); }

// The block's largest magnitude, from each lane's 8 values (NaN-sticky, order-independent).
__device__ __forceinline__ float QAmax(const float (&v)[kQVals]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kQVals; ++i) amax = codec::AmaxFold(amax, fabsf(v[i]));
  amax = codec::AmaxFold(amax, __shfl_xor_sync(QMask(), amax, 1));
  return codec::AmaxFold(amax, __shfl_xor_sync(QMask(), amax, 2));
}

// Pack k of a lane's 8 values, as the array LoadPack and StorePack take.
template <typename T, typename F>
__device__ __forceinline__ F (&PackOf(F (&v)[kQVals], int k))[Pack<T>::kN] {
  return *reinterpret_cast<F(*)[Pack<T>::kN]>(v + k * Pack<T>::kN);
}

// This lane's 8 values of unit u (zeros past the end). `packed`: 16-byte loads (src aligned).
template <typename T>
__device__ __forceinline__ void QLoad(const T* src, int64_t u, int64_t count, bool packed,
                                      float (&v)[kQVals]) {
  const int64_t at = u * kQVals;
  if (packed && at + kQVals <= count) {
#pragma unroll
    for (int k = 0; k < kQVals / Pack<T>::kN; ++k) {
      LoadPack<T>(reinterpret_cast<const char*>(src + at), k, PackOf<T>(v, k));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kQVals; ++i) v[i] = at + i < count ? ToFloat<T>(src[at + i]) : 0.0f;
  }
}

template <typename T>
__device__ __forceinline__ void QStore(T* dst, int64_t u, int64_t count, bool packed,
                                       const float (&v)[kQVals]) {
  const int64_t at = u * kQVals;
  if (packed && at + kQVals <= count) {
#pragma unroll
    for (int k = 0; k < kQVals / Pack<T>::kN; ++k) {
      StorePack<T>(reinterpret_cast<char*>(dst + at), k, PackOf<T>(v, k));
    }
  } else {
    for (int i = 0; i < kQVals && at + i < count; ++i) dst[at + i] = FromFloat<T>(v[i]);
  }
}

// Encodes this lane's 8 values of unit u into `region` (payload bytes, and the block's scale
// from its first lane), exactly as codec::EncodeBlock encodes the whole block.
__device__ __forceinline__ void QEncode(Codec c, const float (&v)[kQVals], int64_t u,
                                        char* region, int64_t blocks) {
  float scale, inv;
  codec::BlockScale(c, QAmax(v), &scale, &inv);
  const int64_t blk = u / kQLanes;
  uint8_t* payload = reinterpret_cast<uint8_t*>(region) + blk * codec::PayloadBytes(c);
  if (c == Codec::kInt4) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < kQVals; ++i) word |= uint32_t{codec::EncodeValue(c, v[i], inv)} << (4 * i);
    reinterpret_cast<uint32_t*>(payload)[u % kQLanes] = word;
  } else {
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo |= uint32_t{codec::EncodeValue(c, v[i], inv)} << (8 * i);
      hi |= uint32_t{codec::EncodeValue(c, v[4 + i], inv)} << (8 * i);
    }
    reinterpret_cast<uint2*>(payload)[u % kQLanes] = make_uint2(lo, hi);
  }
  if (u % kQLanes == 0) reinterpret_cast<float*>(region + ScalesOffset(c, blocks))[blk] = scale;
}

// Decodes this lane's 8 values of unit u from `region`: added to acc (kAdd), or written as is
// (the gather, so that a -0 stays -0 as in the CPU reference).
template <bool kAdd>
__device__ __forceinline__ void QDecode(Codec c, const char* region, int64_t blocks, int64_t u,
                                        float (&acc)[kQVals]) {
  const int64_t blk = u / kQLanes;
  const char* payload = region + blk * codec::PayloadBytes(c);
  alignas(8) uint8_t bytes[kQVals];
  if (c == Codec::kInt4) {
    // Value i of the lane is nibble i of its word: byte i / 2, as DecodeValue reads it.
    *reinterpret_cast<uint32_t*>(bytes) =
        __ldcg(reinterpret_cast<const unsigned int*>(payload) + u % kQLanes);
  } else {
    *reinterpret_cast<uint2*>(bytes) = __ldcg(reinterpret_cast<const uint2*>(payload) + u % kQLanes);
  }
  const float scale = __ldcg(reinterpret_cast<const float*>(region + ScalesOffset(c, blocks)) + blk);
#pragma unroll
  for (int i = 0; i < kQVals; ++i) {
    const float v = codec::DecodeValue(c, bytes, scale, i);
    acc[i] = kAdd ? codec::AddRn(acc[i], v) : v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) QuantizedKernel(Args a, Codec c) {
  const int rank = RankOf(a);
  const Peers& p = a.peers;
  const int64_t blocks = (a.count + codec::kBlock - 1) / codec::kBlock;
  // Every lane of a codec block takes the same path through the loops below: the units of a
  // block are consecutive threads (blockDim.x is a multiple of kQLanes) and slices hold whole
  // blocks.
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const T* in = static_cast<const T*>(a.in[Slot(a)]);
  // Encode this rank's input into its region A, slice by slice with the reading phase's map.
  for (int s = 0; s < p.world; ++s) {
    const Slice sl = SliceOf(blocks, p.world, s);
    for (int64_t u = sl.lo * kQLanes + first; u < sl.hi * kQLanes; u += stride) {
      float v[kQVals];
      QLoad<T>(in, u, a.count, a.packed_io, v);
      QEncode(c, v, u, p.data[rank], blocks);
    }
  }
  Barrier(p, rank, a.timeout_ns);
  // Reduce this rank's slice of blocks from every rank's A, in rank order; encode the sum into
  // its region B.
  const Slice mine = SliceOf(blocks, p.world, rank);
  for (int64_t u = mine.lo * kQLanes + first; u < mine.hi * kQLanes; u += stride) {
    float acc[kQVals];
#pragma unroll
    for (int i = 0; i < kQVals; ++i) acc[i] = 0.0f;
    for (int r = 0; r < p.world; ++r) QDecode<true>(c, p.data[r], blocks, u, acc);
#pragma unroll
    for (int i = 0; i < kQVals; ++i) {
      if (u * kQVals + i >= a.count) acc[i] = 0.0f;  // past the end counts as zeros
    }
    QEncode(c, acc, u, p.data[rank] + p.cap, blocks);
  }
  Barrier(p, rank, a.timeout_ns);
  // Gather: decode every slice from its owner's B.
  T* out = static_cast<T*>(a.out[Slot(a)]);
  for (int s = 0; s < p.world; ++s) {
    const Slice sl = SliceOf(blocks, p.world, s);
    for (int64_t u = sl.lo * kQLanes + first; u < sl.hi * kQLanes; u += stride) {
      float v[kQVals];
      QDecode<false>(c, p.data[s] + p.cap, blocks, u, v);
      QStore<T>(out, u, a.count, a.packed_io, v);
    }
  }
  Barrier(p, rank, a.timeout_ns);
}

template <typename T>
Status QuantizedT(const Call& call, Codec c, const void* const* in, void* const* out,
                  size_t count) {
  Args a = MakeArgs(call, static_cast<int64_t>(count));
  for (int k = 0; k < Ranks(call); ++k) {
    a.in[k] = in[k];
    a.out[k] = out[k];
  }
  a.packed_io = Aligned(in, Ranks(call)) && Aligned(out, Ranks(call));
  int64_t blocks = static_cast<int64_t>((count + codec::kBlock - 1) / codec::kBlock);
  // One thread per kQLanes-th of a codec block.
  return Launch(call, QuantizedKernel<T>,
                BlocksFor((blocks * kQLanes + call.peers->world - 1) / call.peers->world), a, c);
}

}  // namespace

Status QuantizedAllReduce(const Call& call, Codec c, DType t, const void* const* in,
                          void* const* out, size_t count) {
  if (count == 0) return Status::Ok();
  SPMD_RETURN_IF_ERROR(Eligible(*call.peers, Algo::kQuantized, c, t, count * DTypeBytes(t)));
  switch (t) {
    case DType::kF32:
      return QuantizedT<float>(call, c, in, out, count);
    case DType::kF16:
      return QuantizedT<__half>(call, c, in, out, count);
    case DType::kBF16:
      return QuantizedT<__nv_bfloat16>(call, c, in, out, count);
  }
  return Status::Error("unknown dtype code");
}

}  // namespace car
}  // namespace spmd
