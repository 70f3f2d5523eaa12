#include "llm_trainer/reference/evaluation.h"

#include <ATen/ATen.h>
#include <stdlib.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/config/config.h"
#include "common/data/synth.h"
#include "common/nn/export.h"
#include "common/nn/test_ranks.h"
#include "common/status.h"
#include "common/train/batch.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "llm_trainer/llm_inputs.h"
#include "nlohmann/json.hpp"

namespace hetpar::llm {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int64_t kValSamples = 12;

// The tiny models of configs/tiny.yaml in float64, one replica of each, on a 12-sample
// validation split.
std::string SpecYaml(const std::string& dir, bool with_val = true) {
  return absl::StrCat(R"(
run: {name: eval, steps: 1, global_batch: 4, micro_batch: 2, seed: 1234, dtype: float64}
placement: non_colocated
encoder:
  model: {image_size: 32, patch: 8, hidden: 64, layers: 2, heads: 4, mlp: 128, out_hidden: 64}
  layout: {dp: 1, tp: 1}
llm:
  model: {hidden: 64, layers: 2, heads: 4, kv_heads: 2, ffn: 128, vocab: 256, seq_len: 128}
  layout: {dp: 1, tp: 1, cp: 1, pp: 1}
data:
  manifest: )",
                      dir, "/train.jsonl\n",
                      with_val ? absl::StrCat("  val_manifest: ", dir, "/val.jsonl\n") : "",
                      "  tokenizer: ", dir, R"(/tokenizer.model
  synth: {samples: 8, val_samples: 12, seed: 3}
)");
}

absl::StatusOr<hetpar::v1::RunSpec> LoadSpec(const std::string& yaml) {
  config::LoadOptions options;
  options.check_files = false;
  HETPAR_ASSIGN_OR_RETURN(config::LoadedRunSpec loaded,
                          config::LoadRunSpecFromString(yaml, "evaluation_test.yaml", options));
  return loaded.spec;
}

struct Models {
  std::unique_ptr<encoder::VisionEncoder> encoder;
  std::unique_ptr<LanguageModel> llm;
};

absl::StatusOr<Models> BuildModels(const hetpar::v1::RunSpec& spec, nn::Communicator& tp,
                                   bool sequence_parallel) {
  Models m;
  HETPAR_ASSIGN_OR_RETURN(encoder::EncoderOptions encoder_options,
                          encoder::EncoderOptionsFromSpec(spec));
  encoder_options.sequence_parallel = sequence_parallel;
  HETPAR_ASSIGN_OR_RETURN(
      m.encoder, encoder::VisionEncoder::Create(spec.encoder().model(), encoder_options, tp));
  HETPAR_ASSIGN_OR_RETURN(LlmOptions llm_options, LlmOptionsFromSpec(spec));
  llm_options.sequence_parallel = sequence_parallel;
  HETPAR_ASSIGN_OR_RETURN(m.llm, LanguageModel::Create(spec.llm().model(), llm_options, tp));
  return m;
}

// The JSON line without the wall time, which differs between runs.
std::string Deterministic(EvaluationResult result) {
  result.seconds = 0;
  return result.ToJson();
}

class EvaluationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string((fs::temp_directory_path() / "hetpar_eval_XXXXXX").string());
    ASSERT_NE(::mkdtemp(dir_->data()), nullptr);
    auto spec = LoadSpec(SpecYaml(*dir_));
    ASSERT_TRUE(spec.ok()) << spec.status();
    spec_ = new hetpar::v1::RunSpec(*spec);
    auto generated = data::EnsureSyntheticDataset(*spec_);
    ASSERT_TRUE(generated.ok()) << generated.status();
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
    delete spec_;
  }

  // EvaluateCaptioning on every rank of a TP group of `tp` threads; returns rank 0's result
  // after checking that every rank got the same one.
  static EvaluationResult EvaluateAt(int tp, bool sp, EvaluationOptions options,
                                     const std::string& load_encoder = "",
                                     const std::string& load_llm = "") {
    options.keep_predictions = true;
    std::vector<EvaluationResult> results(tp);
    absl::Status status = nn::testing::RunRanks(tp, [&](int rank, nn::Communicator& comm) {
      HETPAR_ASSIGN_OR_RETURN(Models m, BuildModels(*spec_, comm, sp));
      if (!load_encoder.empty()) {
        HETPAR_RETURN_IF_ERROR(nn::LoadFullParameters(m.encoder->parameters(), load_encoder));
        HETPAR_RETURN_IF_ERROR(nn::LoadFullParameters(m.llm->parameters(), load_llm));
      }
      HETPAR_ASSIGN_OR_RETURN(results[rank],
                              EvaluateCaptioning(*spec_, *m.encoder, *m.llm, options));
      return absl::OkStatus();
    });
    EXPECT_TRUE(status.ok()) << status;
    for (int rank = 1; rank < tp; ++rank) {
      EXPECT_EQ(Deterministic(results[rank]), Deterministic(results[0])) << "rank " << rank;
      if (results[rank].predictions.size() != results[0].predictions.size()) {
        ADD_FAILURE() << "rank " << rank << " kept " << results[rank].predictions.size()
                      << " predictions, rank 0 " << results[0].predictions.size();
        continue;
      }
      for (size_t s = 0; s < results[0].predictions.size(); ++s) {
        EXPECT_EQ(results[rank].predictions[s].with_images, results[0].predictions[s].with_images);
        EXPECT_EQ(results[rank].predictions[s].blank_images,
                  results[0].predictions[s].blank_images);
      }
    }
    return results[0];
  }

  static void ExpectSamePredictions(const EvaluationResult& a, const EvaluationResult& b) {
    ASSERT_EQ(a.predictions.size(), b.predictions.size());
    for (size_t s = 0; s < a.predictions.size(); ++s) {
      EXPECT_EQ(a.predictions[s].id, b.predictions[s].id);
      EXPECT_EQ(a.predictions[s].with_images, b.predictions[s].with_images) << a.predictions[s].id;
      EXPECT_EQ(a.predictions[s].blank_images, b.predictions[s].blank_images)
          << a.predictions[s].id;
    }
  }

  static std::unique_ptr<data::DataLoader> ValLoader() {
    auto options = data::LoaderOptionsFromRunSpec(*spec_, data::Split::kVal);
    EXPECT_TRUE(options.ok()) << options.status();
    auto loader = data::DataLoader::Create(*options);
    EXPECT_TRUE(loader.ok()) << loader.status();
    return loader.ok() ? *std::move(loader) : nullptr;
  }

  static std::string* dir_;
  static hetpar::v1::RunSpec* spec_;
};

std::string* EvaluationTest::dir_ = nullptr;
hetpar::v1::RunSpec* EvaluationTest::spec_ = nullptr;

TEST_F(EvaluationTest, MicrobatchedEqualsOneSampleAtATimeThroughEvaluateCaptions) {
  EvaluationOptions options;
  options.micro_batch = 5;  // 12 samples: 5 + 5 + 2
  const EvaluationResult result = EvaluateAt(1, false, options);

  // The same models, one sample per forward, through data::EvaluateCaptions (which zeroes the
  // image buffers for its blank pass).
  auto single = nn::Communicator::CreateSingle();
  auto models = BuildModels(*spec_, *single, false);
  ASSERT_TRUE(models.ok()) << models.status();
  std::map<std::string, std::vector<std::vector<int32_t>>> calls;  // id -> [with, blank]
  data::PredictFn predict =
      [&](const data::LoadedSample& sample) -> absl::StatusOr<std::vector<int32_t>> {
    std::vector<const std::vector<float>*> pixels;
    for (const auto& image : sample.images) pixels.push_back(&image);
    at::Tensor rows;
    if (!pixels.empty()) {
      HETPAR_ASSIGN_OR_RETURN(at::Tensor images, train::ImagesTensor(pixels, 3, 32, at::kDouble));
      at::NoGradGuard no_grad;
      HETPAR_ASSIGN_OR_RETURN(rows, models->encoder->Forward(images));
    }
    HETPAR_ASSIGN_OR_RETURN(
        auto ids,
        models->llm->Predict({LlmSampleOf(sample, models->encoder->tokens_per_image())}, rows));
    calls[sample.id].push_back(ids[0]);
    return ids[0];
  };
  std::unique_ptr<data::DataLoader> loader = ValLoader();
  ASSERT_NE(loader, nullptr);
  auto reference = data::EvaluateCaptions(*loader, data::SynthAttributeLexicon(), predict);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(result.captions.ToJson(), reference->ToJson());

  ASSERT_EQ(result.predictions.size(), static_cast<size_t>(kValSamples));
  int64_t loss_tokens = 0, image_samples = 0, text_samples = 0;
  for (int64_t i = 0; i < kValSamples; ++i) {
    const SamplePredictions& p = result.predictions[i];
    auto sample = loader->Load(i);
    ASSERT_TRUE(sample.ok()) << sample.status();
    EXPECT_EQ(p.id, sample->id);
    ASSERT_EQ(calls[p.id].size(), 2u);
    EXPECT_EQ(p.with_images, calls[p.id][0]) << p.id;
    EXPECT_EQ(p.blank_images, calls[p.id][1]) << p.id;
    EXPECT_EQ(p.with_images.size(), sample->tokens.input_ids.size());
    loss_tokens += sample->tokens.loss_tokens;
    if (sample->images.empty()) {
      ++text_samples;
      EXPECT_EQ(p.with_images, p.blank_images) << p.id << " has no image to blank";
    } else {
      ++image_samples;
      // The images reach the predictions: blanking them changes what the model says.
      EXPECT_NE(p.with_images, p.blank_images) << p.id;
    }
  }
  EXPECT_GT(image_samples, 0);
  EXPECT_EQ(result.captions.with_images.samples, kValSamples);
  EXPECT_EQ(result.captions.blank_images.samples, kValSamples);
  EXPECT_EQ(result.captions.with_images.caption_tokens.total, loss_tokens);
  EXPECT_EQ(result.micro_batch, 5);
}

