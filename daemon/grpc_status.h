// The daemon's one boundary from Error to grpc::Status, for the control and the peer plane.
//
// A status message travels in a header, which gRPC limits to 16 KiB; over it the caller got a
// transport error ("received metadata size exceeds hard limit") instead of the daemon's answer.
// Messages quote what callers sent (a job name, a transport, a parameter's name), so they are cut to
// kMaxStatusMessage bytes, saying how much was cut.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "shm/error.h"

namespace trainstream::daemon {

inline constexpr size_t kMaxStatusMessage = 4096;

inline grpc::Status StatusOf(Code code, std::string message) {
  if (message.size() > kMaxStatusMessage) {
    const size_t cut = message.size() - kMaxStatusMessage;
    message.resize(kMaxStatusMessage);
    message += fmt::format("... ({} more bytes)", cut);
  }
  return {static_cast<grpc::StatusCode>(code), message};
}

inline grpc::Status StatusOf(const Error& e) {
  return StatusOf(e.code(), e.what());
}

}  // namespace trainstream::daemon
