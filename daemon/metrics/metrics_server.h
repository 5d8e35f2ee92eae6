// The Prometheus endpoint (trainstreamd --metrics-listen HOST:PORT): GET /metrics answers with the
// daemon's jobs and counters in Prometheus' text format, read when scraped (prometheus-cpp's Exposer on
// civetweb threads). What each metric means: docs/operations.md, "Metrics".
#pragma once

#include <memory>
#include <string>

#include "daemon/control/job_registry.h"
#include "daemon/engine/worker_pool.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace trainstream::daemon {

class DaemonCollector;

class MetricsServer {
 public:
  // Listens on `listen` ("host:port"; port 0 picks one); kUnavailable if it cannot.
  MetricsServer(const std::string& listen, JobRegistry& registry, const WorkerPool& pool);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  [[nodiscard]] int port() const;

 private:
  std::shared_ptr<DaemonCollector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace trainstream::daemon
