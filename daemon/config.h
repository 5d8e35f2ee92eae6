// trainstreamd's configuration: command line flags and the same keys in a TOML file.
// Precedence: command line > config file > defaults.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace trainstream::daemon {

struct Config {
  std::string socket = "/run/trainstream/trainstreamd.sock";
  uint32_t threads = 0;  // 0: one per allowed CPU not reserved (below)
  // The worker threads' nice value, 0-19. A trainer's thread that shares a core with a busy worker then
  // takes it: the 124M GPT's forced-offload step on the H200 (16 workers on 16 cores) took 47.1 ms at 10
  // against 65.1 ms at 0, its backward 23.8 against 38.1 ms (benchmarks/results/train_gpt.md).
  uint32_t worker_nice = 10;
  // "normal" (at worker_nice) or "idle" (SCHED_IDLE: every other thread takes a worker's core the moment
  // it wakes; daemon/engine/worker_pool.h).
  std::string worker_policy = "normal";
  // Physical cores (every hyperthread of each) no worker is pinned to, left to the training processes'
  // threads; `threads` 0 then means one per CPU left.
  uint32_t reserved_cores = 0;
  std::string log_level = "info";
  uint32_t socket_mode = 0660;
  uint64_t job_ttl_seconds = 3600;  // a job with no rank attached is dropped after this
  uint32_t max_jobs = 64;
  uint64_t max_host_bytes = 0;  // 0: unlimited
  // The same per uid (root's jobs count only toward the two above): unset, MaxJobsPerUid gives half of
  // max_jobs, so that one user's idle jobs (kept job_ttl_seconds) leave room for the others.
  std::optional<uint32_t> max_jobs_per_uid;
  uint64_t max_host_bytes_per_uid = 0;            // 0: unlimited
  uint32_t max_unattached_sessions = 256;         // Session streams not attached yet, over all uids
  uint32_t max_unattached_sessions_per_uid = 32;  // ... of one uid
  int64_t parent_pid = 0;                         // private daemon: exit when this process dies
  std::string peer_listen;                        // "host:port" for the Peer service of multi-node jobs; empty: off
  std::string peer_advertise;                     // "host:port" the other nodes dial; empty: derived from peer_listen
  std::string peer_secret_file;                   // the peers' shared secret (required with peer_listen)
  uint64_t peer_timeout_seconds = 30;             // a peer silent for this long fails the job
  uint32_t peer_connections = 4;                  // to the next daemon of a job's ring (docs/multi-node.md), 1-16
  // Bytes of fragments kept for jobs this daemon does not have (yet): a new job's first all-reduce
  // delivers up to 1/M of its first bucket before this node's ranks attach (M nodes; 16 MiB of a default
  // 32 MiB bucket over 2 nodes), and a peer's mistake could deliver without end (daemon/peer/peer_mailbox.h).
  uint64_t peer_max_unknown_job_bytes = uint64_t{256} << 20;
  std::string metrics_listen;  // "host:port" or "unix:/path" of the Prometheus endpoint; empty: off
  // What the endpoint tells about jobs (daemon/metrics/metrics_collector.h): "none", "uid" (sums per
  // uid, no job names) or "job" (every job by name and uid). It may reach users the 0660 socket refuses.
  std::string metrics_labels = "uid";
  std::string metrics_token_file;  // a bearer token every scrape must carry; empty: none asked
  std::string snapshot_dir;        // periodic snapshots, and requested ones without a path; empty: none
  uint64_t snapshot_every = 0;     // steps between periodic snapshots (needs snapshot_dir); 0: none
  std::string trace_dir;           // each job's step timeline, written when it ends; empty: none
  std::string config_file;
};

// Parses argv. Returns the config, or nullopt after printing help/version (exit 0).
// Throws trainstream::Error (kInvalidArgument) with a message naming the bad flag or key.
std::optional<Config> ParseConfig(int argc, char** argv);

// Loads the keys of a TOML file into `config` (used by ParseConfig; exposed for tests).
void LoadConfigFile(const std::string& path, Config& config);

// The jobs one uid other than root may hold at once: max_jobs_per_uid, else half of max_jobs rounded up.
uint32_t MaxJobsPerUid(const Config& config);

// The peer-plane address this daemon reports to its clients, which publish it to the other nodes:
// peer_advertise if set, else peer_listen's host (`hostname` when it is a wildcard: 0.0.0.0, [::] or
// empty) with `bound_port`, the port the Peer service actually listens on. Empty without a peer plane.
std::string PeerAdvertiseAddress(const Config& config, const std::string& hostname, int bound_port);

}  // namespace trainstream::daemon
