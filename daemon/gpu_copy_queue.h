// One CUDA stream of one GPU and the thread that feeds it. Work is issued in submission order with up
// to kWindow items in flight on the GPU, so the copy engine never idles between buckets; each item's
// `done` runs on this thread once the GPU has finished it, or with the error that stopped it.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "shm/cuda_driver.h"

namespace trainstream::daemon {

class CopyQueue {
 public:
  using Issue = std::function<void(cuda::CUstream)>;  // enqueues work on the stream; may throw Error
  using Done = std::function<void(std::optional<std::string> error)>;

  CopyQueue(const cuda::CudaDriver& driver, cuda::CUcontext context, std::string name);
  ~CopyQueue();  // finishes everything submitted
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;

  void Submit(Issue issue, Done done);

 private:
  static constexpr size_t kWindow = 4;
  struct Item {
    Issue issue;
    Done done;
  };
  struct InFlight {
    cuda::CUevent finished;
    Done done;
  };

  void Loop();
  void Start(Item item);
  void FinishOldest();

  const cuda::CudaDriver& driver_;
  const cuda::CUcontext context_;
  const std::string name_;
  cuda::CUstream stream_ = nullptr;
  std::vector<cuda::CUevent> idle_events_;
  std::deque<InFlight> in_flight_;  // queue thread only

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Item> pending_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace trainstream::daemon
