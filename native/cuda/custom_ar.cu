// Kernels of the custom all-reduce; see custom_ar.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "custom_ar.h"

namespace spmd {
namespace car {
namespace {

using codec::Codec;

// -- element types ------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float ToFloat(T v);
template <>
__device__ __forceinline__ float ToFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float ToFloat<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// 16 bytes of T.
template <typename T>
struct Pack {
  static constexpr int kN = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[kN];
  };
};

// Loads that skip L1: peers' buffers change between (and, for two-shot, within) launches.
template <typename T>
__device__ __forceinline__ void LoadPack(const char* base, int64_t i, float (&out)[Pack<T>::kN]) {
  Pack<T> p;
  p.raw = __ldcg(reinterpret_cast<const uint4*>(base) + i);
#pragma unroll
  for (int k = 0; k < Pack<T>::kN; ++k) out[k] = ToFloat<T>(p.v[k]);
}

// The rank-order float32 sum of pack i of every rank's region A.
template <typename T>
__device__ __forceinline__ void SumPack(const Peers& p, int64_t i, float (&acc)[Pack<T>::kN]) {
  float v[Pack<T>::kN];
  LoadPack<T>(p.data[0], i, acc);
  for (int r = 1; r < p.world; ++r) {
    LoadPack<T>(p.data[r], i, v);
#pragma unroll
    for (int k = 0; k < Pack<T>::kN; ++k) acc[k] += v[k];
  }
}

template <typename T>
__device__ __forceinline__ void StorePack(char* base, int64_t i, const float (&in)[Pack<T>::kN]) {
  Pack<T> p;
#pragma unroll
  for (int k = 0; k < Pack<T>::kN; ++k) p.v[k] = FromFloat<T>(in[k]);
  reinterpret_cast<uint4*>(base)[i] = p.raw;
}

// -- barrier ------------------------------------------------------------------------------------

__device__ __forceinline__ void StoreRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Block blockIdx.x of `rank` meets block blockIdx.x of every other rank. Writes of this block
// before the barrier are visible to the peers' same block after it (release/acquire at system
// scope, after __syncthreads). Flags only grow, so a peer already one barrier ahead passes too.
__device__ void Barrier(const Peers& p, int rank, uint64_t timeout_ns) {
  __syncthreads();
  Signal* self = p.sig[rank];
  const int b = blockIdx.x;
  if (threadIdx.x < p.world) {
    const uint32_t want = self->epoch[b] + 1;
    StoreRelease(&p.sig[threadIdx.x]->flag[b][rank], want);
    uint64_t start = 0;
    while (static_cast<int32_t>(LoadAcquire(&self->flag[b][threadIdx.x]) - want) < 0) {
      const uint64_t now = GlobalTimerNs();
      if (start == 0) {
        start = now;
      } else if (now - start > timeout_ns) {
        __trap();  // a peer never came: fail the launch rather than hang
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) self->epoch[b] += 1;
}

// Work split. A slice is a contiguous range of units owned by one rank; every phase walks the
// slices with the same unit-to-block map, so that the units block b of rank r writes in one phase
// are the units block b of every rank reads in the next (the barrier is per block).
struct Slice {
  int64_t lo, hi;
};

__device__ __forceinline__ Slice SliceOf(int64_t units, int world, int owner) {
  const int64_t per = (units + world - 1) / world;
  const int64_t lo = min(units, per * owner);
  return {lo, min(units, lo + per)};
}

struct Args {
  Peers peers;
  int rank;  // -1: simulation, rank = blockIdx.y
  uint64_t timeout_ns;
  int64_t count;  // elements
  const void* in[kMaxRanks];
  void* out[kMaxRanks];
  // all-reduce + RMSNorm
  const void* residual[kMaxRanks];
  const void* weight[kMaxRanks];
  void* out2[kMaxRanks];
  int64_t rows, hidden;
  float eps;
  bool packed_rows;  // rows in registers (NormRowPacked): see PackedRows
  bool staged;       // the host copied the input into region A (else the kernel does: StagePacks)
  bool packed_io;    // quantized: the input and output are 16-byte aligned (16-byte accesses)
};

__device__ __forceinline__ int RankOf(const Args& a) { return a.rank < 0 ? blockIdx.y : a.rank; }
__device__ __forceinline__ int Slot(const Args& a) { return a.rank < 0 ? blockIdx.y : 0; }

// Copies 16-byte packs lo + first, lo + first + stride, ... < hi of this rank's input into its
// region A, with the map its peers' same block reads them with after the next barrier. One
// launch per call instead of a copy and a launch.
__device__ __forceinline__ void StagePacks(const Args& a, int rank, int64_t lo, int64_t hi,
                                           int64_t first, int64_t stride) {
  const uint4* src = static_cast<const uint4*>(a.in[Slot(a)]);
  uint4* dst = reinterpret_cast<uint4*>(a.peers.data[rank]);
  for (int64_t i = lo + first; i < hi; i += stride) dst[i] = src[i];
}

// The same, for every slice of `units` (the two-shot phases' map).
__device__ __forceinline__ void StageSlices(const Args& a, int rank, int64_t units, int64_t first,
                                            int64_t stride) {
  for (int s = 0; s < a.peers.world; ++s) {
    const Slice sl = SliceOf(units, a.peers.world, s);
    StagePacks(a, rank, sl.lo, sl.hi, first, stride);
  }
}

// Whole rows row0, row0 + gridDim.x, ... < row1 (the fused kernels' map; rows of whole packs).
template <typename T>
__device__ __forceinline__ void StageRows(const Args& a, int rank, int64_t row0, int64_t row1) {
  const int64_t packs = a.hidden / Pack<T>::kN;
  for (int64_t row = row0 + blockIdx.x; row < row1; row += gridDim.x) {
    StagePacks(a, rank, row * packs, (row + 1) * packs, threadIdx.x, blockDim.x);
  }
}

// -- one-shot and two-shot ----------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kThreads) OneShotKernel(Args a) {
  using P = Pack<T>;
  const int rank = RankOf(a);
  const Peers& p = a.peers;
  const int64_t packs = a.count / P::kN;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (!a.staged) StagePacks(a, rank, 0, packs, first, stride);
  Barrier(p, rank, a.timeout_ns);
  char* out = static_cast<char*>(a.out[Slot(a)]);
  for (int64_t i = first; i < packs; i += stride) {
    float acc[P::kN];
    SumPack<T>(p, i, acc);
    StorePack<T>(out, i, acc);
  }
  Barrier(p, rank, a.timeout_ns);  // nobody restages its buffer while a peer still reads it
}

template <typename T>
__global__ void __launch_bounds__(kThreads) TwoShotKernel(Args a) {
  using P = Pack<T>;
  const int rank = RankOf(a);
  const Peers& p = a.peers;
  const int64_t packs = a.count / P::kN;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (!a.staged) StageSlices(a, rank, packs, first, stride);
  Barrier(p, rank, a.timeout_ns);
  // Reduce-scatter: this rank's slice, from every rank, into its own buffer (in place: peers
  // read only their own slices of it).
  const Slice mine = SliceOf(packs, p.world, rank);
  for (int64_t i = mine.lo + first; i < mine.hi; i += stride) {
    float acc[P::kN];
    SumPack<T>(p, i, acc);
    StorePack<T>(p.data[rank], i, acc);
  }
  Barrier(p, rank, a.timeout_ns);
  // All-gather: every slice from its owner.
  uint4* out = static_cast<uint4*>(a.out[Slot(a)]);
  for (int s = 0; s < p.world; ++s) {
    const Slice sl = SliceOf(packs, p.world, s);
    const uint4* src = reinterpret_cast<const uint4*>(p.data[s]);
    for (int64_t i = sl.lo + first; i < sl.hi; i += stride) out[i] = __ldcg(src + i);
  }
  Barrier(p, rank, a.timeout_ns);
}

// -- quantized ----------------------------------------------------------------------------------

// Region layout for `blocks` codec blocks: payloads, then the float32 scales (16-byte aligned).
__host__ __device__ __forceinline__ size_t ScalesOffset(Codec c, int64_t blocks) {
  return (static_cast<size_t>(blocks) * codec::PayloadBytes(c) + 15) / 16 * 16;
}
__host__ __device__ __forceinline__ size_t RegionBytes(Codec c, int64_t blocks) {
  return ScalesOffset(c, blocks) + static_cast<size_t>(blocks) * 4;
}

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

// -- all-reduce + RMSNorm -----------------------------------------------------------------------

__device__ float BlockSum(float v) {
  __shared__ float partial[kThreads / 32];
  __shared__ float total;
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `partial` may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) / 32;
    float s = lane < warps ? partial[lane] : 0.0f;
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// One row: the all-reduced value (rounded to T as the all-reduce returns it) plus the residual,
// rounded to T, into res_out; then the norm of that row into normed. The all-reduced value is
// the rank-order sum of the peers' region A (`summed` null) or read from `summed` (the two-shot
// owner's region B, or res_out itself on the unfused path).
//
// Rows of whole 16-byte packs (hidden * sizeof(T) a multiple of 16, at most kRowPacks packs per
// thread) keep the row in registers between the sum and the norm; other rows go element by
// element and read res_out back.
constexpr int kMaxHidden = 16384;  // FusedEligible; spmd/ops/_cuda.py, FUSED_MAX_HIDDEN

template <typename T>
constexpr int kRowPacks = (kMaxHidden * sizeof(T) / 16 + kThreads - 1) / kThreads;

template <typename T>
__device__ void NormRowPacked(const Args& a, int64_t row, const T* summed, const T* residual,
                              const T* weight, T* normed, T* res_out) {
  using P = Pack<T>;
  const Peers& p = a.peers;
  const int64_t packs = a.hidden / P::kN;
  const int64_t base = row * packs;
  uint4 kept[kRowPacks<T>];
  float sumsq = 0.0f;
#pragma unroll
  for (int k = 0; k < kRowPacks<T>; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (j >= packs) continue;  // (not break: the loop stays unrolled, `kept` in registers)
    float acc[P::kN], v[P::kN];
    if (summed == nullptr) {
      SumPack<T>(p, base + j, acc);
    } else {
      LoadPack<T>(reinterpret_cast<const char*>(summed), base + j, acc);
    }
    LoadPack<T>(reinterpret_cast<const char*>(residual), base + j, v);
    P out;
#pragma unroll
    for (int e = 0; e < P::kN; ++e) {
      out.v[e] = FromFloat<T>(ToFloat<T>(FromFloat<T>(acc[e])) + v[e]);
      const float f = ToFloat<T>(out.v[e]);
      sumsq += f * f;
    }
    reinterpret_cast<uint4*>(res_out)[base + j] = out.raw;
    kept[k] = out.raw;
  }
  const float inv = rsqrtf(BlockSum(sumsq) / static_cast<float>(a.hidden) + a.eps);
#pragma unroll
  for (int k = 0; k < kRowPacks<T>; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (j >= packs) continue;
    P x, n;
    x.raw = kept[k];
    float w[P::kN];
    LoadPack<T>(reinterpret_cast<const char*>(weight), j, w);
#pragma unroll
    for (int e = 0; e < P::kN; ++e) n.v[e] = FromFloat<T>(ToFloat<T>(x.v[e]) * inv * w[e]);
    reinterpret_cast<uint4*>(normed)[base + j] = n.raw;
  }
}

template <typename T>
__device__ void NormRow(const Args& a, int64_t row, const T* summed, const T* residual,
                        const T* weight, T* normed, T* res_out) {
  if (a.packed_rows) {
    NormRowPacked<T>(a, row, summed, residual, weight, normed, res_out);
    return;
  }
  const Peers& p = a.peers;
  const int64_t h = a.hidden;
  float sumsq = 0.0f;
  for (int64_t col = threadIdx.x; col < h; col += blockDim.x) {
    const int64_t i = row * h + col;
    float acc;
    if (summed == nullptr) {
      acc = ToFloat<T>(__ldcg(reinterpret_cast<const T*>(p.data[0]) + i));
      for (int r = 1; r < p.world; ++r) {
        acc += ToFloat<T>(__ldcg(reinterpret_cast<const T*>(p.data[r]) + i));
      }
    } else {
      acc = ToFloat<T>(__ldcg(summed + i));
    }
    const T out = FromFloat<T>(ToFloat<T>(FromFloat<T>(acc)) + ToFloat<T>(residual[i]));
    res_out[i] = out;
    const float f = ToFloat<T>(out);
    sumsq += f * f;
  }
  const float inv = rsqrtf(BlockSum(sumsq) / static_cast<float>(h) + a.eps);
  for (int64_t col = threadIdx.x; col < h; col += blockDim.x) {
    const int64_t i = row * h + col;
    normed[i] = FromFloat<T>(ToFloat<T>(res_out[i]) * inv * ToFloat<T>(weight[col]));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) FusedOneShotKernel(Args a) {
  const int rank = RankOf(a);
  const int slot = Slot(a);
  if (!a.staged) StageRows<T>(a, rank, 0, a.rows);
  Barrier(a.peers, rank, a.timeout_ns);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    NormRow<T>(a, row, nullptr, static_cast<const T*>(a.residual[slot]),
               static_cast<const T*>(a.weight[slot]), static_cast<T*>(a.out[slot]),
               static_cast<T*>(a.out2[slot]));
  }
  Barrier(a.peers, rank, a.timeout_ns);
}

// Rows split between the ranks for the sum: each owner writes its rows of the all-reduced x
// (rounded to T, as the all-reduce returns it) into its region B. Then every rank adds its own
// residual to every row and normalises it with its own weight, as the one-shot and unfused paths
// do (residual and weight need not be the same on every rank).
template <typename T>
__global__ void __launch_bounds__(kThreads) FusedTwoShotKernel(Args a) {
  const int rank = RankOf(a);
  const int slot = Slot(a);
  const Peers& p = a.peers;
  if (!a.staged) {
    for (int s = 0; s < p.world; ++s) {
      const Slice sl = SliceOf(a.rows, p.world, s);
      StageRows<T>(a, rank, sl.lo, sl.hi);
    }
  }
  Barrier(p, rank, a.timeout_ns);
  const Slice mine = SliceOf(a.rows, p.world, rank);
  char* sum_b = p.data[rank] + p.cap;
  if ((a.hidden * static_cast<int64_t>(sizeof(T))) % 16 == 0) {
    using P = Pack<T>;
    const int64_t packs = a.hidden / P::kN;
    for (int64_t row = mine.lo + blockIdx.x; row < mine.hi; row += gridDim.x) {
      for (int64_t j = row * packs + threadIdx.x; j < (row + 1) * packs; j += blockDim.x) {
        float acc[P::kN];
        SumPack<T>(p, j, acc);
        StorePack<T>(sum_b, j, acc);
      }
    }
  } else {
    for (int64_t row = mine.lo + blockIdx.x; row < mine.hi; row += gridDim.x) {
      for (int64_t col = threadIdx.x; col < a.hidden; col += blockDim.x) {
        const int64_t i = row * a.hidden + col;
        float acc = ToFloat<T>(__ldcg(reinterpret_cast<const T*>(p.data[0]) + i));
        for (int r = 1; r < p.world; ++r) {
          acc += ToFloat<T>(__ldcg(reinterpret_cast<const T*>(p.data[r]) + i));
        }
        reinterpret_cast<T*>(sum_b)[i] = FromFloat<T>(acc);
      }
    }
  }
  Barrier(p, rank, a.timeout_ns);
  const T* residual = static_cast<const T*>(a.residual[slot]);
  const T* weight = static_cast<const T*>(a.weight[slot]);
  T* normed = static_cast<T*>(a.out[slot]);
  T* res_out = static_cast<T*>(a.out2[slot]);
  for (int s = 0; s < p.world; ++s) {
    const Slice sl = SliceOf(a.rows, p.world, s);
    const T* sb = reinterpret_cast<const T*>(p.data[s] + p.cap);
    for (int64_t row = sl.lo + blockIdx.x; row < sl.hi; row += gridDim.x) {
      NormRow<T>(a, row, sb, residual, weight, normed, res_out);
    }
  }
  Barrier(p, rank, a.timeout_ns);
}

// The unfused path's norm: res_out holds allreduce(x) on entry.
template <typename T>
__global__ void __launch_bounds__(kThreads) RmsNormKernel(Args a) {
  T* res_out = static_cast<T*>(a.out2[0]);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    NormRow<T>(a, row, res_out, static_cast<const T*>(a.residual[0]),
               static_cast<const T*>(a.weight[0]), static_cast<T*>(a.out[0]), res_out);
  }
}

__global__ void ReadChecksKernel(Peers p, uint32_t* got) {
  if (threadIdx.x < p.world) got[threadIdx.x] = LoadAcquire(&p.sig[threadIdx.x]->check[0]);
}

// -- host side ----------------------------------------------------------------------------------

Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string(what) + " failed: " + cudaGetErrorString(e));
}

