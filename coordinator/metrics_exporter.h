// The coordinator's Prometheus endpoint: GET /metrics answers with the run's state in the text
// exposition format (version 0.0.4), made from the same StatusResponse `hetpar status` shows.
// Workers need no scraping: their figures reach the coordinator in their step reports.
//
//   HETPAR_ASSIGN_OR_RETURN(auto exporter, coordinator::MetricsExporter::Start(
//       "0.0.0.0:9464", [&] { return server->Status(); }));
//
// The metrics (every one labelled with `run`; docs/observability.md lists them with units):
//   hetpar_run_state{state}, hetpar_generation, hetpar_workers{role,state},
//   hetpar_steps_committed_total, hetpar_steps_target, hetpar_steps_aborted_total,
//   hetpar_steps_skipped_total, hetpar_tokens_total, hetpar_images_total,
//   hetpar_step_time_seconds, hetpar_tokens_per_second, hetpar_images_per_second, hetpar_loss,
//   hetpar_grad_norm, hetpar_module_seconds{module,phase}, hetpar_module_bridge_bytes{module},
//   hetpar_module_tflops{module}, hetpar_module_tflops_per_rank{module},
//   hetpar_module_utilization{module} (with run.peak_tflops), hetpar_coordinator_uptime_seconds,
//   hetpar_coordinator_cpu_seconds_total.
// Per-step gauges describe the latest committed step.
#ifndef HETPAR_COORDINATOR_METRICS_EXPORTER_H_
#define HETPAR_COORDINATOR_METRICS_EXPORTER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "hetpar/v1/coordinator.pb.h"

namespace httplib {
class Server;
}

namespace hetpar::coordinator {

// The exposition text for one status.
std::string RenderPrometheus(const v1::StatusResponse& status);

class MetricsExporter {
 public:
  // Listens on `listen` (host:port; port 0 picks one) and serves /metrics from `status` on its
  // own thread. `status` must be callable from that thread until the exporter is destroyed.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(
      const std::string& listen, std::function<v1::StatusResponse()> status);
  MetricsExporter(const MetricsExporter&) = delete;
  MetricsExporter& operator=(const MetricsExporter&) = delete;
  ~MetricsExporter();  // stops serving

  int port() const { return port_; }
  // http://host:port/metrics
  std::string url() const;

 private:
  MetricsExporter() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::string host_;
  int port_ = 0;
};

}  // namespace hetpar::coordinator

#endif  // HETPAR_COORDINATOR_METRICS_EXPORTER_H_
