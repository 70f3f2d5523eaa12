#include "common/data/metrics.h"

#include <stdlib.h>

#include <filesystem>

#include "common/data/synth.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::data {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Tokenizer> Train(int vocab) {
  std::vector<std::string> corpus;
  for (int64_t i = 0; i < 300; ++i) {
    const SynthSample s = MakeSynthSample(4, "train", i, 3);
    corpus.push_back(s.record.text);
  }
  TokenizerTrainOptions options;
  options.vocab_size = vocab;
  options.user_symbols = {"<image>"};
  absl::StatusOr<std::string> model = TrainTokenizer(corpus, options);
  EXPECT_TRUE(model.ok()) << model.status();
  return std::move(*Tokenizer::FromSerialized(*model, "mem"));
}

TokenSequence Sequence(const Tokenizer& tok, const std::string& caption) {
  SequenceOptions o;
  o.tokens_per_image = 2;
  o.seq_len = 128;
  o.image_token_id = *tok.PieceId("<image>");
  o.bos_id = tok.bos_id();
  o.eos_id = tok.eos_id();
  absl::StatusOr<TokenSequence> s =
      BuildTokenSequence({Segment{true, {}}, Segment{false, *tok.Encode("describe the image.")}},
                         {Segment{false, *tok.Encode(caption)}}, o);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

// Perfect predictions, with the positions for which `wrong` says so replaced by a wrong id.
std::vector<int32_t> Predict(const TokenSequence& s, const std::vector<int8_t>& attributes,
                             int wrong_attribute) {
  std::vector<int32_t> p(s.labels.size(), 0);
  for (size_t i = 0; i < p.size(); ++i) {
    if (!s.loss_mask[i]) continue;
    p[i] = s.labels[i];
    if (attributes[i] == wrong_attribute) p[i] = s.labels[i] == 5 ? 6 : 5;
  }
  return p;
}

TEST(MetricsTest, TargetsAreClassifiedByWord) {
  std::unique_ptr<Tokenizer> tok = Train(256);
  const TokenSequence s = Sequence(*tok, "a small red circle at the top left.");
  const std::vector<int8_t> a = TargetAttributes(s, *tok, SynthAttributeLexicon());
  std::vector<std::string> words;
  std::vector<int> classes;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!s.loss_mask[i]) {
      EXPECT_EQ(a[i], -1);
      continue;
    }
    words.push_back(tok->Piece(s.labels[i]));
    classes.push_back(a[i]);
  }
  const std::string w = "\xe2\x96\x81";
  EXPECT_EQ(words,
            (std::vector<std::string>{w + "a", w + "small", w + "red", w + "circle", w + "at",
                                      w + "the", w + "top", w + "left", ".", "</s>"}));
  EXPECT_EQ(classes, (std::vector<int>{-1, 3, 0, 1, -1, -1, 2, 2, -1, -1}));
}

TEST(MetricsTest, WordsSplitIntoSeveralPiecesCountWhole) {
  std::unique_ptr<Tokenizer> tok = Train(48);  // too small for whole words
  const size_t purple = tok->Encode("purple")->size();
  const size_t triangle = tok->Encode("triangle")->size();
  ASSERT_GT(purple + triangle, 2u) << "the small vocabulary should split some words";
  const TokenSequence s = Sequence(*tok, "a large purple triangle at the bottom right.");
  const std::vector<int8_t> a = TargetAttributes(s, *tok, SynthAttributeLexicon());
  std::array<size_t, kAttributes> counts = {0, 0, 0, 0};
  for (int8_t c : a) {
    if (c >= 0) ++counts[static_cast<size_t>(c)];
  }
  EXPECT_EQ(counts[0], purple);
  EXPECT_EQ(counts[1], triangle);
  EXPECT_EQ(counts[2], tok->Encode("bottom")->size() + tok->Encode("right")->size());
  EXPECT_EQ(counts[3], tok->Encode("large")->size());
}

