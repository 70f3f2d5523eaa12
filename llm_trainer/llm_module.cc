#include "llm_trainer/llm_module.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"
#include "common/nn/export.h"
#include "common/plan/layout.h"
#include "common/plan/step_plan.h"
#include "common/status.h"
#include "common/worker/outputs.h"

namespace hetpar::llm {

absl::StatusOr<std::unique_ptr<LlmModule>> LlmModule::Create(worker::WorkerContext& context,
                                                             bool colocated) {
  HETPAR_ASSIGN_OR_RETURN(worker::ModuleState state,
                          worker::ModuleState::Form(context, v1::MODULE_LLM));
  std::unique_ptr<LlmModule> m(new LlmModule(&context, colocated, std::move(state)));
  const v1::RunSpec& spec = context.spec();
  HETPAR_ASSIGN_OR_RETURN(LlmOptions model_options, LlmOptionsFromSpec(spec));
  model_options.device = context.execution().device();
  const v1::RankCoordinates& coords = m->state_.coords();
  model_options.pp_stage = coords.pp();
  model_options.pp_stages = std::max<int64_t>(1, spec.llm().layout().pp());
  if (model_options.pp_stages > 1) {
    // The neighbouring stages of this rank's pipeline, over the data plane.
    HETPAR_ASSIGN_OR_RETURN(plan::Placement placement, plan::PlacementFromRunSpec(spec));
    plan::RankCoords neighbour{coords.dp(), coords.tp(), coords.cp(), coords.pp()};
    if (coords.pp() > 0) {
      neighbour.pp = coords.pp() - 1;
      m->pipeline_.previous_rank = placement.llm.RankOf(neighbour);
    }
    if (coords.pp() + 1 < model_options.pp_stages) {
      neighbour.pp = coords.pp() + 1;
      m->pipeline_.next_rank = placement.llm.RankOf(neighbour);
    }
    m->stage_link_ = std::make_unique<train::StageLink>(&context.transport(), context.peers(),
                                                        context.peer_timeout());
    m->stage_link_->SetInterrupt(&context.interrupt());
    m->pipeline_.link = m->stage_link_.get();
    const auto [begin, end] = plan::PipelineStageLayers(spec.llm().model().layers(),
                                                        model_options.pp_stages, coords.pp());
    HETPAR_LOG(INFO) << "llm model: pipeline stage " << coords.pp() << " of "
                     << model_options.pp_stages << " (layers [" << begin << ", " << end
                     << "), 1F1B over the step's microbatches)";
  }
  HETPAR_ASSIGN_OR_RETURN(m->model_,
                          LanguageModel::Create(spec.llm().model(), model_options, m->state_.tp()));
  HETPAR_RETURN_IF_ERROR(m->model_->SetContextParallel(m->state_.cp().group()));
  if (m->model_->cp_size() > 1) {
    HETPAR_LOG(INFO) << "llm model: cp rank " << m->model_->cp_rank() << " of "
                     << m->model_->cp_size()
                     << " (load-balanced chunks, keys and values all-gathered per layer)";
  }
  // A resumed run takes every parameter from its checkpoint (ModuleState::Train).
  if (!spec.llm().init_from().empty() && spec.checkpoint().resume_from().empty()) {
    HETPAR_RETURN_IF_ERROR(nn::LoadInitialParameters(
        m->model_->parameters(), "llm.init_from", spec.llm().init_from(),
        model_options.pp_stages > 1 ? nn::FileScope::kModelIsPart : nn::FileScope::kWholeModel,
        [model = m->model_.get()](std::string_view name) { return model->WholeModelHas(name); }));
    HETPAR_LOG(INFO) << "llm parameters from " << spec.llm().init_from();
  }
  HETPAR_RETURN_IF_ERROR(m->state_.Train(&m->model_->parameters(), spec.llm().optimizer()));
  return m;
}

absl::Status LlmModule::EnsureRuntime() {
  if (runtime_.has_value()) return absl::OkStatus();
  HETPAR_ASSIGN_OR_RETURN(const data::BatchSource* data, context_->Data());
  runtime_.emplace(model_.get(), &state_.tp(), &state_.dp(), data, &context_->boundary(),
                   LlmRuntimeOptions{context_->peer_timeout(), colocated_,
                                     colocated_ ? 0 : context_->spec().run().max_inflight(),
                                     plan::ImageGradientsCross(context_->spec()),
                                     train::GradBucketBytes(context_->spec())},
                   pipeline_);
  return absl::OkStatus();
}

absl::StatusOr<LlmStepStats> LlmModule::RunModel(const plan::RankStepPlan& plan) {
  HETPAR_RETURN_IF_ERROR(EnsureRuntime());
  return runtime_->RunStep(plan);
}

worker::StepOutcome LlmModule::Outcome(const plan::RankStepPlan& plan, const LlmStepStats& stats,
                                       double loss) const {
  worker::StepOutcome outcome;
  // TP ranks of a replica compute the same loss: one of them reports it (on the last stage).
  outcome.reports_loss = state_.coords().tp() == 0 && model_->last_stage();
  outcome.loss_sum = loss * static_cast<double>(plan.n_global);
  outcome.loss_tokens = stats.loss_tokens;
  worker::ModuleTimings& timings = outcome.modules.emplace_back();
  timings.module = "llm";
  timings.values = {{"compute_s", worker::ComputeSeconds(stats.compute, "llm")},
                    {"bridge_wait_s", stats.bridge_wait_s},
                    {"collective_s", stats.collective_s},
                    {"data_s", stats.data_s},
                    {"tokens", static_cast<double>(stats.tokens)},
                    {"images", static_cast<double>(stats.images)},
                    {"bytes_received", static_cast<double>(stats.bytes_received)}};
  if (pipeline_.link != nullptr) {
    timings.values["pipeline_wait_s"] = stats.pipeline_wait_s;
    timings.values["pipeline_bytes"] = static_cast<double>(stats.pipeline_bytes);
  }
  return outcome;
}

absl::Status LlmModule::WaitForSends() {
  if (!runtime_.has_value()) return absl::OkStatus();
  return runtime_->WaitForSends();
}

void LlmModule::AbandonStage(const plan::RankStepPlan& plan) {
  if (stage_link_ == nullptr) return;
  if (absl::Status s = EnsureRuntime(); !s.ok()) {
    // The data set did not open, so the messages cannot be sized: the attempt's receives and
    // sends are left to the link's next attempt (its sends still complete or fail).
    HETPAR_LOG(WARNING) << "step " << plan.step << ": cannot size the neighbouring stages' "
                        << "messages to absorb them: " << StatusText(s);
    stage_link_->Reset();
    return;
  }
  runtime_->AbandonStage(plan);
}

void LlmModule::StepNotRun(const plan::RankStepPlan& plan) {
  SingleModuleRuntime::StepNotRun(plan);
  AbandonStage(plan);
}

absl::StatusOr<worker::StepOutcome> LlmModule::RunStep(const plan::RankStepPlan& plan) {
  context_->boundary().BeginStep();
  absl::StatusOr<LlmStepStats> stats = RunModel(plan);
  // The step's one wait for the device: its loss and gradient norm share come to the host.
  absl::StatusOr<double> loss =
      stats.ok() ? state_.EndStep(stats->loss) : absl::StatusOr<double>(stats.status());
  // A device message's header is checked once the read has brought it to the host.
  absl::Status checked = loss.status();
  if (checked.ok()) checked = context_->boundary().CheckDeviceHeaders();
  if (!checked.ok()) {
    context_->boundary().Abandon(plan);
    AbandonStage(plan);
    return checked;
  }
  worker::StepOutcome outcome = Outcome(plan, *stats, *loss);
  worker::AddBridgeStats(context_->boundary(), plan::Direction::kForward, &outcome.modules[0]);
  return outcome;
}

}  // namespace hetpar::llm
