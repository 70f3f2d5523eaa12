// A worker process that speaks the whole session protocol without training anything, for the
// coordinator's multi-process tests: it registers, waits for the run to start, and for every
// step decodes its plan, sends its grad-norm partials (0.25 x (world rank + 1) per module rank of
// DP replica 0), and after the GradNorm reports success with loss_sum = --loss-per-token x the
// loss tokens of its microbatches (LLM ranks that count the loss). It prints one line per event
// and exits 0 after StopRun, 1 when the session fails. The run token comes from HETPAR_TOKEN.
#include <cstdlib>
#include <iostream>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/control/client.h"
#include "common/control/plan_codec.h"

namespace {

using namespace hetpar;  // NOLINT: a test program

int Run(const std::string& address, const std::string& role_name, const std::string& host,
        double loss_per_token, int64_t llm_pp, int step_delay_ms) {
  const char* token = std::getenv("HETPAR_TOKEN");
  coordinator::ClientOptions options;
  options.address = address;
  options.token = token == nullptr ? "" : token;
  auto connection = coordinator::CoordinatorConnection::Create(options);
  if (!connection.ok()) {
    std::cout << "error " << connection.status() << std::endl;
    return 1;
  }
  coordinator::WorkerSession::Options session_options;
  session_options.registration.set_role(role_name == "encoder" ? v1::WORKER_ROLE_ENCODER
                                        : role_name == "llm"   ? v1::WORKER_ROLE_LLM
                                                               : v1::WORKER_ROLE_COLOCATED);
  session_options.registration.set_host(host);
  session_options.registration.set_data_address(host + ":9999");
  auto session = coordinator::WorkerSession::Start(*connection, session_options);
  if (!session.ok()) {
    std::cout << "error " << session.status() << std::endl;
    return 1;
  }
  coordinator::WorkerSession& s = **session;
  std::cout << "registered " << s.worker_id() << " world_rank " << s.assignment().world_rank()
            << std::endl;
  const v1::Assignment assignment = s.assignment();  // ranks and world rank stay the same
  int64_t step_loss_tokens = 0;  // loss tokens of this rank's microbatches in the current step
  while (true) {
    auto message = s.Next(absl::Seconds(120));
    if (!message.ok()) {
      std::cout << "session ended: " << message.status() << std::endl;
      return 1;
    }
    switch (message->kind_case()) {
      case v1::CoordinatorMessage::kAssignment:
        std::cout << "assignment generation " << message->assignment().generation() << " peers "
                  << message->assignment().peers_size() << std::endl;
        break;
      case v1::CoordinatorMessage::kStepPlan: {
        const v1::StepPlan& step = message->step_plan();
        auto rank_plan = coordinator::RankStepPlanFromProto(step.rank_plan());
        if (!rank_plan.ok()) {
          std::cout << "bad plan: " << rank_plan.status() << std::endl;
          return 1;
        }
        std::cout << "plan step " << step.step() << " rank " << rank_plan->rank << " samples "
                  << rank_plan->samples.size() << std::endl;
        step_loss_tokens = 0;
        for (const auto& microbatch : rank_plan->microbatches) {
          step_loss_tokens += microbatch.loss_tokens;
        }
        v1::Progress progress;
        progress.set_step(step.step());
        progress.set_phase("backward");
        (void)s.SendProgress(progress);
        for (const auto& rank : assignment.ranks()) {
          // The first replica taking part sends the partials (StepPlan.encoder_replicas).
          const int64_t first =
              rank.module() == v1::MODULE_ENCODER && step.encoder_replicas_size() > 0
                  ? step.encoder_replicas(0)
                  : 0;
          if (rank.dp() != first) continue;
          v1::GradNormPartial partial;
          partial.set_step(step.step());
          partial.set_generation(step.generation());
          partial.set_module(rank.module());
          partial.set_sum_squares(0.25 * static_cast<double>(assignment.world_rank() + 1));
          (void)s.SendGradNormPartial(partial);
        }
        break;
      }
      case v1::CoordinatorMessage::kGradNorm: {
        const v1::GradNorm& norm = message->grad_norm();
        std::cout << "grad_norm step " << norm.step() << " norm " << norm.norm() << std::endl;
        // The time a real worker would spend in its optimizer step.
        absl::SleepFor(absl::Milliseconds(step_delay_ms));
        v1::StepReport report;
        report.set_step(norm.step());
        report.set_generation(norm.generation());
        report.set_ok(true);
        // A time split the coordinator combines per module: compute 1 ms x (world rank + 1),
        // 100 bridge bytes per rank.
        for (const auto& rank : assignment.ranks()) {
          const std::string module = rank.module() == v1::MODULE_LLM ? "llm." : "encoder.";
          (*report.mutable_timings_s())[module + "compute_s"] =
              0.001 * static_cast<double>(assignment.world_rank() + 1);
          (*report.mutable_timings_s())[module + "bridge_bytes"] = 100;
        }
        for (const auto& rank : assignment.ranks()) {
          if (rank.module() != v1::MODULE_LLM || rank.tp() != 0 || rank.pp() != llm_pp - 1) {
            continue;
          }
          report.set_loss_sum(loss_per_token * static_cast<double>(step_loss_tokens));
          report.set_loss_tokens(step_loss_tokens);
        }
        (void)s.SendReport(report);
        break;
      }
      case v1::CoordinatorMessage::kCommit:
        std::cout << "commit step " << message->commit().step() << " loss "
                  << message->commit().loss() << std::endl;
        break;
      case v1::CoordinatorMessage::kAbort: {
        std::cout << "abort step " << message->abort().step() << ": " << message->abort().reason()
                  << std::endl;
        // As a real worker's step driver does: the next attempt waits for it.
        v1::Progress ended;
        ended.set_step(message->abort().step());
        ended.set_generation(message->abort().generation());
        ended.set_ended(true);
        (void)s.SendProgress(ended);
        break;
      }
      case v1::CoordinatorMessage::kMembershipChange:
        std::cout << "membership_change generation " << message->membership_change().generation()
                  << " lost " << message->membership_change().lost(0).worker_id() << std::endl;
        break;
      case v1::CoordinatorMessage::kStop:
        std::cout << "stop: " << message->stop().reason() << std::endl;
        {
          absl::Status closed = s.Close(absl::Seconds(10));
          std::cout << "closed: " << closed << std::endl;
        }
        return 0;
      case v1::CoordinatorMessage::kHeartbeatAck:
      case v1::CoordinatorMessage::kBatch:  // unpacked by WorkerSession
      case v1::CoordinatorMessage::KIND_NOT_SET:
        break;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"coordinator test worker"};
  std::string address;
  std::string role = "encoder";
  std::string host = "sim";
  double loss_per_token = 1.5;
  int64_t llm_pp = 1;
  int step_delay_ms = 0;
  app.add_option("--coordinator", address)->required();
  app.add_option("--role", role);
  app.add_option("--host", host);
  app.add_option("--loss-per-token", loss_per_token);
  app.add_option("--llm-pp", llm_pp);
  app.add_option("--step-delay-ms", step_delay_ms);
  CLI11_PARSE(app, argc, argv);
  return Run(address, role, host, loss_per_token, llm_pp, step_delay_ms);
}
