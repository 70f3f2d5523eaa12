#include "llm_trainer/llm_module.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/worker/outputs.h"

namespace hetpar::llm {

absl::StatusOr<std::unique_ptr<LlmModule>> LlmModule::Create(worker::WorkerContext& context,
                                                             bool colocated) {
  const v1::RankCoordinates* coords = context.Coordinates(v1::MODULE_LLM);
  if (coords == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("world rank ", context.world_rank(), " holds no LLM rank"));
  }
  std::unique_ptr<LlmModule> m(new LlmModule(&context, colocated));
  m->coords_ = *coords;
  const v1::RunSpec& spec = context.spec();
  const auto& layout = spec.llm().layout();
  HETPAR_ASSIGN_OR_RETURN(m->tp_, context.Group(absl::StrCat("llm/dp", coords->dp(), "/tp"),
                                                coords->tp(), layout.tp()));
  HETPAR_ASSIGN_OR_RETURN(m->dp_, context.Group(absl::StrCat("llm/tp", coords->tp(), "/dp"),
                                                coords->dp(), layout.dp()));
  HETPAR_ASSIGN_OR_RETURN(LlmOptions model_options, LlmOptionsFromSpec(spec));
  HETPAR_ASSIGN_OR_RETURN(m->model_,
                          LanguageModel::Create(spec.llm().model(), model_options, *m->tp_));
  HETPAR_ASSIGN_OR_RETURN(m->optimizer_, train::ModuleOptimizer::Create(&m->model_->parameters(),
                                                                        spec.llm().optimizer()));
  return m;
}

absl::StatusOr<worker::StepOutcome> LlmModule::RunPart(const plan::RankStepPlan& plan) {
  if (!runtime_.has_value()) {
    HETPAR_ASSIGN_OR_RETURN(const data::BatchSource* data, context_->Data());
    runtime_.emplace(model_.get(), tp_.get(), dp_.get(), data, &context_->boundary(),
                     LlmRuntimeOptions{context_->options().timeout, colocated_,
                                       colocated_ ? 0 : context_->spec().run().max_inflight()});
  }
  HETPAR_ASSIGN_OR_RETURN(LlmStepStats stats, runtime_->RunStep(plan));
  worker::StepOutcome outcome;
  // TP ranks of a replica compute the same loss: one of them reports it.
  outcome.reports_loss = coords_.tp() == 0;
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

std::vector<worker::GradNormShare> LlmModule::GradNormShares() const {
  if (coords_.dp() != 0) return {};
  return {{v1::MODULE_LLM, train::OwnedGradSums(model_->parameters()).square_sum}};
}

absl::Status LlmModule::Apply(int64_t step, double clip_coefficient) {
  return optimizer_->Step(step, clip_coefficient);
}

void LlmModule::Discard() { model_->parameters().ZeroGrad(); }

absl::Status LlmModule::WriteOutputs(const std::string& out_dir, int64_t world_rank) {
  return worker::WriteModuleOutputs(out_dir, world_rank, "llm", coords_.dp(), model_->parameters(),
                                    *tp_);
}

}  // namespace hetpar::llm
