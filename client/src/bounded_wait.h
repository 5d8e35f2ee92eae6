// How the client's blocking calls wait (client.h's WaitPolicy): in slices, running the interrupt
// check between them, reporting progress when due and giving up at the timeout; and gRPC calls that
// an interrupt cancels.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <string>

#include "trainstream/client.h"

namespace trainstream {

// One wait. `what` says what is awaited ("bucket 3's weights of step 12"); `situation`, asked only
// for a message, says who is missing. Both run on the waiting thread.
class BoundedWait {
 public:
  BoundedWait(const WaitPolicy& policy, std::function<std::string()> what, std::function<std::string()> situation = {});
  // Call between slices, as often as you like: at most every kWaitSlice it runs the interrupt check
  // (which may throw), reports progress when due, and throws kDeadlineExceeded after the timeout.
  void Between();

 private:
  [[nodiscard]] std::string Describe(std::chrono::steady_clock::duration waited) const;
  [[nodiscard]] std::chrono::milliseconds ProgressInterval() const;

  const WaitPolicy& policy_;
  std::function<std::string()> what_, situation_;
  std::chrono::steady_clock::time_point start_, next_check_, next_progress_;
};

// Runs the gRPC call that `start` begins (it must call the callback it is given exactly once) to its
// end, waiting in slices; an exception from `interrupt` cancels the call, waits for it to end, and
// leaves. The call's own deadline bounds it.
grpc::Status WaitForCall(grpc::ClientContext& context, const std::function<void()>& interrupt,
                         const std::function<void(std::function<void(grpc::Status)>)>& start);

}  // namespace trainstream
