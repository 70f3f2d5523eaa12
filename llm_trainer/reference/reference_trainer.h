// The reference trainer: both modules in one process at tp = 1, dp = 1, trained on the same
// global batches as a distributed run of the same RunSpec, microbatch by microbatch in the same
// wave order (wave-major, then LLM replica), with gradient accumulation over the step.
//
// Its metrics (per-step loss and grad norm, final parameter sums) are what a distributed run of
// any layout must reproduce: `hetpar compare` checks them (see docs/training.md).
#ifndef HETPAR_LLM_TRAINER_REFERENCE_REFERENCE_TRAINER_H_
#define HETPAR_LLM_TRAINER_REFERENCE_REFERENCE_TRAINER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/data/batch_source.h"
#include "common/plan/step_plan.h"
#include "encoder_service/encoder.h"
#include "hetpar/v1/run_spec.pb.h"
#include "llm_trainer/language_model.h"

namespace hetpar::llm {

struct ReferenceOptions {
  std::string out_dir;    // run directory (config.yaml, metrics.jsonl, log/)
  bool progress = false;  // one progress line per step on stderr
  bool evaluate = true;   // validation metrics at the end, with and without images
};

struct ReferenceStepResult {
  double loss = 0;  // sum over microbatches of sum(token losses) / N_global
  int64_t tokens = 0;
  int64_t images = 0;
  double encoder_compute_s = 0;
  double llm_compute_s = 0;  // includes the encoder backward that the LLM's backward runs into
};

// Forward and backward of every microbatch of `step_plan` (wave-major, then LLM replica) in one
// process: gradients accumulate in both models' parameters. Models at tp = 1.
absl::StatusOr<ReferenceStepResult> RunReferenceStep(const data::BatchSource& batches,
                                                     const plan::StepPlan& step_plan,
                                                     encoder::VisionEncoder& vision,
                                                     LanguageModel& language);

// Loads the full parameters saved by a run (<model_dir>/encoder.hpar, llm.hpar) into tp = 1
// models, evaluates the validation split with and without images, and returns the metrics line
// ({"eval": {...}}).
absl::StatusOr<std::string> EvaluateSavedModel(const hetpar::v1::RunSpec& spec,
                                               const std::string& model_dir, int64_t step);

// Writes the full parameters of the checkpoint `checkpoint_dir` (train/checkpoint.h, any layout)
// as <model_dir>/encoder.hpar and llm.hpar, the files a run saves in model/: what `init_from`
// starts a new run from. `spec` gives the models' shapes (the run's config).
absl::Status ExportCheckpoint(const hetpar::v1::RunSpec& spec, const std::string& checkpoint_dir,
                              const std::string& model_dir);

// Trains spec.run().steps() steps and writes the run directory. `spec` has defaults applied.
absl::Status RunReference(const hetpar::v1::RunSpec& spec, const ReferenceOptions& options);

}  // namespace hetpar::llm

#endif  // HETPAR_LLM_TRAINER_REFERENCE_REFERENCE_TRAINER_H_
