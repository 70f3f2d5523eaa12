#include "llm_trainer/llm_module.h"

#include <utility>

#include "common/logging.h"
#include "common/nn/export.h"
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
  HETPAR_ASSIGN_OR_RETURN(m->model_,
                          LanguageModel::Create(spec.llm().model(), model_options, m->state_.tp()));
  HETPAR_RETURN_IF_ERROR(m->model_->SetContextParallel(m->state_.cp().group()));
  if (m->model_->cp_size() > 1) {
    HETPAR_LOG(INFO) << "llm model: cp rank " << m->model_->cp_rank() << " of "
                     << m->model_->cp_size()
                     << " (load-balanced chunks, keys and values all-gathered per layer)";
  }
  if (!spec.llm().init_from().empty()) {
    HETPAR_RETURN_IF_ERROR(nn::LoadInitialParameters(m->model_->parameters(), "llm.init_from",
                                                     spec.llm().init_from()));
    HETPAR_LOG(INFO) << "llm parameters from " << spec.llm().init_from();
  }
  HETPAR_RETURN_IF_ERROR(m->state_.Train(&m->model_->parameters(), spec.llm().optimizer()));
  return m;
}

absl::StatusOr<worker::StepOutcome> LlmModule::RunPart(const plan::RankStepPlan& plan) {
  if (!runtime_.has_value()) {
    HETPAR_ASSIGN_OR_RETURN(const data::BatchSource* data, context_->Data());
    runtime_.emplace(model_.get(), &state_.tp(), &state_.dp(), data, &context_->boundary(),
                     LlmRuntimeOptions{context_->options().timeout, colocated_,
                                       colocated_ ? 0 : context_->spec().run().max_inflight(),
                                       plan::ImageGradientsCross(context_->spec())});
  }
  HETPAR_ASSIGN_OR_RETURN(LlmStepStats stats, runtime_->RunStep(plan));
  worker::StepOutcome outcome;
  // TP ranks of a replica compute the same loss: one of them reports it.
  outcome.reports_loss = state_.coords().tp() == 0;
  outcome.loss_sum = stats.loss_sum;
  outcome.loss_tokens = stats.loss_tokens;
  worker::ModuleTimings& timings = outcome.modules.emplace_back();
  timings.module = "llm";
  timings.values = {{"compute_s", stats.compute_s},
                    {"bridge_wait_s", stats.bridge_wait_s},
                    {"collective_s", stats.collective_s},
                    {"data_s", stats.data_s},
                    {"tokens", static_cast<double>(stats.tokens)},
                    {"images", static_cast<double>(stats.images)},
                    {"bytes_received", static_cast<double>(stats.bytes_received)}};
  return outcome;
}

absl::Status LlmModule::WaitForSends() {
  if (!runtime_.has_value()) return absl::OkStatus();
  return runtime_->WaitForSends();
}

absl::StatusOr<worker::StepOutcome> LlmModule::RunStep(const plan::RankStepPlan& plan) {
  context_->boundary().BeginStep();
  HETPAR_ASSIGN_OR_RETURN(worker::StepOutcome outcome, RunPart(plan));
  worker::AddBridgeStats(context_->boundary(), plan::Direction::kForward, &outcome.modules[0]);
  return outcome;
}

}  // namespace hetpar::llm
