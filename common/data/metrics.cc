#include "common/data/metrics.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/config/config.h"
#include "common/data/synth.h"

namespace hetpar::data {
namespace {

constexpr std::string_view kWordStart = "\xe2\x96\x81";  // U+2581, sentencepiece's word start

bool StartsWord(const std::string& piece) {
  return piece.compare(0, kWordStart.size(), kWordStart) == 0;
}

// The letters and digits of a piece, lower-cased (the word-start mark removed).
std::string WordChars(const std::string& piece) {
  std::string out;
  for (unsigned char c : piece) {
    if (std::isalnum(c)) out.push_back(static_cast<char>(std::tolower(c)));
  }
  return out;
}

}  // namespace

std::string_view AttributeName(Attribute attribute) {
  switch (attribute) {
    case Attribute::kColour:
      return "colour";
    case Attribute::kShape:
      return "shape";
    case Attribute::kPosition:
      return "position";
    case Attribute::kSize:
      return "size";
  }
  return "unknown";
}

AttributeLexicon SynthAttributeLexicon() {
  AttributeLexicon lexicon;
  for (const char* w : SynthColourNames()) lexicon[w] = Attribute::kColour;
  for (const char* w : SynthShapeNames()) lexicon[w] = Attribute::kShape;
  for (const char* name : SynthCellNames()) {
    const std::vector<std::string> words = absl::StrSplit(name, ' ');
    for (const std::string& w : words) lexicon[w] = Attribute::kPosition;
  }
  for (const char* w : SynthSizeNames()) lexicon[w] = Attribute::kSize;
  return lexicon;
}

std::vector<int8_t> TargetAttributes(const TokenSequence& sequence, const Tokenizer& tokenizer,
                                     const AttributeLexicon& lexicon) {
  const size_t n = sequence.labels.size();
  std::vector<int8_t> out(n, -1);
  std::vector<size_t> word;  // positions of the current word's pieces
  std::string text;
  auto finish = [&] {
    if (!word.empty()) {
      auto it = lexicon.find(text);
      if (it != lexicon.end()) {
        for (size_t p : word) out[p] = static_cast<int8_t>(it->second);
      }
    }
    word.clear();
    text.clear();
  };
  for (size_t i = 0; i < n; ++i) {
    if (!sequence.loss_mask[i]) {
      finish();
      continue;
    }
    const std::string piece = tokenizer.Piece(sequence.labels[i]);
    if (piece == kWordStart) {  // a bare word-start mark: the first piece of a split word
      finish();
      word.push_back(i);
      continue;
    }
    const std::string chars = WordChars(piece);
    if (chars.empty()) {  // punctuation or a control piece ends a word and belongs to none
      finish();
      continue;
    }
    if (StartsWord(piece)) finish();
    word.push_back(i);
    text += chars;
  }
  finish();
  return out;
}

std::string CaptionMetrics::ToJson() const {
  std::string out =
      absl::StrCat("{\"blank_images\":", blank_images ? "true" : "false", ",\"samples\":", samples,
                   ",\"caption_token_accuracy\":", config::FormatDouble(caption_tokens.value()),
                   ",\"caption_tokens\":", caption_tokens.total);
  for (int a = 0; a < kAttributes; ++a) {
    const std::string name(AttributeName(static_cast<Attribute>(a)));
    absl::StrAppend(&out, ",\"", name, "_accuracy\":",
                    config::FormatDouble(attributes[static_cast<size_t>(a)].value()), ",\"", name,
                    "_tokens\":", attributes[static_cast<size_t>(a)].total);
  }
  out += "}";
  return out;
}

CaptionMetricsAccumulator::CaptionMetricsAccumulator(const Tokenizer* tokenizer,
                                                     AttributeLexicon lexicon, bool blank_images)
    : tokenizer_(tokenizer), lexicon_(std::move(lexicon)) {
  metrics_.blank_images = blank_images;
}

absl::Status CaptionMetricsAccumulator::Add(const TokenSequence& sequence,
                                            const std::vector<int32_t>& predictions,
                                            std::string_view sample_id) {
  if (predictions.size() != sequence.labels.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sample '", std::string(sample_id), "': ", predictions.size(),
                     " predictions for a sequence of ", sequence.labels.size(),
                     " positions; expected one predicted token id per position"));
  }
  const std::vector<int8_t> attributes = TargetAttributes(sequence, *tokenizer_, lexicon_);
  for (size_t i = 0; i < predictions.size(); ++i) {
    if (!sequence.loss_mask[i]) continue;
    const bool correct = predictions[i] == sequence.labels[i];
    ++metrics_.caption_tokens.total;
    metrics_.caption_tokens.correct += correct;
    if (attributes[i] >= 0) {
      Accuracy& a = metrics_.attributes[static_cast<size_t>(attributes[i])];
      ++a.total;
      a.correct += correct;
    }
  }
  ++metrics_.samples;
  return absl::OkStatus();
}