TEST(MetricsTest, AccuraciesCountExactlyTheRightPositions) {
  std::unique_ptr<Tokenizer> tok = Train(256);
  const std::vector<std::string> captions = {
      "a small red circle at the top left.",
      "the first image has a large blue square at the center, the second image is empty.",
      "the image is empty."};
  CaptionMetricsAccumulator perfect(tok.get(), SynthAttributeLexicon(), false);
  CaptionMetricsAccumulator colour_wrong(tok.get(), SynthAttributeLexicon(), false);
  int64_t loss_tokens = 0;
  std::array<int64_t, kAttributes> attribute_tokens = {0, 0, 0, 0};
  for (const std::string& caption : captions) {
    const TokenSequence s = Sequence(*tok, caption);
    const std::vector<int8_t> a = TargetAttributes(s, *tok, SynthAttributeLexicon());
    loss_tokens += s.loss_tokens;
    for (int8_t c : a) {
      if (c >= 0) ++attribute_tokens[static_cast<size_t>(c)];
    }
    ASSERT_TRUE(perfect.Add(s, Predict(s, a, -2), caption).ok());
    ASSERT_TRUE(colour_wrong.Add(s, Predict(s, a, 0), caption).ok());
  }
  EXPECT_EQ(attribute_tokens, (std::array<int64_t, kAttributes>{2, 2, 3, 2}));
  const CaptionMetrics& p = perfect.metrics();
  EXPECT_EQ(p.samples, 3);
  EXPECT_EQ(p.caption_tokens.total, loss_tokens);
  EXPECT_EQ(p.caption_tokens.correct, loss_tokens);
  for (size_t k = 0; k < kAttributes; ++k) {
    EXPECT_EQ(p.attributes[k].total, attribute_tokens[k]);
    EXPECT_EQ(p.attributes[k].value(), 1.0);
  }
  const CaptionMetrics& c = colour_wrong.metrics();
  EXPECT_EQ(c.caption_tokens.correct, loss_tokens - 2);
  EXPECT_EQ(c.attributes[0].correct, 0);
  EXPECT_EQ(c.attributes[0].value(), 0.0);
  EXPECT_EQ(c.attributes[1].value(), 1.0);
  EXPECT_EQ(c.attributes[2].value(), 1.0);
  EXPECT_DOUBLE_EQ(c.caption_tokens.value(),
                   static_cast<double>(loss_tokens - 2) / static_cast<double>(loss_tokens));
  const std::string json = c.ToJson();
  EXPECT_THAT(json, HasSubstr("\"blank_images\":false"));
  EXPECT_THAT(json, HasSubstr("\"samples\":3"));
  EXPECT_THAT(json, HasSubstr("\"colour_accuracy\":0.0,\"colour_tokens\":2"));
  EXPECT_THAT(json, HasSubstr("\"position_accuracy\":1.0,\"position_tokens\":3"));
  EXPECT_THAT(json, HasSubstr(absl::StrCat("\"caption_tokens\":", loss_tokens)));
}

TEST(MetricsTest, BlankImageBaselineComparison) {
  std::unique_ptr<Tokenizer> tok = Train(256);
  const TokenSequence s = Sequence(*tok, "a small red circle at the top left.");
  const std::vector<int8_t> a = TargetAttributes(s, *tok, SynthAttributeLexicon());
  CaptionMetricsAccumulator with(tok.get(), SynthAttributeLexicon(), false);
  CaptionMetricsAccumulator blank(tok.get(), SynthAttributeLexicon(), true);
  ASSERT_TRUE(with.Add(s, Predict(s, a, -2), "s").ok());
  ASSERT_TRUE(blank.Add(s, Predict(s, a, 1), "s").ok());  // the shape is missed without images
  absl::StatusOr<ImageReliance> gain = CompareWithBlankImages(with.metrics(), blank.metrics());
  ASSERT_TRUE(gain.ok()) << gain.status();
  EXPECT_DOUBLE_EQ(gain->caption_tokens, 1.0 / s.loss_tokens);
  EXPECT_EQ(gain->attributes, (std::array<double, kAttributes>{0.0, 1.0, 0.0, 0.0}));
  EXPECT_THAT(gain->ToJson(), HasSubstr("\"shape_accuracy_gain\":1.0"));
  EXPECT_THAT(blank.metrics().ToJson(), HasSubstr("\"blank_images\":true"));

  EXPECT_FALSE(CompareWithBlankImages(blank.metrics(), with.metrics()).ok());
  CaptionMetricsAccumulator more(tok.get(), SynthAttributeLexicon(), true);
  ASSERT_TRUE(more.Add(s, Predict(s, a, -2), "s").ok());
  ASSERT_TRUE(more.Add(s, Predict(s, a, -2), "t").ok());
  absl::StatusOr<ImageReliance> mismatch = CompareWithBlankImages(with.metrics(), more.metrics());
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("different data"));
}