TEST_F(EvaluationTest, EveryTpSizeAndMicrobatchGivesTheSameResult) {
  EvaluationOptions options;  // micro_batch 0: run.micro_batch = 2
  const EvaluationResult base = EvaluateAt(1, false, options);
  EXPECT_EQ(base.micro_batch, 2);
  for (bool sp : {false, true}) {
    SCOPED_TRACE(absl::StrCat("tp=2 sp=", sp));
    const EvaluationResult tp2 = EvaluateAt(2, sp, options);
    EXPECT_EQ(Deterministic(tp2), Deterministic(base));
    ExpectSamePredictions(tp2, base);
  }
  for (int64_t micro_batch : {1, 12}) {
    SCOPED_TRACE(absl::StrCat("micro_batch=", micro_batch));
    options.micro_batch = micro_batch;
    const EvaluationResult other = EvaluateAt(1, false, options);
    EXPECT_EQ(other.captions.ToJson(), base.captions.ToJson());
    ExpectSamePredictions(other, base);
  }
  // The first samples only.
  options.micro_batch = 2;
  options.max_samples = 5;
  const EvaluationResult first = EvaluateAt(2, false, options);
  ASSERT_EQ(first.predictions.size(), 5u);
  EXPECT_EQ(first.captions.with_images.samples, 5);
  for (size_t s = 0; s < 5; ++s) {
    EXPECT_EQ(first.predictions[s].with_images, base.predictions[s].with_images);
  }
}

// A model that predicts one chosen token at every text position: the layers' output
// projections are zero (the residual stream stays the input embedding), every embedding has
// +1 in feature 0, and the output head has a single non-zero entry, (token, feature 0).
void MakeOracle(Models& m, int64_t token) {
  at::NoGradGuard no_grad;
  nn::ParameterSet& p = m.llm->parameters();
  for (int64_t i = 0; i < m.llm->model().layers(); ++i) {
    p.Find(absl::StrCat("llm.layers.", i, ".attn.proj.weight"))->tensor.zero_();
    p.Find(absl::StrCat("llm.layers.", i, ".mlp.down.weight"))->tensor.zero_();
  }
  p.Find("llm.embed.weight")->tensor.select(1, 0).fill_(1.0);
  at::Tensor output = p.Find("llm.output.weight")->tensor;
  output.zero_();
  output[token][0] = 1.0;
}

