// Tests of trainstreamd's configuration (daemon/config.h): defaults, every flag, the TOML file,
// flag-over-file precedence, and errors that name the offending flag or key.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "daemon/config.h"
#include "shm/error.h"
#include "shm/version.h"
#include "tests/cpp/shm/test_support.h"

namespace trainstream::daemon {
namespace {

// ParseConfig on `args` (without the program name).
std::optional<Config> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "trainstreamd");
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  return ParseConfig(static_cast<int>(args.size()), argv.data());
}

Config ParseOk(const std::vector<std::string>& args) {
  std::optional<Config> config = Parse(args);
  EXPECT_TRUE(config.has_value());
  return config.value_or(Config{});
}

// A TOML file that exists for the lifetime of the object.
class TempToml {
 public:
  explicit TempToml(const std::string& content) {
    static std::atomic<int> counter{0};
    path_ = "/tmp/trainstream_config_test." + std::to_string(getpid()) + "." + std::to_string(counter++) + ".toml";
    std::ofstream(path_) << content;
  }
  ~TempToml() { std::remove(path_.c_str()); }
  TempToml(const TempToml&) = delete;
  TempToml& operator=(const TempToml&) = delete;
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void ExpectRejected(const std::vector<std::string>& args, const std::string& needle) {
  SCOPED_TRACE(::testing::PrintToString(args));
  TS_EXPECT_ERROR(Parse(args), Code::kInvalidArgument, needle);
}

void ExpectFileRejected(const std::string& toml, const std::string& needle) {
  SCOPED_TRACE(toml);
  TempToml file(toml);
  ExpectRejected({"--config", file.path()}, needle);
}

TEST(ParseConfig, DefaultsWithoutArguments) {
  const Config config = ParseOk({});
  const Config defaults;
  EXPECT_EQ(config.socket, "/run/trainstream/trainstreamd.sock");
  EXPECT_EQ(config.socket, defaults.socket);
  EXPECT_EQ(config.threads, 0u);
  EXPECT_EQ(config.worker_nice, 10u);
  EXPECT_EQ(config.reserved_cores, 0u);
  EXPECT_EQ(config.log_level, "info");
  EXPECT_EQ(config.socket_mode, 0660u);
  EXPECT_EQ(config.job_ttl_seconds, 3600u);
  EXPECT_EQ(config.max_jobs, 64u);
  EXPECT_EQ(config.max_host_bytes, 0u);
  EXPECT_EQ(config.parent_pid, 0);
  EXPECT_EQ(config.config_file, "");
}

TEST(ParseConfig, EveryFlag) {
  EXPECT_EQ(ParseOk({"--socket", "/tmp/x.sock"}).socket, "/tmp/x.sock");
  EXPECT_EQ(ParseOk({"--socket=/tmp/y.sock"}).socket, "/tmp/y.sock");
  EXPECT_EQ(ParseOk({"--threads", "3"}).threads, 3u);
  EXPECT_EQ(ParseOk({"--worker-nice", "0"}).worker_nice, 0u);
  EXPECT_EQ(ParseOk({"--worker-nice", "19"}).worker_nice, 19u);
  EXPECT_EQ(ParseOk({"--reserved-cores", "2"}).reserved_cores, 2u);
  EXPECT_EQ(ParseOk({"--log-level", "debug"}).log_level, "debug");
  EXPECT_EQ(ParseOk({"--job-ttl", "17"}).job_ttl_seconds, 17u);
  EXPECT_EQ(ParseOk({"--max-jobs", "5"}).max_jobs, 5u);
  EXPECT_EQ(ParseOk({"--max-host-bytes", "123456789012"}).max_host_bytes, 123456789012u);
  EXPECT_EQ(ParseOk({"--parent-pid", "4242"}).parent_pid, 4242);
  EXPECT_EQ(ParseOk({"--max-unattached-sessions", "7"}).max_unattached_sessions, 7u);
  EXPECT_EQ(ParseOk({"--max-unattached-sessions-per-uid", "3"}).max_unattached_sessions_per_uid, 3u);
}

TEST(ParseConfig, SessionLimitsHaveDefaultsAndRefuseZero) {
  const Config config = ParseOk({});
  EXPECT_EQ(config.max_unattached_sessions, 256u);
  EXPECT_EQ(config.max_unattached_sessions_per_uid, 32u);
  TempToml file("max_unattached_sessions = 9\nmax_unattached_sessions_per_uid = 2\n");
  const Config from_file = ParseOk({"--config", file.path()});
  EXPECT_EQ(from_file.max_unattached_sessions, 9u);
  EXPECT_EQ(from_file.max_unattached_sessions_per_uid, 2u);
  ExpectRejected({"--max-unattached-sessions", "0"}, "max_unattached_sessions is 0");
  ExpectRejected({"--max-unattached-sessions-per-uid", "0"}, "max_unattached_sessions_per_uid is 0");
}

TEST(ParseConfig, PerUidQuotasDefaultToHalfTheJobsAndNoByteLimit) {
  const Config config = ParseOk({});
  EXPECT_FALSE(config.max_jobs_per_uid.has_value());
  EXPECT_EQ(MaxJobsPerUid(config), 32u);
  EXPECT_EQ(config.max_host_bytes_per_uid, 0u);
  EXPECT_EQ(MaxJobsPerUid(ParseOk({"--max-jobs", "3"})), 2u);  // rounded up: one job for the others
  EXPECT_EQ(MaxJobsPerUid(ParseOk({"--max-jobs", "1"})), 1u);
  EXPECT_EQ(MaxJobsPerUid(ParseOk({"--max-jobs", "3", "--max-jobs-per-uid", "3"})), 3u);
  EXPECT_EQ(ParseOk({"--max-host-bytes-per-uid", "4096"}).max_host_bytes_per_uid, 4096u);
  TempToml file("max_jobs = 10\nmax_jobs_per_uid = 4\nmax_host_bytes_per_uid = 1073741824\n");
  const Config from_file = ParseOk({"--config", file.path()});
  EXPECT_EQ(MaxJobsPerUid(from_file), 4u);
  EXPECT_EQ(from_file.max_host_bytes_per_uid, 1073741824u);
  EXPECT_EQ(MaxJobsPerUid(ParseOk({"--config", file.path(), "--max-jobs-per-uid", "7"})), 7u);
  ExpectRejected({"--max-jobs-per-uid", "0"}, "max_jobs_per_uid is 0; expected at least 1");
  ExpectFileRejected("max_jobs_per_uid = 0\n", "max_jobs_per_uid is 0");
  ExpectFileRejected("max_jobs_per_uid = -1\n", "max_jobs_per_uid");
  ExpectFileRejected("max_host_bytes_per_uid = \"lots\"\n", "max_host_bytes_per_uid");
}

TEST(ParseConfig, FlagsCombine) {
  const Config config = ParseOk({"--threads", "2", "--max-jobs", "9", "--log-level", "warn"});
  EXPECT_EQ(config.threads, 2u);
  EXPECT_EQ(config.max_jobs, 9u);
  EXPECT_EQ(config.log_level, "warn");
  EXPECT_EQ(config.job_ttl_seconds, 3600u);  // untouched
}

TEST(ParseConfig, ConfigFileSetsEveryKey) {
  TempToml file(R"(
socket = "/tmp/from-file.sock"
threads = 6
log_level = "error"
socket_mode = 0o600
job_ttl_seconds = 99
max_jobs = 12
max_host_bytes = 1073741824
)");
  const Config config = ParseOk({"--config", file.path()});
  EXPECT_EQ(config.socket, "/tmp/from-file.sock");
  EXPECT_EQ(config.threads, 6u);
  EXPECT_EQ(config.log_level, "error");
  EXPECT_EQ(config.socket_mode, 0600u);
  EXPECT_EQ(config.job_ttl_seconds, 99u);
  EXPECT_EQ(config.max_jobs, 12u);
  EXPECT_EQ(config.max_host_bytes, 1073741824u);
  EXPECT_EQ(config.config_file, file.path());
}

TEST(ParseConfig, FlagsOverrideTheFileAndTheFileOverridesDefaults) {
  TempToml file("threads = 4\nmax_jobs = 7\nsocket = \"/tmp/file.sock\"\n");
  const Config config = ParseOk({"--threads", "2", "--config", file.path(), "--socket", "/tmp/flag.sock"});
  EXPECT_EQ(config.threads, 2u);
  EXPECT_EQ(config.socket, "/tmp/flag.sock");
  EXPECT_EQ(config.max_jobs, 7u);
  EXPECT_EQ(config.job_ttl_seconds, 3600u);
}

TEST(ParseConfig, LoadConfigFileKeepsKeysItDoesNotSet) {
  TempToml file("max_jobs = 3\n");
  Config config;
  config.threads = 11;
  LoadConfigFile(file.path(), config);
  EXPECT_EQ(config.max_jobs, 3u);
  EXPECT_EQ(config.threads, 11u);
}

TEST(ParseConfig, UnknownKeyInFileIsRejected) {
  ExpectFileRejected("threads = 2\nbogus_key = 1\n", "bogus_key");
}

TEST(ParseConfig, WrongTypedKeysInFileAreRejected) {
  ExpectFileRejected("threads = \"many\"\n", "threads");
  ExpectFileRejected("socket = 5\n", "socket");
  ExpectFileRejected("max_jobs = -1\n", "max_jobs");
  ExpectFileRejected("job_ttl_seconds = 1.5\n", "job_ttl_seconds");
  ExpectFileRejected("log_level = true\n", "log_level");
}

TEST(ParseConfig, MalformedFileIsRejected) {
  TempToml file("threads = = 3\n[unterminated\n");
  ExpectRejected({"--config", file.path()}, file.path());
}

TEST(ParseConfig, MissingFileIsRejected) {
  const std::string path = "/tmp/trainstream_config_test.does-not-exist." + std::to_string(getpid()) + ".toml";
  ExpectRejected({"--config", path}, path);
}

TEST(ParseConfig, UnknownFlagIsRejected) {
  ExpectRejected({"--bogus-flag", "1"}, "--bogus-flag");
}

TEST(ParseConfig, BadLogLevelFlagIsRejected) {
  ExpectRejected({"--log-level", "loud"}, "loud");
}

TEST(ParseConfig, NonNumericFlagIsRejected) {
  ExpectRejected({"--threads", "lots"}, "threads");
}

// The file accepts "the same keys as these flags": a level the flag refuses must not pass through the file
// (spdlog::level::from_str turns an unknown name into "off", silencing the daemon).
TEST(ParseConfig, BadLogLevelInFileIsRejected) {
  ExpectFileRejected("log_level = \"loud\"\n", "log_level");
}

// A value that does not fit the key's type must not wrap around (threads = 2^32 would become 0).
TEST(ParseConfig, OutOfRangeValueInFileIsRejected) {
  ExpectFileRejected("threads = 4294967296\n", "threads");
  ExpectFileRejected("max_jobs = 4294967297\n", "max_jobs");
}

TEST(ParseConfig, PeerFlagsAndKeys) {
  const Config flags = ParseOk({"--peer-listen", "0.0.0.0:7150", "--peer-advertise", "node3.cluster:7150"});
  EXPECT_EQ(flags.peer_listen, "0.0.0.0:7150");
  EXPECT_EQ(flags.peer_advertise, "node3.cluster:7150");
  EXPECT_EQ(flags.peer_connections, 4u);
  EXPECT_EQ(ParseOk({"--peer-connections", "1"}).peer_connections, 1u);
  EXPECT_EQ(flags.peer_max_unknown_job_bytes, uint64_t{256} << 20);
  TempToml file(
      "peer_listen = \"[::]:7151\"\npeer_advertise = \"10.0.0.3:7151\"\npeer_connections = 16\n"
      "peer_max_unknown_job_bytes = 1048576\n");
  const Config from_file = ParseOk({"--config", file.path()});
  EXPECT_EQ(from_file.peer_listen, "[::]:7151");
  EXPECT_EQ(from_file.peer_advertise, "10.0.0.3:7151");
  EXPECT_EQ(from_file.peer_connections, 16u);
  EXPECT_EQ(from_file.peer_max_unknown_job_bytes, 1048576u);
}

TEST(ParseConfig, WorkerNiceComesFromTheFileAndStaysInRange) {
  TempToml file("worker_nice = 3\n");
  EXPECT_EQ(ParseOk({"--config", file.path()}).worker_nice, 3u);
  ExpectRejected({"--worker-nice", "20"}, "worker_nice is 20; expected 0 to 19");
  ExpectFileRejected("worker_nice = 25\n", "worker_nice is 25; expected 0 to 19");
  EXPECT_EQ(ParseOk({}).worker_policy, "normal");
  EXPECT_EQ(ParseOk({"--worker-policy", "idle"}).worker_policy, "idle");
  TempToml policy("worker_policy = \"idle\"\n");
  EXPECT_EQ(ParseOk({"--config", policy.path()}).worker_policy, "idle");
  ExpectRejected({"--worker-policy", "fifo"}, "worker_policy is 'fifo'; expected normal or idle");
}

TEST(ParseConfig, ReservedCoresComeFromTheFile) {
  TempToml file("reserved_cores = 1\n");
  EXPECT_EQ(ParseOk({"--config", file.path()}).reserved_cores, 1u);
}

TEST(ParseConfig, PeerConnectionsOutOfRangeAreRejected) {
  ExpectRejected({"--peer-connections", "0"}, "peer_connections is 0; expected 1 to 16");
  ExpectFileRejected("peer_connections = 17\n", "peer_connections is 17; expected 1 to 16");
}

TEST(ParseConfig, BadPeerAddressesAreRejected) {
  ExpectRejected({"--peer-advertise", "node3:7150"}, "peer_advertise needs peer_listen");
  ExpectRejected({"--peer-listen", "0.0.0.0:7150", "--peer-advertise", "node3"}, "'node3' must be HOST:PORT");
  ExpectRejected({"--peer-listen", "0.0.0.0:7150", "--peer-advertise", "node3:0"}, "non-zero port");
  ExpectRejected({"--peer-listen", "0.0.0.0:7150", "--peer-advertise", ":7150"}, "must name a host");
  ExpectRejected({"--peer-listen", "0.0.0.0:http"}, "'0.0.0.0:http' has no valid port");
  ExpectRejected({"--peer-listen", "0.0.0.0:65536"}, "no valid port");
  ExpectFileRejected("peer_listen = \"7150\"\n", "peer_listen '7150' must be HOST:PORT");
}

TEST(ParseConfig, OperationsFlagsAndKeys) {
  const Config flags = ParseOk({"--metrics-listen", "127.0.0.1:9150", "--snapshot-dir", "/var/lib/ts",
                                "--snapshot-every", "100", "--trace-dir", "/tmp/traces"});
  EXPECT_EQ(flags.metrics_listen, "127.0.0.1:9150");
  EXPECT_EQ(flags.trace_dir, "/tmp/traces");
  EXPECT_EQ(flags.snapshot_dir, "/var/lib/ts");
  EXPECT_EQ(flags.snapshot_every, 100u);
  TempToml file(
      "metrics_listen = \"[::]:9150\"\nsnapshot_dir = \"/srv/snaps\"\nsnapshot_every = 7\ntrace_dir = \"/srv/t\"\n");
  const Config from_file = ParseOk({"--config", file.path()});
  EXPECT_EQ(from_file.metrics_listen, "[::]:9150");
  EXPECT_EQ(from_file.snapshot_dir, "/srv/snaps");
  EXPECT_EQ(from_file.snapshot_every, 7u);
  EXPECT_EQ(from_file.trace_dir, "/srv/t");
  EXPECT_TRUE(ParseOk({}).metrics_listen.empty());  // off by default
  EXPECT_TRUE(ParseOk({}).trace_dir.empty());
}

TEST(ParseConfig, MetricsLabelsAndTokenFlagsAndKeys) {
  EXPECT_EQ(ParseOk({}).metrics_labels, "uid");  // no job names by default
  const Config flags = ParseOk({"--metrics-listen", "unix:/run/trainstream/metrics.sock", "--metrics-labels", "job",
                                "--metrics-token-file", "/etc/trainstream/metrics-token"});
  EXPECT_EQ(flags.metrics_listen, "unix:/run/trainstream/metrics.sock");
  EXPECT_EQ(flags.metrics_labels, "job");
  EXPECT_EQ(flags.metrics_token_file, "/etc/trainstream/metrics-token");
  TempToml file("metrics_listen = \":9150\"\nmetrics_labels = \"none\"\nmetrics_token_file = \"/t\"\n");
  const Config from_file = ParseOk({"--config", file.path()});
  EXPECT_EQ(from_file.metrics_labels, "none");
  EXPECT_EQ(from_file.metrics_token_file, "/t");
}

TEST(ParseConfig, BadOperationsSettingsAreRejected) {
  ExpectRejected({"--metrics-listen", "9150"}, "metrics_listen '9150' must be HOST:PORT");
  ExpectRejected({"--metrics-listen", "unix:metrics.sock"}, "must be unix: with an absolute path");
  ExpectRejected({"--metrics-listen", ":0", "--metrics-labels", "names"},
                 "metrics_labels is 'names'; expected none, uid or job");
  ExpectRejected({"--metrics-token-file", "/t"}, "metrics_token_file needs metrics_listen");
  ExpectRejected({"--snapshot-every", "10"}, "snapshot_every needs snapshot_dir");
  ExpectRejected({"--snapshot-dir", "relative/dir"}, "snapshot_dir 'relative/dir' must be an absolute path");
  ExpectFileRejected("snapshot_every = -1\n", "snapshot_every");
  ExpectRejected({"--trace-dir", "traces"}, "trace_dir 'traces' must be an absolute path");
}

Config WithPeers(const std::string& listen, const std::string& advertise = "") {
  Config config;
  config.peer_listen = listen;
  config.peer_advertise = advertise;
  return config;
}

TEST(PeerAdvertiseAddress, EmptyWithoutPeerPlane) {
  EXPECT_EQ(PeerAdvertiseAddress(Config{}, "host-a", 7150), "");
}

TEST(PeerAdvertiseAddress, ConcreteListenHostIsAdvertisedAsIs) {
  EXPECT_EQ(PeerAdvertiseAddress(WithPeers("10.1.2.3:7150"), "host-a", 7150), "10.1.2.3:7150");
  EXPECT_EQ(PeerAdvertiseAddress(WithPeers("node0.cluster:7150"), "host-a", 7150), "node0.cluster:7150");
  EXPECT_EQ(PeerAdvertiseAddress(WithPeers("[fd00::3]:7150"), "host-a", 7150), "[fd00::3]:7150");
}

TEST(PeerAdvertiseAddress, WildcardListenHostBecomesTheHostname) {
  for (const std::string wildcard : {"0.0.0.0", "[::]", "::", ""}) {
    EXPECT_EQ(PeerAdvertiseAddress(WithPeers(wildcard + ":7150"), "host-a", 7150), "host-a:7150") << wildcard;
  }
}

TEST(PeerAdvertiseAddress, PortIsTheBoundOne) {  // --peer-listen HOST:0 lets the system pick the port
  EXPECT_EQ(PeerAdvertiseAddress(WithPeers("127.0.0.1:0"), "host-a", 40123), "127.0.0.1:40123");
  EXPECT_EQ(PeerAdvertiseAddress(WithPeers("0.0.0.0:0"), "host-a", 40123), "host-a:40123");
}

TEST(PeerAdvertiseAddress, ExplicitAdvertiseWins) {
  EXPECT_EQ(PeerAdvertiseAddress(WithPeers("0.0.0.0:7150", "gw.example:9000"), "host-a", 7150), "gw.example:9000");
}

// --version / --help print (to stdout) and return nullopt, so main() exits 0 without starting.
std::string PrintedBy(const std::vector<std::string>& args) {
  ::testing::internal::CaptureStdout();
  const bool parsed = Parse(args).has_value();
  std::string printed = ::testing::internal::GetCapturedStdout();
  EXPECT_FALSE(parsed) << ::testing::PrintToString(args) << " returned a config";
  return printed;
}

TEST(ParseConfig, VersionAndHelpReturnNothing) {
  EXPECT_NE(PrintedBy({"--version"}).find(std::string(kVersion)), std::string::npos);
  EXPECT_NE(PrintedBy({"--help"}).find("--max-host-bytes"), std::string::npos);
  EXPECT_NE(PrintedBy({"-h", "--threads", "3"}).find("Usage"), std::string::npos);
}

}  // namespace
}  // namespace trainstream::daemon
