// The client's boundary between grpc::Status and trainstream::Error.
#pragma once

#include <grpcpp/grpcpp.h>

#include "shm/error.h"

namespace trainstream {

inline void ThrowIfFailed(const grpc::Status& status, const std::string& what) {
  if (status.ok()) return;
  Code code = static_cast<Code>(status.error_code());
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::UNAVAILABLE: break;
    default: code = Code::kUnavailable;
  }
  Throw(code, "{}: {}", what, status.error_message());
}

}  // namespace trainstream