TEST_F(EvaluationTest, CountsExactlyAndSurvivesExportAtAnotherTpSize) {
  std::unique_ptr<data::DataLoader> loader = ValLoader();
  ASSERT_NE(loader, nullptr);
  // The most frequent caption token of the split, and what predicting it everywhere scores.
  const data::AttributeLexicon lexicon = data::SynthAttributeLexicon();
  std::map<int32_t, int64_t> frequency;
  std::vector<data::TokenSequence> sequences;
  for (int64_t i = 0; i < kValSamples; ++i) {
    auto tokens = loader->Tokenize(i);
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    for (size_t k = 0; k < tokens->labels.size(); ++k) {
      if (tokens->loss_mask[k]) ++frequency[tokens->labels[k]];
    }
    sequences.push_back(*std::move(tokens));
  }
  int32_t token = 0;
  for (const auto& [id, count] : frequency) {
    if (count > frequency[token]) token = id;
  }
  int64_t total = 0, correct = 0;
  std::array<int64_t, data::kAttributes> attribute_total = {}, attribute_correct = {};
  for (const data::TokenSequence& s : sequences) {
    const std::vector<int8_t> attributes = data::TargetAttributes(s, loader->tokenizer(), lexicon);
    for (size_t k = 0; k < s.labels.size(); ++k) {
      if (!s.loss_mask[k]) continue;
      ++total;
      correct += s.labels[k] == token;
      if (attributes[k] >= 0) {
        ++attribute_total[attributes[k]];
        attribute_correct[attributes[k]] += s.labels[k] == token;
      }
    }
  }
  ASSERT_GT(correct, 0);

  auto single = nn::Communicator::CreateSingle();
  auto oracle = BuildModels(*spec_, *single, false);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  MakeOracle(*oracle, token);
  EvaluationOptions options;
  options.step = 7;
  options.keep_predictions = true;
  auto result = EvaluateCaptioning(*spec_, *oracle->encoder, *oracle->llm, options);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const data::CaptionMetrics* m :
       {&result->captions.with_images, &result->captions.blank_images}) {
    EXPECT_EQ(m->caption_tokens.total, total);
    EXPECT_EQ(m->caption_tokens.correct, correct);
    for (size_t a = 0; a < data::kAttributes; ++a) {
      EXPECT_EQ(m->attributes[a].total, attribute_total[a]) << a;
      EXPECT_EQ(m->attributes[a].correct, attribute_correct[a]) << a;
    }
  }
  EXPECT_EQ(result->captions.reliance.caption_tokens, 0.0);
  for (size_t s = 0; s < sequences.size(); ++s) {
    for (size_t k = 0; k < sequences[s].labels.size(); ++k) {
      if (sequences[s].loss_mask[k]) {
        EXPECT_EQ(result->predictions[s].with_images[k], token);
      }
    }
  }

  // Exported from tp=1, imported at tp=2: the same evaluation; fresh tp=2 models without the
  // import score differently.
  const std::string encoder_file = *dir_ + "/export/encoder.hpar";
  const std::string llm_file = *dir_ + "/export/llm.hpar";
  ASSERT_TRUE(nn::SaveFullParameters(oracle->encoder->parameters(), *single, encoder_file).ok());
  ASSERT_TRUE(nn::SaveFullParameters(oracle->llm->parameters(), *single, llm_file).ok());
  options.keep_predictions = false;
  const EvaluationResult imported = EvaluateAt(2, false, options, encoder_file, llm_file);
  EXPECT_EQ(Deterministic(imported), Deterministic(*result));
  const EvaluationResult fresh = EvaluateAt(2, false, options);
  EXPECT_NE(fresh.captions.with_images.caption_tokens.correct, correct);
}

TEST_F(EvaluationTest, ToJsonIsOneMetricsLine) {
  EvaluationOptions options;
  options.step = 120;
  options.max_samples = 3;
  const EvaluationResult result = EvaluateAt(1, false, options);
  const nlohmann::json line = nlohmann::json::parse(result.ToJson());
  ASSERT_EQ(line.size(), 1u);
  const nlohmann::json& eval = line.at("eval");
  EXPECT_EQ(eval.at("step"), 120);
  EXPECT_EQ(eval.at("split"), "val");
  EXPECT_EQ(eval.at("samples"), 3);
  EXPECT_EQ(eval.at("micro_batch"), 2);
  EXPECT_EQ(eval.at("seconds").get<double>(), result.seconds);
  EXPECT_GT(result.seconds, 0);
  EXPECT_EQ(eval.at("with_images"), nlohmann::json::parse(result.captions.with_images.ToJson()));
  EXPECT_EQ(eval.at("blank_images"), nlohmann::json::parse(result.captions.blank_images.ToJson()));
  EXPECT_EQ(eval.at("image_reliance"), nlohmann::json::parse(result.captions.reliance.ToJson()));
  EXPECT_EQ(eval.at("with_images").at("caption_tokens"),
            result.captions.with_images.caption_tokens.total);
  EvaluationResult no_step = result;
  no_step.step = -1;
  EXPECT_FALSE(nlohmann::json::parse(no_step.ToJson()).at("eval").contains("step"));
}

