#include "encoder_service/encoder_module.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/worker/outputs.h"

namespace hetpar::encoder {

absl::StatusOr<std::unique_ptr<EncoderModule>> EncoderModule::Create(
    worker::WorkerContext& context) {
  const v1::RankCoordinates* coords = context.Coordinates(v1::MODULE_ENCODER);
  if (coords == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("world rank ", context.world_rank(), " holds no encoder rank"));
  }
  std::unique_ptr<EncoderModule> m(new EncoderModule(&context));
  m->coords_ = *coords;
  const v1::RunSpec& spec = context.spec();
  const auto& layout = spec.encoder().layout();
  HETPAR_ASSIGN_OR_RETURN(m->tp_, context.Group(absl::StrCat("encoder/dp", coords->dp(), "/tp"),
                                                coords->tp(), layout.tp()));
  HETPAR_ASSIGN_OR_RETURN(m->dp_, context.Group(absl::StrCat("encoder/tp", coords->tp(), "/dp"),
                                                coords->dp(), layout.dp()));
  HETPAR_ASSIGN_OR_RETURN(EncoderOptions model_options, EncoderOptionsFromSpec(spec));
  HETPAR_ASSIGN_OR_RETURN(m->model_,
                          VisionEncoder::Create(spec.encoder().model(), model_options, *m->tp_));
  HETPAR_ASSIGN_OR_RETURN(m->optimizer_, train::ModuleOptimizer::Create(
                                             &m->model_->parameters(), spec.encoder().optimizer()));
  return m;
}

absl::StatusOr<worker::ModuleTimings> EncoderModule::RunPart(
    const plan::RankStepPlan& plan, const std::function<absl::Status()>& between) {
  if (!runtime_.has_value()) {
    HETPAR_ASSIGN_OR_RETURN(const data::BatchSource* data, context_->Data());
    runtime_.emplace(
        model_.get(), tp_.get(), dp_.get(), data, &context_->boundary(),
        EncoderRuntimeOptions{context_->spec().run().max_inflight(), context_->options().timeout});
  }
  HETPAR_ASSIGN_OR_RETURN(EncoderStepStats stats, runtime_->RunStepAround(plan, between));
  worker::ModuleTimings timings;
  timings.module = "encoder";
  timings.values = {{"compute_s", stats.compute_s},
                    {"bridge_wait_s", stats.bridge_wait_s},
                    {"collective_s", stats.collective_s},
                    {"data_s", stats.data_s},
                    {"images", static_cast<double>(stats.images)},
                    {"bytes_sent", static_cast<double>(stats.bytes_sent)},
                    {"peak_live_jobs", static_cast<double>(stats.peak_live_jobs)},
                    {"peak_live_output_bytes", static_cast<double>(stats.peak_live_output_bytes)}};
  return timings;
}

absl::StatusOr<worker::StepOutcome> EncoderModule::RunStep(const plan::RankStepPlan& plan) {
  context_->boundary().BeginStep();
  HETPAR_ASSIGN_OR_RETURN(worker::ModuleTimings timings, RunPart(plan, nullptr));
  worker::AddBridgeStats(context_->boundary(), plan::Direction::kBackward, &timings);
  worker::StepOutcome outcome;
  outcome.modules.push_back(std::move(timings));
  return outcome;
}

std::vector<worker::GradNormShare> EncoderModule::GradNormShares() const {
  if (coords_.dp() != 0) return {};
  return {{v1::MODULE_ENCODER, train::OwnedGradSums(model_->parameters()).square_sum}};
}

absl::Status EncoderModule::Apply(int64_t step, double clip_coefficient) {
  return optimizer_->Step(step, clip_coefficient);
}

void EncoderModule::Discard() { model_->parameters().ZeroGrad(); }

absl::Status EncoderModule::WriteOutputs(const std::string& out_dir, int64_t world_rank) {
  return worker::WriteModuleOutputs(out_dir, world_rank, "encoder", coords_.dp(),
                                    model_->parameters(), *tp_);
}

}  // namespace hetpar::encoder
