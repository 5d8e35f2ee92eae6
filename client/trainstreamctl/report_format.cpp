#include "client/trainstreamctl/report_format.h"

#include <fmt/format.h>

#include <array>

namespace trainstream::ctl {

std::string Bytes(uint64_t bytes) {
  static constexpr std::array<const char*, 5> kUnits = {"B", "KiB", "MiB", "GiB", "TiB"};
  auto value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < kUnits.size()) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", value, kUnits[unit]);
}

std::string Ago(int64_t unix_ms, int64_t now_unix_ms) {
  if (unix_ms == 0) return "-";
  return fmt::format("{:.1f} s ago", static_cast<double>(std::max<int64_t>(0, now_unix_ms - unix_ms)) / 1000);
}

nlohmann::json StatusJson(const StatsReport& stats) {
  nlohmann::json gpus = nlohmann::json::array();
  for (const GpuReport& gpu : stats.gpus) {
    gpus.push_back({{"gpu", gpu.gpu}, {"to_host_bytes", gpu.to_host_bytes}, {"to_device_bytes", gpu.to_device_bytes}});
  }
  return {{"daemon_version", stats.daemon_version},
          {"pid", stats.pid},
          {"uptime_seconds", stats.uptime_seconds},
          {"worker_threads", stats.worker_threads},
          {"kernel", stats.kernel},
          {"jobs", stats.jobs.size()},
          {"max_jobs", stats.max_jobs},
          {"host_bytes", stats.host_bytes},
          {"max_host_bytes", stats.max_host_bytes},
          {"pinned_bytes", stats.pinned_bytes},
          {"rss_bytes", stats.rss_bytes},
          {"gpus", gpus}};
}

std::string StatusText(const StatsReport& stats) {
  std::string text = fmt::format(
      "trainstreamd {} (pid {}), up {:.0f} s\n"
      "worker threads: {}, kernel: {}\n"
      "jobs:           {} of max_jobs={}\n"
      "host memory:    {} in segments ({}), {} resident\n"
      "pinned memory:  {}\n",
      stats.daemon_version, stats.pid, stats.uptime_seconds, stats.worker_threads, stats.kernel, stats.jobs.size(),
      stats.max_jobs, Bytes(stats.host_bytes),
      stats.max_host_bytes == 0 ? std::string("no max_host_bytes") : "max_host_bytes=" + Bytes(stats.max_host_bytes),
      Bytes(stats.rss_bytes), Bytes(stats.pinned_bytes));
  for (const GpuReport& gpu : stats.gpus) {
    text += fmt::format("{}: {} gradients copied to the host, {} weights to the GPU\n", gpu.gpu,
                        Bytes(gpu.to_host_bytes), Bytes(gpu.to_device_bytes));
  }
  return text;
}

nlohmann::json JobJson(const JobReport& job) {
  nlohmann::json ranks = nlohmann::json::array();
  for (uint32_t rank : job.attached_ranks) {
    auto transport = job.transports.find(rank);
    ranks.push_back({{"rank", rank}, {"transport", transport == job.transports.end() ? "" : transport->second}});
  }
  return {{"name", job.name},
          {"job_key", job.job_key},
          {"uid", job.uid},
          {"world_size", job.world_size},
          {"ranks", ranks},
          {"completed_step", job.completed_step},
          {"steps", job.steps},
          {"updates", job.updates},
          {"update_seconds", job.update_seconds},
          {"nonfinite_steps", job.nonfinite_steps},
          {"params", job.params},
          {"elements", job.elements},
          {"buckets", job.buckets},
          {"host_bytes", job.host_bytes},
          {"pinned_bytes", job.pinned_bytes},
          {"state_bytes", job.state_bytes},
          {"rank_bytes", job.rank_bytes},
          {"last_update_unix_ms", job.last_update_unix_ms},
          {"last_step_unix_ms", job.last_step_unix_ms},
          {"orphaned", job.orphaned},
          {"last_snapshot", job.last_snapshot},
          {"last_snapshot_step", job.last_snapshot_step}};
}

nlohmann::json JobsJson(const StatsReport& stats) {
  nlohmann::json jobs = nlohmann::json::array();
  for (const JobReport& job : stats.jobs) jobs.push_back(JobJson(job));
  return jobs;
}

std::string JobsText(const StatsReport& stats, int64_t now_unix_ms) {
  if (stats.jobs.empty()) return "no jobs\n";
  std::string text = fmt::format("{:<24} {:>6} {:>6} {:>8} {:>10} {:>10} {:>12} {:>12}  {}\n", "JOB", "UID", "RANKS",
                                 "STEP", "HOST", "PINNED", "LAST UPDATE", "LAST STEP", "STATE");
  for (const JobReport& job : stats.jobs) {
    text += fmt::format("{:<24} {:>6} {:>6} {:>8} {:>10} {:>10} {:>12} {:>12}  {}\n", job.name, job.uid,
                        fmt::format("{}/{}", job.attached_ranks.size(), job.world_size), job.completed_step,
                        Bytes(job.host_bytes), Bytes(job.pinned_bytes), Ago(job.last_update_unix_ms, now_unix_ms),
                        Ago(job.last_step_unix_ms, now_unix_ms),
                        job.orphaned                 ? "orphaned"
                        : job.attached_ranks.empty() ? "idle"
                                                     : "attached");
    for (const auto& [rank, transport] : job.transports) text += fmt::format("  rank {}: {}\n", rank, transport);
    if (!job.last_snapshot.empty()) {
      text += fmt::format("  last snapshot: {} (step {})\n", job.last_snapshot, job.last_snapshot_step);
    }
  }
  return text;
}

}  // namespace trainstream::ctl
