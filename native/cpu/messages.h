// Error texts shared by the shared-memory and MPI transports.
#ifndef SPMD_CPU_MESSAGES_H_
#define SPMD_CPU_MESSAGES_H_

#include <cstdint>
#include <string>
#include <vector>

namespace spmd {

// The tag a collective's description carries when it runs in a backward pass (a transpose).
inline constexpr const char* kBackwardTag = " [backward pass]";

inline std::string RankList(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

// The error of ranks whose collective signatures differ, from every rank's description.
inline std::string MismatchMessage(const std::vector<int>& world_ranks,
                                   const std::vector<std::string>& descs) {
  std::string msg = "the ranks of the group " + RankList(world_ranks) +
                    " made different collective calls:";
  size_t backward = 0;
  for (size_t r = 0; r < descs.size(); ++r) {
    msg += "\n  rank " + std::to_string(world_ranks[r]) + ": " + descs[r];
    backward += descs[r].find(kBackwardTag) != std::string::npos;
  }
  msg += "\nEvery rank of a group must call the same collectives in the same order with the "
         "same shapes and dtypes (allgatherv/reduce_scatterv: the same sizes).";
  if (backward != 0 && backward != descs.size()) {
    msg += "\nSome ranks are in the backward pass of a collective the others did not "
           "differentiate: JAX skips that backward collective on a rank where the collective's "
           "differentiated inputs are constants or its output does not reach the objective. "
           "Differentiate alike on every rank (docs/collectives.md).";
  }
  return msg;
}

// The error of a rank whose peer (world rank `peer`) failed collective #failed over MPI of the
// group, seen at this rank's collective #n (n >= failed): the peer's own error follows.
inline std::string PeerFailedMessage(uint64_t failed, uint64_t n,
                                     const std::vector<int>& world_ranks, int peer,
                                     const std::string& error) {
  return "collective #" + std::to_string(failed) + " over MPI of the group " +
         RankList(world_ranks) + " failed on rank " + std::to_string(peer) +
         (failed == n ? " before this rank could complete it" : ", and the group is unusable") +
         ": " + error;
}

}  // namespace spmd

#endif  // SPMD_CPU_MESSAGES_H_
