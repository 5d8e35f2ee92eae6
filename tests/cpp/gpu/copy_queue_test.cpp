// CopyQueue's host-side decisions (order, gates, errors) over a fake driver whose "GPU" is the issuing
// thread itself: work is done when it is issued, so every event is complete once recorded.
#include "daemon/gpu/copy_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shm/error.h"

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;

cuda::CudaDriver FakeDriver() {
  static char stream;
  cuda::CudaDriver d;
  d.cuGetErrorName = [](cuda::CUresult, const char** name) {
    *name = "FAKE";
    return 0;
  };
  d.cuCtxSetCurrent = [](cuda::CUcontext) { return 0; };
  d.cuCtxPushCurrent = [](cuda::CUcontext) { return 0; };
  d.cuCtxPopCurrent = [](cuda::CUcontext* popped) {
    *popped = nullptr;
    return 0;
  };
  d.cuStreamCreate = [](cuda::CUstream* created, unsigned) {
    *created = reinterpret_cast<cuda::CUstream>(&stream);
    return 0;
  };
  d.cuStreamDestroy = [](cuda::CUstream) { return 0; };
  d.cuEventCreate = [](cuda::CUevent* created, unsigned) {
    *created = reinterpret_cast<cuda::CUevent>(new char);
    return 0;
  };
  d.cuEventDestroy = [](cuda::CUevent event) {
    delete reinterpret_cast<char*>(event);
    return 0;
  };
  d.cuEventRecord = [](cuda::CUevent, cuda::CUstream) { return 0; };
  d.cuEventSynchronize = [](cuda::CUevent) { return 0; };
  return d;
}

// What the queue did, in the order it did it.
class Log {
 public:
  CopyQueue::Issue Issue(const std::string& name) {
    return [this, name](cuda::CUstream) { Add(name + " issued"); };
  }
  trainstream::Done Done(const std::string& name) {
    return [this, name](std::optional<Error> error) {
      Add(name + (error ? std::string(" failed: ") + error->what() : " done"));
    };
  }
  std::vector<std::string> Lines() {
    std::lock_guard lock(mutex_);
    return lines_;
  }

 private:
  void Add(const std::string& line) {
    std::lock_guard lock(mutex_);
    lines_.push_back(line);
  }
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

TEST(CopyQueueTest, AnItemWaitsForItsGateAndLaterItemsWaitBehindIt) {
  const cuda::CudaDriver driver = FakeDriver();
  Log log;
  std::atomic<bool> open{false};
  {
    CopyQueue queue(driver, nullptr, "test");
    queue.Submit(log.Issue("a"), log.Done("a"), [&] { return open.load(); });
    queue.Submit(log.Issue("b"), log.Done("b"));
    std::this_thread::sleep_for(50ms);
    EXPECT_TRUE(log.Lines().empty());  // b was submitted later: it waits behind a's gate
    open = true;
  }  // the destructor finishes everything submitted
  const std::vector<std::string> lines = log.Lines();
  ASSERT_EQ(lines.size(), 4U);
  EXPECT_EQ(lines[0], "a issued");
  EXPECT_LT(std::find(lines.begin(), lines.end(), "a done"), std::find(lines.begin(), lines.end(), "b done"));
}

TEST(CopyQueueTest, AGateThatWillNeverOpenFailsOnlyItsItem) {
  const cuda::CudaDriver driver = FakeDriver();
  Log log;
  {
    CopyQueue queue(driver, nullptr, "test");
    queue.Submit(log.Issue("a"), log.Done("a"), []() -> bool { Throw(Code::kUnavailable, "the rank is gone"); });
    queue.Submit(log.Issue("b"), log.Done("b"));
  }
  const std::vector<std::string> lines = log.Lines();  // a's `done` and b's issue run on different threads
  ASSERT_EQ(lines.size(), 3U);
  const auto at = [&](const std::string& line) { return std::find(lines.begin(), lines.end(), line); };
  EXPECT_NE(at("b issued"), lines.end());
  EXPECT_LT(at("a failed: the rank is gone"), at("b done"));
}

TEST(CopyQueueTest, WorkThatCannotBeIssuedFailsWithTheReason) {
  const cuda::CudaDriver driver = FakeDriver();
  Log log;
  {
    CopyQueue queue(driver, nullptr, "test");
    queue.Submit([&driver](cuda::CUstream) { driver.Check(700, "copying gradients to the host"); }, log.Done("a"));
  }
  ASSERT_EQ(log.Lines().size(), 1U);
  EXPECT_EQ(log.Lines()[0], "a failed: copying gradients to the host: FAKE ()");
}

}  // namespace
}  // namespace trainstream::daemon
