// Helpers shared by the shm/ and daemon/ GoogleTest suites: unique segment names that are unlinked
// at scope exit, forked child processes that never return into GoogleTest, and deadline polling.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <thread>

#include "shm/error.h"
#include "shm/segment.h"

namespace trainstream::testing {

// A segment name no other test (or concurrent test process) uses; unlinked when the guard goes.
class ScopedSegmentName {
 public:
  ScopedSegmentName() {
    static std::atomic<int> counter{0};
    name_ = "trainstream.test." + std::to_string(getpid()) + "." + std::to_string(counter++);
    shm::Segment::Remove(name_);
  }
  ~ScopedSegmentName() { shm::Segment::Remove(name_); }
  ScopedSegmentName(const ScopedSegmentName&) = delete;
  ScopedSegmentName& operator=(const ScopedSegmentName&) = delete;
  [[nodiscard]] const std::string& str() const { return name_; }

 private:
  std::string name_;
};

// Runs `body` in a forked child. The child exits with body's return value (0: success), 99 on an
// exception; it never returns into the test framework.
inline pid_t ForkChild(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) {
    int code = 99;
    try {
      code = body();
    } catch (const std::exception& e) {
      fprintf(stderr, "child: %s\n", e.what());
    } catch (...) {
    }
    _exit(code);
  }
  return pid;
}

// Waits for the child; returns its raw wait status. Kills it if it runs past `timeout`.
inline int WaitChild(pid_t pid, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) return status;
    if (done < 0) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "child " << pid << " did not finish in time";
      return status;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

inline bool ExitedWith(int status, int code) {
  return WIFEXITED(status) && WEXITSTATUS(status) == code;
}

// Polls `condition` until it holds or `timeout` passes; returns its last value.
template <typename Condition>
bool PollUntil(Condition condition, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return condition();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// Asserts that `statement` throws trainstream::Error with `code` and a message containing `needle`.
#define TS_EXPECT_ERROR(statement, expected_code, needle)                          \
  do {                                                                             \
    try {                                                                          \
      statement;                                                                   \
      ADD_FAILURE() << #statement " did not throw";                                \
    } catch (const ::trainstream::Error& e) {                                      \
      EXPECT_EQ(e.code(), expected_code) << e.what();                              \
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)             \
          << "message '" << e.what() << "' does not mention '" << (needle) << "'"; \
    }                                                                              \
  } while (0)

}  // namespace trainstream::testing
