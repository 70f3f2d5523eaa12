#include "encoder_service/encoder_module.h"

#include <utility>

#include "common/logging.h"
#include "common/nn/export.h"
#include "common/status.h"
#include "common/worker/outputs.h"

namespace hetpar::encoder {

absl::StatusOr<std::unique_ptr<EncoderModule>> EncoderModule::Create(
    worker::WorkerContext& context) {
  HETPAR_ASSIGN_OR_RETURN(worker::ModuleState state,
                          worker::ModuleState::Form(context, v1::MODULE_ENCODER));
  std::unique_ptr<EncoderModule> m(new EncoderModule(&context, std::move(state)));
  const v1::RunSpec& spec = context.spec();
  HETPAR_ASSIGN_OR_RETURN(EncoderOptions model_options, EncoderOptionsFromSpec(spec));
  model_options.device = context.execution().device();
  HETPAR_ASSIGN_OR_RETURN(
      m->model_, VisionEncoder::Create(spec.encoder().model(), model_options, m->state_.tp()));
  // A resumed run takes every parameter from its checkpoint (ModuleState::Train).
  if (!spec.encoder().init_from().empty() && spec.checkpoint().resume_from().empty()) {
    HETPAR_RETURN_IF_ERROR(nn::LoadInitialParameters(m->model_->parameters(), "encoder.init_from",
                                                     spec.encoder().init_from()));
    HETPAR_LOG(INFO) << "encoder parameters from " << spec.encoder().init_from();
  }
  HETPAR_RETURN_IF_ERROR(m->state_.Train(&m->model_->parameters(), spec.encoder().optimizer()));
  const bool sequence_parallel = model_options.sequence_parallel && m->state_.tp().size() > 1;
  HETPAR_LOG(INFO) << "encoder model: tp " << m->state_.tp().size()
                   << (sequence_parallel
                           ? ", sequence parallel (activations split by rows over the TP group)"
                           : ", no sequence parallelism");
  return m;
}

absl::StatusOr<EncoderStepStats> EncoderModule::RunModel(
    const plan::RankStepPlan& plan, const std::function<absl::Status()>& between) {
  if (!runtime_.has_value()) {
    HETPAR_ASSIGN_OR_RETURN(const data::BatchSource* data, context_->Data());
    runtime_.emplace(
        model_.get(), &state_.tp(), &state_.dp(), data, &context_->boundary(),
        EncoderRuntimeOptions{context_->spec().run().max_inflight(), context_->peer_timeout(),
                              train::GradBucketBytes(context_->spec())});
  }
  return runtime_->RunStepAround(plan, between);
}

worker::ModuleTimings EncoderModule::Timings(const EncoderStepStats& stats) {
  worker::ModuleTimings timings;
  timings.module = "encoder";
  timings.values = {{"compute_s", worker::ComputeSeconds(stats.compute, "encoder")},
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
  absl::StatusOr<EncoderStepStats> stats = RunModel(plan, nullptr);
  // The step's one wait for the device: its gradient norm share comes to the host, and with it
  // the headers of the device messages received, checked next.
  absl::Status checked = stats.status();
  if (checked.ok()) checked = state_.EndStep(at::Tensor()).status();
  if (checked.ok()) checked = context_->boundary().CheckDeviceHeaders();
  if (!checked.ok()) {
    context_->boundary().Abandon(plan);
    return checked;
  }
  worker::ModuleTimings timings = Timings(*stats);
  worker::AddBridgeStats(context_->boundary(), plan::Direction::kBackward, &timings);
  worker::StepOutcome outcome;
  outcome.modules.push_back(std::move(timings));
  return outcome;
}

}  // namespace hetpar::encoder