std::string ImageReliance::ToJson() const {
  std::string out =
      absl::StrCat("{\"caption_token_accuracy_gain\":", config::FormatDouble(caption_tokens));
  for (int a = 0; a < kAttributes; ++a) {
    absl::StrAppend(&out, ",\"", std::string(AttributeName(static_cast<Attribute>(a))),
                    "_accuracy_gain\":", config::FormatDouble(attributes[static_cast<size_t>(a)]));
  }
  out += "}";
  return out;
}

absl::StatusOr<ImageReliance> CompareWithBlankImages(const CaptionMetrics& with_images,
                                                     const CaptionMetrics& blank) {
  if (with_images.blank_images || !blank.blank_images) {
    return absl::InvalidArgumentError(
        "compare metrics with images (blank_images=false) to metrics with blank images "
        "(blank_images=true)");
  }
  if (with_images.samples != blank.samples ||
      with_images.caption_tokens.total != blank.caption_tokens.total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the two evaluations cover different data: ", with_images.samples, " samples / ",
        with_images.caption_tokens.total, " caption tokens with images, ", blank.samples, " / ",
        blank.caption_tokens.total, " blank; expected the same split"));
  }
  ImageReliance out;
  out.caption_tokens = with_images.caption_tokens.value() - blank.caption_tokens.value();
  for (size_t a = 0; a < kAttributes; ++a) {
    out.attributes[a] = with_images.attributes[a].value() - blank.attributes[a].value();
  }
  return out;
}

std::string CaptionEvaluation::ToJson() const {
  return absl::StrCat("{\"with_images\":", with_images.ToJson(),
                      ",\"blank_images\":", blank_images.ToJson(),
                      ",\"image_reliance\":", reliance.ToJson(), "}");
}

absl::StatusOr<CaptionEvaluation> EvaluateCaptions(const DataLoader& loader,
                                                   const AttributeLexicon& lexicon,
                                                   const PredictFn& predict, int64_t max_samples) {
  const int64_t n = max_samples < 0 ? loader.size() : std::min(max_samples, loader.size());
  CaptionMetricsAccumulator with(&loader.tokenizer(), lexicon, /*blank_images=*/false);
  CaptionMetricsAccumulator blank(&loader.tokenizer(), lexicon, /*blank_images=*/true);
  for (int64_t i = 0; i < n; ++i) {
    absl::StatusOr<LoadedSample> sample = loader.Load(i);
    if (!sample.ok()) return sample.status();
    absl::StatusOr<std::vector<int32_t>> predicted = predict(*sample);
    if (!predicted.ok()) return predicted.status();
    if (absl::Status s = with.Add(sample->tokens, *predicted, sample->id); !s.ok()) return s;
    for (std::vector<float>& image : sample->images) std::fill(image.begin(), image.end(), 0.0f);
    absl::StatusOr<std::vector<int32_t>> baseline = predict(*sample);
    if (!baseline.ok()) return baseline.status();
    if (absl::Status s = blank.Add(sample->tokens, *baseline, sample->id); !s.ok()) return s;
  }
  CaptionEvaluation out;
  out.with_images = with.metrics();
  out.blank_images = blank.metrics();
  absl::StatusOr<ImageReliance> reliance =
      CompareWithBlankImages(out.with_images, out.blank_images);
  if (!reliance.ok()) return reliance.status();
  out.reliance = *reliance;
  return out;
}

}  // namespace hetpar::data
