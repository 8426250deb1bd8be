// Simulation mode; see selftest.h.
#include "selftest.h"

#include <cuda_runtime.h>

#include <algorithm>

namespace spmd {
namespace sim {
namespace {

Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string(what) + " failed: " + cudaGetErrorString(e));
}

// Device allocations freed on scope exit.
class Arena {
 public:
  ~Arena() {
    for (void* p : ptrs_) cudaFree(p);
  }
  Status Alloc(size_t bytes, void** out) {
    SPMD_RETURN_IF_ERROR(Check(cudaMalloc(out, std::max<size_t>(bytes, 16)), "cudaMalloc"));
    ptrs_.push_back(*out);
    return Status::Ok();
  }
  Status Upload(const std::string& host, void** out) {
    SPMD_RETURN_IF_ERROR(Alloc(host.size(), out));
    return Check(cudaMemcpy(*out, host.data(), host.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  }

 private:
  std::vector<void*> ptrs_;
};

Status Download(const void* dev, size_t bytes, std::string* host) {
  host->resize(bytes);
  return Check(cudaMemcpy(host->data(), dev, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
}

// The ranks' buffers, flags zeroed, and a launch that keeps every rank's blocks co-resident.
Status MakePeers(Arena& arena, int world, size_t cap, car::Peers* peers, int* max_blocks) {
  if (world < 2 || world > car::kMaxRanks) {
    return Status::Error("simulation takes 2 to 8 ranks, got " + std::to_string(world));
  }
  *peers = car::Peers{};
  peers->world = world;
  peers->cap = (cap + 255) / 256 * 256;
  for (int r = 0; r < world; ++r) {
    void* buf;
    SPMD_RETURN_IF_ERROR(arena.Alloc(car::BufferBytes(peers->cap), &buf));
    SPMD_RETURN_IF_ERROR(Check(cudaMemset(buf, 0, sizeof(car::Signal)), "cudaMemset"));
    peers->sig[r] = car::SignalOf(static_cast<char*>(buf));
    peers->data[r] = car::DataOf(static_cast<char*>(buf));
  }
  *max_blocks = 0;  // the launch fits the blocks of all ranks on the device
  return Status::Ok();
}

// Runs `fn` once, synchronises, then `iters` times between two events.
template <typename Fn>
Status Timed(cudaStream_t stream, int iters, Fn fn, double* ms) {
  SPMD_RETURN_IF_ERROR(fn());
  SPMD_RETURN_IF_ERROR(Check(cudaStreamSynchronize(stream), "running the kernel"));
  *ms = 0;
  if (iters <= 0) return Status::Ok();
  cudaEvent_t a, b;
  SPMD_RETURN_IF_ERROR(Check(cudaEventCreate(&a), "cudaEventCreate"));
  SPMD_RETURN_IF_ERROR(Check(cudaEventCreate(&b), "cudaEventCreate"));
  Status s = Check(cudaEventRecord(a, stream), "cudaEventRecord");
  for (int i = 0; s.ok() && i < iters; ++i) s = fn();
  if (s.ok()) s = Check(cudaEventRecord(b, stream), "cudaEventRecord");
  if (s.ok()) s = Check(cudaEventSynchronize(b), "running the kernel");
  float elapsed = 0;
  if (s.ok()) s = Check(cudaEventElapsedTime(&elapsed, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  *ms = static_cast<double>(elapsed) / iters;
  return s;
}

constexpr uint64_t kTimeoutNs = 20ull * 1000 * 1000 * 1000;

}  // namespace

Status AllReduce(int world, car::DType t, car::Algo algo, codec::Codec c,
                 const std::vector<std::string>& inputs, int iters,
                 std::vector<std::string>* outputs, double* ms) {
  if (static_cast<int>(inputs.size()) != world) return Status::Error("one input per rank");
  size_t bytes = inputs[0].size();
  Arena arena;
  car::Peers peers;
  int max_blocks;
  SPMD_RETURN_IF_ERROR(MakePeers(arena, world, std::max<size_t>(2 * bytes, 4096), &peers,
                                 &max_blocks));
  std::vector<const void*> in(world);
  std::vector<void*> out(world);
  for (int r = 0; r < world; ++r) {
    if (inputs[r].size() != bytes) return Status::Error("inputs differ in size");
    void* p;
    SPMD_RETURN_IF_ERROR(arena.Upload(inputs[r], &p));
    in[r] = p;
    SPMD_RETURN_IF_ERROR(arena.Alloc(bytes, &out[r]));
  }
  cudaStream_t stream;
  SPMD_RETURN_IF_ERROR(Check(cudaStreamCreate(&stream), "cudaStreamCreate"));
  car::Call call{&peers, -1, stream, kTimeoutNs, max_blocks};
  size_t count = bytes / car::DTypeBytes(t);
  Status s = Timed(
      stream, iters,
      [&] {
        return algo == car::Algo::kQuantized
                   ? car::QuantizedAllReduce(call, c, t, in.data(), out.data(), count)
                   : car::AllReduce(call, algo, t, in.data(), out.data(), count);
      },
      ms);
  if (s.ok()) {
    // Timed calls rewrote the same results; read them after the last one.
    outputs->assign(world, std::string());
    for (int r = 0; s.ok() && r < world; ++r) s = Download(out[r], bytes, &(*outputs)[r]);
  }
  cudaStreamDestroy(stream);
  return s;
}

Status AllReduceRmsNorm(int world, car::DType t, int mode, size_t rows, size_t hidden,
                        const std::vector<std::string>& x, const std::vector<std::string>& residual,
                        const std::string& weight, float eps, int iters,
                        std::vector<std::string>* normed, std::vector<std::string>* residual_out,
                        double* ms) {
  size_t bytes = rows * hidden * car::DTypeBytes(t);
  if (static_cast<int>(x.size()) != world || static_cast<int>(residual.size()) != world) {
    return Status::Error("one x and one residual per rank");
  }
  Arena arena;
  car::Peers peers;
  int max_blocks;
  SPMD_RETURN_IF_ERROR(
      MakePeers(arena, world, std::max<size_t>(2 * bytes, 4096), &peers, &max_blocks));
  std::vector<const void*> xs(world), rs(world), ws(world);
  std::vector<void*> ns(world), os(world);
  void* w;
  SPMD_RETURN_IF_ERROR(arena.Upload(weight, &w));
  for (int r = 0; r < world; ++r) {
    if (x[r].size() != bytes || residual[r].size() != bytes) {
      return Status::Error("x and residual must hold rows * hidden values");
    }
    void* p;
    SPMD_RETURN_IF_ERROR(arena.Upload(x[r], &p));
    xs[r] = p;
    SPMD_RETURN_IF_ERROR(arena.Upload(residual[r], &p));
    rs[r] = p;
    ws[r] = w;
    SPMD_RETURN_IF_ERROR(arena.Alloc(bytes, &ns[r]));
    SPMD_RETURN_IF_ERROR(arena.Alloc(bytes, &os[r]));
  }
  cudaStream_t stream;
  SPMD_RETURN_IF_ERROR(Check(cudaStreamCreate(&stream), "cudaStreamCreate"));
  car::Call call{&peers, -1, stream, kTimeoutNs, max_blocks};
  auto run = [&]() -> Status {
    if (mode != 0) {
      return car::AllReduceRmsNorm(call, static_cast<car::Algo>(mode), t, xs.data(), rs.data(),
                                   ws.data(), eps, rows, hidden, ns.data(), os.data());
    }
    car::Algo algo = bytes <= (256u << 10) ? car::Algo::kOneShot : car::Algo::kTwoShot;
    SPMD_RETURN_IF_ERROR(
        car::AllReduce(call, algo, t, xs.data(), os.data(), rows * hidden));
    for (int r = 0; r < world; ++r) {
      SPMD_RETURN_IF_ERROR(
          car::RmsNorm(stream, t, os[r], rs[r], ws[r], eps, rows, hidden, ns[r], os[r]));
    }
    return Status::Ok();
  };
  // Every call recomputes from x (the unfused norm reads the sum it wrote into residual_out), so
  // the timed calls leave the checked call's results.
  Status s = Timed(stream, iters, run, ms);
  normed->assign(world, std::string());
  residual_out->assign(world, std::string());
  for (int r = 0; s.ok() && r < world; ++r) {
    s = Download(ns[r], bytes, &(*normed)[r]);
    if (s.ok()) s = Download(os[r], bytes, &(*residual_out)[r]);
  }
  cudaStreamDestroy(stream);
  return s;
}

Status CopyTime(size_t bytes, int iters, double* ms) {
  Arena arena;
  void *a, *b;
  SPMD_RETURN_IF_ERROR(arena.Alloc(bytes, &a));
  SPMD_RETURN_IF_ERROR(arena.Alloc(bytes, &b));
  cudaStream_t stream;
  SPMD_RETURN_IF_ERROR(Check(cudaStreamCreate(&stream), "cudaStreamCreate"));
  Status s = Timed(
      stream, iters,
      [&] {
        return Check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpyAsync");
      },
      ms);
  cudaStreamDestroy(stream);
  return s;
}

bool DeviceInfo(std::string* name, std::string* bus_id, int* major, int* minor, int* sms,
                std::string* error) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  cudaDeviceProp prop;
  if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    *error = cudaGetErrorString(e);
    return false;
  }
  char bus[32] = {0};
  cudaDeviceGetPCIBusId(bus, sizeof(bus), device);
  *name = prop.name;
  *bus_id = bus;
  *major = prop.major;
  *minor = prop.minor;
  *sms = prop.multiProcessorCount;
  return true;
}

}  // namespace sim
}  // namespace spmd
