// ts_bench_allreduce: the daemons' ring all-reduce (daemon/peer_allreduce.h) between M peer planes
// on loopback, in one process: M gRPC Peer servers, M PeerAllReduce instances, one reduction of S
// floats at a time on all of them. Prints seconds per all-reduce and the bus bandwidth
// 2(M-1)/M * bytes / time, the figure NCCL and gloo benchmarks report. run.py adds gloo.
//
//   ts_bench_allreduce --nodes 2 --floats 8388608 --reps 10 [--json out.json]
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <future>
#include <string>
#include <vector>

#include "daemon/peer_allreduce.h"
#include "daemon/peer_service.h"

using namespace trainstream::daemon;  // NOLINT(google-build-using-namespace): a benchmark's main

namespace {
// CPU time of the whole process (all nodes, gRPC's threads included): on a loaded 2-core machine a
// steadier figure than wall time.
double CpuSeconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}
}  // namespace

int main(int argc, char** argv) {
  uint32_t nodes = 2, reps = 10;
  size_t floats = size_t{1} << 23;
  std::string json;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i], value = argv[i + 1];
    if (arg == "--nodes") nodes = static_cast<uint32_t>(std::stoul(value));
    if (arg == "--floats") floats = static_cast<size_t>(std::stod(value));
    if (arg == "--reps") reps = static_cast<uint32_t>(std::stoul(value));
    if (arg == "--json") json = value;
  }
  KeepPeerBuffersMapped();  // as trainstreamd does
  const std::string secret = "benchmark-secret-0123456789";
  std::vector<PeerMailbox> mailboxes(nodes);
  std::vector<std::unique_ptr<PeerService>> services;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::string> peers;
  for (uint32_t n = 0; n < nodes; ++n) {
    services.push_back(std::make_unique<PeerService>(mailboxes[n], secret));
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(-1);
    builder.RegisterService(services.back().get());
    servers.push_back(builder.BuildAndStart());
    peers.push_back("127.0.0.1:" + std::to_string(port));
  }
  std::vector<std::unique_ptr<PeerAllReduce>> rings;
  std::vector<std::vector<float>> data(nodes, std::vector<float>(floats));
  for (uint32_t n = 0; n < nodes; ++n) {
    rings.push_back(std::make_unique<PeerAllReduce>(
        "bench", peers, n, 1, PeerConfig{&mailboxes[n], secret, std::chrono::milliseconds(60000)}));
    for (size_t i = 0; i < floats; ++i) data[n][i] = static_cast<float>((i + n) % 7);
  }
  auto once = [&](uint64_t step) {
    std::vector<std::future<std::optional<std::string>>> done;
    for (uint32_t n = 0; n < nodes; ++n) {
      auto promise = std::make_shared<std::promise<std::optional<std::string>>>();
      done.push_back(promise->get_future());
      rings[n]->Submit(step, 0, data[n].data(), floats, [promise](auto error) { promise->set_value(error); });
    }
    for (auto& d : done) {
      if (auto error = d.get()) {
        fprintf(stderr, "all-reduce failed: %s\n", error->c_str());
        std::exit(1);
      }
    }
  };
  once(0);  // warm-up: connections
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = CpuSeconds();
  for (uint32_t r = 1; r <= reps; ++r) once(r);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / reps;
  const double cpu = (CpuSeconds() - cpu_start) / reps;
  const double bytes = static_cast<double>(floats) * sizeof(float);
  const double bus = 2.0 * (nodes - 1) / nodes * bytes / seconds / 1e9;
  printf("trainstream ring all-reduce: %u nodes, %zu floats: %.3f ms, bus bandwidth %.2f GB/s, %.3f ms cpu\n", nodes,
         floats, seconds * 1e3, bus, cpu * 1e3);
  if (!json.empty()) {
    FILE* f = fopen(json.c_str(), "w");
    fprintf(f, "{\"nodes\": %u, \"floats\": %zu, \"seconds\": %.6f, \"bus_gbs\": %.4f, \"cpu_seconds\": %.6f}\n", nodes,
            floats, seconds, bus, cpu);
    fclose(f);
  }
  for (auto& s : servers) s->Shutdown();
  return 0;
}
