#include "daemon/metrics/uid_totals.h"

namespace trainstream::daemon {

UidTotals::Counted UidTotals::CountsOf(const JobCounts& job) {
  return Counted{job.steps, job.updates, job.nonfinite_steps, job.update_seconds};
}

void UidTotals::AddTo(Counted& sum, const Counted& more) {
  sum.steps += more.steps;
  sum.updates += more.updates;
  sum.nonfinite_steps += more.nonfinite_steps;
  for (size_t i = 0; i < sum.update_seconds.counts.size(); ++i) {
    sum.update_seconds.counts[i] += more.update_seconds.counts[i];
  }
  sum.update_seconds.sum += more.update_seconds.sum;
  sum.update_seconds.count += more.update_seconds.count;
}

std::map<uint32_t, UidSums> UidTotals::Add(const std::vector<JobCounts>& jobs) {
  std::map<std::pair<uint32_t, std::string>, Counted> now;
  for (const JobCounts& job : jobs) now[{job.uid, job.name}] = CountsOf(job);
  for (const auto& [id, last] : last_) {
    const auto current = now.find(id);
    const bool restarted =
        current != now.end() && (current->second.steps < last.steps || current->second.updates < last.updates ||
                                 current->second.update_seconds.count < last.update_seconds.count);
    if (current == now.end() || restarted) AddTo(gone_[id.first], last);
  }
  last_ = now;
  std::map<uint32_t, UidSums> sums;
  for (const auto& [uid, gone] : gone_) {
    UidSums& sum = sums[uid];
    sum.steps = gone.steps;
    sum.updates = gone.updates;
    sum.nonfinite_steps = gone.nonfinite_steps;
    sum.update_seconds = gone.update_seconds;
  }
  for (const JobCounts& job : jobs) {
    UidSums& sum = sums[job.uid];
    ++sum.jobs;
    sum.ranks += job.ranks;
    sum.host_bytes += job.host_bytes;
    sum.pinned_bytes += job.pinned_bytes;
    Counted counted{sum.steps, sum.updates, sum.nonfinite_steps, sum.update_seconds};
    AddTo(counted, CountsOf(job));
    sum.steps = counted.steps;
    sum.updates = counted.updates;
    sum.nonfinite_steps = counted.nonfinite_steps;
    sum.update_seconds = counted.update_seconds;
  }
  return sums;
}

}  // namespace trainstream::daemon
