// The caps on Session streams that never attach (issue 21: 3,000 of them drove the daemon to 3,012
// threads), against a real trainstreamd: per uid, in total, and the daemon's threads stay bounded.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <future>

#include "tests/cpp/control/daemon_process.h"
#include "trainstream/client.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace trainstream {
namespace {
using namespace trainstream::testing;  // NOLINT(google-build-using-namespace): the shared test helpers

struct Outcome {
  int held = 0;     // the daemon kept the stream open until its deadline
  int refused = 0;  // RESOURCE_EXHAUSTED
  std::string message;
};

// Opens `count` Session streams that never send `attach`, each with a deadline of `hold`.
Outcome OpenUnattached(const std::string& socket, int count, std::chrono::milliseconds hold) {
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  auto stub = v1::Control::NewStub(channel);
  std::vector<std::future<grpc::Status>> streams;
  streams.reserve(count);
  for (int i = 0; i < count; ++i) {
    streams.push_back(std::async(std::launch::async, [&] {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + hold);
      auto stream = stub->Session(&context);
      v1::SessionEvent event;
      while (stream->Read(&event)) {
      }
      return stream->Finish();
    }));
  }
  Outcome outcome;
  for (auto& stream : streams) {
    const grpc::Status status = stream.get();
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) ++outcome.held;
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++outcome.refused;
      outcome.message = status.error_message();
    }
  }
  return outcome;
}

TEST(SessionLimits, UnattachedSessionsOfOneUidAreCapped) {
  DaemonProcess daemon("max_unattached_sessions_per_uid = 4\n");
  EXPECT_TRUE(
      ExitedWith(WaitChild(ForkChild([&] {
                   const Outcome outcome = OpenUnattached(daemon.socket(), 10, std::chrono::seconds(3));
                   fprintf(stderr, "held %d, refused %d: %s\n", outcome.held, outcome.refused, outcome.message.c_str());
                   if (outcome.held != 4 || outcome.refused != 6) return 1;
                   const bool named = outcome.message.find("max_unattached_sessions_per_uid=4") != std::string::npos &&
                                      outcome.message.find("uid 0") != std::string::npos;
                   return named ? 0 : 2;
                 })),
                 0));
}

TEST(SessionLimits, UnattachedSessionsOfAllUidsAreCapped) {
  DaemonProcess daemon("max_unattached_sessions = 3\n");
  EXPECT_TRUE(ExitedWith(WaitChild(ForkChild([&] {
                           const Outcome outcome = OpenUnattached(daemon.socket(), 5, std::chrono::seconds(3));
                           if (outcome.held != 3 || outcome.refused != 2) return 1;
                           return outcome.message.find("max_unattached_sessions=3") != std::string::npos ? 0 : 2;
                         })),
                         0));
}

// One uid at its cap does not keep another from attaching, and a stream that attached no longer counts.
using SessionLimitsAsOtherUids = AsOtherUids;

TEST_F(SessionLimitsAsOtherUids, AnotherUidStillAttachesAndAttachedSessionsDoNotCount) {
  DaemonProcess daemon("max_unattached_sessions_per_uid = 2\n");
  const pid_t flooder = ForkChild([&] {
    if (setgid(kMallory) != 0 || setuid(kMallory) != 0) return 98;
    return OpenUnattached(daemon.socket(), 6, std::chrono::seconds(4)).held == 2 ? 0 : 1;
  });
  EXPECT_TRUE(ExitedWith(RunAs(kAlice,
                               [&] {
                                 auto client = Client::Connect(daemon.socket());
                                 const shm::LayoutSpec spec = OneParamSpec(4, 1);
                                 std::vector<std::unique_ptr<RankSession>> sessions;
                                 sessions.reserve(4);
                                 for (int i = 0; i < 4; ++i) {  // twice the cap, one after another
                                   sessions.push_back(client->Attach("job" + std::to_string(i), 0, spec, 1));
                                 }
                                 return 0;
                               }),
                         0));
  EXPECT_TRUE(ExitedWith(WaitChild(flooder), 0));
}

// 400 streams that never attach, far past the caps: the refused ones give their threads back.
TEST(SessionLimits, ThreadsStayBoundedUnderAFloodOfUnattachedSessions) {
  DaemonProcess daemon;
  const int before = daemon.threads();
  int during = 0;
  const pid_t flooder =
      ForkChild([&] { return OpenUnattached(daemon.socket(), 400, std::chrono::seconds(6)).held == 32 ? 0 : 1; });
  std::this_thread::sleep_for(std::chrono::seconds(3));  // the refused streams are answered by now
  during = daemon.threads();
  EXPECT_TRUE(ExitedWith(WaitChild(flooder), 0));
  fprintf(stderr, "daemon threads: %d before, %d with 32 unattached sessions held and 368 refused\n", before, during);
  EXPECT_LT(during, before + 32 + 40);  // one thread per held stream, and gRPC's pollers
}

}  // namespace
}  // namespace trainstream
