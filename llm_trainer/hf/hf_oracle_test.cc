// hetpar against Hugging Face transformers, an implementation that shares no code with hetpar's
// models: hf_oracle.py builds small random models with transformers, saves them and computes the
// answers; `hetpar convert` imports them, `hetpar score` and the encoder's TowerFeatures must give
// the same numbers (1e-4 in float32, 1e-10 in float64). Then the way back: an exported model
// loads into transformers without a missing or unexpected weight and gives the same answers.
#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/nn/export.h"
#include "common/nn/safetensors.h"
#include "encoder_service/encoder.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "llm_trainer/hf/hf_convert.h"
#include "nlohmann/json.hpp"
#include "tests/util/subprocess.h"

namespace hetpar::hf {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const std::string kPython = HETPAR_PYTHON;
const std::string kOracle = std::string(HETPAR_SOURCE_DIR) + "/llm_trainer/hf/hf_oracle.py";
const std::string kHetpar = HETPAR_BIN;

class HfOracleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        fs::temp_directory_path() /
        absl::StrCat("hetpar-hf-", ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                     "-", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    ASSERT_TRUE(fs::exists(kPython))
        << kPython << " is missing: run deploy/install-deps.sh (it installs transformers there)";
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // Runs hf_oracle.py; fails the test with its output on a non-zero exit.
  void Oracle(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {kPython, kOracle};
    argv.insert(argv.end(), args.begin(), args.end());
    auto result = hetpar::testing::RunCommand(argv, 300);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->exit_code, 0) << "hf_oracle.py " << args.front() << ":\n"
                                    << result->stderr_text;
  }

  hetpar::testing::CommandResult Hetpar(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {kHetpar};
    argv.insert(argv.end(), args.begin(), args.end());
    auto result = hetpar::testing::RunCommand(argv, 300);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : hetpar::testing::CommandResult{};
  }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // A SigLIP tower (seed 6, exact GELU) made by the oracle, imported with the Llama in `llm` into
  // `out`.
  void ImportWithTower(const std::string& llm, const std::string& out) {
    ASSERT_NO_FATAL_FAILURE(
        Oracle({"siglip", "--out", Path("siglip"), "--seed", "6", "--act", "gelu"}));
    const auto imported = Hetpar({"convert", "from-hf", "--llm", Path(llm), "--encoder",
                                  Path("siglip"), "--out", Path(out)});
    ASSERT_EQ(imported.exit_code, 0) << imported.stderr_text;
  }

  fs::path dir_;
};

std::vector<std::vector<double>> ReadLogprobs(const std::string& path) {
  std::vector<std::vector<double>> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    std::vector<double> row;
    const nlohmann::json parsed = nlohmann::json::parse(line);
    for (const auto& v : parsed.at("logprobs")) {
      row.push_back(v.is_null() ? std::nan("") : v.get<double>());  // null: an image row
    }
    rows.push_back(row);
  }
  return rows;
}

// The largest |a - b| over every entry; the row counts and lengths must agree.
double MaxDifference(const std::vector<std::vector<double>>& a,
                     const std::vector<std::vector<double>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    EXPECT_EQ(a[i].size(), b[i].size()) << "line " << i + 1;
    for (size_t j = 0; j < std::min(a[i].size(), b[i].size()); ++j) {
      EXPECT_EQ(std::isnan(a[i][j]), std::isnan(b[i][j])) << "line " << i + 1 << " entry " << j;
      if (!std::isnan(a[i][j]) && !std::isnan(b[i][j])) {
        worst = std::max(worst, std::abs(a[i][j] - b[i][j]));
      }
    }
  }
  return worst;
}