// Blocks that give each thread at least one of `units`.
int64_t BlocksFor(int64_t units) { return (units + kThreads - 1) / kThreads; }

Args MakeArgs(const Call& call, int64_t count) {
  Args a{};
  a.peers = *call.peers;
  a.rank = call.rank;
  a.timeout_ns = call.timeout_ns;
  a.count = count;
  return a;
}

int Ranks(const Call& call) { return call.rank < 0 ? call.peers->world : 1; }

bool Aligned(const void* const* ptrs, int n) {
  for (int k = 0; k < n; ++k) {
    if (reinterpret_cast<uintptr_t>(ptrs[k]) % 16 != 0) return false;
  }
  return true;
}

// Copies each (simulated) rank's input into its buffer's region A.
Status Stage(const Call& call, const void* const* in, size_t bytes) {
  cudaStream_t s = static_cast<cudaStream_t>(call.stream);
  for (int k = 0; k < Ranks(call); ++k) {
    int r = call.rank < 0 ? k : call.rank;
    SPMD_RETURN_IF_ERROR(CudaCheck(
        cudaMemcpyAsync(call.peers->data[r], in[k], bytes, cudaMemcpyDeviceToDevice, s),
        "staging the all-reduce input (cudaMemcpyAsync)"));
  }
  return Status::Ok();
}

