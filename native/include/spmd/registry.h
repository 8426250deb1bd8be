// The registry of the groups a platform's handlers run on. Python registers a group once under
// an integer id; compiled programs carry the id as an FFI attribute and look the group up on
// every call.
#ifndef SPMD_REGISTRY_H_
#define SPMD_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace spmd {

// Groups are shared: a handler holds its group for the whole call, so removing the group
// meanwhile (spmd.finalize) only drops the registry's reference, and the group lives until the
// call is done with it.
template <typename G>
class Registry {
 public:
  // nullptr if no group has this id (never registered, or removed).
  std::shared_ptr<G> Find(int64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(id);
    return it == groups_.end() ? nullptr : it->second;
  }

  // False (and `g` not added) if the id is taken.
  bool Add(int64_t id, std::shared_ptr<G> g) {
    std::lock_guard<std::mutex> lock(mu_);
    return groups_.emplace(id, std::move(g)).second;
  }

  // The group removed, or nullptr if there was none.
  std::shared_ptr<G> Remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find(id);
    if (it == groups_.end()) return nullptr;
    std::shared_ptr<G> g = std::move(it->second);
    groups_.erase(it);
    return g;
  }

 private:
  mutable std::mutex mu_;
  std::map<int64_t, std::shared_ptr<G>> groups_;
};

// The process's registry of G; never destroyed, as handlers may still run while the process
// exits.
template <typename G>
Registry<G>& RegistryOf() {
  static auto* r = new Registry<G>();
  return *r;
}

}  // namespace spmd

#endif  // SPMD_REGISTRY_H_