TEST_F(HfOracleTest, ScoreMatchesTransformersUntiedAndTied) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied embeddings" : "untied embeddings");
    const std::string hf = Path(tied ? "llama-tied" : "llama");
    const std::string model = Path(tied ? "model-tied" : "model");
    std::vector<std::string> args = {"llama", "--out", hf, "--seed", tied ? "2" : "1"};
    if (tied) args.push_back("--tied");
    ASSERT_NO_FATAL_FAILURE(Oracle(args));
    auto imported = Hetpar({"convert", "from-hf", "--llm", hf, "--out", model});
    ASSERT_EQ(imported.exit_code, 0) << imported.stderr_text;
    for (const std::string dtype : {"float32", "float64"}) {
      for (const std::string tp : {"1", "2"}) {
        SCOPED_TRACE(dtype + " tp " + tp);
        const std::string out = Path(absl::StrCat("score-", tied, "-", dtype, "-", tp, ".jsonl"));
        auto scored = Hetpar({"score", "--model", model, "--tokens", hf + "/tokens.jsonl",
                              "--dtype", dtype, "--tp", tp, "--out", out, "--threads", "1"});
        ASSERT_EQ(scored.exit_code, 0) << scored.stderr_text;
        const auto expected = ReadLogprobs(hf + "/expected-" + dtype + ".jsonl");
        ASSERT_EQ(expected.size(), 6u);
        const double worst = MaxDifference(ReadLogprobs(out), expected);
        EXPECT_LT(worst, dtype == "float64" ? 1e-10 : 1e-4) << "largest difference " << worst;
      }
    }
  }
}

TEST_F(HfOracleTest, VisionTowerMatchesTransformers) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "3"}));
  ASSERT_NO_FATAL_FAILURE(Oracle({"siglip", "--out", Path("siglip"), "--seed", "4", "--head"}));
  auto imported = Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--encoder", Path("siglip"),
                          "--out", Path("model")});
  ASSERT_EQ(imported.exit_code, 0) << imported.stderr_text;
  EXPECT_THAT(imported.stderr_text + imported.stdout_text, HasSubstr("attention-pooling head"));
  auto model = OpenModelDirectory(Path("model"));
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE(model->encoder.has_value());
  EXPECT_EQ(model->encoder->activation(), "gelu_tanh");
  auto pixels = nn::ReadSafetensors(Path("siglip/pixels.safetensors"));
  ASSERT_TRUE(pixels.ok()) << pixels.status();
  auto expected = nn::ReadSafetensors(Path("siglip/features.safetensors"));
  ASSERT_TRUE(expected.ok()) << expected.status();
  for (const auto& [name, dtype, tolerance] :
       std::vector<std::tuple<std::string, at::ScalarType, double>>{
           {"float64", at::kDouble, 1e-10}, {"float32", at::kFloat, 1e-4}}) {
    SCOPED_TRACE(name);
    encoder::EncoderOptions options;
    options.dtype = dtype;
    auto comm = nn::Communicator::CreateSingle();
    auto encoder = encoder::VisionEncoder::Create(*model->encoder, options, *comm);
    ASSERT_TRUE(encoder.ok()) << encoder.status();
    ASSERT_TRUE(nn::LoadFullParameters((*encoder)->parameters(), model->encoder_path).ok());
    auto ours = (*encoder)->TowerFeatures(pixels->tensors.at(0).tensor);
    ASSERT_TRUE(ours.ok()) << ours.status();
    at::Tensor theirs;
    for (const auto& t : expected->tensors) {
      if (t.name == name) theirs = t.tensor;
    }
    ASSERT_TRUE(theirs.defined());
    ASSERT_EQ(ours->sizes(), at::IntArrayRef({2 * 16, 48}));
    const double worst = (ours->to(at::kDouble) - theirs.reshape({2 * 16, 48}).to(at::kDouble))
                             .abs()
                             .max()
                             .item<double>();
    EXPECT_LT(worst, tolerance) << "largest difference " << worst;
  }
}

