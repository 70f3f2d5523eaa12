#include "llm_trainer/colocated_modules.h"

#include <utility>
#include <vector>

#include "common/status.h"
#include "common/worker/outputs.h"

namespace hetpar::llm {

absl::StatusOr<std::unique_ptr<ColocatedModules>> ColocatedModules::Create(
    worker::WorkerContext& context) {
  std::unique_ptr<ColocatedModules> m(new ColocatedModules());
  m->context_ = &context;
  HETPAR_ASSIGN_OR_RETURN(m->encoder_, encoder::EncoderModule::Create(context));
  HETPAR_ASSIGN_OR_RETURN(m->llm_, LlmModule::Create(context, /*colocated=*/true));
  return m;
}

void ColocatedModules::StepNotRun(const plan::RankStepPlan& plan) {
  context_->boundary().AbandonUnrun(plan);
  llm_->AbandonStage(plan);
}

absl::StatusOr<worker::StepOutcome> ColocatedModules::RunStep(const plan::RankStepPlan& plan) {
  context_->boundary().BeginStep();
  LlmStepStats llm_stats;
  absl::StatusOr<encoder::EncoderStepStats> encoder_stats =
      encoder_->RunModel(plan, [&]() -> absl::Status {
        HETPAR_ASSIGN_OR_RETURN(llm_stats, llm_->RunModel(plan));
        return absl::OkStatus();
      });
  absl::Status done = encoder_stats.ok() ? llm_->WaitForSends() : encoder_stats.status();
  // The step's one wait for the device, for both modules: the LLM's loss and both gradient norm
  // shares come to the host in one copy, and with them the device messages' headers.
  double loss = 0;
  if (done.ok()) {
    absl::StatusOr<std::vector<double>> read = worker::ModuleState::EndSteps(
        {{&encoder_->state(), at::Tensor()}, {&llm_->state(), llm_stats.loss}});
    done = read.status();
    if (read.ok()) loss = (*read)[1];
  }
  if (done.ok()) done = context_->boundary().CheckDeviceHeaders();
  if (!done.ok()) {
    context_->boundary().Abandon(plan);
    llm_->AbandonStage(plan);
    return done;
  }
  worker::ModuleTimings encoder_timings = encoder::EncoderModule::Timings(*encoder_stats);
  worker::StepOutcome outcome = llm_->Outcome(plan, llm_stats, loss);
  worker::AddBridgeStats(context_->boundary(), plan::Direction::kForward, &outcome.modules[0]);
  worker::AddBridgeStats(context_->boundary(), plan::Direction::kBackward, &encoder_timings);
  outcome.modules.insert(outcome.modules.begin(), std::move(encoder_timings));
  return outcome;
}

std::vector<worker::GradNormShare> ColocatedModules::GradNormShares() const {
  std::vector<worker::GradNormShare> shares = encoder_->GradNormShares();
  for (const worker::GradNormShare& share : llm_->GradNormShares()) shares.push_back(share);
  return shares;
}

absl::Status ColocatedModules::Apply(int64_t step, double clip_coefficient,
                                     const v1::StepCommit& commit) {
  HETPAR_RETURN_IF_ERROR(encoder_->Apply(step, clip_coefficient, commit));
  return llm_->Apply(step, clip_coefficient, commit);
}

absl::Status ColocatedModules::Regroup(int64_t generation, const worker::StepReplicas& replicas) {
  // The encoder's groups first, as at the start.
  HETPAR_RETURN_IF_ERROR(encoder_->Regroup(generation, replicas));
  return llm_->Regroup(generation, replicas);
}

absl::Status ColocatedModules::Skip(int64_t step, const v1::StepCommit& commit) {
  HETPAR_RETURN_IF_ERROR(encoder_->Skip(step, commit));
  return llm_->Skip(step, commit);
}

void ColocatedModules::Discard() {
  encoder_->Discard();
  llm_->Discard();
}

absl::Status ColocatedModules::WriteOutputs(const worker::OutputSender& send, int64_t world_rank) {
  HETPAR_RETURN_IF_ERROR(encoder_->WriteOutputs(send, world_rank));
  return llm_->WriteOutputs(send, world_rank);
}

}  // namespace hetpar::llm
