// trainstreamd: parses the configuration, serves the Control service on a Unix socket, and shuts down
// cleanly on SIGTERM/SIGINT (sessions told, segments removed, socket unlinked). Its SIGBUS handler
// absorbs faults in the memory its clients can truncate (daemon/guard/fault_guard.h).
#include <absl/synchronization/mutex.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "daemon/config.h"
#include "daemon/control/control_service.h"
#include "daemon/control/control_socket.h"
#include "daemon/control/job_registry.h"
#include "daemon/control/orphaned_jobs.h"
#include "daemon/guard/fault_guard.h"
#include "daemon/metrics/metrics_server.h"
#include "daemon/optimizer/adamw_kernels.h"
#include "daemon/peer/peer_server.h"
#include "daemon/systemd_notify.h"
#include "shm/error.h"
#include "shm/version.h"

namespace trainstream::daemon {
namespace {

// True if a process accepts connections on the Unix socket at `path`.
bool SomeoneListens(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  path.copy(address.sun_path, sizeof(address.sun_path) - 1);
  const bool listening = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return listening;
}

void PrepareSocketPath(const std::string& path) {
  TS_CHECK(path.size() < sizeof(sockaddr_un::sun_path), Code::kInvalidArgument,
           "socket path '{}' is longer than {} bytes", path, sizeof(sockaddr_un::sun_path) - 1);
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code error;
  if (!parent.empty()) std::filesystem::create_directories(parent, error);
  TS_CHECK(!error, Code::kFailedPrecondition, "cannot create socket directory {}: {}", parent.string(),
           error.message());
  if (std::filesystem::exists(path)) {
    TS_CHECK(!SomeoneListens(path), Code::kAlreadyExists, "another trainstreamd is listening on {}", path);
    std::filesystem::remove(path);  // stale: left by a daemon that died
  }
}

// A secret that other local users can read lets any of them use what it guards (the peer plane: deliver
// fragments to every node's jobs; the metrics token: read the metrics): worth a warning at every start (a
// refusal would stop working setups). `what` names the setting.
std::string ReadSecret(const std::string& path, const char* what) {
  std::ifstream file(path);
  TS_CHECK(file.good(), Code::kInvalidArgument, "cannot read the {} file '{}'", what, path);
  struct stat status {};
  if (stat(path.c_str(), &status) == 0 && (status.st_mode & 077) != 0) {
    spdlog::warn(
        "the {} file '{}' has mode {:04o}: users other than its owner can read it; make it 0600 (chmod 600 {})", what,
        path, status.st_mode & 07777, path);
  }
  std::string secret((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  while (!secret.empty() && std::isspace(static_cast<unsigned char>(secret.back()))) secret.pop_back();
  TS_CHECK(secret.size() >= 16, Code::kInvalidArgument, "the {} in '{}' is shorter than 16 characters", what, path);
  return secret;
}

std::string Hostname() {
  std::array<char, 256> name{};
  TS_CHECK(gethostname(name.data(), name.size() - 1) == 0, Code::kInternal, "gethostname failed: {}", strerror(errno));
  return name.data();
}

// The Peer service on TCP, for multi-node jobs; all empty unless --peer-listen was given.
struct PeerPlane {
  std::unique_ptr<PeerServer> server;
  std::string advertise;  // the address the other nodes should dial
  PeerConfig jobs;        // for the jobs' all-reduces
};

PeerPlane StartPeerPlane(const Config& config, PeerMailbox& mailbox) {
  PeerPlane plane;
  if (config.peer_listen.empty()) return plane;
  TS_CHECK(!config.peer_secret_file.empty(), Code::kInvalidArgument, "--peer-listen needs --peer-secret-file");
  plane.jobs = PeerConfig{&mailbox, ReadSecret(config.peer_secret_file, "peer secret"),
                          std::chrono::seconds(config.peer_timeout_seconds), config.peer_connections};
  KeepPeerBuffersMapped();
  plane.server = std::make_unique<PeerServer>(config.peer_listen, mailbox, plane.jobs.secret);
  const int port = plane.server->port();
  plane.advertise = PeerAdvertiseAddress(config, Hostname(), port);
  spdlog::info("peer plane listening on {} (port {}), advertised to the other nodes as {}", config.peer_listen, port,
               plane.advertise);
  return plane;
}

// Every connection is a descriptor: the daemon takes all that its hard limit allows, and splits them
// between the control socket, the peer port and the rest (daemon/peer/peer_server.h).
void RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == limit.rlim_max) return;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) spdlog::warn("cannot raise the open-file limit: {}", strerror(errno));
}

// The gRPC server has no listening port of its own: ControlSocket accepts the connections (knowing
// each caller's uid) and hands them over.
std::unique_ptr<grpc::Server> StartControlServer(ControlService& service) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  TS_CHECK(server != nullptr, Code::kUnavailable, "cannot start the gRPC server");
  return server;
}

