#include "daemon/metrics/metrics_collector.h"

#include <prometheus/text_serializer.h>

#include <limits>
#include <sstream>

#include "daemon/counters/counters.h"
#include "daemon/gpu/pinned_host.h"
#include "daemon/optimizer/adamw_kernels.h"
#include "shm/error.h"
#include "shm/version.h"

namespace trainstream::daemon {

namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

ClientMetric Valued(MetricType type, double value, Labels labels = {}) {
  ClientMetric metric;
  metric.label = std::move(labels);
  if (type == MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return metric;
}

ClientMetric Histogram(const DurationHistogram::Reading& reading, Labels labels = {}) {
  ClientMetric metric;
  metric.label = std::move(labels);
  metric.histogram.sample_count = reading.count;
  metric.histogram.sample_sum = reading.sum;
  uint64_t cumulative = 0;
  for (size_t i = 0; i < DurationHistogram::kBounds.size(); ++i) {
    cumulative += reading.counts[i];
    metric.histogram.bucket.push_back({cumulative, DurationHistogram::kBounds[i]});
  }
  metric.histogram.bucket.push_back({reading.count, std::numeric_limits<double>::infinity()});
  return metric;
}

JobCounts CountsOf(const JobInfo& info) {
  return JobCounts{
      info.uid,   info.name,           info.engine.attached_ranks.size(), info.host_bytes,    info.pinned_bytes,
      info.steps, info.engine.updates, info.engine.nonfinite_steps,       info.update_seconds};
}

}  // namespace

MetricsLabels MetricsLabelsFrom(const std::string& name) {
  if (name == "none") return MetricsLabels::kNone;
  if (name == "uid") return MetricsLabels::kUid;
  if (name == "job") return MetricsLabels::kJob;
  Throw(Code::kInvalidArgument, "metrics_labels is '{}'; expected none, uid or job", name);
}

// The families of one scrape, by name in the order they are first added.
class MetricsCollector::Families {
 public:
  MetricFamily& Of(const std::string& name, MetricType type, const std::string& help) {
    for (MetricFamily& family : families_) {
      if (family.name == name) return family;
    }
    families_.push_back(MetricFamily{name, help, type, {}});
    return families_.back();
  }
  void Add(const std::string& name, MetricType type, const std::string& help, double value, Labels labels = {}) {
    Of(name, type, help).metric.push_back(Valued(type, value, std::move(labels)));
  }
  std::vector<MetricFamily> Take() { return std::move(families_); }

 private:
  std::vector<MetricFamily> families_;
};

std::vector<MetricFamily> MetricsCollector::Collect() {
  Families families;
  CollectDaemon(families);
  CollectJobs(families);
  CollectTransfers(families);
  return families.Take();
}

std::string MetricsCollector::Text() {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, Collect());
  return out.str();
}

void MetricsCollector::CollectDaemon(Families& f) const {
  f.Add("trainstream_info", MetricType::Gauge, "trainstreamd's version and optimizer kernel (always 1)", 1,
        {{"version", std::string(kVersion)}, {"kernel", optimizer::ActiveKernelName()}});
  const std::chrono::duration<double> up = std::chrono::steady_clock::now() - started_;
  f.Add("trainstream_uptime_seconds", MetricType::Gauge, "seconds since trainstreamd started", up.count());
  f.Add("trainstream_worker_threads", MetricType::Gauge, "optimizer worker threads",
        static_cast<double>(pool_.threads()));
  f.Add("trainstream_pinned_bytes", MetricType::Gauge, "host memory page-locked for GPU copies",
        static_cast<double>(PinnedHost::Instance().pinned_bytes()));
  for (size_t k = 0; k < static_cast<size_t>(ErrorKind::kCount); ++k) {
    const auto kind = static_cast<ErrorKind>(k);
    f.Add("trainstream_errors_total", MetricType::Counter, "errors by kind",
          static_cast<double>(ProcessCounters::Instance().errors(kind)), {{"kind", NameOf(kind)}});
  }
}

