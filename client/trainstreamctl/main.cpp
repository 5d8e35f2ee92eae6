// trainstreamctl: the operator's command for a trainstreamd, through the Control service on its socket
// (the client library, client/include/trainstream/client.h). Commands: status, jobs, top, drop,
// snapshot, restore (docs/operations.md, "trainstreamctl"). The socket: --socket, else
// $TRAINSTREAM_ADDRESS, else the service's; --socket and --json go before or after the command.
// Errors go to stderr as "trainstreamctl: error: ...", exit 1 (2 for a bad command line).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <thread>

#include "client/trainstreamctl/live_rates.h"
#include "client/trainstreamctl/report_format.h"
#include "shm/version.h"
#include "trainstream/client.h"

namespace trainstream::ctl {
namespace {

constexpr const char* kServiceSocket = "/run/trainstream/trainstreamd.sock";

std::string SocketPath(const std::string& flag) {
  std::string address = flag;
  if (address.empty()) {
    const char* env = std::getenv("TRAINSTREAM_ADDRESS");
    address = env != nullptr && *env != '\0' ? env : kServiceSocket;
  }
  return address.starts_with("unix:") ? address.substr(5) : address;
}

// The daemon resolves paths in its own filesystem view: relative ones are made absolute here.
std::string Absolute(const std::string& path) {
  return path.empty() ? path : std::filesystem::absolute(path).lexically_normal().string();
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void Print(bool json, const nlohmann::json& value, const std::string& text) {
  if (json) {
    std::cout << value.dump() << std::endl;
  } else {
    std::cout << text << std::flush;
  }
}

// Refreshes every `interval` seconds; `iterations` 0: until interrupted.
void Top(Client& client, bool json, double interval, uint64_t iterations) {
  const bool terminal = isatty(STDOUT_FILENO) != 0 && !json;
  StatsReport before = client.Stats();
  auto taken = std::chrono::steady_clock::now();
  for (uint64_t i = 0; iterations == 0 || i < iterations; ++i) {
    std::this_thread::sleep_for(std::chrono::duration<double>(interval));
    StatsReport now = client.Stats();
    const auto at = std::chrono::steady_clock::now();
    const LiveRates rates = RatesBetween(before, now, std::chrono::duration<double>(at - taken).count());
    if (terminal) std::cout << "\033[H\033[2J";  // home, clear
    Print(json, RatesJson(rates), RatesText(rates, now) + (terminal ? "" : "\n"));
    before = std::move(now);
    taken = at;
  }
}

int Run(int argc, char** argv) {
  CLI::App app{"trainstreamctl: inspect and operate a trainstreamd"};
  app.set_version_flag("--version", std::string(kVersion));
  app.require_subcommand(1);
  std::string socket;
  bool json = false;
  app.add_option("--socket", socket,
                 "the daemon's Unix socket (default: $TRAINSTREAM_ADDRESS, else " + std::string(kServiceSocket) + ")");
  app.add_flag("--json", json, "print JSON (one object or array per line) for scripts");
  // Inherited by the subcommands added below: what a subcommand does not know goes to the app, so the
  // options above are accepted before or after it (`trainstreamctl jobs --json`).
  app.fallthrough();

  app.add_subcommand("status", "daemon version, pid, uptime, threads, kernel, memory and quotas");
  app.add_subcommand("jobs", "per job: owner, ranks and transports, step, memory, last update and step");
  CLI::App* top = app.add_subcommand("top", "steps/s, update time and GPU copy rates, refreshed live");
  double interval = 1.0;
  uint64_t iterations = 0;
  top->add_option("--interval", interval, "seconds between refreshes (default 1)")->check(CLI::PositiveNumber);
  top->add_option("--iterations", iterations, "stop after this many refreshes (default: never)");
  CLI::App* drop = app.add_subcommand("drop", "remove a job and its memory (your own; root: any uid's)");
  std::string job;
  bool force = false;
  std::optional<uint32_t> owner;
  const std::string owner_help = "the uid whose job JOB is (default: yours; only root may name another)";
  drop->add_option("JOB", job, "job name")->required();
  drop->add_flag("--force", force, "also if ranks are attached (their sessions fail)");
  drop->add_option("--uid", owner, owner_help);
  CLI::App* snapshot = app.add_subcommand("snapshot", "write a job's state to a safetensors file");
  std::string path;
  double timeout = 600;
  snapshot->add_option("JOB", job, "job name")->required();
  snapshot->add_option("PATH", path, "file to write, as the daemon sees it (default: in its --snapshot-dir)");
  snapshot->add_option("--timeout", timeout, "seconds to wait for the job's next step boundary (default 600)")
      ->check(CLI::PositiveNumber);
  snapshot->add_option("--uid", owner, owner_help);
  CLI::App* restore = app.add_subcommand("restore", "recreate a job from a snapshot file");
  restore->add_option("PATH", path, "snapshot file, as the daemon sees it")->required();
  restore->add_option("--job", job, "name of the new job (default: the name in the snapshot)");
  bool allow_nonfinite = false;
  restore->add_flag("--allow-nonfinite", allow_nonfinite,
                    "also restore master weights or moments that hold inf or NaN (a job that had diverged)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help, --version: 0; a bad command line: 2, whatever CLI11 says
  }

  const std::shared_ptr<Client> client = Client::Connect(SocketPath(socket));
  if (app.got_subcommand("status")) {
    const StatsReport stats = client->Stats();
    Print(json, StatusJson(stats), StatusText(stats));
  } else if (app.got_subcommand("jobs")) {
    const StatsReport stats = client->Stats();
    Print(json, JobsJson(stats), JobsText(stats, NowUnixMs()));
  } else if (app.got_subcommand(top)) {
    Top(*client, json, interval, iterations);
  } else if (app.got_subcommand(drop)) {
    client->DropJob(job, force, owner);
    Print(json, {{"dropped", job}}, fmt::format("dropped job '{}'\n", job));
  } else if (app.got_subcommand(snapshot)) {
    const auto wait = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
    const SnapshotReport written = client->Snapshot(job, Absolute(path), wait, owner);
    Print(json, {{"job", job}, {"path", written.path}, {"step", written.step}, {"bytes", written.bytes}},
          fmt::format("job '{}': step {} written to {} ({})\n", job, written.step, written.path, Bytes(written.bytes)));
  } else if (app.got_subcommand(restore)) {
    const RestoreReport restored = client->Restore(Absolute(path), job, allow_nonfinite);
    Print(json, {{"job", restored.job}, {"step", restored.step}, {"path", Absolute(path)}},
          fmt::format("job '{}' restored at step {} from {}; attach with its name to resume\n", restored.job,
                      restored.step, Absolute(path)));
  }
  return 0;
}

}  // namespace
}  // namespace trainstream::ctl

int main(int argc, char** argv) {
  try {
    return trainstream::ctl::Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "trainstreamctl: error: " << e.what() << std::endl;
    return 1;
  }
}