// LLaVA's projector reads a hidden state of the tower before post_layernorm
// (vision_feature_layer, -2 by default): imported with --vision-feature-layer, the tower stops at
// that layer without its final norm, and its features are transformers' hidden_states[k]. Its
// export loads into transformers and imports back identically.
TEST_F(HfOracleTest, AVisionFeatureLayerImportsTheTowerUpToThatLayerWithoutItsFinalNorm) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "3"}));
  ASSERT_NO_FATAL_FAILURE(Oracle({"siglip", "--out", Path("siglip"), "--seed", "4"}));
  auto pixels = nn::ReadSafetensors(Path("siglip/pixels.safetensors"));
  ASSERT_TRUE(pixels.ok()) << pixels.status();
  auto expected = nn::ReadSafetensors(Path("siglip/features.safetensors"));
  ASSERT_TRUE(expected.ok()) << expected.status();
  for (const int k : {-2, -1}) {
    SCOPED_TRACE(k);
    const std::string out = Path(absl::StrCat("model", k));
    auto imported =
        Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--encoder", Path("siglip"),
                "--vision-feature-layer", std::to_string(k), "--out", out});
    ASSERT_EQ(imported.exit_code, 0) << imported.stderr_text;
    const int64_t layers = 2 + 1 + k;  // the oracle's tower has 2 layers
    EXPECT_THAT(imported.stderr_text,
                HasSubstr(absl::StrCat("the projector reads the output of layer ", layers,
                                       " of 2 without post_layernorm")));
    auto model = OpenModelDirectory(out);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE(model->encoder.has_value());
    EXPECT_EQ(model->encoder->layers(), layers);
    EXPECT_TRUE(model->encoder->no_final_norm());
    encoder::EncoderOptions options;
    options.dtype = at::kDouble;
    auto comm = nn::Communicator::CreateSingle();
    auto encoder = encoder::VisionEncoder::Create(*model->encoder, options, *comm);
    ASSERT_TRUE(encoder.ok()) << encoder.status();
    EXPECT_EQ((*encoder)->parameters().Find("encoder.norm.weight"), nullptr);
    ASSERT_TRUE(nn::LoadFullParameters((*encoder)->parameters(), model->encoder_path).ok());
    auto ours = (*encoder)->TowerFeatures(pixels->tensors.at(0).tensor);
    ASSERT_TRUE(ours.ok()) << ours.status();
    at::Tensor theirs;
    for (const auto& t : expected->tensors) {
      if (t.name == absl::StrCat("float64_layer_", k)) theirs = t.tensor;
    }
    ASSERT_TRUE(theirs.defined());
    const double worst = (*ours - theirs.reshape({2 * 16, 48})).abs().max().item<double>();
    EXPECT_LT(worst, 1e-10) << "largest difference " << worst;
  }
  // The layer -2 feeds differs from the last one's: the comparison above tells them apart.
  at::Tensor last, penultimate;
  for (const auto& t : expected->tensors) {
    if (t.name == "float64_layer_-1") last = t.tensor;
    if (t.name == "float64_layer_-2") penultimate = t.tensor;
  }
  EXPECT_GT((last - penultimate).abs().max().item<double>(), 1e-3);

  auto exported = Hetpar({"convert", "to-hf", "--model", Path("model-1"), "--out", Path("hf")});
  ASSERT_EQ(exported.exit_code, 0) << exported.stderr_text;
  EXPECT_THAT(exported.stderr_text, HasSubstr("the tower has no final norm"));
  // transformers loads it with no missing or unexpected weight (exit 3 otherwise), and its last
  // layer's states are the original's.
  ASSERT_NO_FATAL_FAILURE(
      Oracle({"load-siglip", "--dir", Path("hf/vision"), "--pixels",
              Path("siglip/pixels.safetensors"), "--out", Path("reloaded.safetensors")}));
  auto reloaded = nn::ReadSafetensors(Path("reloaded.safetensors"));
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  bool compared = false;
  for (const auto& t : reloaded->tensors) {
    if (t.name == "float64_layer_-1") {
      EXPECT_TRUE(t.tensor.equal(last));
      compared = true;
    }
  }
  EXPECT_TRUE(compared);
  auto back = Hetpar({"convert", "from-hf", "--llm", Path("hf/llm"), "--encoder", Path("hf/vision"),
                      "--projector", Path("hf/projector.safetensors"), "--vision-feature-layer",
                      "-1", "--out", Path("back")});
  ASSERT_EQ(back.exit_code, 0) << back.stderr_text;
  auto a = nn::ReadFullParameters(Path("model-1/encoder.hpar"));
  auto b = nn::ReadFullParameters(Path("back/encoder.hpar"));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->size(), b->size());
  for (size_t i = 0; i < a->size(); ++i) {
    EXPECT_EQ((*a)[i].name, (*b)[i].name);
    EXPECT_TRUE((*a)[i].tensor.equal((*b)[i].tensor)) << (*a)[i].name;
  }

  // A layer the tower does not have is refused, naming the range; nothing is written.
  for (const std::string k : {"-3", "3"}) {
    auto refused = Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--encoder",
                           Path("siglip"), "--vision-feature-layer", k, "--out", Path("refused")});
    EXPECT_EQ(refused.exit_code, 2) << k;
    EXPECT_THAT(refused.stderr_text, HasSubstr("--vision-feature-layer=" + k +
                                               " is out of range: " + Path("siglip/config.json") +
                                               " has 2 layers (num_hidden_layers)"));
    EXPECT_FALSE(fs::exists(Path("refused/encoder.hpar"))) << k;
  }
  auto embeddings =
      Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--encoder", Path("siglip"),
              "--vision-feature-layer", "0", "--out", Path("refused")});
  EXPECT_EQ(embeddings.exit_code, 2);
  EXPECT_THAT(embeddings.stderr_text,
              HasSubstr("--vision-feature-layer: 0 names the embeddings, which feed no layer"));
  EXPECT_FALSE(fs::exists(Path("refused/encoder.hpar")));

  // A model.yaml edited to no_final_norm over a file that holds the trained norm: exported, the
  // norm would become the identity without a word.
  auto plain = Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--encoder", Path("siglip"),
                       "--out", Path("plain")});
  ASSERT_EQ(plain.exit_code, 0) << plain.stderr_text;
  std::string yaml;
  {
    std::ifstream in(Path("plain/model.yaml"));
    yaml.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::string activation = "    activation: gelu_tanh\n";
  ASSERT_NE(yaml.find(activation), std::string::npos) << yaml;
  yaml.replace(yaml.find(activation), activation.size(), activation + "    no_final_norm: true\n");
  std::ofstream(Path("plain/model.yaml"), std::ios::trunc) << yaml;
  auto edited = Hetpar({"convert", "to-hf", "--model", Path("plain"), "--out", Path("plain-hf")});
  EXPECT_EQ(edited.exit_code, 2);
  EXPECT_THAT(edited.stderr_text,
              HasSubstr("holds the tower's final norm (encoder.norm.*), but the model's config "
                        "says encoder.model.no_final_norm=true"));
}

