// The one error idiom of trainstream.
//
// Inside a component, code throws trainstream::Error (via TS_CHECK / Throw). At every boundary —
// a gRPC handler, a ring message handler, the pybind11 module, main() — the error is caught once and
// turned into that boundary's status: a grpc::Status, a session event, a Python TrainstreamError, an
// exit code. Errors never cross a process boundary as exceptions.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

namespace trainstream {

// Mirrors the gRPC status codes we use, so boundaries can map 1:1 without shm/ depending on gRPC.
enum class Code : int {
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,  // a wait gave up (the client's wait timeout)
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,  // raced with another request (a job removed while a rank attached): try again
  kInternal = 13,
  kUnavailable = 14,
};

class Error : public std::runtime_error {
 public:
  Error(Code code, const std::string& message) : std::runtime_error(message), code_(code) {}
  [[nodiscard]] Code code() const noexcept { return code_; }

 private:
  Code code_;
};

// How asynchronous work (a GPU copy, an all-reduce between daemons) reports its end, exactly once and
// on a thread of its own: with nothing when it succeeded, or with the Error that stopped it, whose
// code the boundary that reports it keeps.
using Done = std::function<void(std::optional<Error> error)>;

template <typename... Args>
[[noreturn]] void Throw(Code code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace trainstream

// TS_CHECK(cond, Code::kX, "message {}", arg): throws trainstream::Error when cond is false.
#define TS_CHECK(cond, code, ...)                         \
  do {                                                    \
    if (!(cond)) ::trainstream::Throw(code, __VA_ARGS__); \
  } while (0)
