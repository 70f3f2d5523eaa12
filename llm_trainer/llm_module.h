// The LLM's module runtime on one worker (common/worker/module_runtime.h): the decoder of this
// rank, its groups and AdamW state (common/worker/module_state.h), and the step runtime over the
// boundary (llm_runtime.h). hetpar-llm drives one, or, colocated, one beside an encoder module
// (colocated_modules.h). One thread calls it.
#ifndef HETPAR_LLM_TRAINER_LLM_MODULE_H_
#define HETPAR_LLM_TRAINER_LLM_MODULE_H_

#include <memory>
#include <optional>
#include <utility>

#include "absl/status/statusor.h"
#include "common/worker/bootstrap.h"
#include "common/worker/module_runtime.h"
#include "common/worker/module_state.h"
#include "llm_trainer/language_model.h"
#include "llm_trainer/llm_runtime.h"

namespace hetpar::llm {

class LlmModule : public worker::SingleModuleRuntime {
 public:
  // Forms this rank's TP and DP groups and builds the model and its optimizer. `context` must
  // hold an LLM rank and outlive the module. `colocated`: the encoder ranks of this step run on
  // the same processes, so the gradient sends complete only in their backward phase
  // (WaitForSends) and every wave's receives are posted at once.
  static absl::StatusOr<std::unique_ptr<LlmModule>> Create(worker::WorkerContext& context,
                                                           bool colocated);

  absl::StatusOr<worker::StepOutcome> RunStep(const plan::RankStepPlan& plan) override;

  // This rank's LLM part of a step whose boundary step has begun, without the step's read of
  // the device: the loss stays on the device (stats.loss) for the caller's read
  // (ModuleState::EndSteps, with the encoder's share when colocated).
  absl::StatusOr<LlmStepStats> RunModel(const plan::RankStepPlan& plan);
  // The step's outcome, without the bridge figures, from RunModel's stats and the loss read (the
  // step's read of the device, which its compute time on a GPU also needs).
  worker::StepOutcome Outcome(const plan::RankStepPlan& plan, const LlmStepStats& stats,
                              double loss) const;
  // Colocated: waits for the gradient sends RunModel left pending.
  absl::Status WaitForSends();
  // With pipeline stages: the attempt of `plan` ended early or did not run on this rank; the
  // link to the neighbouring stages absorbs their messages of it (LlmRuntime::AbandonStage).
  void AbandonStage(const plan::RankStepPlan& plan);
  void StepNotRun(const plan::RankStepPlan& plan) override;
  worker::ModuleState& state() { return state_; }

 private:
  LlmModule(worker::WorkerContext* context, bool colocated, worker::ModuleState state)
      : SingleModuleRuntime(context, std::move(state)), colocated_(colocated) {}

  // Builds the step runtime once (it opens the data set).
  absl::Status EnsureRuntime();

  bool colocated_;
  std::unique_ptr<LanguageModel> model_;
  std::unique_ptr<train::StageLink> stage_link_;  // with pipeline stages
  PipelinePeers pipeline_;
  std::optional<LlmRuntime> runtime_;  // from the first step on (the data set opens then)
};

}  // namespace hetpar::llm

#endif  // HETPAR_LLM_TRAINER_LLM_MODULE_H_
