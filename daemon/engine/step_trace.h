// A job's step timeline, for finding where a step's time goes (trainstreamd --trace-dir; read by
// benchmarks/train_gpt --daemon-trace). Off unless asked for.
//
// Each span is one stretch of work on one bucket for one step: a piece of gradients copied from a
// GPU, one block of an update, an accumulate pass or a norm pass on a worker thread, a push of weights
// to a GPU, a micro-batch's whole accumulate pass (from its start to the engine thread freeing the
// bucket's slots); an instant (begin == end) marks a rank's optimizer.step() reaching the daemon, a
// bucket's commit, a rank's GRAD_READY or MORE_MICRO reaching the engine thread. Times are CLOCK_MONOTONIC
// nanoseconds (std::chrono::steady_clock on Linux), the clock of Python's
// time.monotonic_ns, so that a benchmark sets them against its own marks. Why spans and not the
// busy sampler's /proc states: the 124M's step runs 3.6-4.7 ms longer than the daemon's update alone
// plus its idle time, and only per-block times say whether the update itself ran slower or its
// threads waited between pieces (benchmarks/results/train_gpt.md, 2026-12-06, fourth session).
//
// Invariants: Record takes a slot with one relaxed fetch_add in an array allocated up front (no lock,
// no allocation on the step's path), from any thread. Once the array is full later spans are counted,
// not kept. The file is written once, when the trace is destroyed (its engine has stopped, so nothing
// records any more), 0600 and the job's uid's, into a directory no other user can change
// (daemon/engine/trace_file.h); a trace that cannot be written, or a directory that is no place for it,
// is logged, never an error of the job.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "daemon/engine/trace_file.h"

namespace trainstream::daemon {

enum class SpanKind : uint8_t {
  kPull,
  kUpdateBlock,
  kPush,
  kWeightsWanted,
  kCommit,
  kGradReady,
  kAccumulate,
  kMoreMicro,
  kAccumulateBlock,
  kNormBlock,
};

struct Span {
  SpanKind kind = SpanKind::kPull;
  uint32_t bucket = 0;
  uint64_t step = 0;
  // The piece pulled, the worker's thread id, the bytes pushed, the rank, the half, the micro-batch.
  uint64_t detail = 0;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
};

class StepTrace {
 public:
  StepTrace(TraceFile file, size_t capacity);
  ~StepTrace();  // writes the file
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  void Record(const Span& span);
  void Mark(SpanKind kind, uint32_t bucket, uint64_t step, uint64_t detail);  // an instant, now
  [[nodiscard]] static int64_t Now();
  [[nodiscard]] static uint64_t ThreadId();  // the calling thread's id, as /proc shows it

  // Writes the spans recorded so far as one JSON object: {"pid", "dropped", "kinds", "spans": [[kind,
  // bucket, step, detail, begin_ns, end_ns], ...]}. Returns false (and logs) where it cannot.
  bool Write() const;

 private:
  const TraceFile file_;
  std::unique_ptr<Span[]> spans_;
  const size_t capacity_;
  std::atomic<size_t> next_{0};
};

// The trace of `owner`'s job `job_key`, to be written to `dir`/trace-<job key>.json; none if `dir` is
// empty, or (logged) is no place for it.
std::unique_ptr<StepTrace> TraceInDir(const std::string& dir, const std::string& job_key, uint32_t owner);

}  // namespace trainstream::daemon
