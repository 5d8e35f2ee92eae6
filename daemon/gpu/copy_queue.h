// One CUDA stream of one GPU and the two threads that serve it: one issues work in submission order
// the moment it is submitted (and its gate, if any, is open), the other waits for each item to finish
// on the GPU and then runs its `done`, with the error that stopped it if any. Issuing never waits for
// a completion, so the copy engine always has every issued copy queued.
//
// Gates exist for work that depends on another process's GPU work (a trainer's interprocess event).
// They are polled on the host instead of waited for on the GPU: a stream waiting on the GPU for an
// event whose process has died never resumes, and every later copy on that GPU would wait with it.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shm/cuda_driver.h"
#include "shm/error.h"

namespace trainstream::daemon {

class CopyQueue {
 public:
  using Issue = std::function<void(cuda::CUstream)>;  // enqueues work on the stream; may throw Error
  // True once the item may be issued; throws Error when it never will (its `done` gets the error).
  using Gate = std::function<bool()>;

  CopyQueue(const cuda::CudaDriver& driver, cuda::CUcontext context, std::string name);
  ~CopyQueue();  // finishes everything submitted
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;

  void Submit(Issue issue, Done done, Gate gate = nullptr);

 private:
  struct Item {
    Issue issue;
    Done done;
    Gate gate;
  };
  struct InFlight {
    cuda::CUevent finished;  // nullptr: failed to issue, `error` says why
    Done done;
    std::optional<Error> error;
  };

  void IssueLoop();
  void CompleteLoop();
  InFlight Start(Item item);
  cuda::CUevent TakeEvent();  // requires mutex_

  const cuda::CudaDriver& driver_;
  const cuda::CUcontext context_;
  const std::string name_;
  cuda::CUstream stream_ = nullptr;

  std::mutex mutex_;
  std::condition_variable submitted_, issued_;
  std::deque<Item> pending_;
  std::deque<InFlight> in_flight_;
  std::vector<cuda::CUevent> idle_events_;
  std::vector<cuda::CUevent> all_events_;
  bool stopping_ = false;
  bool issuer_done_ = false;
  std::thread issuer_, completer_;
};

}  // namespace trainstream::daemon
