// How a group's collectives move data on CPU. The Python group layer (spmd.runtime) attaches
// what a group can use (a shared-memory segment, MPI communicators) and then chooses one
// transport for it (group_set_transport); every collective of the group but the point-to-point
// ones is one call on that transport, under the group's lock.
//
// Every op takes the call's signature, which the ranks compare before any data moves (each
// transport in its own way, see Check), and the leaves of one fused call (outputs may alias
// inputs). Every rank of the group makes the same calls in the same order.
#ifndef SPMD_CPU_TRANSPORT_H_
#define SPMD_CPU_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "mpi.h"
#include "reduce.h"
#include "shm.h"
#include "spmd/signature.h"
#include "spmd/alltoallv.h"
#include "spmd/call.h"
#include "spmd/status.h"
#include "spmd/tables.h"

namespace spmd {

// The transports, by the codes Python passes (group_set_transport).
enum class TransportKind : int32_t { kShm = 0, kMpi = 1, kHier = 2 };
inline constexpr NamedCode kTransportKinds[] = {{"shm", 0}, {"mpi", 1}, {"hier", 2}};

// How a compressed allreduce's float32 leaves travel (the allreduce's "wire" attribute; 0:
// exact, not compressed).
enum class Wire : int32_t { kExact = 0, kFp16 = 1, kBf16 = 2 };
inline constexpr NamedCode kWires[] = {{"fp16", 1}, {"bf16", 2}};

using Leaves = std::vector<Leaf>;

class Transport {
 public:
  virtual ~Transport() = default;

  Status Allreduce(const Signature& sig, ReduceOp op, const Leaves& in, const Leaves& out);
  // Compressed sum of float32 leaves: each rank's values divided by `div` and rounded to
  // bfloat16 (`bf16`) or float16 for the wire, summed in float32 and rounded once, the sum
  // widened into `out`.
  Status AllreduceNarrowed(const Signature& sig, bool bf16, float div, const Leaves& in,
                           const Leaves& out);
  // Rank r contributes sizes[r] rows of each leaf, in rank order in the output; without sizes
  // every rank contributes its whole input.
  Status Allgatherv(const Signature& sig, xla::ffi::Span<const int64_t> sizes, const Leaves& in,
                    const Leaves& out);
  // Block r of each input (sizes[r] rows; without sizes, equal blocks) is reduced over the ranks
  // into rank r's output.
  Status ReduceScatterv(const Signature& sig, ReduceOp op, xla::ffi::Span<const int64_t> sizes,
                        const Leaves& in, const Leaves& out);
  Status Broadcast(const Signature& sig, int root, const Leaves& in, const Leaves& out);
  // Inputs and outputs hold one block per rank along their first axis: output block j is rank
  // j's input block for this rank.
  Status AllToAll(const Signature& sig, const Leaves& in, const Leaves& out);
  // Rows of `row` bytes: `in` holds record[kSend + j] rows for rank j, peer after peer; `out`
  // gets rank j's rows for this rank in rank order, and zeros past them. `record` is this rank's
  // (spmd/alltoallv.h): the ranks exchange theirs first and fail alike on any bad count, or on
  // whatever `planner` (there) finds in them; the planner also says where every row goes.
  Status AllToAllv(const Signature& sig, const Leaf& in, const Leaf& out,
                   const a2av::Rows& rows, const std::vector<int64_t>& record,
                   const a2av::Planner& planner);
  Status Barrier(const Signature& sig);

 protected:
  explicit Transport(int size) : size_(size) {}

  // The per-call signature check: an error naming every rank's call, on every rank, when the
  // ranks' signatures differ. Each public op runs it once before its data moves.
  virtual Status Check(const Signature& sig) = 0;

