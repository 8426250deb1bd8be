// The copies of the shared-memory collectives (shm.h): between a rank's buffers and the
// segment's slots, with normal or non-temporal stores.
#ifndef SPMD_CPU_SHM_COPY_H_
#define SPMD_CPU_SHM_COPY_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace spmd {
namespace shm {

// Slots and the blocks cut from them start on this boundary.
constexpr size_t kAlign = 64;
inline size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Results larger than the last-level cache go to memory anyway: writing them with
// non-temporal stores skips the read-for-ownership of every destination line, a third of the
// memory traffic of a copy. Smaller results are written normally so they stay cached for the
// op that reads them next.
constexpr size_t kStreamMin = size_t{16} << 20;

// Where StreamCopy also stores what it copies: nowhere, normally (cached), or non-temporally.
enum Also { kNoAlso, kCachedAlso, kStreamedAlso };

// Copies `len` bytes from src to dst with non-temporal stores; with kAlso, the same pass stores
// them to `also` too, so that a rank staging its own block of an allgather or a broadcast and
// copying it to its output reads its input once (measured in docs/performance.md, "Shared
// memory"). kStreamedAlso: the caller ensures that `also` is as far from a 16-byte boundary as
// dst.
template <Also kAlso>
void StreamCopy(char* dst, const char* src, size_t len, char* also);
extern template void StreamCopy<kNoAlso>(char*, const char*, size_t, char*);
extern template void StreamCopy<kCachedAlso>(char*, const char*, size_t, char*);
extern template void StreamCopy<kStreamedAlso>(char*, const char*, size_t, char*);

// Copies into a collective's output: streaming when the output is large (see kStreamMin).
// The destructor fences, so the streamed stores are ordered before whatever follows the op.
class OutCopy {
 public:
  explicit OutCopy(size_t out_bytes) : stream_(out_bytes >= kStreamMin) {}
  ~OutCopy() {
#if defined(__x86_64__)
    if (stream_) _mm_sfence();
#endif
  }
  void operator()(void* dst, const void* src, size_t len) const {
    if (stream_) {
      StreamCopy<kNoAlso>(static_cast<char*>(dst), static_cast<const char*>(src), len, nullptr);
    } else {
      std::memcpy(dst, src, len);
    }
  }
  // Zeros `len` bytes of the output, streaming as the copies do.
  void Zero(char* dst, size_t len) const;
  // Copies `len` bytes of what this rank publishes both into its slot (`far`: streamed, see
  // ShmGroup::Staging) and into the output.
  void Publish(char* slot, char* dst, const char* src, size_t len, bool far) const;

 private:
  bool stream_;
};

}  // namespace shm
}  // namespace spmd

#endif  // SPMD_CPU_SHM_COPY_H_
