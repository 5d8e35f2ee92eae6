// Per uid, the sums over its jobs that the metrics endpoint serves when it does not name jobs
// (metrics_labels = "uid"). Gauges (jobs, attached ranks, bytes) are the current jobs' sums. Counters
// (steps, updates, non-finite steps, the update-time histogram) must never go down while the daemon
// runs, or Prometheus reads a reset and rate() a spike: a job that went away, or came back under the
// same name with its counters from zero, leaves its last values in its uid's counters. What it did
// between the last scrape and its end is not counted.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "daemon/counters/counters.h"

namespace trainstream::daemon {

struct JobCounts {  // one job's, as read at a scrape
  uint32_t uid = 0;
  std::string name;
  uint64_t ranks = 0, host_bytes = 0, pinned_bytes = 0;
  uint64_t steps = 0, updates = 0, nonfinite_steps = 0;
  DurationHistogram::Reading update_seconds;
};

struct UidSums {
  uint64_t jobs = 0, ranks = 0, host_bytes = 0, pinned_bytes = 0;  // now
  uint64_t steps = 0, updates = 0, nonfinite_steps = 0;            // since the daemon started
  DurationHistogram::Reading update_seconds;
};

class UidTotals {
 public:
  // Takes one scrape's jobs; returns the sums of every uid that has, or had, a job.
  std::map<uint32_t, UidSums> Add(const std::vector<JobCounts>& jobs);

 private:
  struct Counted {
    uint64_t steps = 0, updates = 0, nonfinite_steps = 0;
    DurationHistogram::Reading update_seconds;
  };
  static Counted CountsOf(const JobCounts& job);
  static void AddTo(Counted& sum, const Counted& more);

  std::map<std::pair<uint32_t, std::string>, Counted> last_;  // by (uid, name), at the last scrape
  std::map<uint32_t, Counted> gone_;                          // of jobs no longer there, by uid
};

}  // namespace trainstream::daemon