  // The ops after the check: the fused allreduces and the barrier, and the others leaf by leaf
  // (bytes[r]: rank r's block of the leaf).
  virtual Status AllreduceLeaves(const Signature& sig, ReduceOp op, const Leaves& in,
                                 const Leaves& out) = 0;
  virtual Status AllreduceNarrowedLeaves(const Signature& sig, bool bf16, float div,
                                         const Leaves& in, const Leaves& out) = 0;
  virtual Status AllgathervLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                                const std::vector<size_t>& bytes) = 0;
  virtual Status ReduceScattervLeaf(const Signature& sig, ReduceOp op, const Leaf& in,
                                    const Leaf& out, const std::vector<size_t>& bytes) = 0;
  virtual Status BroadcastLeaf(const Signature& sig, int root, const Leaf& in,
                               const Leaf& out) = 0;
  virtual Status AllToAllLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                              size_t block) = 0;
  virtual Status AllToAllvNow(const Signature& sig, const Leaf& in, const Leaf& out,
                              const a2av::Rows& rows, const std::vector<int64_t>& record,
                              const a2av::Planner& planner) = 0;
  virtual Status BarrierNow(const Signature& sig) = 0;

  const int size_;  // ranks in the group

 private:
  // Rank r's block of a leaf: sizes[r] rows of `row` bytes, or `equal` bytes without sizes.
  const std::vector<size_t>& Blocks(xla::ffi::Span<const int64_t> sizes, size_t row,
                                    size_t equal);
  std::vector<size_t> blocks_;  // Blocks' result, reused from call to call
};

// Shared memory: every rank of the group on one node (shm.h).
class ShmTransport final : public Transport {
 public:
  ShmTransport(ShmGroup& shm, size_t one_shot_max)
      : Transport(shm.size()), shm_(shm), one_shot_max_(one_shot_max) {}

 protected:
  // Shared memory compares the signatures in the sync that starts each op, at no extra cost.
  Status Check(const Signature&) override { return Status::Ok(); }
  Status AllreduceLeaves(const Signature& sig, ReduceOp op, const Leaves& in,
                         const Leaves& out) override;
  Status AllreduceNarrowedLeaves(const Signature& sig, bool bf16, float div, const Leaves& in,
                                 const Leaves& out) override;
  Status AllgathervLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                        const std::vector<size_t>& bytes) override;
  Status ReduceScattervLeaf(const Signature& sig, ReduceOp op, const Leaf& in, const Leaf& out,
                            const std::vector<size_t>& bytes) override;
  Status BroadcastLeaf(const Signature& sig, int root, const Leaf& in, const Leaf& out) override;
  Status AllToAllLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                      size_t block) override;
  // The counts travel in the sync that starts the op, next to the signature check.
  Status AllToAllvNow(const Signature& sig, const Leaf& in, const Leaf& out,
                      const a2av::Rows& rows, const std::vector<int64_t>& record,
                      const a2av::Planner& planner) override;
  Status BarrierNow(const Signature& sig) override;

 private:
  ShmGroup& shm_;
  const size_t one_shot_max_;
};

// MPI over the group's communicator (mpi.h).
class MpiTransport : public Transport {
 public:
  explicit MpiTransport(const MpiComm& comm) : Transport(comm.size), comm_(comm) {}

 protected:
  // MPI compares nothing itself (an allreduce of 4 elements meeting one of 6 would return
  // garbage in the 2 extra), so every call allgathers an 8-byte hash of the signature first;
  // the descriptions travel only when the hashes differ.
  Status Check(const Signature& sig) override { return comm_.CheckSame(sig); }
  Status AllreduceLeaves(const Signature& sig, ReduceOp op, const Leaves& in,
                         const Leaves& out) override;
  // Narrowed into scratch, reduced as float16/bfloat16 (float32 accumulation, one rounding) by
  // AllreduceLeaves, and widened into the outputs.
  Status AllreduceNarrowedLeaves(const Signature& sig, bool bf16, float div, const Leaves& in,
                                 const Leaves& out) final;
  Status AllgathervLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                        const std::vector<size_t>& bytes) override;
  Status ReduceScattervLeaf(const Signature& sig, ReduceOp op, const Leaf& in, const Leaf& out,
                            const std::vector<size_t>& bytes) override;
  Status BroadcastLeaf(const Signature& sig, int root, const Leaf& in, const Leaf& out) override;
  Status AllToAllLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                      size_t block) override;
  // An allgather of the counts, then one MPI_Alltoallv.
  Status AllToAllvNow(const Signature& sig, const Leaf& in, const Leaf& out,
                      const a2av::Rows& rows, const std::vector<int64_t>& record,
                      const a2av::Planner& planner) final;
  Status BarrierNow(const Signature& sig) final;

  const MpiComm& comm_;
};

