// Job ownership by uid, against a real trainstreamd: the daemon takes each caller's uid from the
// kernel (SO_PEERCRED of its connection, daemon/control/control_socket.h), a root daemon gives each
// job's segments to its user, names are per uid, and another uid can neither reach nor see a job, nor
// act as root by replaying what it sees in /dev/shm. Clients run in forked children that drop to
// unprivileged uids; the test runs as root (as here and in CI) and skips otherwise.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>

#include <algorithm>

#include "tests/cpp/control/daemon_process.h"
#include "trainstream/client.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace trainstream {
namespace {
using namespace trainstream::testing;  // NOLINT(google-build-using-namespace): the shared test helpers

using IdentityTest = AsOtherUids;

// A pipe for "ready"/"release" handshakes between forked processes; a wait gives up after 30 s (the
// other side died).
struct Signal {
  Signal() { EXPECT_EQ(pipe(fds), 0); }
  ~Signal() {
    close(fds[0]);
    close(fds[1]);
  }
  void Send() const {
    const char byte = 1;
    EXPECT_EQ(write(fds[1], &byte, 1), 1);
  }
  [[nodiscard]] bool Wait() const {
    pollfd readable{fds[0], POLLIN, 0};
    char byte = 0;
    return poll(&readable, 1, 30000) == 1 && read(fds[0], &byte, 1) == 1;
  }
  int fds[2]{};
};

std::vector<std::string> JobNames(const StatsReport& stats) {
  std::vector<std::string> names;
  for (const JobReport& job : stats.jobs) names.push_back(job.name + "@" + std::to_string(job.uid));
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(IdentityTest, JobSegmentsBelongToTheirUserAndNamesArePerUid) {
  DaemonProcess daemon;
  Signal ready, release;
  // Alice attaches, checks who owns her segments, and stays attached until released.
  const pid_t alice = ForkChild([&] {
    if (setgid(kAlice) != 0 || setuid(kAlice) != 0) return 98;
    auto client = Client::Connect(daemon.socket());
    auto session = client->Attach("run", 0, OneParamSpec(), 1);
    struct stat info {};
    const std::string state = "/dev/shm/" + shm::SegmentName(kAlice, client->Stats().jobs.at(0).job_key, "state");
    if (stat(state.c_str(), &info) != 0 || info.st_uid != kAlice || (info.st_mode & 0777) != 0600) return 2;
    ready.Send();
    if (!release.Wait()) return 3;
    session->CheckHealthy();  // nobody dropped or took her job meanwhile
    return JobNames(client->Stats()) == std::vector<std::string>{"run@65534"} ? 0 : 4;
  });
  ASSERT_TRUE(ready.Wait()) << "alice did not attach";

  EXPECT_TRUE(ExitedWith(RunAs(kMallory,
                               [&] {
                                 auto client = Client::Connect(daemon.socket());
                                 // Her own job of the same name: Alice's is out of her reach.
                                 auto session = client->Attach("run", 0, OneParamSpec(), 1);
                                 if (!session->created()) return 1;
                                 if (JobNames(client->Stats()) != std::vector<std::string>{"run@65533"}) return 2;
                                 try {
                                   client->DropJob("run", true, kAlice);
                                   return 3;
                                 } catch (const Error& e) {
                                   if (e.code() != Code::kPermissionDenied) return 4;
                                 }
                                 session->Close();
                                 client->DropJob("run", false);  // hers
                                 try {
                                   client->DropJob("run", true);
                                   return 5;
                                 } catch (const Error& e) {
                                   return e.code() == Code::kNotFound ? 0 : 6;
                                 }
                               }),
                         0));
  // Root sees every job and may drop anyone's.
  EXPECT_TRUE(ExitedWith(WaitChild(ForkChild([&] {
                           auto client = Client::Connect(daemon.socket());
                           auto session = client->Attach("run", 0, OneParamSpec(), 1);
                           const auto names = JobNames(client->Stats());
                           return names == std::vector<std::string>{"run@0", "run@65534"} ? 0 : 1;
                         })),
                         0));
  release.Send();
  EXPECT_TRUE(ExitedWith(WaitChild(alice), 0));
}

// The attack of issue 21: a uid watching /dev/shm (inotify) replayed root's identity nonce, the name
// of a proof file there, and force-dropped root's job. Now nothing in /dev/shm proves anything: the
// attacker replays every name that appears there, in the old nonce fields too, while root churns jobs.
TEST_F(IdentityTest, ReplayingWhatAppearsInDevShmDoesNotMakeAnotherUidRoot) {
  DaemonProcess daemon;
  Signal victim_ready, release_victim, attacker_ready, stop_attacker;
  const pid_t victim = ForkChild([&] {
    auto client = Client::Connect(daemon.socket());
    auto session = client->Attach("victim", 0, OneParamSpec(), 1);
    victim_ready.Send();
    if (!release_victim.Wait()) return 2;
    session->CheckHealthy();
    for (const JobReport& job : client->Stats().jobs) {
      if (job.name == "victim" && job.uid == 0) return 0;
    }
    return 3;  // dropped
  });
  ASSERT_TRUE(victim_ready.Wait());

  const pid_t attacker = ForkChild([&] {
    if (setgid(kMallory) != 0 || setuid(kMallory) != 0) return 98;
    const int watch = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (watch < 0 || inotify_add_watch(watch, "/dev/shm", IN_CREATE) < 0) return 97;
    auto stub =
        v1::Control::NewStub(grpc::CreateChannel("unix:" + daemon.socket(), grpc::InsecureChannelCredentials()));
    int attempts = 0, wins = 0;
    auto drop = [&](const std::string& seen, bool as_root) {
      grpc::ClientContext context;
      v1::DropJobRequest request;
      request.set_job("victim");
      request.set_force(true);
      if (as_root) request.set_owner_uid(0);
      request.GetReflection()->MutableUnknownFields(&request)->AddLengthDelimited(3, seen);  // protocol 3's nonce
      v1::DropJobReply reply;
      const grpc::Status status = stub->DropJob(&context, request, &reply);
      ++attempts;
      const auto expected = as_root ? grpc::StatusCode::PERMISSION_DENIED : grpc::StatusCode::NOT_FOUND;
      if (status.ok() || status.error_code() != expected) ++wins;
    };
    attacker_ready.Send();
    alignas(inotify_event) char buffer[4096];
    pollfd fds[2] = {{watch, POLLIN, 0}, {stop_attacker.fds[0], POLLIN, 0}};
    while (poll(fds, 2, 5000) > 0 && (fds[1].revents & POLLIN) == 0) {
      const ssize_t n = read(watch, buffer, sizeof(buffer));
      for (ssize_t at = 0; at < n;) {
        const auto* event = reinterpret_cast<const inotify_event*>(buffer + at);
        const std::string name = event->len > 0 ? event->name : "";
        for (const std::string& seen : {name, name.substr(name.rfind('-') + 1)}) {
          drop(seen, false);
          drop(seen, true);
        }
        at += static_cast<ssize_t>(sizeof(inotify_event) + event->len);
      }
    }
    fprintf(stderr, "attacker: %d replays, %d not refused\n", attempts, wins);
    return attempts > 0 && wins == 0 ? 0 : 1;
  });
  ASSERT_TRUE(attacker_ready.Wait());

  // Root's own activity fills /dev/shm with names for the attacker to replay.
  EXPECT_TRUE(ExitedWith(WaitChild(ForkChild([&] {
                           auto client = Client::Connect(daemon.socket());
                           for (int i = 0; i < 20; ++i) {
                             const std::string job = "churn" + std::to_string(i);
                             client->Attach(job, 0, OneParamSpec(), 1)->Close();
                             client->DropJob(job, true);
                           }
                           return 0;
                         })),
                         0));
  stop_attacker.Send();
  EXPECT_TRUE(ExitedWith(WaitChild(attacker), 0));
  release_victim.Send();
  EXPECT_TRUE(ExitedWith(WaitChild(victim), 0));
}

}  // namespace
}  // namespace trainstream