// How many blocks of `kernel` the current device runs at once (cached per device and kernel: the
// simulation's launches ask on every call).
Status ResidentBlocks(const void* kernel, int* blocks) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, int> cache;
  int device = 0;
  SPMD_RETURN_IF_ERROR(CudaCheck(cudaGetDevice(&device), "cudaGetDevice"));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({device, kernel});
  if (it == cache.end()) {
    int sms = 0, per_sm = 0;
    SPMD_RETURN_IF_ERROR(CudaCheck(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute"));
    SPMD_RETURN_IF_ERROR(
        CudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0),
                  "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
    it = cache.emplace(std::make_pair(device, kernel), per_sm * sms).first;
  }
  *blocks = it->second;
  return Status::Ok();
}

// At most `want` blocks per rank (at least one), and no more than kDefaultBlocks, or in
// simulation mode no more than all ranks' blocks of this kernel can be resident at once: a block
// waits at its barriers for the same block of every other rank, so they must run together.
template <typename Kernel>
Status GridFor(const Call& call, Kernel kernel, int64_t want, dim3* grid) {
  int64_t cap = kDefaultBlocks;
  if (call.rank < 0) {
    int resident = 0;
    SPMD_RETURN_IF_ERROR(ResidentBlocks(reinterpret_cast<const void*>(kernel), &resident));
    cap = std::min<int64_t>(kMaxBlocks, resident / call.peers->world);
  }
  if (call.max_blocks > 0) cap = std::min<int64_t>(cap, call.max_blocks);
  *grid = dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(cap, want))), Ranks(call));
  return Status::Ok();
}

