#include "llm_trainer/worker.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/nn/communicator.h"
#include "common/nn/export.h"
#include "common/rendezvous/coordinator_store.h"
#include "common/status.h"
#include "common/train/batch_source.h"
#include "common/train/boundary.h"
#include "common/train/optimizer.h"
#include "common/transport/ucx/ucx_transport.h"
#include "coordinator/client.h"
#include "coordinator/plan_codec.h"
#include "encoder_service/encoder.h"
#include "encoder_service/encoder_runtime.h"
#include "llm_trainer/language_model.h"
#include "llm_trainer/llm_runtime.h"
#include "nlohmann/json.hpp"

namespace hetpar::worker {
namespace {

// The state of one module on this worker: its rank, groups, model and optimizer.
struct ModuleState {
  bool encoder_module = true;
  std::string name;  // "encoder" or "llm"
  v1::RankCoordinates coords;
  std::unique_ptr<nn::Communicator> tp;
  std::unique_ptr<nn::Communicator> dp;
  std::unique_ptr<encoder::VisionEncoder> encoder;
  std::unique_ptr<llm::LanguageModel> llm;
  std::unique_ptr<train::ModuleOptimizer> optimizer;
  nn::ParameterSet* params = nullptr;
};

absl::StatusOr<std::unique_ptr<nn::Communicator>> Group(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int64_t rank,
    int64_t size, absl::Duration timeout, const std::string& host) {
  if (size == 1) return nn::Communicator::CreateSingle();
  nn::CommunicatorOptions options;
  options.prefix = prefix;
  options.rank = static_cast<int>(rank);
  options.size = static_cast<int>(size);
  options.timeout = timeout;
  options.hostname = host;
  return nn::Communicator::Create(store, options);
}

// Waits for the next message that is not a heartbeat ack or an assignment.
absl::StatusOr<v1::CoordinatorMessage> NextMessage(coordinator::WorkerSession& session,
                                                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("no message from the coordinator within ", absl::FormatDuration(timeout)));
    }
    HETPAR_ASSIGN_OR_RETURN(v1::CoordinatorMessage message, session.Next(left));
    if (message.has_heartbeat_ack() || message.has_assignment()) continue;
    return message;
  }
}

