#include "llm_trainer/reference/evaluation.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/config/config.h"
#include "common/data/loader.h"
#include "common/logging.h"
#include "common/nn/torch_status.h"
#include "common/status.h"
#include "common/train/batch.h"
#include "llm_trainer/llm_inputs.h"

namespace hetpar::llm {
namespace {

// Predictions for loaded samples, one vector per sample, and the samples' token sequences (for
// the metrics).
struct MicrobatchPredictions {
  std::vector<data::LoadedSample> samples;
  std::vector<std::vector<int32_t>> ids;
};

absl::StatusOr<MicrobatchPredictions> PredictMicrobatch(std::vector<data::LoadedSample> samples,
                                                        encoder::VisionEncoder& encoder,
                                                        LanguageModel& llm) {
  MicrobatchPredictions out;
  out.samples = std::move(samples);
  std::vector<LlmSample> llm_samples;
  std::vector<const std::vector<float>*> pixels;
  for (const data::LoadedSample& sample : out.samples) {
    llm_samples.push_back(LlmSampleOf(sample, encoder.tokens_per_image()));
    for (const std::vector<float>& image : sample.images) pixels.push_back(&image);
  }
  at::Tensor image_rows;
  if (!pixels.empty()) {
    const auto& model = encoder.model();
    HETPAR_ASSIGN_OR_RETURN(at::Tensor images,
                            train::ImagesTensor(pixels, model.channels(), model.image_size(),
                                                encoder.parameters().dtype()));
    at::NoGradGuard no_grad;
    HETPAR_ASSIGN_OR_RETURN(image_rows, encoder.Forward(images));
    if (image_rows.scalar_type() != llm.options().dtype) {
      HETPAR_ASSIGN_OR_RETURN(image_rows, nn::RunTorchOr("converting image rows", [&] {
                                return image_rows.to(llm.options().dtype);
                              }));
    }
  }
  HETPAR_ASSIGN_OR_RETURN(out.ids, llm.Predict(llm_samples, image_rows));
  return out;
}

}  // namespace

std::string EvaluationResult::ToJson() const {
  std::string out = "{\"eval\":{";
  if (step >= 0) absl::StrAppend(&out, "\"step\":", step, ",");
  absl::StrAppend(&out, "\"split\":\"val\",\"samples\":", captions.with_images.samples,
                  ",\"skipped\":", skipped, ",\"micro_batch\":", micro_batch,
                  ",\"seconds\":", config::FormatDouble(seconds),
                  ",\"with_images\":", captions.with_images.ToJson(),
                  ",\"blank_images\":", captions.blank_images.ToJson(),
                  ",\"image_reliance\":", captions.reliance.ToJson(), "}}");
  return out;
}

absl::StatusOr<EvaluationResult> EvaluateCaptioning(const hetpar::v1::RunSpec& spec,
                                                    encoder::VisionEncoder& encoder,
                                                    LanguageModel& llm,
                                                    const EvaluationOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (options.micro_batch < 0) {
    return absl::InvalidArgumentError(absl::StrCat("evaluation micro_batch=", options.micro_batch,
                                                   "; expected >= 1, or 0 for run.micro_batch"));
  }
  HETPAR_ASSIGN_OR_RETURN(data::LoaderOptions loader_options,
                          data::LoaderOptionsFromRunSpec(spec, data::Split::kVal));
  if (loader_options.tokens_per_image != encoder.tokens_per_image()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "evaluation: the spec gives ", loader_options.tokens_per_image,
        " tokens per image (encoder.model.image_size / patch, squared) but the encoder makes ",
        encoder.tokens_per_image(), "; build the models from the same spec"));
  }
  if (encoder.model().out_hidden() != llm.model().hidden()) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation: encoder out_hidden=", encoder.model().out_hidden(),
                     " does not match the LLM's hidden=", llm.model().hidden()));
  }
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<data::DataLoader> loader,
                          data::DataLoader::Create(loader_options));
  loader_options.blank_images = true;
  HETPAR_ASSIGN_OR_RETURN(std::unique_ptr<data::DataLoader> blank_loader,
                          data::DataLoader::Create(loader_options));

  EvaluationResult result;
  result.step = options.step;
  result.micro_batch = options.micro_batch > 0 ? options.micro_batch
                                               : std::max<int64_t>(1, spec.run().micro_batch());
  const int64_t n =
      options.max_samples < 0 ? loader->size() : std::min(options.max_samples, loader->size());
  data::CaptionMetricsAccumulator with_images(&loader->tokenizer(), options.lexicon,
                                              /*blank_images=*/false);
  data::CaptionMetricsAccumulator blank_images(&blank_loader->tokenizer(), options.lexicon,
                                               /*blank_images=*/true);
  for (int64_t next = 0; next < n;) {
    // The next micro_batch samples that load. Under data.skip_bad_samples one that does not (a
    // missing or corrupt image, an overlong sample under overlong: reject) is skipped, as the
    // training index skips its kind; otherwise it fails the evaluation, naming it.
    std::vector<data::LoadedSample> with_samples;
    std::vector<data::LoadedSample> blank_samples;
    while (next < n && static_cast<int64_t>(with_samples.size()) < result.micro_batch) {
      const int64_t ordinal = next++;
      absl::StatusOr<data::LoadedSample> sample = loader->Load(ordinal);
      if (!sample.ok()) {
        if (!loader_options.skip_bad_samples) return sample.status();
        HETPAR_LOG(WARNING) << "evaluation: skipping bad sample: "
                            << loader->DescribeProblem(ordinal, sample.status()).ToString();
        ++result.skipped;
        continue;
      }
      HETPAR_ASSIGN_OR_RETURN(data::LoadedSample blank, blank_loader->Load(ordinal));
      with_samples.push_back(*std::move(sample));
      blank_samples.push_back(std::move(blank));
    }
    if (with_samples.empty()) break;
    HETPAR_ASSIGN_OR_RETURN(MicrobatchPredictions with,
                            PredictMicrobatch(std::move(with_samples), encoder, llm));
    HETPAR_ASSIGN_OR_RETURN(MicrobatchPredictions blank,
                            PredictMicrobatch(std::move(blank_samples), encoder, llm));
    for (size_t i = 0; i < with.samples.size(); ++i) {
      const data::LoadedSample& sample = with.samples[i];
      HETPAR_RETURN_IF_ERROR(with_images.Add(sample.tokens, with.ids[i], sample.id));
      HETPAR_RETURN_IF_ERROR(
          blank_images.Add(blank.samples[i].tokens, blank.ids[i], blank.samples[i].id));
      if (options.keep_predictions) {
        result.predictions.push_back({sample.id, std::move(with.ids[i]), std::move(blank.ids[i])});
      }
    }
  }
  result.captions.with_images = with_images.metrics();
  result.captions.blank_images = blank_images.metrics();
  if (result.captions.with_images.samples == 0 && result.skipped > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "evaluation: all ", result.skipped, " validation samples of ", loader_options.manifest,
        " were skipped as bad (data.skip_bad_samples; each is in the log): nothing to evaluate"));
  }
  HETPAR_ASSIGN_OR_RETURN(
      result.captions.reliance,
      data::CompareWithBlankImages(result.captions.with_images, result.captions.blank_images));
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace hetpar::llm
