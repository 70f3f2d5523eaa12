// Both modules on one worker (placement: colocated, the LLM cluster also running the encoder's
// layout on the same ranks): Megatron's three-phase schedule within a step, every encoder job's
// forward, then the LLM's waves, then every job's backward, with each module's own layout and
// groups. Blocks between a rank's own encoder and LLM parts are handed over in memory by the
// boundary communicator. One thread calls it.
#ifndef HETPAR_LLM_TRAINER_COLOCATED_MODULES_H_
#define HETPAR_LLM_TRAINER_COLOCATED_MODULES_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/worker/bootstrap.h"
#include "common/worker/module_runtime.h"
#include "encoder_service/encoder_module.h"
#include "llm_trainer/llm_module.h"

namespace hetpar::llm {

class ColocatedModules : public worker::ModuleRuntime {
 public:
  // The encoder's groups are formed first, then the LLM's (every rank in the same order).
  static absl::StatusOr<std::unique_ptr<ColocatedModules>> Create(worker::WorkerContext& context);

  absl::StatusOr<worker::StepOutcome> RunStep(const plan::RankStepPlan& plan) override;
  std::vector<worker::GradNormShare> GradNormShares() const override;
  absl::Status Apply(int64_t step, double clip_coefficient, const v1::StepCommit& commit) override;
  void Discard() override;
  absl::Status Skip(int64_t step, const v1::StepCommit& commit) override;
  void StepNotRun(const plan::RankStepPlan& plan) override;
  absl::Status Regroup(int64_t generation, const worker::StepReplicas& replicas) override;
  absl::Status WriteOutputs(const worker::OutputSender& send, int64_t world_rank) override;

 private:
  ColocatedModules() = default;

  worker::WorkerContext* context_ = nullptr;
  std::unique_ptr<encoder::EncoderModule> encoder_;
  std::unique_ptr<LlmModule> llm_;
};

}  // namespace hetpar::llm

#endif  // HETPAR_LLM_TRAINER_COLOCATED_MODULES_H_