// Where the ranks of a group spanning nodes sit: group rank r is on node node_of[r], the nodes
// numbered in the order of their first rank. `per_node`: the ranks of each node where every node
// holds as many, else 0; `contiguous`: each node's ranks are consecutive in the group, node after
// node (what `spmd-run --nodes`/`--hosts` and a launcher's block placement give the world).
struct NodeLayout {
  int nodes = 0, per_node = 0;
  bool contiguous = false;
  static NodeLayout Of(const std::vector<int>& node_of);
};

// Hierarchical, for a group spanning nodes. Where every node holds L ranks, the ops run in two
// dimensions: shared memory inside each node, and MPI across the nodes over L *rails* (the
// ranks with the same local index, one per node), all rails at once, each carrying 1/L of what
// crosses between nodes:
// - allreduce: reduce_scatter inside the node (local rank k holds piece k of the node's sum),
//   allreduce of piece k over rail k, allgather inside the node;
// - allgather (nodes of consecutive ranks): each rank's block over its rail to the other nodes,
//   then an allgather inside the node for each node's part;
// - reduce_scatter (the same layout): a reduce_scatter inside the node for each node's part
//   (local rank k sums block k of it), then a reduce_scatter over the rail;
// - all_to_all (the same layout, up to kHierAllToAllMax bytes per rank): blocks regrouped by
//   destination local rank, an all_to_all inside the node, regrouped by destination node, an
//   all_to_all over the rail: each rank sends N - 1 messages across nodes instead of (N - 1) L.
// Every byte that crosses between nodes crosses once per node that needs it, as with a single
// node leader, but on L streams. Broadcast is one MPI call over the group: MPI's broadcast is
// node-aware already (MPICH's sends the data to each other node once), and a two-dimensional
// one only added its shared-memory steps (docs/hosts.md). With unequal nodes, allreduce reduces
// inside each node, across the node leaders over MPI, and broadcasts inside the node; every
// other op (and any op the layout does not allow) runs over the whole group's MPI communicator. The signature check runs
// there too, on every rank: shared memory compares the calls inside each node only, and a node
// whose ranks agree among themselves but not with another node must raise on every rank.
class HierTransport final : public MpiTransport {
 public:
  // `rail`: this rank's rail where every node holds as many ranks, else nullptr; `leaders`:
  // where they do not, the node leaders' communicator on a node leader (local rank 0), else
  // nullptr.
  HierTransport(ShmGroup& local, const MpiComm* leaders, const MpiComm* rail,
                const MpiComm& group, NodeLayout layout, size_t one_shot_max)
      : MpiTransport(group),
        local_(local),
        leaders_(leaders),
        rail_(rail),
        layout_(layout),
        one_shot_max_(one_shot_max) {}

  // all_to_all goes in two dimensions up to this many bytes per rank (its whole input): above
  // it the regrouping copies cost more than the messages saved (docs/hosts.md).
  static constexpr size_t kHierAllToAllMax = size_t{256} << 10;

 protected:
  // Sums and products of float16/bfloat16 leaves run in float32 from end to end (Widened).
  Status AllreduceLeaves(const Signature& sig, ReduceOp op, const Leaves& in,
                         const Leaves& out) override;
  Status AllgathervLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                        const std::vector<size_t>& bytes) override;
  Status ReduceScattervLeaf(const Signature& sig, ReduceOp op, const Leaf& in, const Leaf& out,
                            const std::vector<size_t>& bytes) override;
  Status AllToAllLeaf(const Signature& sig, const Leaf& in, const Leaf& out,
                      size_t block) override;

 private:
  // The steps, leaf by leaf: over the rails, or through the node leaders.
  Status Steps(const Signature& sig, ReduceOp op, const Leaves& in, const Leaves& out);
  Status RailAllreduce(const Signature& sig, ReduceOp op, const Leaf& in, const Leaf& out);
  // Half-precision leaves widened into one float32 buffer, reduced in steps, and rounded once
  // at the end, as the flat paths round once (rounding each node's partial result first would
  // round twice).
  Status Widened(const Signature& sig, ReduceOp op, const Leaves& in, const Leaves& out);
  // Whether the ops that place blocks by rank can run over the rails.
  bool BlocksOnRails() const { return rail_ != nullptr && layout_.contiguous; }

  ShmGroup& local_;
  const MpiComm* leaders_;
  const MpiComm* rail_;
  const NodeLayout layout_;
  const size_t one_shot_max_;
};

}  // namespace spmd

#endif  // SPMD_CPU_TRANSPORT_H_