template <typename Kernel, typename... Extra>
Status Launch(const Call& call, Kernel kernel, int64_t want, const Args& a, Extra... extra) {
  dim3 grid;
  SPMD_RETURN_IF_ERROR(GridFor(call, kernel, want, &grid));
  kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(call.stream)>>>(a, extra...);
  return CudaCheck(cudaGetLastError(), "launching the custom all-reduce kernel");
}

template <typename T>
Status AllReduceT(const Call& call, Algo algo, const void* const* in, void* const* out,
                  size_t count) {
  Args a = MakeArgs(call, static_cast<int64_t>(count));
  for (int k = 0; k < Ranks(call); ++k) {
    a.in[k] = in[k];
    a.out[k] = out[k];
  }
  a.staged = !Aligned(in, Ranks(call));  // the kernel stages 16 bytes at a time
  if (a.staged) SPMD_RETURN_IF_ERROR(Stage(call, in, count * sizeof(T)));
  int64_t packs = static_cast<int64_t>(count * sizeof(T) / 16);
  if (algo == Algo::kOneShot) return Launch(call, OneShotKernel<T>, BlocksFor(packs), a);
  return Launch(call, TwoShotKernel<T>,
                BlocksFor((packs + call.peers->world - 1) / call.peers->world), a);
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

// Whether the norm keeps each row in registers: whole 16-byte packs, at most kRowPacks per
// thread, every pointer 16-byte aligned.
template <typename T>
bool PackedRows(size_t hidden, const void* const* residual,
                const void* const* weight, void* const* normed, void* const* residual_out,
                int ranks) {
  return (hidden * sizeof(T)) % 16 == 0 && hidden * sizeof(T) / 16 <= size_t{kRowPacks<T>} * kThreads &&
         Aligned(residual, ranks) && Aligned(weight, ranks) && Aligned(normed, ranks) &&
         Aligned(residual_out, ranks);
}

template <typename T>
Status FusedT(const Call& call, Algo algo, const void* const* x, const void* const* residual,
              const void* const* weight, float eps, size_t rows, size_t hidden,
              void* const* normed, void* const* residual_out) {
  Args a = MakeArgs(call, static_cast<int64_t>(rows * hidden));
  a.rows = static_cast<int64_t>(rows);
  a.hidden = static_cast<int64_t>(hidden);
  a.eps = eps;
  for (int k = 0; k < Ranks(call); ++k) {
    a.residual[k] = residual[k];
    a.weight[k] = weight[k];
    a.out[k] = normed[k];
    a.out2[k] = residual_out[k];
  }
  a.packed_rows = PackedRows<T>(hidden, residual, weight, normed, residual_out, Ranks(call));
  for (int k = 0; k < Ranks(call); ++k) a.in[k] = x[k];
  a.staged = (hidden * sizeof(T)) % 16 != 0 || !Aligned(x, Ranks(call));
  if (a.staged) SPMD_RETURN_IF_ERROR(Stage(call, x, rows * hidden * sizeof(T)));
  // One row per block.
  if (algo == Algo::kOneShot) return Launch(call, FusedOneShotKernel<T>, a.rows, a);
  return Launch(call, FusedTwoShotKernel<T>, (a.rows + call.peers->world - 1) / call.peers->world,
                a);
}


}  // namespace

