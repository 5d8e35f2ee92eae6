#include "daemon/config.h"

#include <toml++/toml.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <iostream>
#include <limits>
#include <string>
#include <utility>

#include "shm/error.h"
#include "shm/version.h"

namespace trainstream::daemon {

namespace {

const std::vector<std::string> kLogLevels = {"trace", "debug", "info", "warn", "error", "critical", "off"};

template <typename T>
void ReadKey(const toml::table& table, const char* key, T& out) {
  const toml::node* node = table.get(key);
  if (node == nullptr) return;
  if constexpr (std::is_same_v<T, std::string>) {
    const auto value = node->value<std::string>();
    TS_CHECK(value.has_value(), Code::kInvalidArgument, "config key '{}' must be a string", key);
    out = *value;
  } else {
    const auto value = node->value<int64_t>();
    TS_CHECK(value.has_value() && *value >= 0 && static_cast<uint64_t>(*value) <= std::numeric_limits<T>::max(),
             Code::kInvalidArgument, "config key '{}' must be an integer in [0, {}]", key,
             std::numeric_limits<T>::max());
    out = static_cast<T>(*value);
  }
}

template <typename T>
void ReadKey(const toml::table& table, const char* key, std::optional<T>& out) {
  if (!table.contains(key)) return;
  ReadKey(table, key, out.emplace());
}

// Splits "host:port" (host may be a bracketed IPv6 literal) at its last colon; `what` names the setting.
std::pair<std::string, std::string> SplitHostPort(const std::string& address, const char* what) {
  const size_t colon = address.rfind(':');
  TS_CHECK(colon != std::string::npos, Code::kInvalidArgument, "{} '{}' must be HOST:PORT", what, address);
  const std::string port = address.substr(colon + 1);
  const bool numeric = !port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos;
  TS_CHECK(numeric && std::stoi(port) <= 65535, Code::kInvalidArgument, "{} '{}' has no valid port (HOST:PORT)", what,
           address);
  return {address.substr(0, colon), port};
}

// The peer settings that only make sense together, and in range.
void CheckPeerSettings(const Config& config) {
  TS_CHECK(config.peer_connections >= 1 && config.peer_connections <= 16, Code::kInvalidArgument,
           "peer_connections is {}; expected 1 to 16", config.peer_connections);
  if (!config.peer_listen.empty()) SplitHostPort(config.peer_listen, "peer_listen");
  if (config.peer_advertise.empty()) return;
  TS_CHECK(!config.peer_listen.empty(), Code::kInvalidArgument, "peer_advertise needs peer_listen (--peer-listen)");
  const auto [host, port] = SplitHostPort(config.peer_advertise, "peer_advertise");
  TS_CHECK(!host.empty() && port != "0", Code::kInvalidArgument,
           "peer_advertise '{}' must name a host and a non-zero port the other nodes can dial", config.peer_advertise);
}

// Zero would refuse every session.
void CheckWorkerSettings(const Config& config) {
  TS_CHECK(config.worker_nice <= 19, Code::kInvalidArgument, "worker_nice is {}; expected 0 to 19", config.worker_nice);
  TS_CHECK(config.worker_policy == "normal" || config.worker_policy == "idle", Code::kInvalidArgument,
           "worker_policy is '{}'; expected normal or idle", config.worker_policy);
}

void CheckQuotas(const Config& config) {
  TS_CHECK(config.max_jobs_per_uid != 0u, Code::kInvalidArgument,
           "max_jobs_per_uid is 0; expected at least 1 (max_jobs or more: no limit per uid)");
}

void CheckSessionLimits(const Config& config) {
  TS_CHECK(config.max_unattached_sessions >= 1, Code::kInvalidArgument,
           "max_unattached_sessions is 0; expected at least 1");
  TS_CHECK(config.max_unattached_sessions_per_uid >= 1, Code::kInvalidArgument,
           "max_unattached_sessions_per_uid is 0; expected at least 1");
}

// Snapshots every N steps need a directory; the metrics address must parse.
void CheckOperationsSettings(const Config& config) {
  if (config.metrics_listen.starts_with("unix:")) {
    TS_CHECK(config.metrics_listen.size() > 6 && config.metrics_listen[5] == '/', Code::kInvalidArgument,
             "metrics_listen '{}' must be unix: with an absolute path", config.metrics_listen);
  } else if (!config.metrics_listen.empty()) {
    SplitHostPort(config.metrics_listen, "metrics_listen");
  }
  TS_CHECK(config.metrics_labels == "none" || config.metrics_labels == "uid" || config.metrics_labels == "job",
           Code::kInvalidArgument, "metrics_labels is '{}'; expected none, uid or job", config.metrics_labels);
  TS_CHECK(config.metrics_token_file.empty() || !config.metrics_listen.empty(), Code::kInvalidArgument,
           "metrics_token_file needs metrics_listen (--metrics-listen)");
  TS_CHECK(config.snapshot_every == 0 || !config.snapshot_dir.empty(), Code::kInvalidArgument,
           "snapshot_every needs snapshot_dir (--snapshot-dir)");
  TS_CHECK(config.snapshot_dir.empty() || config.snapshot_dir.front() == '/', Code::kInvalidArgument,
           "snapshot_dir '{}' must be an absolute path", config.snapshot_dir);
  TS_CHECK(config.trace_dir.empty() || config.trace_dir.front() == '/', Code::kInvalidArgument,
           "trace_dir '{}' must be an absolute path", config.trace_dir);
}

}  // namespace

uint32_t MaxJobsPerUid(const Config& config) {
  return config.max_jobs_per_uid.value_or(config.max_jobs / 2 + config.max_jobs % 2);
}

std::string PeerAdvertiseAddress(const Config& config, const std::string& hostname, int bound_port) {
  if (config.peer_listen.empty()) return "";
  if (!config.peer_advertise.empty()) return config.peer_advertise;
  const std::string host = SplitHostPort(config.peer_listen, "peer_listen").first;
  const bool wildcard = host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::";
  return fmt::format("{}:{}", wildcard ? hostname : host, bound_port);
}

void LoadConfigFile(const std::string& path, Config& config) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    Throw(Code::kInvalidArgument, "cannot parse config file {}: {} (line {})", path, e.description(),
          e.source().begin.line);
  }
  static const std::vector<std::string> kKnown = {"socket",
                                                  "threads",
                                                  "worker_nice",
                                                  "worker_policy",
                                                  "reserved_cores",
                                                  "log_level",
                                                  "socket_mode",
                                                  "job_ttl_seconds",
                                                  "max_jobs",
                                                  "max_host_bytes",
                                                  "max_jobs_per_uid",
                                                  "max_host_bytes_per_uid",
                                                  "max_unattached_sessions",
                                                  "max_unattached_sessions_per_uid",
                                                  "peer_listen",
                                                  "peer_advertise",
                                                  "peer_secret_file",
                                                  "peer_timeout_seconds",
                                                  "peer_connections",
                                                  "peer_max_unknown_job_bytes",
                                                  "metrics_listen",
                                                  "metrics_labels",
                                                  "metrics_token_file",
                                                  "snapshot_dir",
                                                  "snapshot_every",
                                                  "trace_dir"};
  for (const auto& [key, value] : table) {
    TS_CHECK(std::find(kKnown.begin(), kKnown.end(), key.str()) != kKnown.end(), Code::kInvalidArgument,
             "unknown key '{}' in config file {}", key.str(), path);
  }
  ReadKey(table, "socket", config.socket);
  ReadKey(table, "threads", config.threads);
  ReadKey(table, "worker_nice", config.worker_nice);
  ReadKey(table, "worker_policy", config.worker_policy);
  ReadKey(table, "reserved_cores", config.reserved_cores);
  ReadKey(table, "log_level", config.log_level);
  TS_CHECK(std::find(kLogLevels.begin(), kLogLevels.end(), config.log_level) != kLogLevels.end(),
           Code::kInvalidArgument, "config key 'log_level' is '{}'; expected one of {}", config.log_level,
           fmt::join(kLogLevels, ", "));
  ReadKey(table, "socket_mode", config.socket_mode);
  ReadKey(table, "job_ttl_seconds", config.job_ttl_seconds);
  ReadKey(table, "max_jobs", config.max_jobs);
  ReadKey(table, "max_host_bytes", config.max_host_bytes);
  ReadKey(table, "max_jobs_per_uid", config.max_jobs_per_uid);
  ReadKey(table, "max_host_bytes_per_uid", config.max_host_bytes_per_uid);
  ReadKey(table, "max_unattached_sessions", config.max_unattached_sessions);
  ReadKey(table, "max_unattached_sessions_per_uid", config.max_unattached_sessions_per_uid);
  ReadKey(table, "peer_listen", config.peer_listen);
  ReadKey(table, "peer_advertise", config.peer_advertise);
  ReadKey(table, "peer_secret_file", config.peer_secret_file);
  ReadKey(table, "peer_timeout_seconds", config.peer_timeout_seconds);
  ReadKey(table, "peer_connections", config.peer_connections);
  ReadKey(table, "peer_max_unknown_job_bytes", config.peer_max_unknown_job_bytes);
  ReadKey(table, "metrics_listen", config.metrics_listen);
  ReadKey(table, "metrics_labels", config.metrics_labels);
  ReadKey(table, "metrics_token_file", config.metrics_token_file);
  ReadKey(table, "snapshot_dir", config.snapshot_dir);
  ReadKey(table, "snapshot_every", config.snapshot_every);
  ReadKey(table, "trace_dir", config.trace_dir);
}

