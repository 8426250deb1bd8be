// What the custom all-reduce's kernels share (custom_ar.cu, quantized.cu, rmsnorm.cu): element
// types and 16-byte packs, the barrier between ranks, the work split, the kernels' arguments,
// and the host side of a launch. Internal to native/cuda; the interface is custom_ar.h.
#ifndef SPMD_CUDA_CUSTOM_AR_CUH_
#define SPMD_CUDA_CUSTOM_AR_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "custom_ar.h"

namespace spmd {
namespace car {

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
__device__ inline void Barrier(const Peers& p, int rank, uint64_t timeout_ns) {
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

// -- quantized region layout --------------------------------------------------------------------

// Region layout for `blocks` codec blocks: payloads, then the float32 scales (16-byte aligned).
__host__ __device__ __forceinline__ size_t ScalesOffset(Codec c, int64_t blocks) {
  return (static_cast<size_t>(blocks) * codec::PayloadBytes(c) + 15) / 16 * 16;
}
__host__ __device__ __forceinline__ size_t RegionBytes(Codec c, int64_t blocks) {
  return ScalesOffset(c, blocks) + static_cast<size_t>(blocks) * 4;
}

// -- host side ----------------------------------------------------------------------------------

inline Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string(what) + " failed: " + cudaGetErrorString(e));
}

// Blocks that give each thread at least one of `units`.
inline int64_t BlocksFor(int64_t units) { return (units + kThreads - 1) / kThreads; }

inline Args MakeArgs(const Call& call, int64_t count) {
  Args a{};
  a.peers = *call.peers;
  a.rank = call.rank;
  a.timeout_ns = call.timeout_ns;
  a.count = count;
  return a;
}

inline int Ranks(const Call& call) { return call.rank < 0 ? call.peers->world : 1; }

inline bool Aligned(const void* const* ptrs, int n) {
  for (int k = 0; k < n; ++k) {
    if (reinterpret_cast<uintptr_t>(ptrs[k]) % 16 != 0) return false;
  }
  return true;
}

// Copies each (simulated) rank's input into its buffer's region A.
Status Stage(const Call& call, const void* const* in, size_t bytes);

// How many blocks of `kernel` the current device runs at once (cached per device and kernel: the
// simulation's launches ask on every call).
Status ResidentBlocks(const void* kernel, int* blocks);

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

}  // namespace car
}  // namespace spmd

#endif  // SPMD_CUDA_CUSTOM_AR_CUH_
