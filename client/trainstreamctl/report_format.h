// What trainstreamctl prints: the daemon's Stats as text tables for people, and as JSON for scripts.
// JSON keys are the client library's field names (client/include/trainstream/client.h).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "trainstream/client.h"

namespace trainstream::ctl {

// "1.5 GiB"
std::string Bytes(uint64_t bytes);
// "3.2 s ago", or "-" for 0 (never); relative to `now_unix_ms`.
std::string Ago(int64_t unix_ms, int64_t now_unix_ms);

nlohmann::json StatusJson(const StatsReport& stats);
std::string StatusText(const StatsReport& stats);

nlohmann::json JobJson(const JobReport& job);
nlohmann::json JobsJson(const StatsReport& stats);
std::string JobsText(const StatsReport& stats, int64_t now_unix_ms);

}  // namespace trainstream::ctl