size_t DTypeBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

size_t BufferBytes(size_t cap) { return sizeof(Signal) + 2 * cap; }

Status Eligible(const Peers& p, Algo algo, Codec c, DType t, size_t bytes) {
  if (p.world < 2 || p.world > kMaxRanks) {
    return Status::Error("the custom all-reduce takes 2 to 8 ranks, not " +
                         std::to_string(p.world));
  }
  if (algo == Algo::kQuantized) {
    int64_t count = static_cast<int64_t>(bytes / DTypeBytes(t));
    int64_t blocks = (count + codec::kBlock - 1) / codec::kBlock;
    if (c == Codec::kNone) return Status::Error("quantized all-reduce without a codec");
    if (RegionBytes(c, blocks) > p.cap) {
      return Status::Error("the quantized all-reduce of " + std::to_string(bytes) +
                           " bytes needs more than the registered " + std::to_string(p.cap));
    }
    return Status::Ok();
  }
  if (bytes % 16 != 0) {
    return Status::Error("the custom all-reduce needs a multiple of 16 bytes, got " +
                         std::to_string(bytes));
  }
  if (bytes > p.cap) {
    return Status::Error("the custom all-reduce's registered buffer holds " +
                         std::to_string(p.cap) + " bytes, the call has " + std::to_string(bytes));
  }
  return Status::Ok();
}

