// The encoder's module runtime on one worker (common/worker/module_runtime.h): the ViT + projector
// of this rank, its groups and AdamW state (common/worker/module_state.h), and the step runtime
// over the boundary (encoder_runtime.h). hetpar-encoder drives one; a colocated LLM worker drives
// one beside its LLM (llm_trainer/colocated_modules.h). One thread calls it.
#ifndef HETPAR_ENCODER_SERVICE_ENCODER_MODULE_H_
#define HETPAR_ENCODER_SERVICE_ENCODER_MODULE_H_

#include <functional>
#include <memory>
#include <optional>
#include <utility>

#include "absl/status/statusor.h"
#include "common/worker/bootstrap.h"
#include "common/worker/module_runtime.h"
#include "common/worker/module_state.h"
#include "encoder_service/encoder.h"
#include "encoder_service/encoder_runtime.h"

namespace hetpar::encoder {

class EncoderModule : public worker::SingleModuleRuntime {
 public:
  // Forms this rank's TP and DP groups and builds the model and its optimizer. `context` must
  // hold an encoder rank and outlive the module.
  static absl::StatusOr<std::unique_ptr<EncoderModule>> Create(worker::WorkerContext& context);

  absl::StatusOr<worker::StepOutcome> RunStep(const plan::RankStepPlan& plan) override;

  // This rank's encoder part of a step whose boundary step has begun, without the step's read of
  // the device (ModuleState::EndSteps, with the LLM's when colocated): 1F1B over the jobs, or
  // with `between` the colocated schedule (every forward, `between`, every backward).
  absl::StatusOr<EncoderStepStats> RunModel(const plan::RankStepPlan& plan,
                                            const std::function<absl::Status()>& between);
  // The step's figures, without the bridge figures, from RunModel's stats; after the step's read
  // of the device, which its compute time on a GPU needs (worker::ComputeSeconds).
  static worker::ModuleTimings Timings(const EncoderStepStats& stats);
  worker::ModuleState& state() { return state_; }

 private:
  EncoderModule(worker::WorkerContext* context, worker::ModuleState state)
      : SingleModuleRuntime(context, std::move(state)) {}

  std::unique_ptr<VisionEncoder> model_;
  std::optional<EncoderRuntime> runtime_;  // from the first step on (the data set opens then)
};

}  // namespace hetpar::encoder

#endif  // HETPAR_ENCODER_SERVICE_ENCODER_MODULE_H_
