#include "coordinator/cli/step_metrics.h"

#include <string>

#include "common/logging.h"

namespace hetpar::cli {

nlohmann::json StepMetricsLine(const v1::StepTiming& t) {
  nlohmann::json line = {{"step", t.step()},
                         {"loss", t.loss()},
                         {"grad_norm", t.grad_norm()},
                         {"tokens", t.tokens()},
                         {"images", t.images()},
                         {"step_time_s", t.duration_s()},
                         {"generation", t.generation()}};
  // A step whose gradient norm was not finite is committed without an update.
  if (t.skipped()) line["skipped"] = true;
  for (const auto& [module, m] : t.modules()) {
    nlohmann::json j = {{"compute_s", m.compute_s()},
                        {"bridge_wait_s", m.bridge_wait_s()},
                        {"collective_s", m.collective_s()},
                        {"idle_s", m.idle_s()},
                        {"data_s", m.data_s()},
                        {"grad_norm_wait_s", m.grad_norm_wait_s()},
                        {"optimizer_s", m.optimizer_s()},
                        {"bridge_messages", m.bridge_messages()},
                        {"bridge_bytes", m.bridge_bytes()},
                        {"bridge_transfer_s", m.bridge_transfer_s()}};
    if (module == "encoder") {
      j["peak_live_jobs"] = m.peak_live_jobs();
      j["peak_live_output_bytes"] = m.peak_live_output_bytes();
    }
    line[module] = std::move(j);
  }
  return line;
}

absl::Status StepMetricsWriter::Follow(const v1::StatusResponse& status) {
  // recent_steps is newest first.
  for (int i = status.recent_steps_size() - 1; i >= 0; --i) {
    const v1::StepTiming& t = status.recent_steps(i);
    if (!t.committed() || t.step() < written_) continue;
    if (t.step() > written_) {
      HETPAR_LOG(WARNING) << "metrics of steps " << written_ << " to " << t.step() - 1
                          << " were committed but not seen; their lines are missing";
    }
    if (absl::Status s = dir_->AppendMetrics(StepMetricsLine(t).dump()); !s.ok()) return s;
    written_ = t.step() + 1;
    if (on_step_) on_step_(t);
  }
  return absl::OkStatus();
}

}  // namespace hetpar::cli