// The Prometheus endpoint, if --metrics-listen asks for one.
std::unique_ptr<MetricsServer> StartMetrics(const Config& config, JobRegistry& registry, const WorkerPool& pool) {
  if (config.metrics_listen.empty()) return nullptr;
  const std::string token =
      config.metrics_token_file.empty() ? "" : ReadSecret(config.metrics_token_file, "metrics token");
  auto metrics = std::make_unique<MetricsServer>(config.metrics_listen, MetricsLabelsFrom(config.metrics_labels), token,
                                                 registry, pool);
  spdlog::info("metrics endpoint listening on {} (port {}), path /metrics, labels {}, {}", config.metrics_listen,
               metrics->port(), config.metrics_labels, token.empty() ? "no token asked" : "bearer token asked");
  return metrics;
}

// Snapshots without a path, and periodic ones, go to --snapshot-dir: it must exist before they do.
// Creates `dir` (a snapshot or trace directory) at start, so that a bad path fails there and not when
// a job first writes to it.
void PrepareDir(const std::string& dir, const char* what) {
  if (dir.empty()) return;
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  TS_CHECK(!error && std::filesystem::is_directory(dir), Code::kFailedPrecondition, "cannot create the {} {}: {}", what,
           dir, error.message());
}

int Serve(const Config& config) {
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [trainstreamd] [%l] %v");

  // Signals are taken synchronously by the main loop below; every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  if (config.parent_pid != 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != config.parent_pid) return 0;  // the parent is already gone
  }

  // Before anything maps a client's segment (the orphans below): a truncated one must not kill the daemon.
  InstallFaultGuard();
  RaiseOpenFileLimit();
  PrepareSocketPath(config.socket);
  PrepareDir(config.snapshot_dir, "snapshot directory");
  PrepareDir(config.trace_dir, "trace directory");
  const std::vector<int> worker_cpus = CpusLeftAfterReserving(AllowedCpus(), config.reserved_cores);
  const uint32_t threads = config.threads != 0 ? config.threads : std::max<size_t>(1, worker_cpus.size());
  const bool idle_workers = config.worker_policy == "idle";
  WorkerPool pool(threads, /*pin_threads=*/true, {}, static_cast<int>(config.worker_nice), worker_cpus,
                  idle_workers ? WorkerPolicy::kIdle : WorkerPolicy::kNormal);
  PeerMailbox mailbox(config.peer_max_unknown_job_bytes);
  PeerPlane peers = StartPeerPlane(config, mailbox);
  JobRegistry registry(config, pool, peers.jobs);
  RemoveDeadPrivateJobs();
  if (config.parent_pid == 0) registry.ClaimOrphans();  // a private daemon's socket is new every time
  std::unique_ptr<ControlSocket> socket;                // reset only once the server has stopped calling handlers
  ControlService service(
      registry, pool, peers.advertise,
      [&socket](const grpc::ServerContext& context) -> std::optional<uint32_t> {
        const std::optional<PeerCredentials> caller = socket->CallerOf(context);
        if (!caller) return std::nullopt;
        return caller->uid;
      },
      config);
  const std::unique_ptr<MetricsServer> metrics = StartMetrics(config, registry, pool);

  std::unique_ptr<grpc::Server> server = StartControlServer(service);
  socket = std::make_unique<ControlSocket>(config.socket, config.socket_mode, *server);
  spdlog::info("trainstreamd {} listening on {} ({} worker threads {}, {} cores reserved, kernel {}, pid {})", kVersion,
               config.socket, threads, idle_workers ? "at SCHED_IDLE" : fmt::format("at nice {}", config.worker_nice),
               config.reserved_cores, optimizer::ActiveKernelName(), getpid());
  NotifySystemd("READY=1");

  for (;;) {
    const timespec tick{.tv_sec = 1, .tv_nsec = 0};
    const int signal = sigtimedwait(&signals, nullptr, &tick);
    if (signal == SIGTERM || signal == SIGINT) {
      spdlog::info("received {}, shutting down", strsignal(signal));
      break;
    }
    registry.DropLost();
    registry.ExpireIdle();
    // A reduction waits at most the peer timeout for progress; what waited several times that long
    // belongs to none (a job that never came here, a failed step).
    if (peers.server) mailbox.Expire(4 * peers.jobs.timeout);
  }

  NotifySystemd("STOPPING=1");
  socket->StopAccepting();
  registry.Shutdown("trainstreamd is shutting down");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (peers.server) peers.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  socket.reset();
  spdlog::info("stopped");
  return 0;
}

}  // namespace
}  // namespace trainstream::daemon

int main(int argc, char** argv) {
  // Debian's Abseil is built with mutex deadlock detection on: every absl::Mutex that gRPC takes
  // then records lock-order edges in a process-wide graph under one spin lock (3.5% of the CPU
  // samples of an all-reduce of 1 MiB over 4 nodes on the 2-core dev machine). A debugging aid.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  try {
    const auto config = trainstream::daemon::ParseConfig(argc, argv);
    if (!config) return 0;
    return trainstream::daemon::Serve(*config);
  } catch (const trainstream::Error& e) {
    fmt::print(stderr, "trainstreamd: error: {}\n", e.what());
    return 2;
  }
}
