// Validation metrics of a trained encoder + LLM pair: caption token accuracy and accuracy per
// attribute (colour, shape, position, size) on the validation split, with the real images and
// with blank ones (the text-only baseline), and the difference, which says how much the model
// reads its images (see common/data/metrics.h for what is counted).
//
//   llm::EvaluationOptions options;
//   options.max_samples = 64;
//   options.step = step;
//   HETPAR_ASSIGN_OR_RETURN(llm::EvaluationResult eval,
//                           llm::EvaluateCaptioning(spec, *encoder, *language, options));
//   HETPAR_RETURN_IF_ERROR(run_dir->AppendMetrics(eval.ToJson()));   // {"eval": {...}}
//
// The validation samples run in micro-batches: the images of a micro-batch through the encoder,
// its samples packed into one LLM sequence, and LanguageModel::Predict gives the argmax token at
// every position; no autograd graph is built. The blank pass uses a second loader with the
// loader's blank_images option (every image zeros, no image file read).
//
// Parallelism: the two models may have any TP sizes (and sequence parallelism); every TP rank
// of both calls EvaluateCaptioning with the same arguments, in the same order relative to its
// other collectives, and gets the same result (the encoder's output is replicated over its TP
// group and Predict returns the same ids on every LLM TP rank). Each DP replica evaluating runs
// the whole split; a runtime usually evaluates on one replica, or on all for a consistency check.
#ifndef HETPAR_LLM_TRAINER_REFERENCE_EVALUATION_H_
#define HETPAR_LLM_TRAINER_REFERENCE_EVALUATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/metrics.h"
#include "encoder_service/encoder.h"
#include "hetpar/v1/run_spec.pb.h"
#include "llm_trainer/language_model.h"

namespace hetpar::llm {

struct EvaluationOptions {
  int64_t max_samples = -1;  // the first max_samples samples of the split; < 0: all of them
  int64_t micro_batch = 0;   // samples per forward; 0: run.micro_batch (>= 1)
  int64_t step = -1;         // the training step the models are at; >= 0 goes into ToJson()
  // Which caption words count for which attribute; the synthetic set's words by default.
  data::AttributeLexicon lexicon = data::SynthAttributeLexicon();
  // Keep every sample's predicted token ids (with and without images) in the result.
  bool keep_predictions = false;
};

// The predictions for one validation sample: one token id per position, as
// LanguageModel::Predict returns them (position i predicts the token at i + 1).
struct SamplePredictions {
  std::string id;
  std::vector<int32_t> with_images;
  std::vector<int32_t> blank_images;
};

struct EvaluationResult {
  int64_t step = -1;  // EvaluationOptions::step
  int64_t micro_batch = 0;
  int64_t skipped = 0;                         // bad samples left out (data.skip_bad_samples)
  data::CaptionEvaluation captions;            // with_images, blank_images, reliance
  double seconds = 0;                          // wall time of the evaluation
  std::vector<SamplePredictions> predictions;  // with keep_predictions, in split order

  // One metrics.jsonl line:
  // {"eval":{"step":120,"split":"val","samples":128,"skipped":0,"micro_batch":2,"seconds":1.5,
  //  "with_images":{...},"blank_images":{...},"image_reliance":{...}}}
  // ("step" only when >= 0; the nested objects are data::CaptionEvaluation's).
  std::string ToJson() const;
};

// Runs the validation split (data::LoaderOptionsFromRunSpec(spec, data::Split::kVal)) through
// `encoder` and `llm`. `spec` has defaults applied; the models are built from it (any TP size).
// Errors: InvalidArgument for a negative micro_batch, a spec without data.val_manifest, or models
// whose sizes do not match the spec (tokens per image, encoder out_hidden vs llm hidden); the
// loader's errors naming the sample (a bad sample under data.skip_bad_samples is skipped and
// counted instead); the models' errors.
absl::StatusOr<EvaluationResult> EvaluateCaptioning(const hetpar::v1::RunSpec& spec,
                                                    encoder::VisionEncoder& encoder,
                                                    LanguageModel& llm,
                                                    const EvaluationOptions& options);

}  // namespace hetpar::llm

#endif  // HETPAR_LLM_TRAINER_REFERENCE_EVALUATION_H_