void MetricsCollector::CollectJobs(Families& f) {
  const auto jobs = registry_.Jobs();
  const auto orphans = registry_.Orphans();
  f.Add("trainstream_jobs", MetricType::Gauge, "jobs, by whether a dead daemon left them (orphaned)",
        static_cast<double>(jobs.size()), {{"orphaned", "false"}});
  f.Add("trainstream_jobs", MetricType::Gauge, "", static_cast<double>(orphans.size()), {{"orphaned", "true"}});
  double host_bytes = 0;
  for (const OrphanedJob& orphan : orphans) host_bytes += static_cast<double>(orphan.state_bytes);
  std::vector<JobCounts> counts;
  for (const auto& job : jobs) {
    const JobInfo info = job->Info();
    host_bytes += static_cast<double>(info.host_bytes);
    counts.push_back(CountsOf(info));
    if (labels_ != MetricsLabels::kJob) continue;
    const Labels labels = {{"job", info.name}, {"uid", std::to_string(info.uid)}};
    f.Add("trainstream_job_world_size", MetricType::Gauge, "ranks the job has on this node",
          static_cast<double>(info.world_size), labels);
    f.Add("trainstream_job_completed_step", MetricType::Gauge, "the job's last completed step",
          static_cast<double>(info.completed_step), labels);
  }
  f.Add("trainstream_host_bytes", MetricType::Gauge, "shared memory of all jobs", host_bytes);
  if (labels_ == MetricsLabels::kNone) return;
  std::map<uint32_t, UidSums> sums;
  {
    std::lock_guard lock(mutex_);
    sums = totals_.Add(counts);
  }
  for (const auto& [uid, sum] : sums) {
    f.Add("trainstream_uid_jobs", MetricType::Gauge, "jobs of the uid", static_cast<double>(sum.jobs),
          {{"uid", std::to_string(uid)}});
  }
  // Per job with "job", else per uid: the same families, with the labels {job, uid} or {uid}.
  auto add = [&f](const Labels& labels, uint64_t ranks, uint64_t host, uint64_t pinned, uint64_t steps,
                  uint64_t updates, uint64_t nonfinite, const DurationHistogram::Reading& update_seconds) {
    f.Add("trainstream_job_ranks", MetricType::Gauge, "ranks attached", static_cast<double>(ranks), labels);
    f.Add("trainstream_job_host_bytes", MetricType::Gauge, "shared memory: state and attached rank segments",
          static_cast<double>(host), labels);
    f.Add("trainstream_job_pinned_bytes", MetricType::Gauge, "of that shared memory, bytes page-locked",
          static_cast<double>(pinned), labels);
    f.Add("trainstream_job_steps_total", MetricType::Counter, "steps completed (every bucket updated)",
          static_cast<double>(steps), labels);
    f.Add("trainstream_job_updates_total", MetricType::Counter, "bucket updates run", static_cast<double>(updates),
          labels);
    f.Add("trainstream_job_nonfinite_steps_total", MetricType::Counter, "steps whose gradients had inf or NaN",
          static_cast<double>(nonfinite), labels);
    f.Of("trainstream_update_seconds", MetricType::Histogram, "time of one bucket's AdamW update pass")
        .metric.push_back(Histogram(update_seconds, labels));
  };
  if (labels_ == MetricsLabels::kJob) {
    for (const JobCounts& job : counts) {
      add({{"job", job.name}, {"uid", std::to_string(job.uid)}}, job.ranks, job.host_bytes, job.pinned_bytes, job.steps,
          job.updates, job.nonfinite_steps, job.update_seconds);
    }
    return;
  }
  for (const auto& [uid, sum] : sums) {
    add({{"uid", std::to_string(uid)}}, sum.ranks, sum.host_bytes, sum.pinned_bytes, sum.steps, sum.updates,
        sum.nonfinite_steps, sum.update_seconds);
  }
}

void MetricsCollector::CollectTransfers(Families& f) {
  const char* help = "bytes the daemon copied with a GPU (cuda-ipc): gradients to_host, weights to_device";
  f.Of("trainstream_gpu_copy_bytes_total", MetricType::Counter, help);  // listed before the first GPU is
  for (const auto& [gpu, counters] : ProcessCounters::Instance().Gpus()) {
    f.Add("trainstream_gpu_copy_bytes_total", MetricType::Counter, help,
          static_cast<double>(counters->to_host_bytes.load()), {{"gpu", gpu}, {"direction", "to_host"}});
    f.Add("trainstream_gpu_copy_bytes_total", MetricType::Counter, help,
          static_cast<double>(counters->to_device_bytes.load()), {{"gpu", gpu}, {"direction", "to_device"}});
  }
  PeerCounters& peer = ProcessCounters::Instance().peer();
  f.Add("trainstream_peer_allreduce_bytes_total", MetricType::Counter,
        "bytes sent to other daemons by the all-reduces of multi-node jobs",
        static_cast<double>(peer.bytes_sent.load()));
  f.Of("trainstream_peer_allreduce_seconds", MetricType::Histogram, "time of one bucket's all-reduce between daemons")
      .metric.push_back(Histogram(peer.allreduce_seconds.Read()));
}

}  // namespace trainstream::daemon
