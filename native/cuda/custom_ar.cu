// The custom all-reduce: one-shot and two-shot kernels, the host side they share with the
// quantized and fused kernels, eligibility, and the peer-access check; see custom_ar.h.
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "custom_ar.cuh"

namespace spmd {
namespace car {
namespace {

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

__global__ void ReadChecksKernel(Peers p, uint32_t* got) {
  if (threadIdx.x < p.world) got[threadIdx.x] = LoadAcquire(&p.sig[threadIdx.x]->check[0]);
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

}  // namespace

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
