// A job's step engine: the thread that runs its step protocol (step_protocol.h) and the engine's
// thread-safe face. The thread waits on the job's doorbell, drains the continuations worker threads
// posted (EngineMailbox) and every attached rank's request ring, and hands each to the protocol; a
// rank whose message is refused is failed alone. gRPC threads attach and detach ranks under the rank
// table's mutex, which the engine thread holds while it runs the protocol, so the protocol's state is
// never touched by two threads at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "daemon/engine/all_reduce.h"
#include "daemon/engine/engine_mailbox.h"
#include "daemon/engine/rank_channel.h"
#include "daemon/engine/rank_table.h"
#include "daemon/engine/step_protocol.h"
#include "daemon/engine/step_trace.h"
#include "daemon/engine/worker_pool.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

class StepEngine {
 public:
  // `peers` sums the gradients over the daemons of a multi-node job (nullptr for one node). `adopted`:
  // the state is a dead daemon's, which may have been killed while it wrote the upload region.
  // `on_commit` hears of every commit of a bucket's state; `trace` (optional) records the step's timeline.
  // `state_segment`: the guarded mapping `state` lies in (nullptr: tests that map the state unguarded).
  StepEngine(std::string job_name, const shm::LayoutSpec& spec, const shm::JobLayout& layout, shm::StateView state,
             uint64_t seed, WorkerPool& pool, AllReduce* peers = nullptr, bool adopted = false,
             CommitObserver on_commit = {}, std::unique_ptr<StepTrace> trace = nullptr,
             const ClientSegment* state_segment = nullptr);
  ~StepEngine();  // stops the thread and waits for in-flight work
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  // Thread-safe. AddRank fails (kAlreadyExists) if the rank is attached.
  // First touch, with several NUMA nodes: the state's pages are faulted in by the threads that will
  // update them (the job leaves them unbacked for this: Job::LeftToFirstTouch). Call before the
  // first rank attaches (no client may have written the state yet); later calls return at once.
  // Takes a while for a large job: never call it under a shared lock.
  void PlaceState();
  void AddRank(std::shared_ptr<RankChannel> channel);
  // Readies the job for a rank that attaches, and returns the step it resumes from: the job's completed
  // step (every bucket committed it), each bucket collecting the next. Waits for the passes in flight;
  // then a bucket one step ahead (its update of the resume step committed before the step was
  // abandoned: a trainer died in its backward) is rolled back with two halves (its other half holds the
  // resume step), and with one half it keeps its step and takes the replayed step's gradients without
  // applying them again (its current weights go back: PARAMS_READY). The upload region of a bucket
  // whose committed weights it may not hold (rolled back, a discarded speculation, an adopted job) is
  // rewritten from the committed master weights. Thread-safe; blocks until the engine thread did it.
  uint64_t Resume();
  // The rank's data moves through `transfer` from now on (before it sends any message).
  void SetTransfer(uint32_t rank, std::shared_ptr<RankTransfer> transfer);
  void RemoveRank(uint32_t rank);
  [[nodiscard]] bool HasRank(uint32_t rank);
  // Why no rank may attach any more, if so: a failed all-reduce between daemons may have left the
  // nodes with different weights (some applied buckets of the step that others did not).
  [[nodiscard]] std::optional<std::string> Diverged();
  EngineStats Stats();
  // Fails every attached session (daemon shutdown, job dropped).
  void FailAll(const std::string& message);
  // Why the job cannot go on, if so: its owner truncated its state segment or an attached rank's
  // segment under the daemon (ClientSegment::LostMessage). The engine checks at every round (at least
  // every 100 ms, idle or not) and before it fails a rank for anything else; it then fails every
  // session, posts nothing more to any rank and refuses new ranks. The job must be dropped. Thread-safe.
  [[nodiscard]] std::optional<std::string> Lost();
  // Soon, on the engine thread: tells on_commit again of the committed state of every bucket that no
  // update or load is changing now (Commit::announced); the others are told when they commit.
  void AnnounceCommitted();

 private:
  void Loop();
  bool DrainRequests();
  bool DrainFinished();

  const std::string job_name_;
  shm::Doorbell& doorbell_;  // the job's: rings for a message, a continuation, or the engine's stop
  RankTable ranks_;          // its mutex guards the table, against attach/detach from gRPC threads
  EngineMailbox mailbox_;    // continuations from worker threads, and the work in flight
  StepProtocol protocol_;
  std::once_flag placed_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace trainstream::daemon