// Scoring with images: transformers' SigLIP, a LLaVA projector and the Llama, images spliced as
// input embeddings, against the imported model's `hetpar score` of the same PNG files.
TEST_F(HfOracleTest, MultimodalScoreMatchesTransformers) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "10"}));
  ASSERT_NO_FATAL_FAILURE(Oracle({"siglip", "--out", Path("siglip"), "--seed", "11"}));
  fs::create_directories(Path("mm"));
  ASSERT_NO_FATAL_FAILURE(Oracle({"multimodal", "--llama", Path("llama"), "--siglip",
                                  Path("siglip"), "--out", Path("mm"), "--seed", "12"}));
  auto imported = Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--encoder", Path("siglip"),
                          "--projector", Path("mm/projector.safetensors"), "--out", Path("model")});
  ASSERT_EQ(imported.exit_code, 0) << imported.stderr_text;
  const auto expected = ReadLogprobs(Path("mm/expected-float64.jsonl"));
  ASSERT_EQ(expected.size(), 4u);
  ASSERT_EQ(expected[0].size(), 1u + 16u + 3u - 1u);  // one image of 16 rows and 4 tokens
  for (const std::string tp : {"1", "2"}) {
    SCOPED_TRACE("tp " + tp);
    const std::string out = Path("mm-" + tp + ".jsonl");
    auto scored = Hetpar({"score", "--model", Path("model"), "--tokens", Path("mm/tokens.jsonl"),
                          "--dtype", "float64", "--tp", tp, "--out", out, "--threads", "1"});
    ASSERT_EQ(scored.exit_code, 0) << scored.stderr_text;
    const double worst = MaxDifference(ReadLogprobs(out), expected);
    EXPECT_LT(worst, 1e-10) << "largest difference " << worst;
  }
  // Images without an encoder, and markers that do not match the images, name the line.
  std::ofstream(Path("bad.jsonl")) << "{\"tokens\": [1, 2]}\n{\"tokens\": [1, -1, 2]}\n";
  auto bad = Hetpar({"score", "--model", Path("model"), "--tokens", Path("bad.jsonl")});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.stderr_text, HasSubstr("bad.jsonl:2: 1 image markers (-1) in \"tokens\" but 0"));
}

