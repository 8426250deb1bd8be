// The fused all-reduce + RMSNorm (one-shot or two-shot by rows) and the RMSNorm kernel of the
// unfused path; see custom_ar.h.
#include <string>

#include "custom_ar.cuh"

namespace spmd {
namespace car {
namespace {

// Whole rows row0, row0 + gridDim.x, ... < row1 (the fused kernels' map; rows of whole packs).
template <typename T>
__device__ __forceinline__ void StageRows(const Args& a, int rank, int64_t row0, int64_t row1) {
  const int64_t packs = a.hidden / Pack<T>::kN;
  for (int64_t row = row0 + blockIdx.x; row < row1; row += gridDim.x) {
    StagePacks(a, rank, row * packs, (row + 1) * packs, threadIdx.x, blockDim.x);
  }
}

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
constexpr int kMaxHidden = 16384;  // FusedEligible; FUSED_MAX_HIDDEN on the Python side

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

bool FusedEligible(const Peers& p, Algo algo, DType t, size_t rows, size_t hidden) {
  size_t plane = rows * hidden * DTypeBytes(t);
  if (p.world < 2 || p.world > kMaxRanks || hidden == 0 || hidden > kMaxHidden) return false;
  if (algo == Algo::kOneShot) return plane <= p.cap;
  if (algo == Algo::kTwoShot) return plane <= p.cap;  // region B holds the summed rows
  return false;
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

}  // namespace car
}  // namespace spmd
