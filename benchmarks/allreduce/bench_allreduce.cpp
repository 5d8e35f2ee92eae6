// ts_bench_allreduce: the daemons' ring all-reduce (daemon/peer/peer_allreduce.h) between M peer planes
// on loopback. Prints seconds per all-reduce and the bus bandwidth 2(M-1)/M * bytes / time, the
// figure NCCL and gloo benchmarks report. run.py starts the nodes and adds gloo.
//
// One process per node, like trainstreamd daemons (and gloo's ranks): node i serves its Peer service
// on 127.0.0.1:0, writes the port to DIR/node-<i>.port, waits for the other nodes' ports, reduces
// once to warm up, then `reps` times (the ring keeps the nodes in step); node 0 writes --json.
//
//   ts_bench_allreduce --nodes 2 --node 0 --ports-dir DIR --floats 8388608 --reps 10 [--connections 4]
//                      [--json out.json]
//
// Without --node, all M nodes (M servers, M PeerAllReduce instances) run in this one process.
//
// Node n starts with x[i] = (i + n) % 7; after the warm-up every node checks a strided sample of
// its buffer against the sum over the nodes (exact: small integers), after the timed all-reduces
// against sum * M^reps (within rounding), and exits 1 on a mismatch.
#include <absl/synchronization/mutex.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "daemon/peer/peer_allreduce.h"
#include "daemon/peer/peer_server.h"

using namespace trainstream::daemon;  // NOLINT(google-build-using-namespace): a benchmark's main

namespace {
constexpr char kSecret[] = "benchmark-secret-0123456789";

// CPU time of the whole process (its nodes and gRPC's threads): on a loaded 2-core machine a
// steadier figure than wall time.
double CpuSeconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

[[noreturn]] void Die(const std::string& message) {
  fprintf(stderr, "ts_bench_allreduce: %s\n", message.c_str());
  std::exit(1);
}

// One node's peer plane: mailbox, Peer server on 127.0.0.1:0, and (once the peers are known) its
// ring, with its buffer.
struct Node {
  PeerMailbox mailbox;
  std::unique_ptr<PeerServer> server;
  int port = 0;
  std::unique_ptr<PeerAllReduce> ring;
  std::vector<float> data;

  Node() {
    try {
      server = std::make_unique<PeerServer>("127.0.0.1:0", mailbox, kSecret);
    } catch (const trainstream::Error& e) {
      Die(std::string("cannot start the Peer server on 127.0.0.1: ") + e.what());
    }
    port = server->port();
  }

  void Join(const std::vector<std::string>& peers, uint32_t rank, size_t floats, uint32_t connections) {
    ring = std::make_unique<PeerAllReduce>(
        "bench", peers, rank, 1, PeerConfig{&mailbox, kSecret, std::chrono::milliseconds(60000), connections});
    data.resize(floats);
    for (size_t i = 0; i < floats; ++i) data[i] = static_cast<float>((i + rank) % 7);
  }

  std::future<std::optional<trainstream::Error>> Submit(uint64_t step) {
    auto promise = std::make_shared<std::promise<std::optional<trainstream::Error>>>();
    auto done = promise->get_future();
    ring->Submit(step, 0, data.data(), data.size(), [promise](auto error) { promise->set_value(error); });
    return done;
  }