TEST_F(HfOracleTest, ExportLoadsIntoTransformersAndImportsBackIdentically) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "5"}));
  ASSERT_NO_FATAL_FAILURE(ImportWithTower("llama", "model"));
  auto exported = Hetpar({"convert", "to-hf", "--model", Path("model"), "--out", Path("hf")});
  ASSERT_EQ(exported.exit_code, 0) << exported.stderr_text;
  auto back = Hetpar({"convert", "from-hf", "--llm", Path("hf/llm"), "--encoder", Path("hf/vision"),
                      "--projector", Path("hf/projector.safetensors"), "--out", Path("model2")});
  ASSERT_EQ(back.exit_code, 0) << back.stderr_text;
  for (const std::string file : {"llm.hpar", "encoder.hpar"}) {
    auto a = nn::ReadFullParameters(Path("model/" + file));
    auto b = nn::ReadFullParameters(Path("model2/" + file));
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->size(), b->size());
    for (size_t i = 0; i < a->size(); ++i) {
      EXPECT_EQ((*a)[i].name, (*b)[i].name);
      EXPECT_TRUE((*a)[i].tensor.equal((*b)[i].tensor)) << (*a)[i].name;
    }
  }
  // Identical score output, byte for byte.
  std::vector<std::string> outputs;
  for (const std::string model : {"model", "model2"}) {
    const std::string out = Path(model + ".jsonl");
    ASSERT_EQ(Hetpar({"score", "--model", Path(model), "--tokens", Path("llama/tokens.jsonl"),
                      "--dtype", "float64", "--out", out, "--threads", "1"})
                  .exit_code,
              0);
    std::ifstream in(out);
    outputs.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  EXPECT_FALSE(outputs[0].empty());
  EXPECT_EQ(outputs[0], outputs[1]);
  // transformers loads the export with no missing or unexpected weight (exit 3 otherwise) and
  // computes what the original computed.
  ASSERT_NO_FATAL_FAILURE(Oracle({"load-llama", "--dir", Path("hf/llm"), "--tokens",
                                  Path("llama/tokens.jsonl"), "--out", Path("reloaded.jsonl")}));
  EXPECT_LT(MaxDifference(ReadLogprobs(Path("reloaded.jsonl")),
                          ReadLogprobs(Path("llama/expected-float64.jsonl"))),
            1e-12);
  ASSERT_NO_FATAL_FAILURE(
      Oracle({"load-siglip", "--dir", Path("hf/vision"), "--pixels",
              Path("siglip/pixels.safetensors"), "--out", Path("reloaded.safetensors")}));
  auto reloaded = nn::ReadSafetensors(Path("reloaded.safetensors"));
  auto original = nn::ReadSafetensors(Path("siglip/features.safetensors"));
  ASSERT_TRUE(reloaded.ok() && original.ok());
  for (size_t i = 0; i < original->tensors.size(); ++i) {
    EXPECT_TRUE(reloaded->tensors.at(i).tensor.equal(original->tensors.at(i).tensor))
        << original->tensors.at(i).name;
  }
}