std::optional<Config> ParseConfig(int argc, char** argv) {
  Config defaults;
  CLI::App app{"trainstreamd: per-node optimizer offload daemon for PyTorch training"};
  app.set_version_flag("--version", std::string(kVersion));
  std::string config_file;
  app.add_option("--config", config_file, "TOML file with the same keys as these flags");
  // Flags are parsed into optionals so that a flag overrides the file only when given.
  std::optional<std::string> socket, log_level, worker_policy;
  std::optional<uint32_t> threads, worker_nice, reserved_cores, max_jobs, max_jobs_per_uid, max_unattached,
      max_unattached_per_uid;
  std::optional<uint64_t> ttl, max_host_bytes, max_host_bytes_per_uid;
  std::optional<int64_t> parent_pid;
  app.add_option("--socket", socket, "Unix socket to listen on (default " + defaults.socket + ")");
  app.add_option("--threads", threads, "optimizer worker threads (default: one per CPU not reserved)");
  app.add_option("--worker-nice", worker_nice,
                 "nice value of the worker threads, 0-19 (default 10): they yield a shared core to the trainers");
  app.add_option("--worker-policy", worker_policy,
                 "normal (at --worker-nice) or idle (SCHED_IDLE: any other thread takes a worker's core at once)");
  app.add_option("--reserved-cores", reserved_cores,
                 "physical cores no worker is pinned to, left to the training processes (default 0)");
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")->check(CLI::IsMember(kLogLevels));
  app.add_option("--job-ttl", ttl, "seconds a job with no attached rank is kept (default 3600)");
  app.add_option("--max-jobs", max_jobs, "maximum number of jobs (default 64)");
  app.add_option("--max-host-bytes", max_host_bytes, "maximum bytes of shared memory over all jobs (0: no limit)");
  app.add_option("--max-jobs-per-uid", max_jobs_per_uid,
                 "maximum number of jobs of one user other than root (default: half of --max-jobs)");
  app.add_option("--max-host-bytes-per-uid", max_host_bytes_per_uid,
                 "maximum bytes of shared memory of one user other than root (0: no limit)");
  app.add_option("--max-unattached-sessions", max_unattached,
                 "Session streams not attached yet, over all users (default 256)");
  app.add_option("--max-unattached-sessions-per-uid", max_unattached_per_uid,
                 "Session streams not attached yet, of one user (default 32)");
  app.add_option("--parent-pid", parent_pid, "exit when this process exits (private daemons)");
  std::optional<std::string> peer_listen, peer_secret_file;
  std::optional<uint64_t> peer_timeout;
  std::optional<uint32_t> peer_connections;
  std::optional<std::string> peer_advertise;
  app.add_option("--peer-listen", peer_listen, "host:port of the Peer service for multi-node jobs (default: off)");
  app.add_option("--peer-advertise", peer_advertise,
                 "host:port the other nodes dial (default: --peer-listen's host, or this machine's hostname if it "
                 "is 0.0.0.0 or [::], with the listening port)");
  app.add_option("--peer-secret-file", peer_secret_file, "file holding the peers' shared secret");
  app.add_option("--peer-timeout", peer_timeout, "seconds a peer may stay silent before its job fails (default 30)");
  app.add_option("--peer-connections", peer_connections,
                 "connections to the next node of a job's ring, 1 to 16 (default 4)");
  std::optional<std::string> metrics_listen, metrics_labels, metrics_token_file, snapshot_dir, trace_dir;
  std::optional<uint64_t> snapshot_every;
  app.add_option("--metrics-listen", metrics_listen,
                 "host:port or unix:/path of the Prometheus metrics endpoint (default: off)");
  app.add_option("--metrics-labels", metrics_labels,
                 "what the metrics tell about jobs: none, uid (sums per user, the default) or job (names)");
  app.add_option("--metrics-token-file", metrics_token_file,
                 "file holding a bearer token every scrape must carry (default: none asked)");
  app.add_option("--snapshot-dir", snapshot_dir,
                 "directory of periodic snapshots, and of requested ones without a path (default: none)");
  app.add_option("--snapshot-every", snapshot_every, "snapshot every job every N steps into --snapshot-dir (0: never)");
  app.add_option("--trace-dir", trace_dir,
                 "directory where each job's step timeline is written when it ends, for benchmarks (default: none)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    app.exit(e);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    Throw(Code::kInvalidArgument, "{}", e.what());
  }
  Config config;
  if (!config_file.empty()) {
    LoadConfigFile(config_file, config);
    config.config_file = config_file;
  }
  if (socket) config.socket = *socket;
  if (threads) config.threads = *threads;
  if (worker_nice) config.worker_nice = *worker_nice;
  if (worker_policy) config.worker_policy = *worker_policy;
  if (reserved_cores) config.reserved_cores = *reserved_cores;
  if (log_level) config.log_level = *log_level;
  if (ttl) config.job_ttl_seconds = *ttl;
  if (max_jobs) config.max_jobs = *max_jobs;
  if (max_host_bytes) config.max_host_bytes = *max_host_bytes;
  if (max_jobs_per_uid) config.max_jobs_per_uid = *max_jobs_per_uid;
  if (max_host_bytes_per_uid) config.max_host_bytes_per_uid = *max_host_bytes_per_uid;
  if (max_unattached) config.max_unattached_sessions = *max_unattached;
  if (max_unattached_per_uid) config.max_unattached_sessions_per_uid = *max_unattached_per_uid;
  if (parent_pid) config.parent_pid = *parent_pid;
  if (peer_listen) config.peer_listen = *peer_listen;
  if (peer_advertise) config.peer_advertise = *peer_advertise;
  if (peer_secret_file) config.peer_secret_file = *peer_secret_file;
  if (peer_timeout) config.peer_timeout_seconds = *peer_timeout;
  if (peer_connections) config.peer_connections = *peer_connections;
  if (metrics_listen) config.metrics_listen = *metrics_listen;
  if (metrics_labels) config.metrics_labels = *metrics_labels;
  if (metrics_token_file) config.metrics_token_file = *metrics_token_file;
  if (snapshot_dir) config.snapshot_dir = *snapshot_dir;
  if (snapshot_every) config.snapshot_every = *snapshot_every;
  if (trace_dir) config.trace_dir = *trace_dir;
  CheckWorkerSettings(config);
  CheckPeerSettings(config);
  CheckQuotas(config);
  CheckSessionLimits(config);
  CheckOperationsSettings(config);
  return config;
}

}  // namespace trainstream::daemon
