// Evaluation of captions from model predictions: caption token accuracy and accuracy per
// attribute (colour, shape, position, size) on the validation split, and the same for the
// text-only baseline (the loader's blank_images), so a user sees how much the model uses its
// images.
//
// Input per sample: its TokenSequence and the model's predictions, one token id per position
// (the argmax at position i predicts input_ids[i + 1], so it is compared with labels[i]). Only
// positions with loss_mask = 1 count. A target token belongs to an attribute when the word it is
// part of (the pieces from one starting with "▁", or a bare "▁", up to the next word start or
// punctuation) is one of that attribute's words; punctuation pieces belong to none.
#ifndef HETPAR_COMMON_DATA_METRICS_H_
#define HETPAR_COMMON_DATA_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/data/loader.h"
#include "common/data/sequence.h"
#include "common/data/tokenizer.h"

namespace hetpar::data {

enum class Attribute { kColour = 0, kShape = 1, kPosition = 2, kSize = 3 };
inline constexpr int kAttributes = 4;
std::string_view AttributeName(Attribute attribute);  // "colour", "shape", "position", "size"

// Word (lower case, no punctuation) -> attribute.
using AttributeLexicon = std::map<std::string, Attribute>;

// The synthetic set's words: its colours, shapes, position words (top, bottom, left, right,
// center) and sizes.
AttributeLexicon SynthAttributeLexicon();

// For each position of `sequence`: the attribute of labels[i] where loss_mask[i] = 1, else -1.
std::vector<int8_t> TargetAttributes(const TokenSequence& sequence, const Tokenizer& tokenizer,
                                     const AttributeLexicon& lexicon);

struct Accuracy {
  int64_t correct = 0;
  int64_t total = 0;
  double value() const { return total == 0 ? 0.0 : static_cast<double>(correct) / total; }
};

struct CaptionMetrics {
  bool blank_images = false;  // computed on the text-only baseline
  int64_t samples = 0;
  Accuracy caption_tokens;  // every loss position
  std::array<Accuracy, kAttributes> attributes;

  // {"blank_images":false,"samples":128,"caption_token_accuracy":0.91,"caption_tokens":1630,
  //  "colour_accuracy":0.88,"colour_tokens":210,...}
  std::string ToJson() const;
};

// Accumulates CaptionMetrics over samples. Not thread-safe.
class CaptionMetricsAccumulator {
 public:
  // `tokenizer` must outlive the accumulator.
  CaptionMetricsAccumulator(const Tokenizer* tokenizer, AttributeLexicon lexicon,
                            bool blank_images);

  // InvalidArgument (naming `sample_id`) when predictions.size() != the sequence length.
  absl::Status Add(const TokenSequence& sequence, const std::vector<int32_t>& predictions,
                   std::string_view sample_id);
  const CaptionMetrics& metrics() const { return metrics_; }

 private:
  const Tokenizer* tokenizer_;
  AttributeLexicon lexicon_;
  CaptionMetrics metrics_;
};

// How much the model uses its images: accuracy with images minus accuracy with blank images.
struct ImageReliance {
  double caption_tokens = 0;
  std::array<double, kAttributes> attributes = {0, 0, 0, 0};
  std::string ToJson() const;
};

// InvalidArgument unless `with_images` is not blank, `blank` is, and they cover the same number
// of samples and caption tokens (the same split).
absl::StatusOr<ImageReliance> CompareWithBlankImages(const CaptionMetrics& with_images,
                                                     const CaptionMetrics& blank);

// The model under evaluation: for a loaded sample, one predicted token id per position (the
// argmax of its logits). Called with real images and again with blank ones.
using PredictFn = std::function<absl::StatusOr<std::vector<int32_t>>(const LoadedSample&)>;

struct CaptionEvaluation {
  CaptionMetrics with_images;
  CaptionMetrics blank_images;  // the text-only baseline: every image zeros (mid-grey)
  ImageReliance reliance;       // with_images - blank_images
  // {"with_images":{...},"blank_images":{...},"image_reliance":{...}}
  std::string ToJson() const;
};

// Evaluates `predict` on the first `max_samples` samples of `loader` (all when < 0), usually the
// validation split: each sample is loaded once, predicted with its images and with blank images
// (same tokens, image buffers zeroed). The first load or prediction error stops it.
absl::StatusOr<CaptionEvaluation> EvaluateCaptions(const DataLoader& loader,
                                                   const AttributeLexicon& lexicon,
                                                   const PredictFn& predict,
                                                   int64_t max_samples = -1);

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_METRICS_H_