absl::Status WriteOwnedParams(const std::string& out_dir, int64_t world_rank,
                              const ModuleState& m) {
  const bool encoder = m.encoder_module;
  const int64_t dp_rank = m.coords.dp();
  const nn::ParameterSet& params = *m.params;
  if (out_dir.empty()) return absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(out_dir + "/workers", ec);
  const train::OwnedSums sums = train::OwnedParamSums(params);
  nlohmann::json j = {{"world_rank", world_rank},
                      {"module", encoder ? "encoder" : "llm"},
                      {"dp", dp_rank},
                      {"sum", sums.sum},
                      {"square_sum", sums.square_sum}};
  const std::string path =
      absl::StrCat(out_dir, "/workers/rank-", world_rank, "-", m.name, ".json");
  std::ofstream out(path);
  out << j.dump() << "\n";
  if (!out) return absl::DataLossError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

// Appends this rank's time split of one step to <out>/workers/rank-<r>.steps.jsonl: the per-rank
// detail behind the per-module split that the coordinator combines from the step reports (and
// `hetpar run` writes to metrics.jsonl).
void AppendStepTimings(const std::string& out_dir, int64_t world_rank, int64_t step,
                       const std::string& module, const std::map<std::string, double>& timings) {
  if (out_dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(out_dir + "/workers", ec);
  nlohmann::json line = {{"step", step}, {"module", module}};
  for (const auto& [key, value] : timings) line[key] = value;
  std::ofstream out(absl::StrCat(out_dir, "/workers/rank-", world_rank, ".steps.jsonl"),
                    std::ios::app);
  out << line.dump() << "\n";
}

}  // namespace

absl::Status RunWorker(const WorkerOptions& options) {
  const std::string role_name = options.role == Role::kEncoder ? "encoder"
                                : options.role == Role::kLlm   ? "llm"
                                                               : "colocated";

  // 1. Data plane, then registration.
  transport::ucx::UcxTransport::Options transport_options;
  transport_options.name = absl::StrCat(role_name, " on ", options.host);
  HETPAR_ASSIGN_OR_RETURN(auto transport, transport::ucx::UcxTransport::Create(transport_options));

  coordinator::ClientOptions client;
  client.address = options.coordinator;
  client.token = options.token;
  HETPAR_ASSIGN_OR_RETURN(auto connection, coordinator::CoordinatorConnection::Create(client));
  HETPAR_RETURN_IF_ERROR(connection->WaitForConnected(absl::Seconds(30)));
  coordinator::WorkerSession::Options session_options;
  v1::RegisterRequest& request = session_options.registration;
  request.set_role(options.role == Role::kEncoder ? v1::WORKER_ROLE_ENCODER
                   : options.role == Role::kLlm   ? v1::WORKER_ROLE_LLM
                                                  : v1::WORKER_ROLE_COLOCATED);
  request.set_host(options.host);
  request.set_data_address(transport->LocalAddress());
  request.add_capabilities("cpu");
  request.add_capabilities("ucx");
  if (options.requested_rank >= 0) request.set_requested_rank(options.requested_rank);
  HETPAR_ASSIGN_OR_RETURN(auto session,
                          coordinator::WorkerSession::Start(connection, session_options));
  const v1::RunSpec spec = session->registration().spec();

  // 2. Everyone is here: peers, groups, models.
  HETPAR_ASSIGN_OR_RETURN(v1::Assignment assignment, session->WaitForRunStart(options.timeout));
  const int expected_ranks = options.role == Role::kColocated ? 2 : 1;
  if (assignment.ranks_size() != expected_ranks) {
    return absl::FailedPreconditionError(
        absl::StrCat("the coordinator assigned ", assignment.ranks_size(), " module ranks to this ",
                     role_name, " worker; expected ", expected_ranks));
  }
  const int64_t world_rank = assignment.world_rank();
  std::vector<ModuleState> modules;
  std::string tag;
  for (const v1::RankCoordinates& coords : assignment.ranks()) {
    ModuleState m;
    m.encoder_module = coords.module() == v1::MODULE_ENCODER;
    m.name = m.encoder_module ? "encoder" : "llm";
    m.coords = coords;
    modules.push_back(std::move(m));
    absl::StrAppend(&tag, tag.empty() ? "" : " ", m.encoder_module ? "enc" : "llm", " dp",
                    coords.dp(), " tp", coords.tp());
  }
  // Encoder first: its groups are formed, and its phases run, before the LLM's.
  std::sort(modules.begin(), modules.end(), [](const ModuleState& a, const ModuleState& b) {
    return a.encoder_module > b.encoder_module;
  });
  SetLogTag(absl::StrCat("r", world_rank, " ", tag));
  HETPAR_LOG(INFO) << "registered as world rank " << world_rank << ", generation "
                   << assignment.generation() << ", " << assignment.peers_size()
                   << " boundary peers";

  std::map<int64_t, transport::PeerId> peers;
  for (const v1::PeerInfo& peer : assignment.peers()) {
    HETPAR_ASSIGN_OR_RETURN(transport::PeerId id,
                            transport->Connect(peer.data_address(), absl::Now() + options.timeout));
    peers[peer.world_rank()] = id;
  }
  train::BoundaryCommunicator boundary(transport.get(), peers, options.timeout);

  HETPAR_ASSIGN_OR_RETURN(auto store, rendezvous::OpenCoordinatorStore(
                                          connection, assignment.generation(), options.timeout));
  ModuleState* enc = nullptr;
  ModuleState* lm = nullptr;
  for (ModuleState& m : modules) {
    const auto& layout = m.encoder_module ? spec.encoder().layout() : spec.llm().layout();
    HETPAR_ASSIGN_OR_RETURN(m.tp, Group(store, absl::StrCat(m.name, "/dp", m.coords.dp(), "/tp"),
                                        m.coords.tp(), layout.tp(), options.timeout, options.host));
    HETPAR_ASSIGN_OR_RETURN(m.dp, Group(store, absl::StrCat(m.name, "/tp", m.coords.tp(), "/dp"),
                                        m.coords.dp(), layout.dp(), options.timeout, options.host));
    if (m.encoder_module) {
      HETPAR_ASSIGN_OR_RETURN(encoder::EncoderOptions model_options,
                              encoder::EncoderOptionsFromSpec(spec));
      HETPAR_ASSIGN_OR_RETURN(
          m.encoder, encoder::VisionEncoder::Create(spec.encoder().model(), model_options, *m.tp));
      m.params = &m.encoder->parameters();
      enc = &m;
    } else {
      HETPAR_ASSIGN_OR_RETURN(llm::LlmOptions model_options, llm::LlmOptionsFromSpec(spec));
      HETPAR_ASSIGN_OR_RETURN(m.llm,
                              llm::LanguageModel::Create(spec.llm().model(), model_options, *m.tp));
      m.params = &m.llm->parameters();
      lm = &m;
    }
    HETPAR_ASSIGN_OR_RETURN(m.optimizer, train::ModuleOptimizer::Create(
                                             m.params, m.encoder_module ? spec.encoder().optimizer()
                                                                        : spec.llm().optimizer()));
  }
  const bool colocated = enc != nullptr && lm != nullptr;

  // The data set is opened once the coordinator has planned the first step (it generates a
  // synthetic data set before that, so workers never race to write it).
  std::unique_ptr<train::BatchSource> batches;
  std::optional<encoder::EncoderRuntime> encoder_runtime;
  std::optional<llm::LlmRuntime> llm_runtime;

  // 3. Steps until the coordinator says stop.
  while (true) {
    HETPAR_ASSIGN_OR_RETURN(v1::CoordinatorMessage message, NextMessage(*session, options.timeout));
    if (message.has_stop()) {
      HETPAR_LOG(INFO) << "stop: " << message.stop().reason();
      break;
    }
    if (message.has_abort()) {
      // Parameters change only at commit: drop the step's gradients and wait for what comes
      // next (the step again, a stop, or a membership change).
      HETPAR_LOG(WARNING) << "step " << message.abort().step()
                          << " aborted by the coordinator: " << message.abort().reason();
      for (ModuleState& m : modules) m.params->ZeroGrad();
      continue;
    }
    if (message.has_membership_change()) {
      std::string lost;
      for (const auto& peer : message.membership_change().lost()) {
        absl::StrAppend(&lost, lost.empty() ? "" : ", ", peer.worker_id(), " (", peer.host(), ")");
      }
      return absl::UnavailableError(
          absl::StrCat("the run lost ", lost, ": ", message.membership_change().reason()));
    }
    if (!message.has_step_plan()) continue;
    const v1::StepPlan& step_message = message.step_plan();
    HETPAR_ASSIGN_OR_RETURN(plan::RankStepPlan rank_plan,
                            coordinator::RankStepPlanFromProto(step_message.rank_plan()));
    if (batches == nullptr) {
      HETPAR_ASSIGN_OR_RETURN(batches, train::BatchSource::Create(spec));
      if (enc != nullptr) {
        encoder_runtime.emplace(
            enc->encoder.get(), enc->tp.get(), enc->dp.get(), batches.get(), &boundary,
            encoder::EncoderRuntimeOptions{spec.run().max_inflight(), options.timeout});
      }
      if (lm != nullptr) {
        llm_runtime.emplace(lm->llm.get(), lm->tp.get(), lm->dp.get(), batches.get(), &boundary,
                            llm::LlmRuntimeOptions{options.timeout, colocated,
                                                   colocated ? 0 : spec.run().max_inflight()});
      }
    }
    const int64_t step = step_message.step();
    v1::StepReport report;
    report.set_step(step);
    report.set_generation(step_message.generation());
    const absl::Time start = absl::Now();
    boundary.BeginStep();
    std::map<std::string, double> encoder_timings, llm_timings;
    // What the bridge delivered to this rank for `module`: image rows to the LLM, their
    // gradients to the encoder.
    auto add_bridge = [&](std::map<std::string, double>& timings, plan::Direction direction) {
      const train::BridgeStats bridge = boundary.Stats(direction);
      timings["bridge_messages"] = static_cast<double>(bridge.messages);
      timings["bridge_bytes"] = static_cast<double>(bridge.bytes);
      timings["bridge_transfer_s"] = bridge.transfer_s;
      timings["bridge_transfer_sum_s"] = bridge.sum_transfer_s;
    };
    auto run_llm = [&]() -> absl::Status {
      HETPAR_ASSIGN_OR_RETURN(llm::LlmStepStats stats, llm_runtime->RunStep(rank_plan));
      if (lm->coords.tp() == 0) {
        report.set_loss_sum(stats.loss_sum);
        report.set_loss_tokens(stats.loss_tokens);
      }
      llm_timings = {{"compute_s", stats.compute_s},
                     {"bridge_wait_s", stats.bridge_wait_s},
                     {"collective_s", stats.collective_s},
                     {"data_s", stats.data_s},
                     {"tokens", static_cast<double>(stats.tokens)},
                     {"images", static_cast<double>(stats.images)},
                     {"bytes_received", static_cast<double>(stats.bytes_received)}};
      return absl::OkStatus();
    };
    absl::Status status;
    if (enc != nullptr) {
      auto stats = colocated ? encoder_runtime->RunStepAround(rank_plan, run_llm)
                             : encoder_runtime->RunStep(rank_plan);
      status = stats.status();
      if (stats.ok()) {
        encoder_timings = {
            {"compute_s", stats->compute_s},
            {"bridge_wait_s", stats->bridge_wait_s},
            {"collective_s", stats->collective_s},
            {"data_s", stats->data_s},
            {"images", static_cast<double>(stats->images)},
            {"bytes_sent", static_cast<double>(stats->bytes_sent)},
            {"peak_live_jobs", static_cast<double>(stats->peak_live_jobs)},
            {"peak_live_output_bytes", static_cast<double>(stats->peak_live_output_bytes)}};
      }
      if (status.ok() && colocated) status = llm_runtime->WaitForSends();
    } else {
      status = run_llm();
    }
    if (!status.ok()) {
      report.set_ok(false);
      report.set_error(std::string(status.message()));
      (void)session->SendReport(report);
      return Annotate(status, absl::StrCat("step ", step));
    }
    if (!encoder_timings.empty()) add_bridge(encoder_timings, plan::Direction::kBackward);
    if (!llm_timings.empty()) add_bridge(llm_timings, plan::Direction::kForward);
    for (const ModuleState& m : modules) {
      if (m.coords.dp() != 0) continue;
      v1::GradNormPartial partial;
      partial.set_step(step);
      partial.set_generation(step_message.generation());
      partial.set_module(m.encoder_module ? v1::MODULE_ENCODER : v1::MODULE_LLM);
      partial.set_sum_squares(train::OwnedGradSums(*m.params).square_sum);
      HETPAR_RETURN_IF_ERROR(session->SendGradNormPartial(partial));
    }
    const absl::Time norm_asked = absl::Now();
    HETPAR_ASSIGN_OR_RETURN(v1::CoordinatorMessage norm, NextMessage(*session, options.timeout));
    const double grad_norm_wait_s = absl::ToDoubleSeconds(absl::Now() - norm_asked);
    if (norm.has_abort()) {
      HETPAR_LOG(WARNING) << "step " << step
                          << " aborted by the coordinator: " << norm.abort().reason();
      for (ModuleState& m : modules) m.params->ZeroGrad();
      continue;
    }
    if (norm.has_stop()) {
      HETPAR_LOG(INFO) << "stop: " << norm.stop().reason();
      break;
    }
    if (!norm.has_grad_norm()) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step,
                       ": expected the global gradient norm from the coordinator, got another "
                       "message"));
    }
    const absl::Time optimizer_start = absl::Now();
    for (ModuleState& m : modules) {
      HETPAR_RETURN_IF_ERROR(m.optimizer->Step(step, norm.grad_norm().clip_coefficient()));
    }
    const double optimizer_s = absl::ToDoubleSeconds(absl::Now() - optimizer_start);
    report.set_ok(true);
    report.set_compute_s(absl::ToDoubleSeconds(absl::Now() - start));
    for (auto* timings : {&encoder_timings, &llm_timings}) {
      if (timings->empty()) continue;
      const std::string prefix = timings == &encoder_timings ? "encoder." : "llm.";
      (*timings)["step_s"] = report.compute_s();
      (*timings)["idle_s"] =
          std::max(0.0, report.compute_s() - (*timings)["compute_s"] - (*timings)["bridge_wait_s"] -
                            (*timings)["collective_s"]);
      (*timings)["grad_norm_wait_s"] = grad_norm_wait_s;
      (*timings)["optimizer_s"] = optimizer_s;
      for (const auto& [key, value] : *timings) (*report.mutable_timings_s())[prefix + key] = value;
      AppendStepTimings(options.out_dir, world_rank, step,
                        timings == &encoder_timings ? "encoder" : "llm", *timings);
    }
    HETPAR_RETURN_IF_ERROR(session->SendReport(report));
  }

  // 4. Final parameters, then a clean goodbye. Replica 0 of each module saves the full model.
  for (ModuleState& m : modules) {
    HETPAR_RETURN_IF_ERROR(WriteOwnedParams(options.out_dir, world_rank, m));
    if (!options.out_dir.empty() && m.coords.dp() == 0) {
      HETPAR_RETURN_IF_ERROR(nn::SaveFullParameters(
          *m.params, *m.tp, absl::StrCat(options.out_dir, "/model/", m.name, ".hpar")));
    }
  }
  return session->Close(absl::Seconds(10));
}

}  // namespace hetpar::worker
