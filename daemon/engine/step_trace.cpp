#include "daemon/engine/step_trace.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

namespace trainstream::daemon {
namespace {

// By SpanKind.
constexpr std::array<const char*, 5> kKindNames = {"pull", "update-block", "push", "weights-wanted", "commit"};

// About 2,000 spans a step of the 124M GPT (most of them its update's blocks) and 30,000 of the 1.86B:
// a few hundred steps of the one, dozens of the other, in 40 MiB.
constexpr size_t kTraceSpans = size_t{1} << 20;

}  // namespace

StepTrace::StepTrace(std::string path, size_t capacity)
    : path_(std::move(path)), spans_(std::make_unique<Span[]>(capacity)), capacity_(capacity) {}

StepTrace::~StepTrace() {
  Write();
}

void StepTrace::Record(const Span& span) {
  const size_t slot = next_.fetch_add(1, std::memory_order_relaxed);
  if (slot < capacity_) spans_[slot] = span;
}

int64_t StepTrace::Now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint64_t StepTrace::ThreadId() {
  thread_local const auto id = static_cast<uint64_t>(syscall(SYS_gettid));
  return id;
}

bool StepTrace::Write() const {
  std::FILE* file = std::fopen(path_.c_str(), "w");
  if (file == nullptr) {
    spdlog::warn("cannot write the step trace {}: {}", path_, std::strerror(errno));
    return false;
  }
  const size_t recorded = next_.load(std::memory_order_relaxed);
  const size_t kept = std::min(recorded, capacity_);
  fmt::print(file, R"({{"pid": {}, "dropped": {}, "kinds": ["{}"], "spans": [)", getpid(), recorded - kept,
             fmt::join(kKindNames, R"(", ")"));
  for (size_t i = 0; i < kept; ++i) {
    const Span& s = spans_[i];
    fmt::print(file, "{}[{}, {}, {}, {}, {}, {}]", i == 0 ? "" : ",\n", static_cast<int>(s.kind), s.bucket, s.step,
               s.detail, s.begin_ns, s.end_ns);
  }
  fmt::print(file, "]}}\n");
  const bool written = std::ferror(file) == 0;
  if (std::fclose(file) != 0 || !written) {
    spdlog::warn("writing the step trace {} failed", path_);
    return false;
  }
  spdlog::info("step trace: {} spans in {}{}", kept, path_,
               recorded > kept ? fmt::format(" ({} more dropped: the trace was full)", recorded - kept) : "");
  return true;
}

std::unique_ptr<StepTrace> TraceInDir(const std::string& dir, const std::string& job_key) {
  if (dir.empty()) return nullptr;
  return std::make_unique<StepTrace>(fmt::format("{}/trace-{}.json", dir, job_key), kTraceSpans);
}

}  // namespace trainstream::daemon