// A run starts from the imported files on the demo's layout (encoder dp 2, LLM tp 2) and
// trains exactly as the single-process reference does from the same files; the imported weights
// are what it starts from (its first loss differs from a seeded start's).
TEST_F(HfOracleTest, RunsTrainFromAnImportedModel) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "8"}));
  ASSERT_NO_FATAL_FAILURE(Oracle({"siglip", "--out", Path("siglip"), "--seed", "9"}));
  ASSERT_EQ(Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--encoder", Path("siglip"),
                    "--out", Path("model")})
                .exit_code,
            0);
  const std::vector<std::string> common = {
      "--config", std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml", "--steps", "3",
      "--threads", "1", "--set", "run.dtype=float64",
      // the imported shapes (model.yaml) where they differ from tiny.yaml
      "--set", "llm.model.ffn=96", "--set", "llm.model.rope_theta=5000", "--set",
      "llm.model.norm_eps=1e-5", "--set", "encoder.model.hidden=48", "--set",
      "encoder.model.mlp=96", "--set", "encoder.model.activation=gelu_tanh", "--set",
      "data.manifest=" + Path("data/train.jsonl"), "--set",
      "data.val_manifest=" + Path("data/val.jsonl"), "--set",
      "data.tokenizer=" + Path("data/tokenizer.model"), "--set", "data.synth.samples=64", "--set",
      "data.synth.val_samples=8"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"run"};
    args.insert(args.end(), common.begin(), common.end());
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  const std::vector<std::string> init = {"--set", "llm.init_from=" + Path("model/llm.hpar"),
                                         "--set",
                                         "encoder.init_from=" + Path("model/encoder.hpar")};
  std::vector<std::string> args = with(init);
  args.insert(args.end(), {"--out", Path("run")});
  auto run = Hetpar(args);
  ASSERT_EQ(run.exit_code, 0) << run.stderr_text;
  args = with(init);
  args.insert(args.end(), {"--out", Path("reference"), "--reference"});
  auto reference = Hetpar(args);
  ASSERT_EQ(reference.exit_code, 0) << reference.stderr_text;
  auto compared = Hetpar({"compare", Path("run"), Path("reference")});
  EXPECT_EQ(compared.exit_code, 0) << compared.stdout_text << compared.stderr_text;
  args = with({"--out", Path("seeded"), "--reference"});
  auto seeded = Hetpar(args);
  ASSERT_EQ(seeded.exit_code, 0) << seeded.stderr_text;
  auto first_loss = [](const std::string& run_dir) {
    std::ifstream in(run_dir + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("step") && j.contains("loss")) return j["loss"].get<double>();
    }
    return -1.0;
  };
  const double imported_loss = first_loss(Path("run"));
  EXPECT_GT(imported_loss, 0);
  EXPECT_GT(std::abs(imported_loss - first_loss(Path("seeded"))), 1e-3);

  // The trained model (run/model, its shapes from run/config.yaml) goes back to Hugging Face:
  // transformers scores as `hetpar score` does, and importing the export gives the same files.
  auto exported =
      Hetpar({"convert", "to-hf", "--model", Path("run/model"), "--out", Path("trained-hf")});
  ASSERT_EQ(exported.exit_code, 0) << exported.stderr_text;
  ASSERT_EQ(Hetpar({"score", "--model", Path("run/model"), "--tokens", Path("llama/tokens.jsonl"),
                    "--dtype", "float64", "--out", Path("trained.jsonl"), "--threads", "1"})
                .exit_code,
            0);
  ASSERT_NO_FATAL_FAILURE(
      Oracle({"load-llama", "--dir", Path("trained-hf/llm"), "--tokens", Path("llama/tokens.jsonl"),
              "--out", Path("trained-transformers.jsonl")}));
  const double worst = MaxDifference(ReadLogprobs(Path("trained.jsonl")),
                                     ReadLogprobs(Path("trained-transformers.jsonl")));
  EXPECT_LT(worst, 1e-10) << "largest difference " << worst;
  ASSERT_EQ(Hetpar({"convert", "from-hf", "--llm", Path("trained-hf/llm"), "--encoder",
                    Path("trained-hf/vision"), "--projector",
                    Path("trained-hf/projector.safetensors"), "--out", Path("reimported")})
                .exit_code,
            0);
  for (const std::string file : {"llm.hpar", "encoder.hpar"}) {
    auto trained = nn::ReadFullParameters(Path("run/model/" + file));
    auto back = nn::ReadFullParameters(Path("reimported/" + file));
    ASSERT_TRUE(trained.ok() && back.ok()) << file;
    ASSERT_EQ(trained->size(), back->size()) << file;
    for (size_t i = 0; i < trained->size(); ++i) {
      EXPECT_EQ((*trained)[i].name, (*back)[i].name);
      EXPECT_TRUE((*trained)[i].tensor.equal((*back)[i].tensor)) << (*trained)[i].name;
    }
  }
}

