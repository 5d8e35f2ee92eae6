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

#include "daemon/engine/rank_copies.h"
#include "daemon/engine/rank_transfer.h"
#include "daemon/engine/session_sink.h"
#include "daemon/guard/client_segment.h"
#include "shm/job_layout.h"

namespace trainstream::daemon {

// The cuda-ipc bookkeeping (RankCopies) is a base: the GPU copies' decisions read it alone.
struct RankChannel : RankCopies {
  // `segment` is initialized (shm::InitRankSegment).
  RankChannel(uint32_t rank, ClientSegment segment, const shm::JobLayout& layout, std::shared_ptr<SessionSink> session)
      : RankCopies(layout.buckets.size()),
        rank(rank),
        segment(std::move(segment)),
        view(shm::ViewRank(this->segment.data(), layout)),
        requests(view.request_ring),
        completions(view.completion_ring, &view.header->completion_doorbell),
        session(std::move(session)) {}
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
};

}  // namespace trainstream::daemon