bool FusedEligible(const Peers& p, Algo algo, DType t, size_t rows, size_t hidden) {
  size_t plane = rows * hidden * DTypeBytes(t);
  if (p.world < 2 || p.world > kMaxRanks || hidden == 0 || hidden > kMaxHidden) return false;
  if (algo == Algo::kOneShot) return plane <= p.cap;
  if (algo == Algo::kTwoShot) return plane <= p.cap;  // region B holds the summed rows
  return false;
}

Status AllReduce(const Call& call, Algo algo, DType t, const void* const* in, void* const* out,
                 size_t count) {
  if (count == 0) return Status::Ok();
  SPMD_RETURN_IF_ERROR(Eligible(*call.peers, algo, Codec::kNone, t, count * DTypeBytes(t)));
  for (int k = 0; k < Ranks(call); ++k) {  // the kernels store 16 bytes at a time
    if (reinterpret_cast<uintptr_t>(out[k]) % 16 != 0) {
      return Status::Error("the custom all-reduce needs a 16-byte aligned output buffer");
    }
  }
  switch (t) {
    case DType::kF32:
      return AllReduceT<float>(call, algo, in, out, count);
    case DType::kF16:
      return AllReduceT<__half>(call, algo, in, out, count);
    case DType::kBF16:
      return AllReduceT<__nv_bfloat16>(call, algo, in, out, count);
  }
  return Status::Error("unknown dtype code");
}

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