// Import errors name the tensor or key, and nothing is written.
// Checkpoints saved by transformers before 4.31 carry each layer's rotary inv_freq buffer: not a
// weight, it is passed over, and the import gives the same model as without it.
TEST_F(HfOracleTest, TheRotaryBuffersOfOlderCheckpointsArePassedOver) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "7"}));
  auto tensors = nn::ReadSafetensors(Path("llama/model.safetensors"));
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  const std::string older = Path("older");
  fs::create_directories(older);
  fs::copy_file(Path("llama/config.json"), older + "/config.json");
  std::vector<nn::SafetensorsTensor> with_buffers = tensors->tensors;
  for (int layer = 0; layer < 2; ++layer) {
    with_buffers.push_back({absl::StrCat("model.layers.", layer, ".self_attn.rotary_emb.inv_freq"),
                            at::arange(8, at::kFloat)});
  }
  ASSERT_TRUE(nn::WriteSafetensors(with_buffers, older + "/model.safetensors").ok());
  auto result = Hetpar({"convert", "from-hf", "--llm", older, "--out", Path("out-older")});
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  result = Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--out", Path("out")});
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  std::ifstream a(Path("out-older/llm.hpar"), std::ios::binary);
  std::ifstream b(Path("out/llm.hpar"), std::ios::binary);
  const std::string older_bytes((std::istreambuf_iterator<char>(a)), {});
  const std::string bytes((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(bytes.empty());
  EXPECT_TRUE(older_bytes == bytes) << "the two imports differ";
}

// An import into a directory that holds an earlier one: a failure while writing (here a
// tokenizer file that cannot be copied) leaves the earlier import whole; a later import without
// --encoder removes the earlier encoder.hpar its model.yaml no longer describes.
TEST_F(HfOracleTest, AnImportReplacesAnEarlierOneWholeOrNotAtAll) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "7"}));
  ASSERT_NO_FATAL_FAILURE(ImportWithTower("llama", "model"));
  const auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  const std::string yaml = read(Path("model/model.yaml"));
  const std::string llm = read(Path("model/llm.hpar"));
  ASSERT_FALSE(llm.empty());
  // The same model at another seed's weights, with a tokenizer.json that is a directory.
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama8"), "--seed", "8"}));
  fs::create_directories(Path("llama8/tokenizer.json"));
  auto failed = Hetpar({"convert", "from-hf", "--llm", Path("llama8"), "--out", Path("model")});
  EXPECT_EQ(failed.exit_code, 1) << failed.stderr_text;
  EXPECT_THAT(failed.stderr_text, HasSubstr("tokenizer.json"));
  EXPECT_EQ(read(Path("model/model.yaml")), yaml);
  EXPECT_TRUE(read(Path("model/llm.hpar")) == llm) << "the earlier llm.hpar was replaced";
  EXPECT_TRUE(fs::exists(Path("model/encoder.hpar")));
  for (const auto& entry : fs::directory_iterator(Path("model"))) {
    EXPECT_THAT(entry.path().filename().string(), ::testing::Not(HasSubstr(".hetpar-import")));
  }
  fs::remove_all(Path("llama8/tokenizer.json"));
  auto imported = Hetpar({"convert", "from-hf", "--llm", Path("llama8"), "--out", Path("model")});
  ASSERT_EQ(imported.exit_code, 0) << imported.stderr_text;
  EXPECT_FALSE(read(Path("model/llm.hpar")) == llm);
  EXPECT_FALSE(fs::exists(Path("model/encoder.hpar")));
  EXPECT_THAT(imported.stderr_text, HasSubstr("encoder.hpar of an earlier import"));
  auto exported = Hetpar({"convert", "to-hf", "--model", Path("model"), "--out", Path("hf")});
  EXPECT_EQ(exported.exit_code, 0) << exported.stderr_text;
}

// The ids generation starts and stops on go through an import and an export (transformers
// falls back to 1 and 2 without them): here bos 5 and the two eos ids of a Llama-3 style config.
TEST_F(HfOracleTest, AnExportKeepsTheBosAndEosIds) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "7"}));
  for (const std::string name : {"config.json", "generation_config.json"}) {
    std::ifstream in(Path("llama/" + name));
    nlohmann::json j = nlohmann::json::parse(in);
    j["bos_token_id"] = 5;
    j["eos_token_id"] = {7, 9};
    std::ofstream(Path("llama/" + name)) << j.dump(2);
  }
  ASSERT_EQ(
      Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--out", Path("model")}).exit_code, 0);
  auto exported = Hetpar({"convert", "to-hf", "--model", Path("model"), "--out", Path("hf")});
  ASSERT_EQ(exported.exit_code, 0) << exported.stderr_text;
  for (const std::string name : {"config.json", "generation_config.json"}) {
    SCOPED_TRACE(name);
    std::ifstream in(Path("hf/llm/" + name));
    ASSERT_TRUE(in) << "no " << name << " in the export";
    const nlohmann::json j = nlohmann::json::parse(in);
    EXPECT_EQ(j.value("bos_token_id", nlohmann::json()), nlohmann::json(5));
    EXPECT_EQ(j.value("eos_token_id", nlohmann::json()), nlohmann::json({7, 9}));
  }
}