TEST(MetricsTest, PredictionLengthMustMatch) {
  std::unique_ptr<Tokenizer> tok = Train(256);
  const TokenSequence s = Sequence(*tok, "the image is empty.");
  CaptionMetricsAccumulator m(tok.get(), SynthAttributeLexicon(), false);
  absl::Status status = m.Add(s, std::vector<int32_t>(3, 0), "val-000001");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("sample 'val-000001': 3 predictions"));
  EXPECT_EQ(m.metrics().samples, 0);
}

TEST(MetricsTest, EvaluationOnASplitSeesWhatTheImagesAreWorth) {
  namespace fs = std::filesystem;
  std::string dir = (fs::temp_directory_path() / "hetpar_metrics_XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  SynthOptions o = SynthOptionsForDirectory(dir);
  o.samples = 8;
  o.val_samples = 24;
  o.seed = 2;
  ASSERT_TRUE(GenerateSyntheticDataset(o).ok());
  LoaderOptions lo;
  lo.manifest = dir + "/val.jsonl";
  lo.tokenizer = dir + "/tokenizer.model";
  lo.image_size = 32;
  lo.tokens_per_image = 16;
  lo.seq_len = 128;
  std::unique_ptr<DataLoader> loader = std::move(*DataLoader::Create(lo));
  const AttributeLexicon lexicon = SynthAttributeLexicon();
  // A model that reads its images: perfect when it sees any non-blank pixel, and without them
  // right on everything but the colours.
  int64_t calls = 0;
  int64_t image_samples = 0;
  PredictFn predict = [&](const LoadedSample& s) -> absl::StatusOr<std::vector<int32_t>> {
    ++calls;
    bool sees = false;
    for (const std::vector<float>& image : s.images) {
      for (float v : image) sees = sees || v != 0.0f;
    }
    if (sees) ++image_samples;
    const std::vector<int8_t> a = TargetAttributes(s.tokens, loader->tokenizer(), lexicon);
    return Predict(s.tokens, a, s.images.empty() || sees ? -2 : 0);
  };
  absl::StatusOr<CaptionEvaluation> eval = EvaluateCaptions(*loader, lexicon, predict);
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_EQ(calls, 48);
  EXPECT_GT(image_samples, 10);
  EXPECT_EQ(eval->with_images.samples, 24);
  EXPECT_EQ(eval->blank_images.samples, 24);
  EXPECT_FALSE(eval->with_images.blank_images);
  EXPECT_TRUE(eval->blank_images.blank_images);
  EXPECT_EQ(eval->with_images.caption_tokens.value(), 1.0);
  const Accuracy& colour = eval->blank_images.attributes[0];
  EXPECT_GT(colour.total, 0);
  EXPECT_EQ(colour.correct, 0);
  EXPECT_EQ(eval->reliance.attributes[0], 1.0);
  EXPECT_EQ(eval->reliance.attributes[1], 0.0);
  EXPECT_DOUBLE_EQ(eval->reliance.caption_tokens,
                   static_cast<double>(colour.total) / eval->with_images.caption_tokens.total);
  EXPECT_THAT(eval->ToJson(), HasSubstr("\"image_reliance\":{\"caption_token_accuracy_gain\""));
  // A failing model stops the evaluation with its error.
  PredictFn broken = [](const LoadedSample& s) -> absl::StatusOr<std::vector<int32_t>> {
    return absl::InternalError("model failed on " + s.id);
  };
  absl::StatusOr<CaptionEvaluation> failed = EvaluateCaptions(*loader, lexicon, broken, 3);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("val-000000"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hetpar::data
