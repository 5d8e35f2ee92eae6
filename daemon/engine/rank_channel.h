// The daemon's end of one attached rank: its mapped rank segment (guarded: its owner may truncate it,
// daemon/guard/client_segment.h), the consumer of its request ring, the producer of its completion ring,
// and the session to report errors on.
//
// Owned through shared_ptr: worker tasks that read this rank's gradient slots hold a reference, so a
// rank that detaches mid-update keeps its mapping until the last task that reads it has finished.
// Only the job's engine thread touches the rings, the backlog and the cuda-ipc bookkeeping.
#pragma once

#include <deque>
#include <memory>

#include "daemon/engine/rank_transfer.h"
#include "daemon/engine/session_sink.h"
#include "daemon/guard/client_segment.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

struct RankChannel {
  // `segment` is initialized (shm::InitRankSegment).
  RankChannel(uint32_t rank, ClientSegment segment, const shm::JobLayout& layout, std::shared_ptr<SessionSink> session)
      : rank(rank),
        segment(std::move(segment)),
        view(shm::ViewRank(this->segment.data(), layout)),
        requests(view.request_ring),
        completions(view.completion_ring, &view.header->completion_doorbell),
        session(std::move(session)),
        staged(layout.buckets.size(), 0),
        pulled(layout.buckets.size(), 0),
        pushing(layout.buckets.size(), 0),
        streamed(layout.buckets.size(), 0),
        pushed(layout.buckets.size(), -1),
        speculated(layout.buckets.size(), -1) {}
  // No copy can touch the segment any more (copies hold a reference): it may stop being page-locked.
  ~RankChannel() {
    if (transfer) transfer->ReleaseHost(segment.data(), segment.size());
  }
  RankChannel(const RankChannel&) = delete;
  RankChannel& operator=(const RankChannel&) = delete;

  // Queues a completion; whatever the ring cannot take now waits in the backlog (a slow client never
  // blocks the engine).
  void Post(const shm::Message& message) {
    if (backlog.empty() && completions.TryPush(message)) return;
    backlog.push_back(message);
  }
  void FlushBacklog() {
    while (!backlog.empty() && completions.TryPush(backlog.front())) backlog.pop_front();
  }

  const uint32_t rank;
  ClientSegment segment;
  shm::RankView view;
  shm::RingConsumer requests;
  shm::RingProducer completions;
  std::deque<shm::Message> backlog;
  std::shared_ptr<SessionSink> session;
  bool failed = false;  // protocol error reported; its ring is no longer read

  // cuda-ipc ranks only: the daemon copies gradients from the rank's GPU and weights to it.
  std::shared_ptr<RankTransfer> transfer;
  // Per bucket, for the micro-batch it collects: pieces announced (GRAD_READY) and copied to the host.
  std::vector<uint32_t> staged, pulled;
  std::vector<uint32_t> pushing;   // per bucket: copies of its weights to the GPU in flight
  std::vector<uint32_t> streamed;  // per bucket: pieces of its running update pushed (StepEngine::PushWritten)
  std::vector<int64_t> pushed;     // per bucket: the step whose weights the GPU holds (-1: none)
  // Per bucket: the step whose speculated weights (written, not committed: speculative clipping) the GPU
  // holds, -1 when none or when they were redone; they count as pushed once the step commits.
  std::vector<int64_t> speculated;
  int64_t weights_wanted = -1;   // the latest step whose weights the rank asked for (kWeightsWanted)
  int64_t claims_on_gpu = -1;    // kWeightsOnGpu: the step the rank says its GPU holds (its own load)
  int64_t on_gpu = -1;           // the step whose weights the GPU holds without a push (claim checked)
  uint64_t push_generation = 0;  // a state load makes pushes still in flight stale
};

}  // namespace trainstream::daemon
