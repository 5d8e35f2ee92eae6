// What a scrape of the metrics endpoint returns: the daemon's jobs and counters as Prometheus metric
// families, read when scraped (the planes only bump atomic counters). What each metric means, and
// what each level of detail reveals: docs/operations.md, "Metrics".
//
// The endpoint may be reachable by more users than the control socket, which shows a user its own
// jobs only. So how much it tells about jobs is a setting (metrics_labels):
//   "none"  the daemon's totals only: no uid, no job name;
//   "uid"   (the default) also per uid, sums over that uid's jobs (daemon/metrics/uid_totals.h);
//   "job"   also per job, labelled with its name and uid.
#pragma once

#include <prometheus/metric_family.h>

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "daemon/control/job_registry.h"
#include "daemon/engine/worker_pool.h"
#include "daemon/metrics/uid_totals.h"

namespace trainstream::daemon {

enum class MetricsLabels { kNone, kUid, kJob };
// "none", "uid" or "job"; kInvalidArgument naming the setting otherwise.
MetricsLabels MetricsLabelsFrom(const std::string& name);

class MetricsCollector {
 public:
  MetricsCollector(JobRegistry& registry, const WorkerPool& pool, MetricsLabels labels)
      : registry_(registry), pool_(pool), labels_(labels) {}

  std::vector<prometheus::MetricFamily> Collect();
  // Collect() in Prometheus' text format.
  std::string Text();

 private:
  class Families;
  void CollectDaemon(Families& f) const;
  void CollectJobs(Families& f);
  static void CollectTransfers(Families& f);

  JobRegistry& registry_;
  const WorkerPool& pool_;
  const MetricsLabels labels_;
  std::mutex mutex_;  // guards totals_ (one scrape at a time)
  UidTotals totals_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

}  // namespace trainstream::daemon
