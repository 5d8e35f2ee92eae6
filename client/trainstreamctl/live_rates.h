// `trainstreamctl top`: rates between two Stats readings (the daemon keeps counters only).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "trainstream/client.h"

namespace trainstream::ctl {

struct JobRates {
  std::string name;
  uint64_t completed_step = 0;
  size_t ranks = 0;
  double steps_per_second = 0;
  double update_ms = 0;  // mean time of one bucket update in the interval; 0 if none ran
};

struct GpuRates {
  std::string gpu;
  double to_host_gb_per_second = 0, to_device_gb_per_second = 0;
};

struct LiveRates {
  double seconds = 0;  // between the readings
  std::vector<JobRates> jobs;
  std::vector<GpuRates> gpus;
};

// Jobs and GPUs of `now`; one missing from `before` counts from zero.
LiveRates RatesBetween(const StatsReport& before, const StatsReport& now, double seconds);
nlohmann::json RatesJson(const LiveRates& rates);
std::string RatesText(const LiveRates& rates, const StatsReport& now);

}  // namespace trainstream::ctl
