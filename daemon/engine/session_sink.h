// How the daemon's internals talk back to one attached rank: the control service implements this over
// the rank's gRPC Session stream; unit tests implement it with a recorder.
#pragma once

#include <string>

namespace trainstream::daemon {

class SessionSink {
 public:
  virtual ~SessionSink() = default;
  // Something the user should see; the session continues.
  virtual void Warn(const std::string& message) = 0;
  // The session broke the protocol or must end; the daemon ends the stream with this message.
  virtual void Fail(const std::string& message) = 0;
};

}  // namespace trainstream::daemon
