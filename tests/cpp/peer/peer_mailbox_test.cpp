// Tests of the peer plane's mailbox (daemon/peer/peer_mailbox.h): fragments wait for their bucket's sink,
// go straight to a registered one, and expire once they have waited too long; what a peer may leave
// there is bounded: a key delivered twice, a fragment of a bucket already reduced, and fragments of
// unknown jobs past the byte bound are refused, naming what was wrong. A job dropped and created again
// under its name is a new instance: what the dropped one reduced, registered or left behind later
// refuses nothing of the new one; an instance opened beside a running one takes nothing from it.
#include "daemon/peer/peer_mailbox.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "shm/error.h"

namespace trainstream::daemon {
namespace {

using namespace std::chrono_literals;

class CountingSink final : public PeerSink {
 public:
  void Arrived(Delivered) override { ++arrived; }
  int arrived = 0;
};

Delivered Fragment(uint64_t step, uint32_t fragment, size_t bytes = 0, const std::string& job = "job",
                   uint32_t bucket = 0) {
  PeerPayload data;
  if (bytes > 0) data.emplace_back(std::string(bytes, 'x'));
  return Delivered{.key = {.job = job, .step = step, .bucket = bucket, .phase = 0, .round = 0, .fragment = fragment},
                   .data = std::move(data),
                   .sender = "ipv4:10.0.0.2:41234",
                   .from_node = 0};
}

// The code of the Error that `put` throws, and its message in `message`.
template <typename Put>
std::optional<Code> Refusal(Put put, std::string* message = nullptr) {
  try {
    put();
  } catch (const Error& e) {
    if (message != nullptr) *message = e.what();
    return e.code();
  }
  return std::nullopt;
}

TEST(PeerMailbox, PiecesWaitForTheirSinkOrGoStraightToIt) {
  PeerMailbox mailbox;
  mailbox.Put(Fragment(1, 0));
  const MailboxJob job = mailbox.Open("job");
  CountingSink sink;
  EXPECT_EQ(mailbox.Register(job, 1, 0, &sink).size(), 1U);  // waited
  mailbox.Put(Fragment(1, 1));
  EXPECT_EQ(sink.arrived, 1);  // delivered while registered
  mailbox.Unregister(job, 1, 0);
  EXPECT_TRUE(mailbox.Register(job, 1, 0, &sink).empty());
  mailbox.Unregister(job, 1, 0);
  mailbox.Close(job);
}

TEST(PeerMailbox, OnlyPiecesOlderThanTheAgeExpire) {
  PeerMailbox mailbox;
  mailbox.Put(Fragment(1, 0));
  mailbox.Put(Fragment(2, 0));
  std::this_thread::sleep_for(400ms);
  mailbox.Put(Fragment(3, 0));
  EXPECT_EQ(mailbox.Expire(200ms), 2U);  // margins wide enough for a loaded machine
  EXPECT_EQ(mailbox.Expire(1h), 0U);
  const MailboxJob job = mailbox.Open("job");
  CountingSink sink;
  for (uint64_t step = 1; step <= 3; ++step) {
    EXPECT_EQ(mailbox.Register(job, step, 0, &sink).size(), step == 3 ? 1U : 0U) << "step " << step;
    mailbox.Unregister(job, step, 0);
  }
  mailbox.Close(job);
  EXPECT_EQ(mailbox.unknown_bytes(), 0U);
}

TEST(PeerMailbox, AFragmentDeliveredTwiceIsRefusedAndTheFirstStays) {
  PeerMailbox mailbox;
  mailbox.Put(Fragment(1, 0, 8));
  std::string message;
  EXPECT_EQ(Refusal([&] { mailbox.Put(Fragment(1, 0, 16)); }, &message), Code::kAlreadyExists);
  EXPECT_NE(message.find("fragment 0 of round 0 of phase 0 of bucket 0 of step 1 of job 'job' arrived twice "
                         "(first from ipv4:10.0.0.2:41234)"),
            std::string::npos)
      << message;
  const MailboxJob job = mailbox.Open("job");
  CountingSink sink;
  const auto waiting = mailbox.Register(job, 1, 0, &sink);
  ASSERT_EQ(waiting.size(), 1U);
  EXPECT_EQ(PayloadBytes(waiting[0].data), 8U);  // the first one
  mailbox.Unregister(job, 1, 0);
  mailbox.Close(job);
}

TEST(PeerMailbox, AFragmentOfABucketAlreadyReducedIsRefused) {
  PeerMailbox mailbox;
  const MailboxJob job = mailbox.Open("job");
  CountingSink sink;
  mailbox.Register(job, 1, 0, &sink);
  mailbox.Unregister(job, 1, 0);
  std::string message;
  EXPECT_EQ(Refusal([&] { mailbox.Put(Fragment(1, 0)); }, &message), Code::kFailedPrecondition);
  EXPECT_NE(message.find("fragment 0 of round 0 of phase 0 of bucket 0 of step 1 of job 'job' arrived after this "
                         "node reduced that bucket (bucket 0 of step 1 is the last one it did)"),
            std::string::npos)
      << message;
  EXPECT_EQ(Refusal([&] { mailbox.Put(Fragment(1, 0, 0, "job", 1)); }), std::nullopt);  // the next bucket waits
  EXPECT_EQ(mailbox.Register(job, 1, 1, &sink).size(), 1U);
  mailbox.Unregister(job, 1, 1);
  mailbox.Close(job);
}

// The test_peers.py scenario: a job is dropped while its all-reduce cannot finish, and a new job of its
// name opens before the old one's Job is gone. The old instance's last reduction ends (Unregister) after
// the new one opened; the new job's first step must not be refused for it.
TEST(PeerMailbox, AJobOfTheSameNameStartsCleanWhileTheDroppedOneWindsDown) {
  PeerMailbox mailbox;
  CountingSink old_sink, new_sink;
  const MailboxJob dropped = mailbox.Open("job");
  mailbox.Register(dropped, 1, 0, &old_sink);
  mailbox.Unregister(dropped, 1, 0);
  mailbox.Register(dropped, 1, 1, &old_sink);  // cannot finish: its peer's rank died
  mailbox.Drop(dropped);
  const MailboxJob job = mailbox.Open("job");
  mailbox.Unregister(dropped, 1, 1);  // late: the dropped job's Job went only now
  std::string message;
  EXPECT_EQ(Refusal([&] { mailbox.Put(Fragment(1, 0)); }, &message), std::nullopt) << message;
  EXPECT_EQ(old_sink.arrived, 0);
  EXPECT_EQ(mailbox.Register(job, 1, 0, &new_sink).size(), 1U);  // the new job's step 1 takes it
  mailbox.Put(Fragment(1, 1));
  EXPECT_EQ(new_sink.arrived, 1);
  mailbox.Unregister(job, 1, 0);
  mailbox.Close(dropped);
  // Its own bound stays: a duplicate of the bucket it reduced is refused.
  EXPECT_EQ(Refusal([&] { mailbox.Put(Fragment(1, 0)); }), Code::kFailedPrecondition);
  mailbox.Close(job);
}

// The peer's new job may start sending before this node's new job opens, while the dropped one still
// has a bucket registered: those fragments wait for the new job (bounded as an unknown job's), and a
// reduction of the dropped job, even of the same bucket, gets none of them.
TEST(PeerMailbox, ADroppedJobTakesNoMoreFragmentsAndItsLateUnregisterRefusesNothing) {
  const size_t each = 1024 + kMaxFragmentHeaderBytes;
  PeerMailbox mailbox;
  CountingSink old_sink, new_sink;
  const MailboxJob dropped = mailbox.Open("job");
  mailbox.Register(dropped, 3, 0, &old_sink);
  mailbox.Drop(dropped);
  mailbox.Put(Fragment(3, 0, 1024));  // from the peer's new job, which is already at step 3
  EXPECT_EQ(old_sink.arrived, 0);
  EXPECT_EQ(mailbox.unknown_bytes(), each);  // no job of that name is open here now
  mailbox.Unregister(dropped, 3, 0);
  EXPECT_TRUE(mailbox.Register(dropped, 3, 0, &old_sink).empty());  // not the dropped job's
  mailbox.Unregister(dropped, 3, 0);
  EXPECT_EQ(Refusal([&] { mailbox.Put(Fragment(1, 0)); }), std::nullopt);
  const MailboxJob job = mailbox.Open("job");
  EXPECT_EQ(mailbox.unknown_bytes(), 0U);
  EXPECT_EQ(mailbox.Register(job, 1, 0, &new_sink).size(), 1U);
  mailbox.Unregister(job, 1, 0);
  EXPECT_EQ(mailbox.Register(job, 3, 0, &new_sink).size(), 1U);
  mailbox.Unregister(job, 3, 0);
  mailbox.Close(dropped);
  mailbox.Close(job);
  EXPECT_EQ(mailbox.unknown_bytes(), 0U);
}

// A job being built opens an instance beside a running job of its name before the registry refuses it
// (a restore racing a create): the running job still gets what waits and what arrives, and the other
// instance's drop and close leave its fragments and its bound alone.
TEST(PeerMailbox, AnInstanceOpenedBesideARunningJobTakesNothingFromIt) {
  PeerMailbox mailbox;
  const MailboxJob running = mailbox.Open("job");
  mailbox.Put(Fragment(1, 0));
  const MailboxJob beside = mailbox.Open("job");
  CountingSink sink;
  EXPECT_EQ(mailbox.Register(running, 1, 0, &sink).size(), 1U);
  mailbox.Put(Fragment(1, 1));
  EXPECT_EQ(sink.arrived, 1);
  mailbox.Unregister(running, 1, 0);
  mailbox.Put(Fragment(2, 0, 1024));
  mailbox.Drop(beside);
  mailbox.Close(beside);
  EXPECT_EQ(mailbox.unknown_bytes(), 0U);  // still the running job's
  EXPECT_EQ(Refusal([&] { mailbox.Put(Fragment(1, 2)); }), Code::kFailedPrecondition);
  EXPECT_EQ(mailbox.Register(running, 2, 0, &sink).size(), 1U);
  mailbox.Unregister(running, 2, 0);
  mailbox.Close(running);
}

TEST(PeerMailbox, FragmentsOfUnknownJobsHoldAtMostTheBound) {
  const size_t each = 1024 + kMaxFragmentHeaderBytes;  // a fragment counts with its header's bound
  PeerMailbox mailbox(3 * each);
  const MailboxJob known = mailbox.Open("known");
  for (uint32_t f = 0; f < 3; ++f) mailbox.Put(Fragment(1, f, 1024, "stranger"));
  EXPECT_EQ(mailbox.unknown_bytes(), 3 * each);
  std::string message;
  EXPECT_EQ(Refusal([&] { mailbox.Put(Fragment(1, 3, 0, "stranger")); }, &message), Code::kResourceExhausted);
  EXPECT_NE(message.find("peer_max_unknown_job_bytes"), std::string::npos) << message;
  for (uint32_t f = 0; f < 8; ++f) mailbox.Put(Fragment(1, f, 1024, "known"));  // an open job's are not bounded
  const MailboxJob stranger = mailbox.Open("stranger");  // its ranks attached: its fragments no longer count
  EXPECT_EQ(mailbox.unknown_bytes(), 0U);
  mailbox.Close(stranger);
  EXPECT_EQ(mailbox.unknown_bytes(), 3 * each);
  mailbox.Drop(stranger);
  EXPECT_EQ(mailbox.unknown_bytes(), 0U);
  mailbox.Put(Fragment(1, 3, 1024, "another"));
  EXPECT_EQ(mailbox.unknown_bytes(), each);
  mailbox.Close(known);
}

TEST(PeerMailbox, WhatTheSinkRefusesReachesTheSenderAndTheSinkStaysUsable) {
  class RefusingSink final : public PeerSink {
   public:
    void Arrived(Delivered) override { throw Error(Code::kInvalidArgument, "wrong size"); }
  } sink;
  PeerMailbox mailbox;
  const MailboxJob job = mailbox.Open("job");
  mailbox.Register(job, 1, 0, &sink);
  EXPECT_EQ(Refusal([&] { mailbox.Put(Fragment(1, 0)); }), Code::kInvalidArgument);
  mailbox.Unregister(job, 1, 0);  // returns: no thread counted inside the sink any more
  mailbox.Close(job);
}

}  // namespace
}  // namespace trainstream::daemon
