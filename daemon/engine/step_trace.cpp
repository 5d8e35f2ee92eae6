#include "daemon/engine/step_trace.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <exception>

namespace trainstream::daemon {
namespace {

// By SpanKind.
constexpr std::array<const char*, 10> kKindNames = {
    "pull",       "update-block", "push",       "weights-wanted",   "commit",
    "grad-ready", "accumulate",   "more-micro", "accumulate-block", "norm-block"};

// About 2,000 spans a step of the 124M GPT (most of them its update's blocks; 10,000 with four
// micro-batches, whose accumulate passes add 5,805 blocks) and 30,000 of the 1.86B: a hundred or more
// steps of the one, dozens of the other, in 40 MiB.
constexpr size_t kTraceSpans = size_t{1} << 20;

}  // namespace

StepTrace::StepTrace(TraceFile file, size_t capacity)
    : file_(std::move(file)), spans_(std::make_unique<Span[]>(capacity)), capacity_(capacity) {}

StepTrace::~StepTrace() {
  Write();
}

void StepTrace::Record(const Span& span) {
  const size_t slot = next_.fetch_add(1, std::memory_order_relaxed);
  if (slot < capacity_) spans_[slot] = span;
}

void StepTrace::Mark(SpanKind kind, uint32_t bucket, uint64_t step, uint64_t detail) {
  const int64_t now = Now();
  Record({kind, bucket, step, detail, now, now});
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
  const size_t recorded = next_.load(std::memory_order_relaxed);
  const size_t kept = std::min(recorded, capacity_);
  try {
    file_.Write([&](std::FILE* file) {
      fmt::print(file, R"({{"pid": {}, "dropped": {}, "kinds": ["{}"], "spans": [)", getpid(), recorded - kept,
                 fmt::join(kKindNames, R"(", ")"));
      for (size_t i = 0; i < kept; ++i) {
        const Span& s = spans_[i];
        fmt::print(file, "{}[{}, {}, {}, {}, {}, {}]", i == 0 ? "" : ",\n", static_cast<int>(s.kind), s.bucket, s.step,
                   s.detail, s.begin_ns, s.end_ns);
      }
      fmt::print(file, "]}}\n");
    });
  } catch (const std::exception& e) {
    spdlog::warn("the step trace {} is not written: {}", file_.path(), e.what());
    return false;
  }
  spdlog::info("step trace: {} spans in {}{}", kept, file_.path(),
               recorded > kept ? fmt::format(" ({} more dropped: the trace was full)", recorded - kept) : "");
  return true;
}

std::unique_ptr<StepTrace> TraceInDir(const std::string& dir, const std::string& job_key, uint32_t owner) {
  if (dir.empty()) return nullptr;
  try {
    return std::make_unique<StepTrace>(TraceFile(dir, fmt::format("trace-{}.json", job_key), owner), kTraceSpans);
  } catch (const std::exception& e) {
    spdlog::warn("job key {}: no step trace: {}", job_key, e.what());
    return nullptr;
  }
}

}  // namespace trainstream::daemon
