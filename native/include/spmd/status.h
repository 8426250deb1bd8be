// A minimal status type for native code that knows nothing of XLA's or Python's error types; the
// FFI handlers turn it into an ffi::Error, the Python module into an exception.
#ifndef SPMD_STATUS_H_
#define SPMD_STATUS_H_

#include <string>
#include <utility>

namespace spmd {

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string message) {
    Status s;
    s.ok_ = false;
    s.message_ = std::move(message);
    return s;
  }
  bool ok() const { return ok_; }
  const std::string& message() const { return message_; }

 private:
  bool ok_ = true;
  std::string message_;
};

#define SPMD_RETURN_IF_ERROR(expr) \
  do {                             \
    ::spmd::Status _s = (expr);    \
    if (!_s.ok()) return _s;       \
  } while (0)

}  // namespace spmd

#endif  // SPMD_STATUS_H_
