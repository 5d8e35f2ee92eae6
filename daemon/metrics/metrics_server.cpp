#include "daemon/metrics/metrics_server.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <chrono>
#include <limits>

#include "daemon/gpu/pinned_host.h"
#include "daemon/metrics/counters.h"
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

// The families of one scrape, by name in the order they are first added.
class Families {
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

}  // namespace

class DaemonCollector final : public prometheus::Collectable {
 public:
  DaemonCollector(JobRegistry& registry, const WorkerPool& pool) : registry_(registry), pool_(pool) {}

  std::vector<MetricFamily> Collect() const override {
    Families families;
    CollectDaemon(families);
    CollectJobs(families);
    CollectTransfers(families);
    return families.Take();
  }

 private:
  void CollectDaemon(Families& f) const {
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

  void CollectJobs(Families& f) const {
    const auto jobs = registry_.Jobs();
    const auto orphans = registry_.Orphans();
    f.Add("trainstream_jobs", MetricType::Gauge, "jobs, by whether a dead daemon left them (orphaned)",
          static_cast<double>(jobs.size()), {{"orphaned", "false"}});
    f.Add("trainstream_jobs", MetricType::Gauge, "", static_cast<double>(orphans.size()), {{"orphaned", "true"}});
    double host_bytes = 0;
    for (const OrphanedJob& orphan : orphans) host_bytes += static_cast<double>(orphan.state_bytes);
    for (const auto& job : jobs) {
      const JobInfo info = job->Info();
      const Labels labels = {{"job", info.name}, {"uid", std::to_string(info.uid)}};
      host_bytes += static_cast<double>(info.host_bytes);
      f.Add("trainstream_job_ranks", MetricType::Gauge, "ranks attached to the job",
            static_cast<double>(info.engine.attached_ranks.size()), labels);
      f.Add("trainstream_job_world_size", MetricType::Gauge, "ranks the job has on this node",
            static_cast<double>(info.world_size), labels);
      f.Add("trainstream_job_host_bytes", MetricType::Gauge,
            "the job's shared memory: state and attached rank segments", static_cast<double>(info.host_bytes), labels);
      f.Add("trainstream_job_pinned_bytes", MetricType::Gauge, "of the job's shared memory, bytes page-locked",
            static_cast<double>(info.pinned_bytes), labels);
      f.Add("trainstream_job_steps_total", MetricType::Counter, "steps completed (every bucket updated)",
            static_cast<double>(info.steps), labels);
      f.Add("trainstream_job_completed_step", MetricType::Gauge, "the job's last completed step",
            static_cast<double>(info.completed_step), labels);
      f.Add("trainstream_job_updates_total", MetricType::Counter, "bucket updates run",
            static_cast<double>(info.engine.updates), labels);
      f.Add("trainstream_job_nonfinite_steps_total", MetricType::Counter, "steps whose gradients had inf or NaN",
            static_cast<double>(info.engine.nonfinite_steps), labels);
      f.Of("trainstream_update_seconds", MetricType::Histogram, "time of one bucket's AdamW update pass")
          .metric.push_back(Histogram(info.update_seconds, labels));
    }
    f.Add("trainstream_host_bytes", MetricType::Gauge, "shared memory of all jobs", host_bytes);
  }

  static void CollectTransfers(Families& f) {
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

  JobRegistry& registry_;
  const WorkerPool& pool_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

MetricsServer::MetricsServer(const std::string& listen, JobRegistry& registry, const WorkerPool& pool)
    : collector_(std::make_shared<DaemonCollector>(registry, pool)) {
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/2);
  } catch (const std::exception& e) {
    Throw(Code::kUnavailable, "cannot serve metrics on {}: {}", listen, e.what());
  }
  exposer_->RegisterCollectable(collector_);
}

MetricsServer::~MetricsServer() = default;

int MetricsServer::port() const {
  const std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace trainstream::daemon
