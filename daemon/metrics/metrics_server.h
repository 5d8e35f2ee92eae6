// The Prometheus endpoint (trainstreamd --metrics-listen): GET /metrics answers with what
// MetricsCollector reads, in Prometheus' text format (daemon/metrics/metrics_http.h for the HTTP).
//
// It listens on TCP ("host:port"; port 0 picks one, a wildcard host every address) or on a Unix
// socket ("unix:/path", created 0600: only the daemon's user may connect, e.g. a local collector
// running as root). With a token (metrics_token_file) every scrape must carry it as a bearer token.
// One thread serves it: at most kMaxClients connections at once (a newer one closes the oldest), each
// for at most kClientTime, one request each; so a client that connects and says nothing, or reads
// nothing, holds a descriptor for a bounded time and cannot keep a scraper out.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/control/job_registry.h"
#include "daemon/engine/worker_pool.h"
#include "daemon/metrics/metrics_collector.h"
#include "daemon/metrics/metrics_http.h"
#include "daemon/tcp_listen.h"

namespace trainstream::daemon {

class MetricsServer {
 public:
  static constexpr size_t kMaxClients = 16;
  static constexpr std::chrono::seconds kClientTime{10};

  // Listens on `listen`; kUnavailable if it cannot, kInvalidArgument for a malformed address.
  // `token` empty: no authorization asked.
  MetricsServer(const std::string& listen, MetricsLabels labels, std::string token, JobRegistry& registry,
                const WorkerPool& pool);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  [[nodiscard]] int port() const { return port_; }  // 0 on a Unix socket

 private:
  struct Client {
    int fd;
    std::chrono::steady_clock::time_point until;
    RequestHead request;
    std::string response;
    size_t sent = 0;
    bool answered = false;  // the response is being sent, or was (then the rest of the request is read away)
  };
  void Run();
  void Accept(int listener);
  void Read(Client& client);
  void Write(Client& client);
  static void Close(Client& client);

  MetricsCollector collector_;
  const std::string token_;
  std::vector<int> listeners_;
  std::string unix_path_;  // removed at the end
  int port_ = 0;
  WakeFd wake_;
  std::deque<Client> clients_;  // oldest first; fd -1 once closed
  std::chrono::steady_clock::time_point accept_again_;
  std::thread thread_;
};

}  // namespace trainstream::daemon
