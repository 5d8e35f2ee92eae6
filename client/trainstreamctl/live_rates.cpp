#include "client/trainstreamctl/live_rates.h"

#include <fmt/format.h>

#include "client/trainstreamctl/report_format.h"

namespace trainstream::ctl {

namespace {

template <typename T, typename Key>
const T* Find(const std::vector<T>& items, const Key& key, const std::string& name) {
  for (const T& item : items) {
    if (item.*key == name) return &item;
  }
  return nullptr;
}

double PerSecond(uint64_t before, uint64_t now, double seconds) {
  return seconds > 0 && now >= before ? static_cast<double>(now - before) / seconds : 0;
}

}  // namespace

LiveRates RatesBetween(const StatsReport& before, const StatsReport& now, double seconds) {
  LiveRates rates{.seconds = seconds, .jobs = {}, .gpus = {}};
  for (const JobReport& job : now.jobs) {
    const JobReport* old = Find(before.jobs, &JobReport::name, job.name);
    const JobReport zero;
    const JobReport& from = old != nullptr && old->job_key == job.job_key ? *old : zero;
    const uint64_t updates = job.updates >= from.updates ? job.updates - from.updates : 0;
    rates.jobs.push_back(JobRates{
        .name = job.name,
        .completed_step = job.completed_step,
        .ranks = job.attached_ranks.size(),
        .steps_per_second = PerSecond(from.steps, job.steps, seconds),
        .update_ms =
            updates == 0 ? 0 : (job.update_seconds - from.update_seconds) * 1000 / static_cast<double>(updates),
    });
  }
  for (const GpuReport& gpu : now.gpus) {
    const GpuReport* old = Find(before.gpus, &GpuReport::gpu, gpu.gpu);
    const GpuReport zero;
    const GpuReport& from = old != nullptr ? *old : zero;
    rates.gpus.push_back(GpuRates{
        .gpu = gpu.gpu,
        .to_host_gb_per_second = PerSecond(from.to_host_bytes, gpu.to_host_bytes, seconds) / 1e9,
        .to_device_gb_per_second = PerSecond(from.to_device_bytes, gpu.to_device_bytes, seconds) / 1e9,
    });
  }
  return rates;
}

nlohmann::json RatesJson(const LiveRates& rates) {
  nlohmann::json jobs = nlohmann::json::array(), gpus = nlohmann::json::array();
  for (const JobRates& job : rates.jobs) {
    jobs.push_back({{"name", job.name},
                    {"completed_step", job.completed_step},
                    {"ranks", job.ranks},
                    {"steps_per_second", job.steps_per_second},
                    {"update_ms", job.update_ms}});
  }
  for (const GpuRates& gpu : rates.gpus) {
    gpus.push_back({{"gpu", gpu.gpu},
                    {"to_host_gb_per_second", gpu.to_host_gb_per_second},
                    {"to_device_gb_per_second", gpu.to_device_gb_per_second}});
  }
  return {{"interval_seconds", rates.seconds}, {"jobs", jobs}, {"gpus", gpus}};
}

std::string RatesText(const LiveRates& rates, const StatsReport& now) {
  std::string text = fmt::format("trainstreamd {} (pid {}): {} jobs, {} in segments, {} pinned, every {:.1f} s\n\n",
                                 now.daemon_version, now.pid, now.jobs.size(), Bytes(now.host_bytes),
                                 Bytes(now.pinned_bytes), rates.seconds);
  text += fmt::format("{:<24} {:>6} {:>8} {:>10} {:>10}\n", "JOB", "RANKS", "STEP", "STEPS/S", "UPDATE MS");
  for (const JobRates& job : rates.jobs) {
    text += fmt::format("{:<24} {:>6} {:>8} {:>10.2f} {:>10.2f}\n", job.name, job.ranks, job.completed_step,
                        job.steps_per_second, job.update_ms);
  }
  if (!rates.gpus.empty()) {
    text += fmt::format("\n{:<44} {:>14} {:>14}\n", "GPU", "TO HOST GB/S", "TO GPU GB/S");
    for (const GpuRates& gpu : rates.gpus) {
      text +=
          fmt::format("{:<44} {:>14.2f} {:>14.2f}\n", gpu.gpu, gpu.to_host_gb_per_second, gpu.to_device_gb_per_second);
    }
  }
  return text;
}

}  // namespace trainstream::ctl