Status AllReduceRmsNorm(const Call& call, Algo algo, DType t, const void* const* x,
                        const void* const* residual, const void* const* weight, float eps,
                        size_t rows, size_t hidden, void* const* normed,
                        void* const* residual_out) {
  if (rows == 0 || hidden == 0) return Status::Ok();
  if (!FusedEligible(*call.peers, algo, t, rows, hidden)) {
    return Status::Error("the fused all-reduce + RMSNorm does not take " + std::to_string(rows) +
                         " x " + std::to_string(hidden) + " with this algorithm");
  }
  switch (t) {
    case DType::kF32:
      return FusedT<float>(call, algo, x, residual, weight, eps, rows, hidden, normed,
                           residual_out);
    case DType::kF16:
      return FusedT<__half>(call, algo, x, residual, weight, eps, rows, hidden, normed,
                            residual_out);
    case DType::kBF16:
      return FusedT<__nv_bfloat16>(call, algo, x, residual, weight, eps, rows, hidden, normed,
                                   residual_out);
  }
  return Status::Error("unknown dtype code");
}

Status RmsNorm(void* stream, DType t, const void* summed, const void* residual, const void* weight,
               float eps, size_t rows, size_t hidden, void* normed, void* residual_out) {
  if (rows == 0 || hidden == 0) return Status::Ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  size_t bytes = rows * hidden * DTypeBytes(t);
  if (summed != residual_out) {
    SPMD_RETURN_IF_ERROR(CudaCheck(
        cudaMemcpyAsync(residual_out, summed, bytes, cudaMemcpyDeviceToDevice, s),
        "cudaMemcpyAsync"));
  }
  Args a{};
  a.rows = static_cast<int64_t>(rows);
  a.hidden = static_cast<int64_t>(hidden);
  a.eps = eps;
  a.residual[0] = residual;
  a.weight[0] = weight;
  a.out[0] = normed;
  a.out2[0] = residual_out;
  int blocks = static_cast<int>(std::min<size_t>(rows, 1024));
  switch (t) {
    case DType::kF32:
      a.packed_rows = PackedRows<float>(hidden, &residual, &weight, &normed, &residual_out, 1);
      RmsNormKernel<float><<<blocks, kThreads, 0, s>>>(a);
      break;
    case DType::kF16:
      a.packed_rows = PackedRows<__half>(hidden, &residual, &weight, &normed, &residual_out, 1);
      RmsNormKernel<__half><<<blocks, kThreads, 0, s>>>(a);
      break;
    case DType::kBF16:
      a.packed_rows =
          PackedRows<__nv_bfloat16>(hidden, &residual, &weight, &normed, &residual_out, 1);
      RmsNormKernel<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(a);
      break;
  }
  return CudaCheck(cudaGetLastError(), "launching the RMSNorm kernel");
}

Status WriteCheck(char* own_buffer, uint32_t pattern) {
  Signal* sig = SignalOf(own_buffer);
  SPMD_RETURN_IF_ERROR(
      CudaCheck(cudaMemcpy(&sig->check[0], &pattern, sizeof(pattern), cudaMemcpyHostToDevice),
                "writing the peer-access check pattern"));
  return CudaCheck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

Status ReadChecks(const Peers& p, uint32_t* got) {
  uint32_t* dev = nullptr;
  SPMD_RETURN_IF_ERROR(CudaCheck(cudaMalloc(&dev, kMaxRanks * sizeof(uint32_t)), "cudaMalloc"));
  ReadChecksKernel<<<1, 32>>>(p, dev);
  Status s = CudaCheck(cudaGetLastError(), "launching the peer-access check");
  if (s.ok()) {
    s = CudaCheck(cudaMemcpy(got, dev, p.world * sizeof(uint32_t), cudaMemcpyDeviceToHost),
                  "reading peers' buffers (the peer-access check)");
  }
  cudaFree(dev);
  return s;
}

}  // namespace car
}  // namespace spmd
