// libFuzzer harness: the Control service's handlers (daemon/control/control_service.h) with requests
// parsed from the fuzzer's bytes, through a real in-process gRPC server on a socket pair (a handler
// cannot be driven without its server), against a real registry whose jobs live in /dev/shm. Each
// input is a series of calls: Handshake, Stats, DropJob, Session streams whose first and second
// messages come from the bytes, Snapshot and Restore, each as the caller uid the bytes choose (root, or
// one of two users). Snapshot and Restore name files in the harness's own directory only (also its
// --snapshot-dir): a file whose content comes from the bytes, the last snapshot written, a FIFO, a
// directory, a missing file. After each input every job is dropped. Statuses are whatever they are;
// the daemon must not crash or hang.
#include <fuzzer/FuzzedDataProvider.h>
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/create_channel_posix.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>

#include "daemon/config.h"
#include "daemon/control/control_service.h"
#include "daemon/control/job_registry.h"
#include "daemon/engine/worker_pool.h"
#include "shm/error.h"

namespace ts = trainstream;

namespace {

constexpr uint32_t kUids[] = {0, 65534, 65533};

// The harness's directory: files to restore and snapshots to write, every uid may write it.
std::string Dir() {
  static const std::string dir = [] {
    std::string path = "/tmp/trainstream-fuzz-control-" + std::to_string(getpid());
    std::filesystem::create_directories(path);
    chmod(path.c_str(), 01777);
    mkfifo((path + "/fifo").c_str(), 0666);
    std::filesystem::create_directories(path + "/directory");
    return path;
  }();
  return dir;
}

struct Daemon {
  Daemon() : pool(1, /*pin_threads=*/false), registry(config, pool) {
    config.socket = "/nonexistent/trainstream-fuzz.sock";  // names the jobs' owner; never listened on
    config.snapshot_dir = Dir();
    config.max_jobs = 4;
    config.max_host_bytes = 64 << 20;  // a fuzzed layout cannot fill /dev/shm
    service = std::make_unique<ts::daemon::ControlService>(
        registry, pool, "", [this](const grpc::ServerContext&) { return std::optional<uint32_t>(caller.load()); },
        config);
    grpc::ServerBuilder builder;
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds) != 0) abort();
    grpc::AddInsecureChannelFromFd(server.get(), fds[1]);
    stub = ts::v1::Control::NewStub(grpc::CreateInsecureChannelFromFd("fuzz", fds[0]));
  }

  ts::daemon::Config config;
  ts::daemon::WorkerPool pool;
  ts::daemon::JobRegistry registry;
  std::atomic<uint32_t> caller{0};
  std::unique_ptr<ts::daemon::ControlService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<ts::v1::Control::Stub> stub;
};

template <typename Message>
Message Parse(FuzzedDataProvider& data) {
  Message message;
  const std::string bytes = data.ConsumeRandomLengthString(2048);
  message.ParseFromString(bytes);  // what does not parse stays partly filled, as a sloppy client's would
  return message;
}

std::unique_ptr<grpc::ClientContext> Context() {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return context;
}

void RunSession(Daemon& daemon, FuzzedDataProvider& data) {
  auto context = Context();
  auto stream = daemon.stub->Session(context.get());
  const size_t messages = data.ConsumeIntegralInRange<size_t>(0, 2);
  for (size_t i = 0; i < messages; ++i) {
    if (!stream->Write(Parse<ts::v1::SessionRequest>(data))) break;
  }
  ts::v1::SessionEvent event;
  if (messages > 0) stream->Read(&event);  // the answer to attach, or the end
  context->TryCancel();
  stream->Finish();
}

// A path in the harness's directory, chosen by the bytes; the content of "restore.safetensors" too.
std::string PathFrom(FuzzedDataProvider& data, bool write_content) {
  static const char* const kNames[] = {"restore.safetensors", "snapshot.safetensors", "fifo", "directory",
                                       "missing/x.safetensors"};
  const char* name = kNames[data.ConsumeIntegralInRange<size_t>(0, 4)];
  std::string path = Dir() + "/" + name;
  if (write_content && name == kNames[0]) {
    const std::string content = data.ConsumeRandomLengthString(4096);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
    chmod(path.c_str(), 0644);
  }
  return path;
}

void RunSnapshot(Daemon& daemon, FuzzedDataProvider& data) {
  auto request = Parse<ts::v1::SnapshotRequest>(data);
  request.set_path(data.ConsumeBool() ? "" : PathFrom(data, false));  // "": the --snapshot-dir
  auto context = Context();
  ts::v1::SnapshotReply reply;
  daemon.stub->Snapshot(context.get(), request, &reply);
}

void RunRestore(Daemon& daemon, FuzzedDataProvider& data) {
  auto request = Parse<ts::v1::RestoreRequest>(data);
  request.set_path(PathFrom(data, true));
  auto context = Context();
  ts::v1::RestoreReply reply;
  daemon.stub->Restore(context.get(), request, &reply);
}

void DropEverything(Daemon& daemon) {
  daemon.caller = 0;
  auto context = Context();
  ts::v1::StatsReply stats;
  daemon.stub->Stats(context.get(), ts::v1::StatsRequest(), &stats);
  for (const ts::v1::JobStats& job : stats.jobs()) {
    ts::v1::DropJobRequest request;
    request.set_job(job.name());
    request.set_force(true);
    request.set_owner_uid(job.uid());
    ts::v1::DropJobReply reply;
    auto drop = Context();
    daemon.stub->DropJob(drop.get(), request, &reply);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in a string field is logged: expected here
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  static auto* daemon = new Daemon();  // one server for the whole run; never destroyed (gRPC's threads)
  FuzzedDataProvider data(bytes, size);
  for (int calls = 0; calls < 8 && data.remaining_bytes() > 0; ++calls) {
    daemon->caller = kUids[data.ConsumeIntegralInRange<size_t>(0, 2)];
    auto context = Context();
    switch (data.ConsumeIntegralInRange<int>(0, 5)) {
      case 0: {
        ts::v1::HandshakeReply reply;
        daemon->stub->Handshake(context.get(), Parse<ts::v1::HandshakeRequest>(data), &reply);
        break;
      }
      case 1: {
        ts::v1::StatsReply reply;
        daemon->stub->Stats(context.get(), Parse<ts::v1::StatsRequest>(data), &reply);
        break;
      }
      case 2: {
        ts::v1::DropJobReply reply;
        daemon->stub->DropJob(context.get(), Parse<ts::v1::DropJobRequest>(data), &reply);
        break;
      }
      case 3: RunSession(*daemon, data); break;
      case 4: RunSnapshot(*daemon, data); break;
      default: RunRestore(*daemon, data);
    }
  }
  DropEverything(*daemon);
  return 0;
}
