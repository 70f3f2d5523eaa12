#include "coordinator/metrics_exporter.h"

#include <httplib.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/control/security.h"
#include "common/plan/flops.h"
#include "coordinator/membership.h"
#include "coordinator/run_controller.h"

namespace hetpar::coordinator {
namespace {

// A label value in the exposition format: backslash, double quote and newline escaped.
std::string Escape(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') {
      out.push_back('\\');
      out.push_back(c);
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

std::string Number(double v) {
  if (v != v) return "NaN";
  if (v == std::numeric_limits<double>::infinity()) return "+Inf";
  if (v == -std::numeric_limits<double>::infinity()) return "-Inf";
  return absl::StrCat(v);
}

// Collects one metric family at a time: HELP and TYPE once, then its samples.
class Writer {
 public:
  explicit Writer(std::string run) : run_(std::move(run)) {}

  void Family(const std::string& name, const std::string& type, const std::string& help) {
    name_ = name;
    absl::StrAppend(&text_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  }
  void Sample(double value, const std::vector<std::pair<std::string, std::string>>& labels = {}) {
    absl::StrAppend(&text_, name_, "{run=\"", Escape(run_), "\"");
    for (const auto& [key, v] : labels) absl::StrAppend(&text_, ",", key, "=\"", Escape(v), "\"");
    absl::StrAppend(&text_, "} ", Number(value), "\n");
  }
  std::string Take() { return std::move(text_); }

 private:
  std::string run_;
  std::string name_;
  std::string text_;
};

}  // namespace

std::string RenderPrometheus(const v1::StatusResponse& s) {
  Writer w(s.run_name());
  w.Family("hetpar_run_state", "gauge", "1 for the run's current state, 0 for the others.");
  for (v1::RunState state : {v1::RUN_STATE_WAITING, v1::RUN_STATE_RUNNING, v1::RUN_STATE_STOPPING,
                             v1::RUN_STATE_DONE, v1::RUN_STATE_FAILED}) {
    w.Sample(s.state() == state ? 1 : 0, {{"state", RunStateName(state)}});
  }
  w.Family("hetpar_generation", "gauge", "Membership generation (bumped when workers are lost).");
  w.Sample(static_cast<double>(s.generation()));

  std::map<std::pair<std::string, std::string>, int> workers;
  for (v1::WorkerRole role :
       {v1::WORKER_ROLE_ENCODER, v1::WORKER_ROLE_LLM, v1::WORKER_ROLE_COLOCATED}) {
    for (const char* state : {"alive", "dead"}) workers[{RoleName(role), state}] = 0;
  }
  for (const v1::WorkerStatus& worker : s.workers()) {
    ++workers[{RoleName(worker.role()), worker.alive() ? "alive" : "dead"}];
  }
  w.Family("hetpar_workers", "gauge", "Registered workers by role and state.");
  for (const auto& [key, count] : workers) {
    w.Sample(count, {{"role", key.first}, {"state", key.second}});
  }
  w.Family("hetpar_workers_expected", "gauge", "Workers the layouts call for.");
  w.Sample(static_cast<double>(s.expected_workers()));

  // A counter starts at 0 with its process: a coordinator restarted on its run directory (or a
  // resumed run) counts from 0 again, which Prometheus reads as a reset, not as its resumed
  // step's worth of commits. Where the run stands is hetpar_step.
  w.Family("hetpar_steps_committed_total", "counter", "Steps this coordinator committed.");
  w.Sample(static_cast<double>(std::max<int64_t>(0, s.committed_steps() - s.first_step())));
  w.Family("hetpar_step", "gauge",
           "Committed steps of the run (a resumed run starts at its checkpoint's step).");
  w.Sample(static_cast<double>(s.committed_steps()));
  w.Family("hetpar_steps_target", "gauge", "Steps the run trains (run.steps).");
  w.Sample(static_cast<double>(s.total_steps()));
  w.Family("hetpar_steps_aborted_total", "counter", "Aborted step attempts.");
  w.Sample(static_cast<double>(s.aborted_steps()));
  w.Family("hetpar_steps_skipped_total", "counter",
           "Committed steps without an update (the gradient norm was not finite).");
  w.Sample(static_cast<double>(s.skipped_steps()));
  w.Family("hetpar_tokens_total", "counter",
           "Sequence positions (text and image tokens) of the committed steps' batches.");
  w.Sample(static_cast<double>(s.tokens_total()));
  w.Family("hetpar_images_total", "counter", "Images of the committed steps' batches.");
  w.Sample(static_cast<double>(s.images_total()));

  // recent_steps is newest first: the latest committed step.
  const v1::StepTiming* last = nullptr;
  for (const v1::StepTiming& t : s.recent_steps()) {
    if (t.committed()) {
      last = &t;
      break;
    }
  }
  if (last != nullptr) {
    const double seconds = last->duration_s();
    w.Family("hetpar_step_time_seconds", "gauge",
             "Duration of the latest committed step, plan sent to commit.");
    w.Sample(seconds);
    w.Family("hetpar_tokens_per_second", "gauge", "Positions per second in the latest step.");
    w.Sample(seconds > 0 ? static_cast<double>(last->tokens()) / seconds : 0);
    w.Family("hetpar_images_per_second", "gauge", "Images per second in the latest step.");
    w.Sample(seconds > 0 ? static_cast<double>(last->images()) / seconds : 0);
    w.Family("hetpar_loss", "gauge", "Global batch loss of the latest step.");
    w.Sample(last->loss());
    w.Family("hetpar_grad_norm", "gauge", "Global gradient norm (before clipping), latest step.");
    w.Sample(last->grad_norm());
    const std::map<std::string, v1::ModuleStepSplit> modules(last->modules().begin(),
                                                             last->modules().end());
    w.Family("hetpar_module_seconds", "gauge",
             "Latest step's time split of each module's slowest rank, by phase.");
    for (const auto& [module, m] : modules) {
      for (const auto& [phase, value] :
           std::vector<std::pair<std::string, double>>{{"compute", m.compute_s()},
                                                       {"bridge_wait", m.bridge_wait_s()},
                                                       {"collective", m.collective_s()},
                                                       {"idle", m.idle_s()},
                                                       {"data", m.data_s()},
                                                       {"grad_norm_wait", m.grad_norm_wait_s()},
                                                       {"optimizer", m.optimizer_s()}}) {
        w.Sample(value, {{"module", module}, {"phase", phase}});
      }
    }
    w.Family("hetpar_module_bridge_bytes", "gauge",
             "Bytes the data plane delivered to the module's ranks in the latest step.");
    for (const auto& [module, m] : modules) {
      w.Sample(static_cast<double>(m.bridge_bytes()), {{"module", module}});
    }
    std::map<std::string, plan::FlopRate> rates;
    for (const auto& [module, m] : modules) {
      rates[module] = plan::AchievedRate(m.model_flops(), seconds, m.ranks(), s.peak_tflops());
    }
    w.Family("hetpar_module_tflops", "gauge",
             "Model TFLOPS of each module in the latest step (model FLOPs / step time).");
    for (const auto& [module, r] : rates) w.Sample(r.tflops, {{"module", module}});
    w.Family("hetpar_module_tflops_per_rank", "gauge", "hetpar_module_tflops per rank.");
    for (const auto& [module, r] : rates) w.Sample(r.tflops_per_rank, {{"module", module}});
    if (s.peak_tflops() > 0) {
      w.Family("hetpar_module_utilization", "gauge",
               "hetpar_module_tflops_per_rank over run.peak_tflops (0..1).");
      for (const auto& [module, r] : rates) w.Sample(r.utilization, {{"module", module}});
    }
  }
  w.Family("hetpar_coordinator_uptime_seconds", "gauge", "Seconds since the coordinator started.");
  w.Sample(s.uptime_s());
  w.Family("hetpar_coordinator_cpu_seconds_total", "counter",
           "CPU time of the coordinator process (user and system).");
  w.Sample(s.cpu_seconds());
  return w.Take();
}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(
    const std::string& listen, std::function<v1::StatusResponse()> status) {
  const int port = PortOf(listen);
  const size_t colon = listen.rfind(':');
  if (port < 0 || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", listen, "' is not host:port"));
  }
  std::unique_ptr<MetricsExporter> exporter(new MetricsExporter());
  exporter->host_ = listen.substr(0, colon);
  if (exporter->host_.size() > 2 && exporter->host_.front() == '[') {
    exporter->host_ = exporter->host_.substr(1, exporter->host_.size() - 2);
  }
  exporter->server_ = std::make_unique<httplib::Server>();
  exporter->server_->Get("/metrics", [status](const httplib::Request&, httplib::Response& res) {
    res.set_content(RenderPrometheus(status()), "text/plain; version=0.0.4; charset=utf-8");
  });
  exporter->server_->Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("hetpar coordinator: metrics at /metrics\n", "text/plain");
  });
  if (port == 0) {
    exporter->port_ = exporter->server_->bind_to_any_port(exporter->host_);
  } else if (exporter->server_->bind_to_port(exporter->host_, port)) {
    exporter->port_ = port;
  }
  if (exporter->port_ <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for metrics on ", listen, " (in use, or not a local address)"));
  }
  httplib::Server* server = exporter->server_.get();
  exporter->thread_ = std::thread([server] { server->listen_after_bind(); });
  return exporter;
}

MetricsExporter::~MetricsExporter() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

std::string MetricsExporter::url() const {
  return absl::StrCat("http://", host_.find(':') != std::string::npos ? "[" + host_ + "]" : host_,
                      ":", port_, "/metrics");
}

}  // namespace hetpar::coordinator