// to-hf reads the shapes from model.yaml: one edited so that it no longer fits llm.hpar is
// refused (exit 2) naming both, not exported truncated (fewer layers) or ended by an uncaught
// libtorch error (other heads).
TEST_F(HfOracleTest, AnExportWhoseConfigDoesNotFitItsFileIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "7"}));
  ASSERT_EQ(
      Hetpar({"convert", "from-hf", "--llm", Path("llama"), "--out", Path("model")}).exit_code, 0);
  std::ifstream in(Path("model/model.yaml"));
  const std::string yaml((std::istreambuf_iterator<char>(in)), {});
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"    layers: 2\n",
       "holds 2 layers (llm.layers.N), but the model's config says "
       "llm.model.layers=1"},
      {"    kv_heads: 2\n", "does not have the shapes the model's config gives"}};
  for (const auto& [line, message] : edits) {
    SCOPED_TRACE(line);
    const size_t at = yaml.find(line);
    ASSERT_NE(at, std::string::npos);
    std::string edited = yaml;
    edited.replace(at, line.size(),
                   line.find("layers") != std::string::npos ? std::string("    layers: 1\n")
                                                            : std::string("    kv_heads: 4\n"));
    std::ofstream(Path("model/model.yaml")) << edited;
    const std::string out = Path("hf-" + std::to_string(at));
    auto result = Hetpar({"convert", "to-hf", "--model", Path("model"), "--out", out});
    EXPECT_EQ(result.exit_code, 2) << result.stderr_text;
    EXPECT_THAT(result.stderr_text, HasSubstr(Path("model") + "/llm.hpar"));
    EXPECT_THAT(result.stderr_text, HasSubstr(message));
    EXPECT_FALSE(fs::exists(out + "/llm/model.safetensors"));
  }
}

TEST_F(HfOracleTest, BrokenCheckpointsAreRefusedAndNothingIsWritten) {
  ASSERT_NO_FATAL_FAILURE(Oracle({"llama", "--out", Path("llama"), "--seed", "7"}));
  auto tensors = nn::ReadSafetensors(Path("llama/model.safetensors"));
  ASSERT_TRUE(tensors.ok());
  std::ifstream config_in(Path("llama/config.json"));
  const nlohmann::json config = nlohmann::json::parse(config_in);

  struct Case {
    std::string name;
    std::string tensor_to_drop;
    std::string tensor_to_reshape;  // narrowed to 16 rows; "int:" + name: stored as int32
    nlohmann::json config_patch;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"missing", "model.layers.1.mlp.up_proj.weight", "", nlohmann::json::object(),
       "tensor 'model.layers.1.mlp.up_proj.weight' is missing"},
      {"shape", "", "model.layers.0.self_attn.k_proj.weight", nlohmann::json::object(),
       "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 64], expected [32, 64]"},
      {"dtype", "", "int:model.norm.weight", nlohmann::json::object(),
       "tensor 'model.norm.weight' holds Int values; a weight is floating-point"},
      {"architecture", "", "", {{"model_type", "mistral"}}, "model_type=\"mistral\""},
      {"activation", "", "", {{"hidden_act", "gelu"}}, "hidden_act=\"gelu\""},
      {"scaling",
       "",
       "",
       {{"rope_parameters", {{"rope_type", "llama3"}, {"rope_theta", 5e5}}}},
       "rope_parameters.rope_type=\"llama3\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string broken = Path("broken-" + c.name);
    fs::create_directories(broken);
    std::vector<nn::SafetensorsTensor> kept;
    for (const auto& t : tensors->tensors) {
      if (t.name == c.tensor_to_drop) continue;
      at::Tensor tensor = t.tensor;
      if (t.name == c.tensor_to_reshape) tensor = tensor.narrow(0, 0, 16);
      if ("int:" + t.name == c.tensor_to_reshape) tensor = tensor.to(at::kInt);
      kept.push_back({t.name, tensor});
    }
    ASSERT_TRUE(nn::WriteSafetensors(kept, broken + "/model.safetensors").ok());
    nlohmann::json patched = config;
    patched.update(c.config_patch);
    std::ofstream(broken + "/config.json") << patched.dump(2);
    const std::string out = Path("out-" + c.name);
    auto result = Hetpar({"convert", "from-hf", "--llm", broken, "--out", out});
    EXPECT_EQ(result.exit_code, 2) << result.stderr_text;
    EXPECT_THAT(result.stderr_text, HasSubstr(c.message));
    EXPECT_FALSE(fs::exists(out)) << "an import that failed wrote " << out;
  }
}

}  // namespace
}  // namespace hetpar::hf
