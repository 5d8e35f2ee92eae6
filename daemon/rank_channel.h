// The daemon's end of one attached rank: its mapped rank segment, the consumer of its request ring,
// the producer of its completion ring, and the session to report errors on.
//
// Owned through shared_ptr: worker tasks that read this rank's gradient slots hold a reference, so a
// rank that detaches mid-update keeps its mapping until the last task that reads it has finished.
// Only the job's engine thread touches the rings and the backlog.
#pragma once

#include <deque>
#include <memory>

#include "daemon/session_sink.h"
#include "shm/job_layout.h"
#include "shm/segment.h"

namespace trainstream::daemon {

struct RankChannel {
  RankChannel(uint32_t rank, shm::Segment segment, const shm::JobLayout& layout, std::shared_ptr<SessionSink> session)
      : rank(rank),
        segment(std::move(segment)),
        view(shm::ViewRank(this->segment.data(), layout)),
        requests(view.request_ring),
        completions(view.completion_ring, &view.header->completion_doorbell),
        session(std::move(session)) {}

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
  shm::Segment segment;
  shm::RankView view;
  shm::RingConsumer requests;
  shm::RingProducer completions;
  std::deque<shm::Message> backlog;
  std::shared_ptr<SessionSink> session;
  bool failed = false;  // protocol error reported; its ring is no longer read
};

}  // namespace trainstream::daemon