// A bad validation sample (here a missing image) is skipped and counted under
// data.skip_bad_samples, and the others are evaluated as without it; otherwise it fails the
// evaluation, named.
TEST_F(EvaluationTest, ABadSampleIsSkippedUnderSkipBadSamplesAndNamedOtherwise) {
  const std::string manifest = *dir_ + "/val-with-bad.jsonl";
  {
    std::ifstream in(*dir_ + "/val.jsonl");
    std::ofstream out(manifest);
    std::string line;
    for (int i = 0; std::getline(in, line); ++i) {
      if (i == 5) {
        out << R"({"id": "lost", "prompt": "<image>describe the image.", "images": ["gone.png"], )"
            << R"("text": "the image is gone."})"
            << "\n";
      }
      out << line << "\n";
    }
  }
  hetpar::v1::RunSpec skipping = *spec_;
  skipping.mutable_data()->set_val_manifest(manifest);
  skipping.mutable_data()->set_skip_bad_samples(true);
  auto single = nn::Communicator::CreateSingle();
  auto m = BuildModels(*spec_, *single, false);
  ASSERT_TRUE(m.ok()) << m.status();
  auto clean = EvaluateCaptioning(*spec_, *m->encoder, *m->llm, EvaluationOptions());
  ASSERT_TRUE(clean.ok()) << clean.status();
  auto skipped = EvaluateCaptioning(skipping, *m->encoder, *m->llm, EvaluationOptions());
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_EQ(skipped->skipped, 1);
  EXPECT_EQ(clean->skipped, 0);
  EXPECT_EQ(skipped->captions.with_images.samples, kValSamples);
  EXPECT_EQ(nlohmann::json::parse(skipped->ToJson()).at("eval").at("skipped"), 1);
  skipped->skipped = 0;
  EXPECT_EQ(Deterministic(*skipped), Deterministic(*clean));

  hetpar::v1::RunSpec strict = skipping;
  strict.mutable_data()->set_skip_bad_samples(false);
  auto failed = EvaluateCaptioning(strict, *m->encoder, *m->llm, EvaluationOptions());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("gone.png"));
}

TEST_F(EvaluationTest, ErrorsSayWhatToFix) {
  auto single = nn::Communicator::CreateSingle();
  auto m = BuildModels(*spec_, *single, false);
  ASSERT_TRUE(m.ok()) << m.status();
  EvaluationOptions options;
  options.micro_batch = -1;
  auto negative = EvaluateCaptioning(*spec_, *m->encoder, *m->llm, options);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(negative.status().message()), HasSubstr("micro_batch=-1"));

  auto no_val = LoadSpec(SpecYaml(*dir_, /*with_val=*/false));
  ASSERT_TRUE(no_val.ok()) << no_val.status();
  auto missing = EvaluateCaptioning(*no_val, *m->encoder, *m->llm, EvaluationOptions());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("data.val_manifest"));

  // Models of another spec: 4 x 4 tokens per image in the spec, 2 x 2 in the encoder.
  hetpar::v1::RunSpec other = *spec_;
  other.mutable_encoder()->mutable_model()->set_patch(16);
  auto other_models = BuildModels(other, *single, false);
  ASSERT_TRUE(other_models.ok()) << other_models.status();
  auto mismatch =
      EvaluateCaptioning(*spec_, *other_models->encoder, *other_models->llm, EvaluationOptions());
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mismatch.status().message()),
              HasSubstr("16 tokens per image (encoder.model.image_size / patch, squared) but the "
                        "encoder makes 4"));
}

}  // namespace
}  // namespace hetpar::llm
