// The sequence check of calls compared in full only on their first run (the GPU handlers'); see
// ShmGroup::Sequence in shm.h.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

#include "messages.h"
#include "shm.h"

namespace spmd {
namespace {

// The chain of a rank's calls: each call's hash folded into the chain of the calls before it,
// so that the same calls in another order (or one call more) give another chain.
uint64_t Fold(uint64_t chain, uint64_t hash) {
  uint64_t x = (chain ^ hash) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  return x ^ ((chain << 7) | (chain >> 57));
}

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

bool ShmGroup::SeqRead(int r, uint64_t n, uint64_t* chain, uint64_t* hash) const {
  const Ctrl::SeqEntry& e = ctrl(r)->seq_ring[n % kSequenceRing];
  if (e.n.load(std::memory_order_acquire) != n) return false;
  *chain = e.chain.load(std::memory_order_relaxed);
  *hash = e.hash.load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  return e.n.load(std::memory_order_relaxed) == n;  // not rewritten meanwhile
}

Status ShmGroup::Sequence(uint64_t hash, std::string_view described) {
  std::lock_guard<std::mutex> lock(seq_mu_);
  if (!seq_broken_.empty()) return Status::Error(seq_broken_);
  auto [text, added] = seq_texts_.try_emplace(hash, described);  // a string if new
  if (added) SeqPublishText(hash, text->second);
  const uint64_t n = ++seq_calls_;
  seq_chain_ = Fold(seq_chain_, hash);
  // Publish call n: its entry marked unreadable while it changes (a seqlock whose odd state
  // is 0), then the latest call.
  Ctrl* mine = ctrl(rank_);
  Ctrl::SeqEntry& e = mine->seq_ring[n % kSequenceRing];
  e.n.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  e.chain.store(seq_chain_, std::memory_order_relaxed);
  e.hash.store(hash, std::memory_order_relaxed);
  e.n.store(n, std::memory_order_release);
  mine->seq_latest.store(n, std::memory_order_release);
  // Publishing comes before reading the peers' (a store then loads: without the fence x86 may
  // let two ranks each read the other's previous call, and both miss the differing one).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // Compare with each peer at the latest call that both have published.
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const uint64_t c = std::min(n, ctrl(r)->seq_latest.load(std::memory_order_acquire));
    uint64_t theirs, their_hash, ours, our_hash;
    if (c == 0 || !SeqRead(r, c, &theirs, &their_hash) || !SeqRead(rank_, c, &ours, &our_hash)) {
      continue;  // nothing yet, or the peer is kSequenceRing calls ahead
    }
    if (theirs == ours) continue;
    seq_broken_ = SeqMismatch(r, c);
    return Status::Error(seq_broken_);
  }
  return Status::Ok();
}

void ShmGroup::SeqPublishText(uint64_t hash, const std::string& text) {
  if (hash == 0) return;
  Ctrl* mine = ctrl(rank_);
  for (uint64_t i = 0; i < kSequenceTexts; ++i) {
    Ctrl::SeqText& t = mine->seq_texts[(hash + i) % kSequenceTexts];
    if (t.hash.load(std::memory_order_relaxed) != 0) continue;
    const size_t len = std::min(text.size(), sizeof(t.text) - 1);
    std::memcpy(t.text, text.data(), len);
    t.text[len] = 0;
    t.hash.store(hash, std::memory_order_release);
    return;
  }  // full: a peer's error names the signature's hash instead
}

std::string ShmGroup::SeqText(int r, uint64_t hash) const {
  const Ctrl* c = ctrl(r);
  for (uint64_t i = 0; i < kSequenceTexts; ++i) {
    const Ctrl::SeqText& t = c->seq_texts[(hash + i) % kSequenceTexts];
    const uint64_t h = t.hash.load(std::memory_order_acquire);
    if (h == 0) return "";
    if (h == hash) return std::string(t.text, strnlen(t.text, sizeof(t.text)));
  }
  return "";
}

void ShmGroup::SequenceReset() {
  std::lock_guard<std::mutex> lock(seq_mu_);
  seq_calls_ = seq_chain_ = 0;
  seq_texts_.clear();
  seq_broken_.clear();
  Ctrl* mine = ctrl(rank_);
  mine->seq_latest.store(0, std::memory_order_release);
  for (Ctrl::SeqEntry& e : mine->seq_ring) e.n.store(0, std::memory_order_release);
  for (Ctrl::SeqText& t : mine->seq_texts) t.hash.store(0, std::memory_order_release);
}

// The first call up to `upto` whose chains differ between this rank and rank r, of those both
// rings still hold, with each rank's call: named only where the call before it was read alike
// (or it is the first call), else the calls before it differ.
std::string ShmGroup::SeqMismatch(int r, uint64_t upto) {
  auto text = [this](int rank, uint64_t hash) {
    std::string t = SeqText(rank, hash);
    if (t.empty()) {
      auto it = seq_texts_.find(hash);
      t = it != seq_texts_.end() ? it->second : "a call";
    }
    return t;
  };
  const std::string head = "the ranks of the group " + RankList(world_ranks_) +
                           " made different collective calls, found by the sequence check after "
                           "their first runs (SPMD_DEBUG=1 compares every call before it runs): ";
  const uint64_t lo = upto >= kSequenceRing ? upto - kSequenceRing + 1 : 1;
  bool alike_before = lo == 1;  // the chains agree before call d
  for (uint64_t d = lo; d <= upto; ++d) {
    uint64_t theirs, their_hash, ours, our_hash;
    if (!SeqRead(r, d, &theirs, &their_hash) || !SeqRead(rank_, d, &ours, &our_hash)) {
      alike_before = false;
      continue;
    }
    if (theirs == ours) {
      alike_before = true;
      continue;
    }
    if (!alike_before) {
      return head + "the calls before call #" + std::to_string(d) + " on this group differ " +
             "(the check holds the last " + std::to_string(kSequenceRing) + " calls)";
    }
    std::string mine = text(rank_, our_hash), other = text(r, their_hash);
    if (mine == other) {  // texts cut short, or alike: the signatures tell them apart
      mine += " (signature " + Hex(our_hash) + ")";
      other += " (signature " + Hex(their_hash) + ")";
    }
    return head + "call #" + std::to_string(d) + " on this group is\n  rank " +
           std::to_string(world_ranks_[rank_]) + ": " + mine + "\n  rank " +
           std::to_string(world_ranks_[r]) + ": " + other;
  }
  return head + "up to call #" + std::to_string(upto) + " on this group";
}

}  // namespace spmd
