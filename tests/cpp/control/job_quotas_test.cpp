// The per-uid job quotas (issue 46: three idle jobs of one uid filled max_jobs=3 for an hour and
// refused root), against a real trainstreamd: max_jobs_per_uid (by default half of max_jobs) and
// max_host_bytes_per_uid refuse a uid's job past its share with RESOURCE_EXHAUSTED naming the key,
// leave room for other uids, and do not apply to root. Clients run as other uids in forked children;
// the test runs as root and skips otherwise.
#include <gtest/gtest.h>

#include "tests/cpp/control/daemon_process.h"
#include "trainstream/client.h"

namespace trainstream {
namespace {
using namespace trainstream::testing;  // NOLINT(google-build-using-namespace): the shared test helpers

shm::LayoutSpec TinySpec() {
  shm::LayoutSpec spec = OneParamSpec(64, 64);
  spec.state_halves = 1;  // no decision by free memory: the bytes are known
  return spec;
}

uint64_t BytesOfTinyJob() {
  const shm::JobLayout layout = shm::ComputeLayout(TinySpec());
  return layout.state_bytes + layout.rank_bytes;
}

// Attaches to (creating) `job`; "" if the daemon accepted it, else the refusal, prefixed by its code.
std::string Refusal(Client& client, const std::string& job, std::unique_ptr<RankSession>* keep = nullptr) {
  try {
    auto session = client.Attach(job, 0, TinySpec(), 1);
    if (keep != nullptr) *keep = std::move(session);
    return "";
  } catch (const Error& e) {
    return (e.code() == Code::kResourceExhausted ? "RESOURCE_EXHAUSTED: " : "other: ") + std::string(e.what());
  }
}

bool Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return true;
  fprintf(stderr, "'%s' does not say '%s'\n", text.c_str(), part.c_str());
  return false;
}

using JobQuotasTest = AsOtherUids;

TEST_F(JobQuotasTest, OneUidsIdleJobsLeaveRoomForOthersAndRoot) {
  DaemonProcess daemon("max_jobs = 3\n");  // max_jobs_per_uid: 2 by default
  EXPECT_TRUE(ExitedWith(RunAs(kAlice,
                               [&] {
                                 auto client = Client::Connect(daemon.socket());
                                 // Two jobs left idle (their sessions closed), as a crashed trainer leaves them.
                                 if (!Refusal(*client, "a").empty() || !Refusal(*client, "b").empty()) return 1;
                                 const std::string third = Refusal(*client, "c");
                                 const bool named =
                                     third.starts_with("RESOURCE_EXHAUSTED") &&
                                     Contains(third, "job limit of uid 65534 reached: 2 of max_jobs_per_uid=2") &&
                                     Contains(third, "raise max_jobs_per_uid");
                                 return named ? 0 : 2;
                               }),
                         0));
  // The last slot is root's, whom one uid's jobs used to lock out for job_ttl_seconds.
  EXPECT_TRUE(ExitedWith(WaitChild(ForkChild([&] {
                           auto client = Client::Connect(daemon.socket());
                           if (!Refusal(*client, "roots").empty()) return 1;
                           // The global limit still holds for everyone, root included.
                           return Contains(Refusal(*client, "more"), "job limit reached: 3 of max_jobs=3") ? 0 : 2;
                         })),
                         0));
}

TEST_F(JobQuotasTest, RootIsExemptFromThePerUidLimits) {
  DaemonProcess daemon("max_jobs = 3\nmax_jobs_per_uid = 1\nmax_host_bytes_per_uid = 4096\n");
  EXPECT_TRUE(ExitedWith(RunAs(kAlice,
                               [&] {
                                 auto client = Client::Connect(daemon.socket());
                                 return Contains(Refusal(*client, "a"), "of max_host_bytes_per_uid=4096") ? 0 : 1;
                               }),
                         0));
  EXPECT_TRUE(ExitedWith(WaitChild(ForkChild([&] {
                           auto client = Client::Connect(daemon.socket());
                           for (const char* job : {"r1", "r2", "r3"}) {
                             if (!Refusal(*client, job).empty()) return 1;
                           }
                           return 0;
                         })),
                         0));
}

TEST_F(JobQuotasTest, HostBytesPerUidLeaveTheRestToOtherUids) {
  const uint64_t job_bytes = BytesOfTinyJob();
  DaemonProcess daemon("max_host_bytes_per_uid = " + std::to_string(job_bytes * 3 / 2) + "\n");
  EXPECT_TRUE(ExitedWith(RunAs(kAlice,
                               [&] {
                                 auto client = Client::Connect(daemon.socket());
                                 std::unique_ptr<RankSession> attached;
                                 if (!Refusal(*client, "a", &attached).empty()) return 1;
                                 const std::string second = Refusal(*client, "b");
                                 const bool named =
                                     second.starts_with("RESOURCE_EXHAUSTED") &&
                                     Contains(second, "host memory quota exceeded: job 'b' needs " +
                                                          std::to_string(job_bytes) + " bytes, " +
                                                          std::to_string(job_bytes) + " of max_host_bytes_per_uid=") &&
                                     Contains(second, "in use by uid 65534 (raise max_host_bytes_per_uid)");
                                 return named ? 0 : 2;
                               }),
                         0));
  EXPECT_TRUE(ExitedWith(RunAs(kMallory,
                               [&] {
                                 auto client = Client::Connect(daemon.socket());
                                 return Refusal(*client, "m").empty() ? 0 : 1;
                               }),
                         0));
}

}  // namespace
}  // namespace trainstream
