// The custom all-reduce inside a node: every rank's staging buffer is registered once and mapped
// into every other rank's address space with CUDA IPC, and one kernel per call reads the peers'
// buffers directly.
//
// Algorithms (all sum in rank order 0..n-1 in float32 and round once, so every rank gets
// bit-identical results):
//   one-shot: each rank reads every peer's whole input and reduces all of it (latency-bound sizes);
//   two-shot: each rank reduces its 1/n slice from every peer into its own buffer, then gathers
//             the other slices from their owners (bandwidth-bound sizes; moves 2(n-1)/n of the
//             data per rank instead of n-1);
//   quantized: two-shot on block-scaled fp8/int8/int4 codes (codec.h);
//   fused all-reduce + RMSNorm: one-shot or two-shot by rows, the residual add and the norm in
//             the same kernel.
//
// Synchronisation: a per-block barrier between the ranks through flags in the buffers' headers.
// The epoch a barrier waits for is kept in device memory and advanced by the kernel itself, so a
// captured CUDA graph replays correctly; no host value changes between calls. A barrier that
// waits longer than the group's timeout traps (the launch fails; XLA reports it) instead of
// hanging.
//
// Simulation mode (`sim`): the kernels take the buffers of all n ranks in one process and run the
// n ranks as blockIdx.y of one launch, so the kernel logic and its barriers can be checked on one
// GPU (kernels of different processes do not run concurrently on one GPU without MPS).
#ifndef SPMD_CUDA_CUSTOM_AR_H_
#define SPMD_CUDA_CUSTOM_AR_H_

#include <cstddef>
#include <cstdint>

#include "codec.h"
#include "spmd/status.h"
#include "spmd/tables.h"

namespace spmd {
namespace car {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 128;     // blocks per rank and launch, at most (the barrier flags)
constexpr int kDefaultBlocks = 64;  // blocks per rank and launch when a rank has its own GPU
constexpr int kThreads = 512;

// At the start of every rank's buffer. 256-byte aligned size; data follows.
struct alignas(256) Signal {
  uint32_t flag[kMaxBlocks][kMaxRanks];  // flag[b][p]: the last barrier epoch peer p's block b reached
  uint32_t epoch[kMaxBlocks];            // this rank's block b's barrier count (own use only)
  uint32_t check[4];                     // peer-access check pattern
};

// The element types the custom kernels take, by dtype name.
enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
inline constexpr NamedCode kCustomDtypes[] = {{"float32", 0}, {"float16", 1}, {"bfloat16", 2}};
size_t DTypeBytes(DType t);

// The all-reduce algorithms, as the allreduce's "algos" attribute chooses them per leaf.
enum class Algo : int32_t { kNccl = 0, kOneShot = 1, kTwoShot = 2, kQuantized = 3 };
inline constexpr NamedCode kAlgos[] = {
    {"nccl", 0}, {"one_shot", 1}, {"two_shot", 2}, {"quantized", 3}};

// The ranks' buffers as a kernel sees them: data[r] and sig[r] are rank r's (mapped by IPC for
// peers, or all local in simulation mode). `cap` bytes of data per half; a buffer holds the
// Signal, then region A (cap bytes), then region B (cap bytes).
struct Peers {
  char* data[kMaxRanks];
  Signal* sig[kMaxRanks];
  int world;
  size_t cap;
};

// Bytes of one rank's buffer for a cap: Signal + 2 * cap.
size_t BufferBytes(size_t cap);
// Pointers into a buffer allocated with BufferBytes.
inline Signal* SignalOf(char* buffer) { return reinterpret_cast<Signal*>(buffer); }
inline char* DataOf(char* buffer) { return buffer + sizeof(Signal); }

// `rank` is this process's rank, or -1 in simulation mode where in/out hold one pointer per rank.
// All functions enqueue on `stream` and never synchronise the host.
struct Call {
  const Peers* peers;
  int rank;
  void* stream;
  uint64_t timeout_ns;
  int max_blocks;  // a cap on blocks per rank, or 0: kDefaultBlocks with a GPU per rank; in
                  // simulation as many as fit at once on the device for all ranks (their
                  // blocks meet at barriers, so they must run together), at most kMaxBlocks
};

// Whether `bytes` of `dtype` can take `algo` (sizes a multiple of 16 bytes, within the cap);
// a message saying why not otherwise.
Status Eligible(const Peers& p, Algo algo, codec::Codec c, DType t, size_t bytes);

Status AllReduce(const Call& call, Algo algo, DType t, const void* const* in, void* const* out,
                 size_t count);
Status QuantizedAllReduce(const Call& call, codec::Codec c, DType t, const void* const* in,
                          void* const* out, size_t count);
// normed = rmsnorm(allreduce(x) + residual) * weight, residual_out = allreduce(x) + residual;
// x, residual, normed, residual_out are [rows, hidden].
Status AllReduceRmsNorm(const Call& call, Algo algo, DType t, const void* const* x,
                        const void* const* residual, const void* const* weight, float eps,
                        size_t rows, size_t hidden, void* const* normed, void* const* residual_out);
// Whether the fused kernel takes this shape (else all-reduce, then the norm kernel).
bool FusedEligible(const Peers& p, Algo algo, DType t, size_t rows, size_t hidden);
// RMSNorm alone (the unfused path's second step), on this rank's data.
Status RmsNorm(void* stream, DType t, const void* summed, const void* residual, const void* weight,
               float eps, size_t rows, size_t hidden, void* normed, void* residual_out);

// Peer-access check: writes `pattern` into this rank's check words...
Status WriteCheck(char* own_buffer, uint32_t pattern);
// ...and after every rank wrote, reads every rank's first check word through the mapping with a
// kernel (the path the collectives use); `got` receives p.world words. Synchronises the device.
Status ReadChecks(const Peers& p, uint32_t* got);

}  // namespace car
}  // namespace spmd

#endif  // SPMD_CUDA_CUSTOM_AR_H_
