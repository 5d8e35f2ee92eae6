// Tests of the per-uid sums the metrics endpoint serves without job names (daemon/metrics/uid_totals.h):
// gauges follow the current jobs, counters never go down when a job goes or comes back from zero.
#include "daemon/metrics/uid_totals.h"

#include <gtest/gtest.h>

namespace trainstream::daemon {
namespace {

JobCounts Job(uint32_t uid, const std::string& name, uint64_t steps, uint64_t host_bytes = 100) {
  JobCounts job;
  job.uid = uid;
  job.name = name;
  job.ranks = 1;
  job.host_bytes = host_bytes;
  job.steps = steps;
  job.updates = 2 * steps;
  job.update_seconds.count = 2 * steps;
  job.update_seconds.counts[0] = 2 * steps;
  return job;
}

TEST(UidTotals, GaugesSumTheCurrentJobsPerUid) {
  UidTotals totals;
  const auto sums = totals.Add({Job(1000, "a", 3, 10), Job(1000, "b", 4, 20), Job(1001, "c", 5, 40)});
  ASSERT_EQ(sums.size(), 2U);
  EXPECT_EQ(sums.at(1000).jobs, 2U);
  EXPECT_EQ(sums.at(1000).ranks, 2U);
  EXPECT_EQ(sums.at(1000).host_bytes, 30U);
  EXPECT_EQ(sums.at(1000).steps, 7U);
  EXPECT_EQ(sums.at(1001).update_seconds.count, 10U);
}

TEST(UidTotals, CountersKeepWhatJobsThatWentAwayOrStartedAgainHadDone) {
  UidTotals totals;
  totals.Add({Job(1000, "a", 3), Job(1000, "b", 4)});
  auto sums = totals.Add({Job(1000, "b", 6)});  // "a" dropped
  EXPECT_EQ(sums.at(1000).jobs, 1U);
  EXPECT_EQ(sums.at(1000).steps, 9U);
  EXPECT_EQ(sums.at(1000).updates, 18U);
  EXPECT_EQ(sums.at(1000).update_seconds.counts[0], 18U);
  sums = totals.Add({Job(1000, "b", 1)});  // "b" dropped and created again between two scrapes
  EXPECT_EQ(sums.at(1000).steps, 10U);
  sums = totals.Add({});
  EXPECT_EQ(sums.at(1000).jobs, 0U);
  EXPECT_EQ(sums.at(1000).host_bytes, 0U);
  EXPECT_EQ(sums.at(1000).steps, 10U);  // still served, never lower
}

}  // namespace
}  // namespace trainstream::daemon
