// The mixture-of-experts exchange (spmd.moe's dispatch and combine on CPU): an all_to_allv whose
// counts, order and placement the native layer works out from the routing itself.
//
// Every rank passes its assignments' experts, `ids` (T * k int32, token-major; E marks a dropped
// assignment). E experts are split evenly over the n ranks of the group, E / n per rank.
//
// Dispatch: assignment a of this rank (row a / k of x with `tokens`, else row a) goes to the rank
// holding expert ids[a], scaled by weights[a] if given. Rank r's output holds, per local expert j,
// the rows sent to it, from rank 0 first, then rank 1, ..., in assignment order within a rank;
// expert 0's rows first, then expert 1's, ..., then zeros. A second result counts them per local
// expert (jax.lax.ragged_dot's group sizes).
//
// Combine, the transpose: the rows of such a layout go back to the assignments they came from;
// with `tokens`, assignment a's row, scaled by weights[a] if given, is added into output row
// a / k (rows no assignment reaches are zeros), else it lands in output row a.
//
// Each rank counts its assignments per expert before anything moves; the counts travel as the
// exchange's records (one sync, spmd/alltoallv.h), so every rank knows every block, and all fail
// alike on a bad id or an output too small.
#ifndef SPMD_CPU_MOE_H_
#define SPMD_CPU_MOE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "spmd/alltoallv.h"
#include "xla/ffi/api/ffi.h"

namespace spmd {
namespace moe {

// The weighted and summed rows' arithmetic for `dtype` (float16, bfloat16, float32, float64);
// false for another dtype.
bool RowFns(xla::ffi::DataType dtype, a2av::RowFn* scale, a2av::RowFn* add);

// A record: [rows, out_rows, assignments, bad, slots, capacity, counts[0..E)], int64 each.
// rows: x's rows (the dispatch) or y's (the combine); out_rows: the result's rows; slots and
// capacity: the layout's (Exchange); counts: the rank's assignments per expert.
enum : size_t {
  kRows = 0,
  kOutRows = 1,
  kAssign = 2,
  kBad = 3,
  kSlots = 4,
  kCapacity = 5,
  kCounts = 6
};
inline size_t RecordLen(int64_t experts) { return kCounts + static_cast<size_t>(experts); }

// This rank's side of one exchange: its record (Count), then, from every rank's (Plan), the
// rows' indices and the plan.
//
// The layout of a rank's experts' rows: `slots` 0 (grouped): expert j's rows right after expert
// j - 1's, then zeros; else expert j's block is rows [j * slots, (j + 1) * slots), its rows from
// rank 0, rank 1, ... at the start of it (padded), or, with a `capacity` C, rank s's rows at
// row s * C of the block (each rank sends at most C rows to an expert, first choices first:
// spmd.moe.route's queue positions). Rows no assignment fills are zeros.
class Exchange {
 public:
  // The call's parameters (the buffers below are kept from call to call).
  void Reset(bool combine, int64_t k, int64_t experts, int64_t slots, int64_t capacity, int n,
             int me, const std::vector<int>* world) {
    combine_ = combine, k_ = k, experts_ = experts, slots_ = slots, capacity_ = capacity;
    n_ = n, me_ = me, world_ = world;
  }

  // Counts and sorts this rank's assignments by expert (stable); the record to publish.
  // `bad`: this rank's own problem (an id out of range, a shape), recorded so that every rank
  // fails.
  const std::vector<int64_t>& Count(const int32_t* ids, int64_t assignments, int64_t rows,
                                    int64_t out_rows, const std::string& bad);

  // The first problem in every rank's records, the same on every rank; or this rank's plan,
  // with `rows`' indices set (their other fields are the caller's) and, for the dispatch,
  // the rows per local expert written to `sizes` (int32, E / n).
  std::string Plan(const int64_t* all, a2av::Plan* plan, a2av::Rows* rows, int32_t* sizes);

 private:
  bool combine_ = false;
  int64_t k_ = 1, experts_ = 1, slots_ = 0, capacity_ = 0;
  int n_ = 1, me_ = 0;
  const std::vector<int>* world_ = nullptr;  // the group's world ranks, for messages
  std::vector<int64_t> record_;
  std::vector<int32_t> sorted_;  // this rank's assignments by expert (dropped ones left out)
  std::vector<int32_t> place_;   // each received row's place in the experts' layout
  std::vector<std::pair<int64_t, int64_t>> gaps_;  // rows of the layout no row fills
};

}  // namespace moe
}  // namespace spmd

#endif  // SPMD_CPU_MOE_H_