  // Checks about 4096 elements spread over the buffer (so every fragment's range for the sizes the
  // benchmark uses) and the last one against scale * sum_n (i + n) % 7.
  void Check(uint32_t nodes, uint32_t rank, double scale, bool exact) const {
    auto check = [&](size_t i) {
      double sum = 0;
      for (uint32_t n = 0; n < nodes; ++n) sum += static_cast<double>((i + n) % 7);
      const double expected = sum * scale, got = data[i];
      if (exact ? got != expected : std::abs(got - expected) > 1e-5 * expected) {
        Die("node " + std::to_string(rank) + ": element " + std::to_string(i) + " is " + std::to_string(got) +
            ", expected " + std::to_string(expected));
      }
    };
    const size_t stride = std::max<size_t>(1, data.size() / 4096);
    for (size_t i = 0; i < data.size(); i += stride) check(i);
    check(data.size() - 1);
  }
};

void Await(std::future<std::optional<trainstream::Error>>& done) {
  if (auto error = done.get()) Die(std::string("all-reduce failed: ") + error->what());
}

// Waits until every node has written DIR/node-<n>.<suffix> (written whole: renamed into place) and
// returns the files' contents.
std::vector<std::string> AwaitFiles(const std::filesystem::path& dir, uint32_t nodes, const std::string& suffix,
                                    std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::string> contents(nodes);
  for (uint32_t n = 0; n < nodes;) {
    std::ifstream in(dir / ("node-" + std::to_string(n) + "." + suffix));
    if (in && std::getline(in, contents[n])) {
      ++n;
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      Die("node " + std::to_string(n) + " did not write " +
          (dir / ("node-" + std::to_string(n) + "." + suffix)).string() + " within " + std::to_string(timeout.count()) +
          " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return contents;
}

void WriteFile(const std::filesystem::path& dir, uint32_t node, const std::string& suffix, const std::string& text) {
  const auto path = dir / ("node-" + std::to_string(node) + "." + suffix);
  const auto temporary = path.string() + ".tmp";
  {
    std::ofstream out(temporary);
    out << text << "\n";
    if (!out.flush()) Die("cannot write " + temporary);
  }
  std::filesystem::rename(temporary, path);
}
}  // namespace

int main(int argc, char** argv) {
  uint32_t nodes = 2, reps = 10, wait_s = 60, connections = PeerConfig{}.connections;
  int node = -1;  // -1: every node in this process
  size_t floats = size_t{1} << 23;
  std::string json, ports_dir;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i], value = argv[i + 1];
    if (arg == "--nodes") nodes = static_cast<uint32_t>(std::stoul(value));
    if (arg == "--node") node = std::stoi(value);
    if (arg == "--ports-dir") ports_dir = value;
    if (arg == "--wait-s") wait_s = static_cast<uint32_t>(std::stoul(value));
    if (arg == "--floats") floats = static_cast<size_t>(std::stod(value));
    if (arg == "--reps") reps = static_cast<uint32_t>(std::stoul(value));
    if (arg == "--connections") connections = static_cast<uint32_t>(std::stoul(value));
    if (arg == "--json") json = value;
  }
  if (nodes < 2 || floats < 1) Die("--nodes must be at least 2, --floats at least 1");
  if (node >= static_cast<int>(nodes)) Die("--node must be below --nodes");
  if (node >= 0 && ports_dir.empty()) Die("--node needs --ports-dir");
  // As trainstreamd does (daemon/peer/peer_service.h, daemon/main.cpp).
  KeepPeerBuffersMapped();
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // This process's nodes: one, or all of them.
  const uint32_t first = node >= 0 ? static_cast<uint32_t>(node) : 0, last = node >= 0 ? first + 1 : nodes;
  std::vector<std::unique_ptr<Node>> local;
  for (uint32_t n = first; n < last; ++n) local.push_back(std::make_unique<Node>());
  std::vector<std::string> peers;
  if (node >= 0) {
    WriteFile(ports_dir, first, "port", std::to_string(local[0]->port));
    for (const auto& port : AwaitFiles(ports_dir, nodes, "port", std::chrono::seconds(wait_s))) {
      peers.push_back("127.0.0.1:" + port);
    }
  } else {
    for (const auto& n : local) peers.push_back("127.0.0.1:" + std::to_string(n->port));
  }
  for (uint32_t n = first; n < last; ++n) local[n - first]->Join(peers, n, floats, connections);

  auto once = [&](uint64_t step) {
    std::vector<std::future<std::optional<trainstream::Error>>> done;
    done.reserve(local.size());
    for (auto& n : local) done.push_back(n->Submit(step));
    for (auto& d : done) Await(d);
  };
  once(0);  // warm-up: connections
  for (uint32_t n = first; n < last; ++n) local[n - first]->Check(nodes, n, 1, true);
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = CpuSeconds();
  for (uint32_t r = 1; r <= reps; ++r) once(r);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / reps;
  const double cpu = (CpuSeconds() - cpu_start) / reps;
  // Each all-reduce multiplies the sums by M; past float's range there is nothing left to check.
  const double scale = std::pow(static_cast<double>(nodes), reps);
  if (scale * 6 * nodes < 1e37) {
    for (uint32_t n = first; n < last; ++n) local[n - first]->Check(nodes, n, scale, false);
  }

  const double bytes = static_cast<double>(floats) * sizeof(float);
  const double bus = 2.0 * (nodes - 1) / nodes * bytes / seconds / 1e9;
  const std::string who = node >= 0 ? "node " + std::to_string(node) + " (one process per node)" : "in one process";
  printf("trainstream ring all-reduce: %u nodes, %zu floats, %s: %.3f ms, bus bandwidth %.2f GB/s, %.3f ms cpu\n",
         nodes, floats, who.c_str(), seconds * 1e3, bus, cpu * 1e3);
  if (!json.empty() && first == 0) {
    FILE* f = fopen(json.c_str(), "w");
    if (f == nullptr) Die("cannot write " + json);
    fprintf(f,
            "{\"nodes\": %u, \"floats\": %zu, \"processes\": %u, \"seconds\": %.6f, \"bus_gbs\": %.4f, "
            "\"cpu_seconds\": %.6f}\n",
            nodes, floats, node >= 0 ? nodes : 1, seconds, bus, cpu);
    fclose(f);
  }
  // A node's server must outlive its neighbours' last sends: wait until every node is done.
  if (node >= 0) {
    WriteFile(ports_dir, first, "done", "done");
    AwaitFiles(ports_dir, nodes, "done", std::chrono::seconds(wait_s));
  }
  for (auto& n : local) n->ring.reset();
  for (auto& n : local) n->server->Shutdown(std::chrono::system_clock::now());
  return 0;
}
