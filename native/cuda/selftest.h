// Simulation mode of the custom all-reduce: n ranks' buffers in one process, the real kernels
// launched once over all of them (custom_ar.h). Used by the GPU tests and the benchmark to check
// the kernels and measure them on a single GPU.
#ifndef SPMD_CUDA_SELFTEST_H_
#define SPMD_CUDA_SELFTEST_H_

#include <string>
#include <vector>

#include "custom_ar.h"
#include "spmd/status.h"

namespace spmd {
namespace sim {

// inputs[r]: rank r's bytes. Runs `iters` timed calls after one checked call; `outputs` gets the
// checked call's results, `ms` the mean time of a timed call.
Status AllReduce(int world, car::DType t, car::Algo algo, codec::Codec c,
                 const std::vector<std::string>& inputs, int iters,
                 std::vector<std::string>* outputs, double* ms);

// mode: 0 = custom all-reduce (one-shot if algo_hint==1, else two-shot) then the norm kernel per
// rank; 1, 2 = the fused kernel, one-shot or two-shot.
Status AllReduceRmsNorm(int world, car::DType t, int mode, size_t rows, size_t hidden,
                        const std::vector<std::string>& x, const std::vector<std::string>& residual,
                        const std::string& weight, float eps, int iters,
                        std::vector<std::string>* normed, std::vector<std::string>* residual_out,
                        double* ms);

// Device-to-device copy of `bytes`: the bandwidth roofline (mean ms per copy).
Status CopyTime(size_t bytes, int iters, double* ms);

// Name, PCI bus id and compute capability of the current device; false if there is none.
bool DeviceInfo(std::string* name, std::string* bus_id, int* major, int* minor, int* sms,
                std::string* error);

}  // namespace sim
}  // namespace spmd

#endif  // SPMD_CUDA_SELFTEST_H_
